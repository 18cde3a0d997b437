"""Failovers under a steady stream of calls, on every Redis topology, with real servers.

Each test sends calls one after another (a few ms apart, as a legitimate client would) while a
master goes away: promoted replica behind Sentinel (SENTINEL FAILOVER, or the master killed), a
Redis Cluster master replaced by its replica (CLUSTER FAILOVER, or killed), a standalone address
repointed at a new master while the old one is demoted (READONLY), a restarted server loading its
data (LOADING). What each asserts is what Envoy would see:

- every call ends within its deadline (plus scheduling slack), with outcomes or a StorageError,
  which the service answers by its failure mode; never another exception, never a hang;
- from one second after the new master is available, as the test sees it from the Sentinels' or
  the cluster's view (or from the moment it repointed the address), every call is decided by the
  new master and counted there exactly: a limit of LIMIT admits exactly LIMIT of CALLS_AFTER.

Every server of these tests is started by a fixture of the test's own, once with Redis and once
with Valkey (the `flavour` fixture): a managed Valkey fails over the same ways. Two tests run on
Redis alone (REDIS_ONLY), to keep the suite's time down where Valkey would prove nothing more:
the Sentinel failover with the master killed (Valkey's Sentinels announce a new master as in the
graceful case, which runs on both), and local mode (the limiter's, whatever server died).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot
from support import callbacks
from support.servers import (
    HOST,
    Flavour,
    RedisCluster,
    RedisServer,
    SentinelGroup,
    ServerError,
    add_replica,
    free_port,
    role,
    start_cluster,
    start_replica,
    start_sentinels,
    start_server,
    wait_for,
)

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.errors import StorageError
from sidecar.model import Code, Descriptor, Entry, Hit, Outcome, Request, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

NOW_MS = (int(time.time()) // 60 * 60 + 5) * 1000
DEADLINE_MS = 250
# How far past its deadline a failing call may end: what is guarded against is a call that hangs.
SLACK = 0.4
#: The bound under test: limiting again this long after the new master is available.
WITHIN = 1.0
LIMIT = 20
CALLS_AFTER = 30
#: How long the stream goes on when the failover never completes (then the test fails).
GIVE_UP = 40.0


def hit(key: bytes, limit: int) -> Hit:
    return Hit(key, 1, Window(limit, Unit.MINUTE), ttl=60, end_ms=NOW_MS + 55_000)


@dataclasses.dataclass
class Call:
    started: float
    took: float
    outcome: Outcome | BaseException


async def one_call(backend: Backend, key: bytes, limit: int) -> Call:
    started = time.monotonic()
    try:
        [outcome] = await callbacks.apply(backend, [hit(key, limit)], False, NOW_MS)
        result: Outcome | BaseException = outcome
    except Exception as exc:  # judged by the caller
        result = exc
    return Call(started, time.monotonic() - started, result)


async def through_failover(
    backend: Backend, fail_over: Callable[[], None], available: Callable[[], bool], key: bytes
) -> tuple[list[Call], float]:
    """Calls on `key` (a limit nobody reaches) every 5 ms while `fail_over` runs in a thread,
    until WITHIN after `available` first holds (polled in a thread every 10 ms); returns the
    calls and when the new master was available."""
    ready: list[float] = []

    def watch() -> None:
        fail_over()
        wait_for(available, "the new master", timeout=GIVE_UP)
        ready.append(time.monotonic())

    watcher = asyncio.create_task(asyncio.to_thread(watch))
    calls: list[Call] = []
    while not ready or time.monotonic() < ready[0] + WITHIN:
        if watcher.done() and not ready:
            await watcher  # raises what went wrong
        calls.append(await one_call(backend, key, 10**9))
        await asyncio.sleep(0.005)
    await watcher
    return calls, ready[0]


def check_stream(calls: list[Call]) -> None:
    """Every call ended in time, decided or failed as the failure mode answers."""
    assert len(calls) >= 20, "the stream did not run through the failover"
    for call in calls:
        assert call.took < DEADLINE_MS / 1000 + SLACK, call
        assert isinstance(call.outcome, Outcome | StorageError), call


async def check_limiting(backend: Backend, master: RedisServer, key: bytes) -> list[Call]:
    """CALLS_AFTER calls on a limit of LIMIT: every one decided, exactly LIMIT admitted, and the
    new master holds the count of every call."""
    calls = [await one_call(backend, key, LIMIT) for _ in range(CALLS_AFTER)]
    failed = [call for call in calls if not isinstance(call.outcome, Outcome)]
    assert not failed, f"{len(failed)} of {CALLS_AFTER} calls failed: {failed[0]}"
    admitted = [c for c in calls if isinstance(c.outcome, Outcome) and not c.outcome.over]
    assert len(admitted) == LIMIT
    with master.client() as client:
        assert int(client.get(key) or 0) == CALLS_AFTER
    return calls


# --- Sentinel ----------------------------------------------------------------------------------


@pytest.fixture
def sentinel_group(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, flavour: Flavour
) -> Iterator[SentinelGroup]:
    """A master, its replica and `request.param` Sentinels of this test's own."""
    try:
        group = start_sentinels(tmp_path_factory.mktemp("sentinel"), request.param, flavour)
    except ServerError as exc:
        pytest.fail(str(exc))
    yield group
    group.stop()


#: `flavour` for a test that runs on Redis alone (see the module's docstring).
REDIS_ONLY = pytest.mark.parametrize("flavour", ["redis"], indirect=True)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("sentinel_group", "how", "flavour"),
    [
        pytest.param(1, "SENTINEL FAILOVER", "redis", id="redis-1-SENTINEL FAILOVER"),
        pytest.param(1, "SENTINEL FAILOVER", "valkey", id="valkey-1-SENTINEL FAILOVER",
                     marks=pytest.mark.valkey),
        pytest.param(3, "master killed", "redis", id="redis-3-master killed"),
    ],
    indirect=["sentinel_group", "flavour"],
)  # fmt: skip
async def test_a_sentinel_failover_is_followed_within_a_second(
    sentinel_group: SentinelGroup, how: str
) -> None:
    """Through a Sentinel failover (a graceful one, where the old master goes on taking writes
    until the Sentinels demote it; or the master killed, with 3 Sentinels), every call ends in
    time, decided or failed by the failure mode, and from one second after the Sentinels name
    the new master (and it says ROLE master), calls are counted exactly there."""
    group = sentinel_group
    old, new = group.master(), group.replica()
    backend = open_backend(group.url, timeout_ms=DEADLINE_MS)
    try:
        assert isinstance((await one_call(backend, b"{warm}", 10)).outcome, Outcome)

        def fail_over() -> None:
            if how == "master killed":
                old.kill()
            else:
                with group.sentinels[0].client() as client:
                    client.execute_command("SENTINEL", "FAILOVER", group.MASTER_NAME)

        def available() -> bool:
            return group.master_address() == (HOST, new.port) and role(new) == "master"

        calls, _ = await through_failover(backend, fail_over, available, b"{stream}")
        check_stream(calls)
        await check_limiting(backend, new, b"{after}")
        if old.running:  # the graceful case: nothing was counted on the old master
            with old.client() as client:
                assert client.get(b"{after}") is None
    finally:
        await backend.close()


@pytest.mark.redis
@pytest.mark.parametrize("sentinel_group", [1], indirect=True)
async def test_sentinel_and_master_credentials_are_apart(sentinel_group: SentinelGroup) -> None:
    """The userinfo authenticates to the master, `sentinel_password` to the Sentinels; a wrong
    master password fails calls with StorageError, and no error shows a password."""
    group = sentinel_group
    master = group.master()
    for sentinel in group.sentinels:
        with sentinel.client() as client:
            client.execute_command(
                "SENTINEL", "SET", group.MASTER_NAME, "auth-pass", "master-secret"
            )
            client.execute_command("ACL", "SETUSER", "default", "on", ">sentinel-secret")
    for server in group.servers:
        with server.client() as client:
            client.config_set("masterauth", "master-secret")
            client.config_set("requirepass", "master-secret")
    hosts = ",".join(f"{HOST}:{s.port}" for s in group.sentinels)
    good = open_backend(
        f"redis+sentinel://:master-secret@{hosts}/{group.MASTER_NAME}/2"
        "?sentinel_password=sentinel-secret",
        timeout_ms=1000,
    )
    bad = open_backend(
        f"redis+sentinel://:master-secret@{hosts}/{group.MASTER_NAME}?sentinel_password=wrong",
        timeout_ms=1000,
    )
    try:
        assert isinstance((await one_call(good, b"{auth}", 10)).outcome, Outcome)
        with master.client(password="master-secret") as client:
            client.select(2)
            assert int(client.get(b"{auth}")) == 1
        failed = (await one_call(bad, b"{auth}", 10)).outcome
        assert isinstance(failed, StorageError)
        assert "secret" not in str(failed) and "wrong" not in str(failed)
    finally:
        await good.close()
        await bad.close()


LOCAL_RULES = f"""
domain: d
descriptors:
  - key: stream
    rate_limit: {{unit: hour, requests_per_unit: 1000000000}}
  - key: after
    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}
"""


@pytest.mark.redis
@pytest.mark.parametrize("sentinel_group", [1], indirect=True)
@REDIS_ONLY
async def test_local_mode_decides_every_call_through_a_sentinel_failover(
    sentinel_group: SentinelGroup,
) -> None:
    """The limiter under `--failure-mode local` (2 sidecars share the counters) through a
    Sentinel failover with the master killed: every call is answered in time, by the shared
    counters or, while no master answers, by this sidecar's share; from one second after the
    new master is available, every call is decided on the shared counters again (the limit
    reported is the whole limit, not the share) and counted exactly on the new master."""
    group = sentinel_group
    old, new = group.master(), group.replica()
    rules = Rules({"d": config.parse(LOCAL_RULES, "rules.yaml")})
    backend = open_backend(group.url, timeout_ms=DEADLINE_MS)
    limiter = Limiter(rules, backend, settings=Settings(failure_mode="local", local_divisor=2))

    async def decide(key: str) -> tuple[float, tuple[Code, int]]:
        plan = limiter.prepare(Request("d", (Descriptor((Entry(key, "a"),)),), 0))
        started = time.monotonic()
        status = (await callbacks.decide(limiter, plan)).statuses[0]
        return time.monotonic() - started, (status.code, status.window.requests_per_unit)

    try:
        assert (await decide("stream"))[1] == (Code.OK, 10**9)
        ready: list[float] = []

        def available() -> bool:
            return group.master_address() == (HOST, new.port) and role(new) == "master"

        def watch() -> None:
            old.kill()
            wait_for(available, "the new master", timeout=GIVE_UP)
            ready.append(time.monotonic())

        watcher = asyncio.create_task(asyncio.to_thread(watch))
        answers = []
        while not ready or time.monotonic() < ready[0] + WITHIN:
            if watcher.done() and not ready:
                await watcher
            answers.append(await decide("stream"))
            await asyncio.sleep(0.005)
        await watcher
        assert all(took < DEADLINE_MS / 1000 + SLACK for took, _ in answers)
        assert {answer for _, answer in answers} <= {(Code.OK, 10**9), (Code.OK, 10**9 // 2)}
        assert limiter.stats.local_decisions > 0, "no call was decided locally"

        after = [(await decide("after"))[1] for _ in range(CALLS_AFTER)]
        assert after == [(Code.OK, LIMIT)] * LIMIT + [(Code.OVER_LIMIT, LIMIT)] * (
            CALLS_AFTER - LIMIT
        )
        with new.client() as client:
            keys = client.keys("*after*")
            assert sum(int(client.get(key)) for key in keys) == CALLS_AFTER
    finally:
        await backend.close()


# --- Redis Cluster -----------------------------------------------------------------------------


@pytest.fixture
def replicated_cluster(
    tmp_path_factory: pytest.TempPathFactory, flavour: Flavour
) -> Iterator[RedisCluster]:
    """3 masters, the first with a replica; a node timeout of 1 s, so a killed master is
    replaced in a few seconds."""
    workdir = tmp_path_factory.mktemp("cluster-failover")
    try:
        cluster = start_cluster(workdir, node_timeout_ms=1000, flavour=flavour)
    except ServerError as exc:
        pytest.fail(str(exc))
    try:
        add_replica(cluster, cluster.nodes[0], workdir)
    except ServerError as exc:
        cluster.stop()
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


def key_of(cluster: RedisCluster, node: RedisServer, name: str) -> bytes:
    """A key whose slot `node` serves."""
    with node.client() as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    mine = [(start, end) for start, end, master, *_ in ranges if int(master[1]) == node.port]
    for tag in range(10_000):
        key = b"{%s%d}" % (name.encode(), tag)
        if any(start <= key_slot(key) <= end for start, end in mine):
            return key
    raise AssertionError(f"no key for port {node.port}")


def serves(cluster: RedisCluster, node: RedisServer, key: bytes) -> bool:
    """Every running master's slot map gives `key`'s slot to `node`, a master, and the cluster
    is up."""
    if role(node) != "master":
        return False
    for other in [*cluster.nodes, *cluster.replicas]:
        if not other.running or role(other) != "master":
            continue
        try:
            with other.client() as client:
                ranges = client.execute_command("CLUSTER", "SLOTS")
                state = client.execute_command("CLUSTER", "INFO")
        except Exception:  # a node going down meanwhile: ask again
            return False
        if b"cluster_state:ok" not in state:
            return False
        slot = key_slot(key)
        owners = [int(m[1]) for start, end, m, *_ in ranges if start <= slot <= end]
        if owners != [node.port]:
            return False
    return True


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["CLUSTER FAILOVER", "master killed"])
async def test_a_cluster_failover_is_followed_within_a_second(
    replicated_cluster: RedisCluster, how: str
) -> None:
    """A cluster master replaced by its replica (CLUSTER FAILOVER on the replica, or the master
    killed and the replica promoted by the cluster): every call ends in time, decided or failed
    by the failure mode, and from one second after every master's slot map names the new master,
    calls are counted exactly there."""
    cluster = replicated_cluster
    old, new = cluster.nodes[0], cluster.replicas[0]
    stream, after = key_of(cluster, old, "stream"), key_of(cluster, old, "after")
    backend = open_backend(cluster.url, timeout_ms=DEADLINE_MS)
    try:
        assert isinstance((await one_call(backend, stream, 10**9)).outcome, Outcome)

        def fail_over() -> None:
            if how == "master killed":
                old.kill()
                return
            # A manual failover the master does not take up within 5 s is given up (by
            # Redis): ask again, a busy machine can be that slow.
            for _ in range(3):
                with new.client() as client:
                    client.execute_command("CLUSTER", "FAILOVER")
                with contextlib.suppress(ServerError):
                    wait_for(lambda: role(new) == "master", "CLUSTER FAILOVER", timeout=8)
                    return

        calls, _ = await through_failover(
            backend, fail_over, lambda: serves(cluster, new, stream), stream
        )
        check_stream(calls)
        await check_limiting(backend, new, after)
    finally:
        await backend.close()


# --- standalone: an address repointed, a server loading -------------------------------------


class Repointable:
    """A TCP proxy on a free loopback port, as a Kubernetes Service or a DNS name in front of
    Redis: new connections go to `target`, established ones stay where they were."""

    def __init__(self, target: RedisServer) -> None:
        self.target = target
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, HOST, free_port())
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target.port)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


@pytest.fixture
def replicated(tmp_path: Path, flavour: Flavour) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica, of this test's own."""
    try:
        master = start_server(tmp_path / "master", flavour=flavour)
    except ServerError as exc:
        pytest.fail(str(exc))
    try:
        replica = start_replica(tmp_path / "replica", master)
    except ServerError as exc:
        master.stop()
        pytest.fail(str(exc))
    yield master, replica
    replica.stop()
    master.stop()


@pytest.mark.redis
async def test_a_demoted_master_behind_a_repointed_address_is_left_within_a_second(
    replicated: tuple[RedisServer, RedisServer],
) -> None:
    """redis:// through an address that a failover repoints (a Service, DNS, a proxy) while the
    old master becomes a replica and keeps its connections: the calls it refuses with READONLY
    fail by the failure mode, the client drops its connections and dials again, and from one
    second after the failover every call is counted exactly on the new master (the bug of
    envoyproxy/ratelimit's PR #1191, where they failed until a restart)."""
    old, new = replicated
    proxy = Repointable(old)
    await proxy.start()
    backend = open_backend(f"redis://{HOST}:{proxy.port}", timeout_ms=DEADLINE_MS)
    try:
        assert isinstance((await one_call(backend, b"{warm}", 10)).outcome, Outcome)

        def fail_over() -> None:
            with new.client() as client:
                client.execute_command("REPLICAOF", "NO", "ONE")
            proxy.target = new
            with old.client() as client:
                client.execute_command("REPLICAOF", HOST, str(new.port))

        calls, _ = await through_failover(
            backend, fail_over, lambda: role(old) == "slave", b"{stream}"
        )
        check_stream(calls)
        assert any(
            isinstance(c.outcome, StorageError) and "READONLY" in str(c.outcome) for c in calls
        ), "the demoted master never answered READONLY: the test did not test it"
        await check_limiting(backend, new, b"{after}")
    finally:
        await backend.close()
        await proxy.close()


@pytest.fixture
def restartable(tmp_path: Path, flavour: Flavour) -> Iterator[RedisServer]:
    """A server of this test's own, to stop and start again on the same port."""
    try:
        server = start_server(tmp_path / "restartable", flavour=flavour)
    except ServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.mark.redis
async def test_a_loading_server_fails_calls_in_time_and_the_connection_serves_after(
    restartable: RedisServer,
) -> None:
    """A restarted server loading its data answers LOADING: those calls fail in time with
    StorageError (the failure mode), the client keeps its connection (the server is the same),
    and the calls after loading are counted on it."""
    server = restartable
    with server.client() as client:
        with client.pipeline(transaction=False) as pipe:
            for index in range(2_000):
                pipe.set(f"filler{index}", "x" * 32)
            pipe.execute()
        client.save()
    backend = open_backend(server.url, timeout_ms=DEADLINE_MS)
    try:
        server.stop()
        # 1 ms per key of 2,000: about two seconds of LOADING, the server answering meanwhile.
        server.extra_args = (
            "--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024",
        )  # fmt: skip
        starting = asyncio.create_task(asyncio.to_thread(server.start))  # returns once loaded
        pipelined = backend._client  # type: ignore[attr-defined]

        def open_connections() -> set[object]:
            return {p for p in pipelined._connections if p is not None and p.lost is None}

        calls: list[Call] = []
        loading = 0
        met: set[object] = set()  # every connection open after a call that met LOADING
        while not starting.done():
            calls.append(await one_call(backend, b"{loading}", 10**9))
            await asyncio.sleep(0.005)
            if "LOADING" in str(calls[-1].outcome):
                loading += 1
                met |= open_connections()
        await starting
        check_stream(calls)
        assert loading, "no call met LOADING: the test did not test it"
        await check_limiting(backend, server, b"{after}")
        assert met and met <= open_connections(), "connections were dropped after LOADING"
    finally:
        await backend.close()
        server.extra_args = ()


# --- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://10.0.0.1:26379,10.0.0.2/mymaster",
        "redis+sentinel://:pw@s1:26379/mymaster/3?sentinel_password=x&sentinel_username=u",
        "rediss+sentinel://s1/m?ssl_ca_certs=/etc/ca.pem&sentinel_password=x",
        "redis+sentinel://[::1]:26379/my%20master/",
    ],
)
async def test_sentinel_urls_open_without_connecting(url: str) -> None:
    """Every Sentinel URL form opens a `redis-sentinel` backend without connecting to anything."""
    backend = open_backend(url)
    assert backend.name == "redis-sentinel"
    await backend.close()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+sentinel://s1:26379", "no master name"),
        ("redis+sentinel://s1:26379/", "no master name"),
        ("redis+sentinel:///m", "no Sentinel host:port"),
        ("redis+sentinel://s1:0/m", "bad port"),
        ("redis+sentinel://s1/m/db", "database must be a number"),
        ("redis+sentinel://s1/m/1/2", "database must be a number"),
        ("redis+sentinel://s1/m?ssl_ca_certs=/x", "unknown query parameter 'ssl_ca_certs'"),
        ("rediss+sentinel://s1/m?verify=1", "unknown query parameter 'verify'"),
        ("redis+sentinel://s1/m#f", "unexpected fragment"),
    ],
)
def test_bad_sentinel_urls_are_refused_with_a_reason(url: str, reason: str) -> None:
    """A Sentinel URL the backend cannot use is a ValueError that says what is wrong with it."""
    with pytest.raises(ValueError, match=reason):
        open_backend(url)


def test_sentinel_passwords_stay_out_of_url_errors() -> None:
    """A refused Sentinel URL is quoted without either password (the master's, the Sentinels')."""
    with pytest.raises(ValueError) as caught:
        open_backend("redis+sentinel://:master-pw@s1/m/x?sentinel_password=sentinel-pw")
    assert "master-pw" not in str(caught.value) and "sentinel-pw" not in str(caught.value)
