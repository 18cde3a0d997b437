"""`serve --workers N`: N sidecar processes behind one gRPC address and one HTTP port.

Each worker is a whole `serve` process (its own event loop, backend connections, statistics).
On TCP every worker binds the ports itself with SO_REUSEPORT, so each has its own accept queue
and the kernel spreads *connections* over them, not calls: Envoy opens about one connection per
worker thread, so a sidecar behind an Envoy with fewer threads than workers leaves workers idle.
A Unix socket cannot be shared that way; the parent listens on it once and the workers inherit
it, and on the way out removes its file unless a replacement has bound its own there meanwhile.
The parent only supervises: it forwards SIGTERM and SIGINT to each worker by its PID, and
when a worker exits on its own, it stops the others and exits with that worker's status. A
worker the forwarded signal kills while still starting (before its handlers exist) has taken no
call: that is a clean stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator, Sequence
from types import FrameType

import structlog

from sidecar.rls.h2.server import BACKLOG, socket_file, unix_path, unlink_socket
from sidecar.runner.app import split_address

log = structlog.get_logger("sidecar.workers")

#: How a worker ends when a signal the parent forwards kills it (see `_supervise`).
_STOPPED_BY_US = frozenset({-signal.SIGTERM, -signal.SIGINT})


def run(base_argv: Sequence[str], workers: int, grpc_address: str, http_address: str) -> int:
    """Run `workers` times `python -m sidecar serve BASE_ARGV` on the two addresses; returns the
    exit status: 0 when every worker stopped cleanly after a signal, else the first failure's."""
    with contextlib.ExitStack() as held:
        grpc_args, fds = _grpc_listener(grpc_address, held)
        http_args = ["--http-address", _reserve(http_address, held)]
        argv = [
            sys.executable, "-m", "sidecar", "serve", *base_argv,
            *grpc_args, *http_args, "--workers", "1", "--reuse-port",
        ]  # fmt: skip
        return _supervise(argv, workers, fds)


def _grpc_listener(address: str, held: contextlib.ExitStack) -> tuple[list[str], tuple[int, ...]]:
    path = unix_path(address)
    if path is None:
        return ["--grpc-address", _reserve(address, held)], ()
    sock = held.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            # Left by an earlier run, or still served by the sidecars this one replaces: either
            # way new connections come here from now on, as asyncio would do it.
            os.unlink(path)
    sock.bind(path)
    held.callback(unlink_socket, path, socket_file(path))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    fd = sock.fileno()
    return ["--grpc-address", address, "--grpc-socket-fd", str(fd)], (fd,)


def _reserve(address: str, held: contextlib.ExitStack) -> str:
    """Bind (without listening) a SO_REUSEPORT socket on `address`, so port 0 becomes one port
    every worker can join, and hold it while the workers run; returns `HOST:PORT`."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise OSError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    bound = sock.getsockname()[1]
    return f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}"


def _supervise(argv: list[str], workers: int, fds: tuple[int, ...]) -> int:
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    with _handling((signal.SIGTERM, signal.SIGINT), forward):
        for _ in range(workers):
            if stopping:
                break
            child = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL)
            children[child.pid] = child
        if stopping:  # a signal came while the workers were starting
            forward(signal.SIGTERM, None)
        log.info("workers_started", workers=workers, pids=sorted(children), pid=os.getpid())
        status = 0
        while children:
            pid, wait_status = os.waitpid(-1, 0)
            if pid not in children:
                continue
            child = children.pop(pid)
            code = os.waitstatus_to_exitcode(wait_status)
            child.returncode = code
            if stopping and code in _STOPPED_BY_US:
                # Killed by the signal forwarded to it before its handlers existed: it was still
                # starting (a worker installs them before it listens or accepts), so it had taken
                # no call, and that is a clean stop.
                log.info("worker_stopped_while_starting", worker_pid=pid)
            elif code and not status:
                status = code if code > 0 else 128 - code
            if not stopping:
                log.error("worker_exited", worker_pid=pid, exit_status=code)
                stopping = True
                status = status or 1
                forward(signal.SIGTERM, None)
    log.info("workers_stopped", exit_status=status)
    return status


@contextlib.contextmanager
def _handling(signums: Sequence[signal.Signals], handler: signal._HANDLER) -> Iterator[None]:
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
