"""Backing servers a scenario needs (Redis now; a Redis Cluster can follow), one per bench run.

A service is started the first time a scenario names it, shared by later scenarios, and stopped
at the end of the run.
Its placeholders (such as `{redis_url}`) fill the scenario commands, and its processes' CPU time
is reported per call next to the server's own.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.processes import BenchError, Process, exited_message, free_port, start

START_TIMEOUT = 10.0


@dataclass
class Service:
    name: str
    processes: list[Process]
    placeholders: dict[str, str] = field(default_factory=dict)

    def cpu_ticks(self) -> int:
        return sum(process.cpu_ticks() for process in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def start_redis(log_dir: Path) -> Service:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BenchError("redis-server not found on PATH (apt-get install redis-server)")
    port = free_port()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    process = start("redis", argv, {}, log_dir)
    try:
        _wait_for_pong(process, port, START_TIMEOUT)
    except BaseException:
        process.stop()
        raise
    return Service("redis", [process], {"redis_url": f"redis://127.0.0.1:{port}"})


STARTERS: dict[str, Callable[[Path], Service]] = {"redis": start_redis}


def _wait_for_pong(process: Process, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.exit_code()
        if code is not None:
            raise BenchError(exited_message(process, code))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                # A loading Redis answers -LOADING; only +PONG means it serves commands.
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise BenchError(f"redis: no PONG on port {port} after {timeout:g}s\n{process.log_tail()}")
