"""Backing servers a scenario needs (a Redis, a 3-master Redis Cluster), one of each per bench run.

A service is started the first time a scenario names it, shared by later scenarios, and stopped
at the end of the run.
Its placeholders (such as `{redis_url}`) fill the scenario commands, and its processes' CPU time
is reported per call next to the server's own, in the column its `kind` names: a cluster's
nodes are summed into the same `redis` column as a single server.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.processes import BenchError, Process, exited_message, free_port, start

START_TIMEOUT = 10.0
CLUSTER_SIZE = 3
# Redis Cluster listens on a bus at port + 10000, which must be free (and exist) too.
CLUSTER_BUS_OFFSET = 10_000
# Ports are probed, not reserved: another run may take one first, so a failed start is retried.
CLUSTER_START_ATTEMPTS = 3


@dataclass
class Service:
    name: str
    processes: list[Process]
    placeholders: dict[str, str] = field(default_factory=dict)
    #: The report column its CPU goes to; a single Redis and a cluster are both `redis`.
    kind: str = "redis"

    def cpu_ticks(self) -> int:
        return sum(process.cpu_ticks() for process in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def start_redis(log_dir: Path) -> Service:
    port = free_port()
    process = start("redis", _redis_argv(_redis_binary(), port), {}, log_dir)
    try:
        _wait_for_pong(process, port, START_TIMEOUT)
    except BaseException:
        process.stop()
        raise
    return Service("redis", [process], {"redis_url": f"redis://127.0.0.1:{port}"})


def start_redis_cluster(log_dir: Path) -> Service:
    """Three masters, no replicas, joined by `redis-cli --cluster create`; every slot served."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise BenchError("redis-cli not found on PATH (apt-get install redis-server)")
    binary = _redis_binary()
    error: BenchError | None = None
    for attempt in range(CLUSTER_START_ATTEMPTS):
        nodes: list[Process] = []
        try:
            ports = _cluster_ports(CLUSTER_SIZE)
            for index, port in enumerate(ports):
                # Each node writes its nodes.conf into its own directory.
                node_dir = log_dir / f"redis-cluster-{attempt}-{index}"
                node_dir.mkdir()
                argv = [
                    *_redis_argv(binary, port), "--dir", str(node_dir),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000",
                ]  # fmt: skip
                nodes.append(start(f"redis-cluster-{index}", argv, {}, log_dir))
            for node, port in zip(nodes, ports, strict=True):
                _wait_for_pong(node, port, START_TIMEOUT)
            _create_cluster(cli, nodes, ports)
        except BenchError as exc:
            error = exc
            _stop_all(nodes)
            continue
        except BaseException:
            _stop_all(nodes)
            raise
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        return Service("redis-cluster", nodes, {"redis_cluster_url": f"redis+cluster://{hosts}"})
    raise BenchError(f"redis-cluster: not started after {CLUSTER_START_ATTEMPTS} attempts: {error}")


def start_otlp(log_dir: Path) -> Service:
    """An OTLP/HTTP receiver that drops what it gets (bench/otlp_sink.py), for tracing."""
    port = free_port()
    sink = Path(__file__).resolve().parent / "otlp_sink.py"
    process = start("otlp", [sys.executable, str(sink), "--port", str(port)], {}, log_dir)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            code = process.exit_code()
            if code is not None or time.monotonic() > deadline:
                process.stop()
                raise BenchError(
                    exited_message(process, code) if code is not None else "otlp: not listening"
                ) from None
            time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/traces"
    return Service("otlp", [process], {"otlp_url": url}, kind="otlp")


STARTERS: dict[str, Callable[[Path], Service]] = {
    "redis": start_redis,
    "redis-cluster": start_redis_cluster,
    "otlp": start_otlp,
}


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BenchError("redis-server not found on PATH (apt-get install redis-server)")
    return binary


def _redis_argv(binary: str, port: int) -> list[str]:
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip


def _cluster_ports(count: int) -> list[int]:
    """`count` loopback ports, each with its bus port (port + 10000) free too."""
    # The kernel's ephemeral ports often sit above 55535, where no bus port exists; pick below.
    ports: list[int] = []
    taken: set[int] = set()
    for _ in range(1_000):
        port = random.randint(20_000, 65_535 - CLUSTER_BUS_OFFSET)
        pair = {port, port + CLUSTER_BUS_OFFSET}
        if taken.isdisjoint(pair) and all(_port_is_free(p) for p in pair):
            ports.append(port)
            taken |= pair
            if len(ports) == count:
                return ports
    raise BenchError("redis-cluster: no free port pairs (port, port + 10000) on 127.0.0.1")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _create_cluster(cli: str, nodes: list[Process], ports: list[int]) -> None:
    addresses = [f"127.0.0.1:{port}" for port in ports]
    try:
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError("redis-cli --cluster create did not finish within 60s") from exc
    if created.returncode != 0:
        output = (created.stdout + created.stderr).strip()[-500:]
        raise BenchError(f"redis-cli --cluster create failed: {output}")
    # `create` returns once the slots are assigned; each node says ok once it has heard of all.
    deadline = time.monotonic() + 30
    pending = list(zip(nodes, ports, strict=True))
    while pending and time.monotonic() < deadline:
        for node, _port in pending:
            code = node.exit_code()
            if code is not None:
                raise BenchError(f"{node.name} exited with code {code}\n{node.log_tail()}")
        pending = [(node, port) for node, port in pending if not _cluster_state_ok(port)]
        time.sleep(0.05)
    if pending:
        raise BenchError(
            "redis-cluster: no cluster_state:ok after 30s on port "
            + ", ".join(str(port) for _node, port in pending)
        )


def _cluster_state_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"CLUSTER INFO\r\n")
            # The reply is one bulk string whose first line is `cluster_state:...`.
            return b"cluster_state:ok" in sock.recv(256)
    except OSError:
        return False


def _stop_all(processes: list[Process]) -> None:
    for process in processes:
        process.stop()


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
    raise BenchError(
        f"{process.name}: no PONG on port {port} after {timeout:g}s\n{process.log_tail()}"
    )
