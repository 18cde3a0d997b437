"""Real `redis-server` processes for the tests: a standalone server and a 3-master Redis Cluster.

Every server listens on a free loopback port, keeps nothing on disk (``--save ""``,
``--appendonly no``, its own temporary directory) and is stopped by the PID it was started with.
Ports are picked by probing, so another test run on the same machine may grab one first: a
server that dies while starting is retried on fresh ports.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import redis.cluster

HOST = "127.0.0.1"
# Redis Cluster listens on its bus at port + 10000, so a node's port must leave room for it.
CLUSTER_BUS_OFFSET = 10_000
MAX_CLUSTER_PORT = 65_535 - CLUSTER_BUS_OFFSET
START_TIMEOUT = 10.0
START_ATTEMPTS = 5


class ServerError(RuntimeError):
    """A test server could not be started or did not become ready."""


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
    return port


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free and within range too."""
    # Kernel-chosen ports often sit above 55535, where the bus port would not exist.
    for _ in range(1_000):
        port = random.randint(20_000, MAX_CLUSTER_PORT)
        bus = port + CLUSTER_BUS_OFFSET
        if taken.isdisjoint((port, bus)) and _port_is_free(port) and _port_is_free(bus):
            return port
    raise ServerError("no free port pair (port, port + 10000) found on 127.0.0.1")


class RedisServer:
    """One `redis-server` process that can be stopped, paused and started again on its port."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        extra_args: tuple[str, ...] = (),
        tls_port: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port
        self.extra_args = extra_args
        #: The port that speaks TLS (see `tls_args`), beside the plain one the fixtures use.
        self.tls_port = tls_port
        self._process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    @property
    def nodes(self) -> list[RedisServer]:
        """The servers holding data: just this one (a cluster lists its masters)."""
        return [self]

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server on its port and wait until it answers PING."""
        if self.running:
            return
        command = [
            "redis-server",
            "--bind", HOST,
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise ServerError(f"redis-server on port {self.port} exited: {self.log_tail()}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"redis-server on port {self.port} did not answer PING in time")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and reap it; a no-op when it is not running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            # A paused server ignores SIGTERM until it is continued.
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        else:
            process.wait()

    def restart(self) -> None:
        """Stop the server and start a fresh one on the same port (its data is lost)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the process: it keeps its socket open and accepts TCP, but never answers."""
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGCONT)

    @contextmanager
    def client(self) -> Iterator[redis.Redis]:
        """A synchronous client for inspecting the server from a test."""
        client = redis.Redis(host=HOST, port=self.port, socket_timeout=5, protocol=2)
        try:
            yield client
        finally:
            client.close()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = (self.workdir / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])

    def _answers_ping(self) -> bool:
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.RedisError:
            return False


def tls_args(
    certificate: tuple[Path, Path], tls_port: int, auth_clients: str = "no"
) -> tuple[str, ...]:
    """redis-server flags for TLS on `tls_port`, with a self-signed certificate (its own CA,
    see `certs.py`) as the server's and, with ``--tls-cluster yes``, the cluster bus's.
    `auth_clients`: ``yes`` requires a client certificate signed by that CA."""
    cert_file, key_file = certificate
    return (
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(cert_file),
        "--tls-key-file", str(key_file),
        "--tls-ca-cert-file", str(cert_file),
        "--tls-auth-clients", auth_clients,
    )  # fmt: skip


def start_server(
    workdir: Path,
    extra_args: tuple[str, ...] = (),
    certificate: tuple[Path, Path] | None = None,
    auth_clients: str = "no",
) -> RedisServer:
    """A started standalone server on a free port, retrying when the port is taken meanwhile;
    with `certificate`, also on a TLS port (see `tls_args`)."""
    error: ServerError | None = None
    for attempt in range(START_ATTEMPTS):
        port = free_port()
        tls_port = None
        args = extra_args
        if certificate is not None:
            tls_port = next(p for p in iter(free_port, None) if p != port)
            args += tls_args(certificate, tls_port, auth_clients)
        server = RedisServer(workdir / f"attempt-{attempt}", port, args, tls_port)
        try:
            server.start()
        except ServerError as exc:
            error = exc
            continue
        return server
    raise ServerError(f"could not start redis-server: {error}")


class RedisCluster:
    """Three master nodes joined by `redis-cli --cluster create`, no replicas."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def flushall(self) -> None:
        for node in self.nodes:
            with node.client() as client:
                client.flushall()

    @contextmanager
    def client(self) -> Iterator[redis.cluster.RedisCluster]:
        """A synchronous cluster client for inspecting keys from a test."""
        client = redis.cluster.RedisCluster(
            host=HOST, port=self.nodes[0].port, socket_timeout=5, protocol=2
        )
        try:
            yield client
        finally:
            client.close()


def start_cluster(
    workdir: Path, size: int = 3, certificate: tuple[Path, Path] | None = None
) -> RedisCluster:
    """A started cluster of `size` masters, every node reporting ``cluster_state:ok``.

    With `certificate`, every node also listens on a TLS port and the cluster bus runs over TLS
    (``--tls-cluster yes``): the cluster then announces its TLS ports to clients that connect
    over TLS, and its plain ports to the others (the fixtures)."""
    error: ServerError | None = None
    for attempt in range(START_ATTEMPTS):
        taken: set[int] = set()
        nodes: list[RedisServer] = []
        try:
            for index in range(size):
                port = free_cluster_port(taken)
                taken.update((port, port + CLUSTER_BUS_OFFSET))
                args: tuple[str, ...] = (
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000",
                )  # fmt: skip
                tls_port = None
                if certificate is not None:
                    # With --tls-cluster the bus listens at the TLS port + 10000, not the plain one.
                    tls_port = free_cluster_port(taken)
                    taken.update((tls_port, tls_port + CLUSTER_BUS_OFFSET))
                    args += (*tls_args(certificate, tls_port), "--tls-cluster", "yes")
                node = RedisServer(
                    workdir / f"attempt-{attempt}" / f"node-{index}", port, args, tls_port
                )
                nodes.append(node)
                node.start()
            _create_cluster(nodes)
        except ServerError as exc:
            error = exc
            for node in nodes:
                node.stop()
            continue
        return RedisCluster(nodes)
    raise ServerError(f"could not start a Redis Cluster: {error}")


def _create_cluster(nodes: list[RedisServer]) -> None:
    addresses = [f"{HOST}:{node.port}" for node in nodes]
    result = subprocess.run(
        ["redis-cli", "--cluster", "create", *addresses,
         "--cluster-replicas", "0", "--cluster-yes"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        raise ServerError(f"redis-cli --cluster create failed: {output[-500:]}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(_cluster_state_ok(node) for node in nodes):
            return
        time.sleep(0.05)
    raise ServerError("the cluster did not reach cluster_state:ok in time")


def _cluster_state_ok(node: RedisServer) -> bool:
    try:
        with node.client() as client:
            info = client.cluster("INFO")
    except redis.RedisError:
        return False
    return bool(info.get("cluster_state") == "ok")
