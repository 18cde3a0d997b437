"""`serve --transport` and `serve --workers N`: flags, Unix sockets, and worker processes sharing
one port (SO_REUSEPORT) or one inherited Unix socket, supervised by their parent."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitRequest, RateLimitResponse
from support.sidecars import ServeProcess, request, serve_process, write_rules

from sidecar import cli
from sidecar.rls.server import METHOD

USER = [("user", "alice")]
#: 3 calls an hour per user: four calls that straddle a minute (a per-minute limit's window)
#: would all be admitted, and the test fail on a busy machine now and then.
HOURLY = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3}
"""


def test_the_transport_is_fast_unless_told_otherwise() -> None:
    """`--transport` defaults to fast; RLS_TRANSPORT and RLS_WORKERS set it as any flag."""
    default = cli.parse_args(["serve", "--config", "a.yaml"], {})
    from_env = cli.parse_args(
        ["serve", "--config", "a.yaml"], {"RLS_TRANSPORT": "grpcio", "RLS_WORKERS": "4"}
    )

    assert (default.transport, default.workers) == ("fast", 1)
    assert (from_env.transport, from_env.workers) == ("grpcio", 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--transport", "h3"], "invalid choice: 'h3'"),
        (["--workers", "0"], "must be at least 1"),
        (["--grpc-address", "unix:"], "expected unix:PATH"),
    ],
    ids=["unknown-transport", "no-workers", "empty-unix-path"],
)
def test_bad_transport_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown transport, fewer than one worker or an empty Unix socket path is a usage error
    (exit status 2) naming the fault."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["serve", "--config", "a.yaml", *argv], {})

    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_unix_grpc_address_is_accepted() -> None:
    """`--grpc-address unix:PATH` is a gRPC address."""
    args = cli.parse_args(["serve", "--config", "a.yaml", "--grpc-address", "unix:/run/rls.sock"])
    assert args.grpc_address == "unix:/run/rls.sock"


def test_workers_get_every_flag_but_the_addresses_and_their_count() -> None:
    """Each worker is started with every `serve` flag of the command line and its RLS_* variables,
    but the addresses and the worker count."""
    args = cli.parse_args(
        [
            "serve", "--config", "a.yaml", "--config", "b.yaml", "--backend", "redis://r:6379",
            "--shadow-mode", "--workers", "3", "--grpc-address", "127.0.0.1:1",
        ],
        {"RLS_FAILURE_MODE": "deny"},
    )  # fmt: skip

    flags = cli.serve.worker_flags(args)

    assert flags[:6] == ["--config", "a.yaml", "--config", "b.yaml", "--backend", "redis://r:6379"]
    assert "--shadow-mode" in flags
    assert flags[flags.index("--failure-mode") + 1] == "deny"
    assert flags[flags.index("--transport") + 1] == "fast"
    assert "--workers" not in flags and "--grpc-address" not in flags


async def test_workers_refuse_the_memory_backend(tmp_path: Path) -> None:
    """Counters in memory would be per worker, so every limit would be N times too high."""
    rules = write_rules(tmp_path)
    args = ["--config", str(rules), "--workers", "2", "--grpc-address", "127.0.0.1:0"]
    async with serve_process(args, wait=False) as served:
        status = await asyncio.wait_for(served.process.wait(), 20)

    assert status == 2
    assert "--workers 2 needs a shared backend" in served.output()


@pytest.mark.parametrize("transport", ["fast", "grpcio"])
async def test_one_sidecar_serves_on_a_unix_socket(tmp_path: Path, transport: str) -> None:
    """`--grpc-address unix:PATH`: Envoy can reach the sidecar over a pipe."""
    rules = write_rules(tmp_path)
    path = tmp_path / "rls.sock"
    args = ["--config", str(rules), "--grpc-address", f"unix:{path}", "--transport", transport]
    args += ["--http-address", "127.0.0.1:0"]
    async with serve_process(args, wait=False) as served:
        await _started(served, 1)
        answer = await _call(f"unix:{path}")
        served.process.send_signal(signal.SIGTERM)
        status = await asyncio.wait_for(served.process.wait(), 20)

    assert answer.overall_code == RateLimitResponse.OK
    assert status == 0, served.output()


@pytest.mark.parametrize("transport", ["fast", "grpcio"])
async def test_grpc_socket_mode_sets_the_sockets_permission_bits(
    tmp_path: Path, transport: str
) -> None:
    """`--grpc-socket-mode 666` makes the socket connectable by any user (Envoy in the same pod
    runs as another user than the sidecar); without it the umask decides (no write for others
    under the usual 022)."""
    rules = write_rules(tmp_path)
    modes = {}
    for flag in ([], ["--grpc-socket-mode", "666"]):
        path = tmp_path / f"rls{len(flag)}.sock"
        args = ["--config", str(rules), "--grpc-address", f"unix:{path}", "--transport", transport]
        args += ["--http-address", "127.0.0.1:0", *flag]
        async with serve_process(args, wait=False) as served:
            await _started(served, 1)
            modes[bool(flag)] = stat.S_IMODE(os.stat(path).st_mode)
            answer = await _call(f"unix:{path}")
            served.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(served.process.wait(), 20) == 0, served.output()
        assert answer.overall_code == RateLimitResponse.OK
    umask = os.umask(0)
    os.umask(umask)
    assert modes == {False: 0o777 & ~umask, True: 0o666}


@pytest.mark.parametrize("mode", ["8", "1777", "rw", ""])
def test_a_socket_mode_that_is_not_octal_permission_bits_is_a_usage_error(mode: str) -> None:
    """A `--grpc-socket-mode` that is not octal permission bits (0 to 777) is a usage error."""
    with pytest.raises(SystemExit) as caught:
        cli.parse_args(["serve", "--config", "a.yaml", "--grpc-socket-mode", mode])
    assert caught.value.code == 2


@pytest.mark.redis
@pytest.mark.parametrize("where", ["tcp", "unix"])
async def test_workers_share_one_address_and_stop_together(
    tmp_path: Path, redis_url: str, where: str
) -> None:
    """Two workers, one port (or one socket), one Redis: the counters are shared whichever worker
    takes a connection (3 an hour, the 4th call is OVER_LIMIT); SIGTERM stops both, exit 0."""
    path = tmp_path / "rls.sock"
    address = "127.0.0.1:0" if where == "tcp" else f"unix:{path}"
    async with _workers(tmp_path, redis_url, address) as served:
        started = await _started(served, 2)
        target = f"127.0.0.1:{started[0]['grpc_port']}" if where == "tcp" else f"unix:{path}"
        answers = [await _call(target) for _ in range(4)]
        served.process.send_signal(signal.SIGTERM)
        status = await asyncio.wait_for(served.process.wait(), 30)

    assert status == 0, served.output()
    assert len({event["pid"] for event in started}) == 2
    assert len({event["grpc_port"] for event in started}) == 1
    ok, over = RateLimitResponse.OK, RateLimitResponse.OVER_LIMIT
    assert [a.overall_code for a in answers] == [ok, ok, ok, over]
    events = [e["event"] for e in served.events()]
    assert events.count("stopped") == 2
    assert events[-1] == "workers_stopped"
    assert not path.exists()


@pytest.mark.redis
async def test_a_worker_that_dies_stops_the_others(tmp_path: Path, redis_url: str) -> None:
    """The parent does not run on with fewer workers: it stops them all and fails."""
    async with _workers(tmp_path, redis_url, "127.0.0.1:0") as served:
        started = await _started(served, 2)
        os.kill(started[0]["pid"], signal.SIGKILL)  # a worker this test started, by its PID
        status = await asyncio.wait_for(served.process.wait(), 30)

    assert status != 0
    assert "worker_exited" in served.output()
    assert [e["event"] for e in served.events()].count("stopped") == 1


@asynccontextmanager
async def _workers(tmp_path: Path, redis_url: str, address: str) -> AsyncIterator[ServeProcess]:
    rules = write_rules(tmp_path, HOURLY)
    args = ["--config", str(rules), "--backend", redis_url, "--workers", "2"]
    args += ["--grpc-address", address, "--http-address", "127.0.0.1:0"]
    async with serve_process(args, wait=False) as served:
        yield served


async def _started(served: ServeProcess, count: int) -> list[dict[str, Any]]:
    """The `started` events of `count` processes, once they have all logged one."""
    async with asyncio.timeout(60):
        while True:
            started = [e for e in served.events() if e.get("event") == "started"]
            if len(started) >= count:
                return started
            if served.process.returncode is not None:
                raise AssertionError(f"exited before starting:\n{served.output()}")
            await asyncio.sleep(0.05)


async def _call(target: str) -> RateLimitResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(
            METHOD,
            request_serializer=RateLimitRequest.SerializeToString,
            response_deserializer=RateLimitResponse.FromString,
        )
        answer: RateLimitResponse = await call(request("test", USER), timeout=10)
        return answer


_SUPERVISOR = """
import sys
from sidecar.runner import workers
sys.exit(workers._supervise([sys.executable, "-c", sys.argv[1]], 2, ()))
"""


async def _supervised(worker: str, *, terminate: bool) -> tuple[int, str]:
    """Run the supervisor over two copies of the `worker` program; once both have printed
    "up", SIGTERM the supervisor (a process this test started, by its PID) if `terminate`.
    Returns its exit status and what it and the workers wrote."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SUPERVISOR, worker,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    output = b""
    try:
        async with asyncio.timeout(60):
            if terminate:
                while output.count(b"up\n") < 2:
                    line = await process.stdout.readline()
                    assert line, f"the workers did not start:\n{output.decode()}"
                    output += line
                process.send_signal(signal.SIGTERM)
            output += await process.stdout.read()
            status = await process.wait()
    except TimeoutError:
        # What came so far (it showed the interleaved "up" lines once).
        raise AssertionError(f"no end within 60 s; output so far:\n{output.decode()}") from None
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return status, output.decode()


async def test_a_worker_stopped_while_still_starting_is_a_clean_stop() -> None:
    """A SIGTERM that reaches a worker before it has installed its signal handlers (it installs
    them before it listens or accepts, so it has taken no call) kills it by that signal; the
    parent, which forwarded it, counts that as a clean stop and exits 0. A worker that exits
    with an error on its own still makes the parent fail with its status."""
    # "up\n" in one write: print() writes the text and the newline apart when stdout is
    # unbuffered (PYTHONUNBUFFERED), and two workers once wrote "upup\n\n" in a whole-suite run.
    starting = "import os, time; os.write(1, b'up\\n'); time.sleep(60)"
    status, output = await _supervised(starting, terminate=True)
    assert status == 0, output
    assert output.count("worker_stopped_while_starting") == 2

    status, output = await _supervised("import sys; sys.exit(3)", terminate=False)
    assert status == 3, output
    assert "worker_exited" in output
