"""Subprocesses the bench starts: loopback ports, logs, CPU time from /proc, and stop by PID.

Every process is started in its own session so a Ctrl-C at the terminal reaches only the harness,
which then stops each process it started, by its PID, in `finally`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A scenario cannot be measured: its server did not start, answered wrongly, or failed load."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the small race is fine for a bench)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Process:
    """A started subprocess, its combined stdout/stderr log, and how to stop it."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = text.splitlines()[-lines:]
        return "\n".join(f"    | {line}" for line in tail) or "    | (empty log)"

    def cpu_ticks(self) -> int:
        """User + system clock ticks of this process and all its descendants, live or reaped."""
        return sum(_own_and_reaped_ticks(pid) for pid in _tree(self.pid))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; descendants are stopped by their own PIDs."""
        if self.popen.poll() is not None:
            return
        descendants = [pid for pid in _tree(self.pid) if pid != self.pid]
        self.popen.terminate()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=timeout)
        for pid in descendants:
            _kill_if_alive(pid)


def start(name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path) -> Process:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        except OSError as exc:
            raise BenchError(f"{name}: cannot start {argv[0]!r}: {exc}") from exc
    return Process(name=name, popen=popen, log_path=log_path)


def exited_message(process: Process, code: int) -> str:
    return f"{process.name} exited with code {code} before it was ready\n{process.log_tail()}"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat fields from field 3 (state) on; the command name may contain spaces."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _own_and_reaped_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    if fields is None:
        return 0
    # stat(5) fields 14-17: utime, stime, cutime, cstime; `fields` starts at field 3.
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return utime + stime + cutime + cstime


def _tree(root: int) -> list[int]:
    """`root` and every live descendant, found by the parent PID in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _kill_if_alive(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
