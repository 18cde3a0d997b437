"""The pipelined Redis Cluster client and the cluster backend on it, against real 3-master clusters.

Routing and writes are checked on the session cluster. Tests that move slots, flush a script
cache, add users or stop a master use a cluster of this module's own, so the session cluster
other tests share stays as they expect it; they find slot owners as they are, not as created.
Every test runs on a Redis Cluster and on a Valkey Cluster (the `flavour` fixture).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import hiredis
import pytest
from redis.crc import key_slot
from support.callbacks import apply
from support.servers import HOST, Flavour, RedisCluster, RedisServer, ServerError, start_cluster

from sidecar.errors import StorageError
from sidecar.model import Hit, Outcome, Unit, Window
from sidecar.storage.backends import open_backend
from sidecar.storage.cluster_client import (
    MAX_REDIRECTS,
    REFRESH_INTERVAL,
    ClusterError,
    PipelinedCluster,
)
from sidecar.storage.redis_client import DeadlineExceeded
from sidecar.storage.scripts import COUNT_SHA

pytestmark = pytest.mark.cluster

NOW_MS = (int(time.time()) // 60 * 60 + 5) * 1000
RESET_MS = 55_000
DEADLINE_MS = 250
# How far past its deadline a failing call may end: the failure guarded against is a call that
# hangs, so the allowance can absorb a busy CI machine's scheduling delays.
SLACK = 0.4


@pytest.fixture(scope="module")
def own_cluster(
    tmp_path_factory: pytest.TempPathFactory, flavour: Flavour
) -> Iterator[RedisCluster]:
    """A 3-master cluster of the flavour under test for this module alone, stopped by PID at
    its end."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("cluster-client"), flavour=flavour)
    except ServerError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def own(own_cluster: RedisCluster) -> RedisCluster:
    """The module's cluster, every master running and emptied."""
    for node in own_cluster.nodes:
        node.start()
    own_cluster.flushall()
    return own_cluster


def client_of(cluster: RedisCluster, **options: Any) -> PipelinedCluster:
    return PipelinedCluster([(HOST, node.port) for node in cluster.nodes], **options)


@pytest.fixture
async def shared(session_cluster: RedisCluster) -> AsyncIterator[PipelinedCluster]:
    """A client of the session cluster of the flavour under test."""
    client = client_of(session_cluster, connect_timeout=2.0)
    yield client
    await client.close()


@pytest.fixture
async def client(own: RedisCluster) -> AsyncIterator[PipelinedCluster]:
    """A client of the module's cluster."""
    client = client_of(own, connect_timeout=2.0)
    yield client
    await client.close()


# --- inspecting the servers ------------------------------------------------------------------


def owner(cluster: RedisCluster, slot: int) -> RedisServer:
    """The master serving `slot`, as the cluster's nodes say now."""
    running = next(node for node in cluster.nodes if node.running)
    with running.client() as sync:
        ranges = sync.execute_command("CLUSTER", "SLOTS")
    for start, end, master, *_ in ranges:
        if start <= slot <= end:
            return next(node for node in cluster.nodes if node.port == int(master[1]))
    raise AssertionError(f"no master serves slot {slot}")


def key_on(cluster: RedisCluster, node: RedisServer, name: str) -> bytes:
    """A key named after `name` whose slot `node` serves."""
    for tag in range(1_000):
        key = b"{%s%d}" % (name.encode(), tag)
        if owner(cluster, key_slot(key)) is node:
            return key
    raise AssertionError(f"no key for port {node.port}")


def node_id(node: RedisServer) -> bytes:
    with node.client() as sync:
        answer: bytes = sync.execute_command("CLUSTER", "MYID")
    return answer


def stat(node: RedisServer, name: str, field: str = "calls") -> int:
    """A command's (``cmdstat_get``) or an error's (``errorstat_MOVED``) count since the reset."""
    section = "commandstats" if name.startswith("cmdstat_") else "errorstats"
    with node.client() as sync:
        return int(sync.info(section).get(name, {}).get(field, 0))


def reset_stats(cluster: RedisCluster) -> None:
    for node in cluster.nodes:
        if node.running:
            with node.client() as sync:
                sync.config_resetstat()


def migrate(source: RedisServer, target: RedisServer, keys: list[bytes]) -> None:
    with source.client() as sync:
        sync.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)


def start_migration(cluster: RedisCluster, slot: int, target: RedisServer) -> RedisServer:
    """Mark `slot` as leaving its master for `target`; returns the master."""
    source = owner(cluster, slot)
    with target.client() as sync:
        sync.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
    with source.client() as sync:
        sync.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))
    return source


def finish_migration(
    cluster: RedisCluster, slot: int, source: RedisServer, target: RedisServer
) -> None:
    """Move the slot's remaining keys to `target` and tell every master it serves the slot."""
    with source.client() as sync:
        keys = sync.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        migrate(source, target, keys)
    for node in [target, source, *(n for n in cluster.nodes if n not in (source, target))]:
        with node.client() as sync:
            sync.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id(target))


def other_than(cluster: RedisCluster, node: RedisServer) -> RedisServer:
    return next(n for n in cluster.nodes if n is not node)


async def all_open(client: PipelinedCluster) -> None:
    """Open every connection to every master, and wait until they are."""
    nodes = await client.masters()
    for node in nodes:
        await node.execute("PING")
    for _ in range(200):
        if all(p is not None and p.lost is None for n in nodes for p in n._connections):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the connections did not open")


def count_writes(client: PipelinedCluster) -> dict[int, int]:
    """From now on, count the writes to each master, by port, over all its open connections."""
    writes: dict[int, int] = {}
    for node in client._nodes.values():
        writes[node.port] = 0
        for protocol in node._connections:
            assert protocol is not None and protocol.transport is not None
            transport: Any = protocol.transport
            write = transport.write

            def counting(data: bytes, port: int = node.port, write: Any = write) -> None:
                writes[port] += 1
                write(data)

            transport.write = counting
    return writes


# --- routing and writes ----------------------------------------------------------------------


async def test_commands_go_straight_to_the_master_of_their_slot(
    session_cluster: RedisCluster, shared: PipelinedCluster
) -> None:
    """Every command reaches the master serving its first key's slot (a script's first KEYS
    entry) without a redirection."""
    keys = {node.port: key_on(session_cluster, node, "route") for node in session_cluster.nodes}
    reset_stats(session_cluster)
    for key in keys.values():
        assert await shared.execute("SET", key, key) == b"OK"
    # A different number of calls per master, so no mix-up can give the same counts.
    calls = [
        shared.execute("GET", key)
        for count, key in enumerate(keys.values(), start=1)
        for _ in range(count)
    ]
    assert await asyncio.gather(*calls) == [
        k for n, k in enumerate(keys.values(), 1) for _ in range(n)
    ]
    for key in keys.values():
        assert await shared.execute("EVAL", "return KEYS[1]", 1, key) == key
    for count, node in enumerate(session_cluster.nodes, start=1):
        assert stat(node, "cmdstat_get") == count
        assert stat(node, "cmdstat_get", "rejected_calls") == 0
        assert stat(node, "cmdstat_eval") == 1
        assert stat(node, "errorstat_MOVED", "count") == 0


async def test_calls_of_one_tick_leave_in_one_write_per_master(
    session_cluster: RedisCluster, shared: PipelinedCluster
) -> None:
    """300 calls over three masters issued together: one write to each master, and every call
    gets its own reply."""
    keys = [
        key_on(session_cluster, node, f"tick{i}")
        for node in session_cluster.nodes
        for i in range(3)
    ]
    for key in keys:
        await shared.execute("SET", key, key)
    await all_open(shared)
    writes = count_writes(shared)
    calls = [key for _ in range(300 // len(keys) + 1) for key in keys][:300]
    assert await asyncio.gather(*(shared.execute("GET", key) for key in calls)) == calls
    assert writes == dict.fromkeys((node.port for node in session_cluster.nodes), 1)


async def test_a_command_without_a_key_is_refused() -> None:
    """A command the client cannot route by a key is refused before anything is sent."""
    client = PipelinedCluster([(HOST, 1)])
    with pytest.raises(ClusterError, match="names no key"):
        await client.execute("PING")
    with pytest.raises(ClusterError, match="no keys"):
        await client.execute("EVAL", "return 1", 0)


# --- redirections ----------------------------------------------------------------------------


async def test_moved_is_followed_and_the_slot_map_updated(
    own: RedisCluster, client: PipelinedCluster
) -> None:
    """After a slot moves to another master, one call follows MOVED there, the next calls go
    there directly, and the slot map is reloaded in the background."""
    key = b"{moved}key"
    slot = key_slot(key)
    await client.execute("SET", key, "v")
    source = owner(own, slot)
    target = other_than(own, source)
    start_migration(own, slot, target)
    finish_migration(own, slot, source, target)
    reset_stats(own)

    assert await client.execute("GET", key) == b"v"
    assert stat(source, "errorstat_MOVED", "count") == 1
    for _ in range(3):
        assert await client.execute("GET", key) == b"v"
    assert stat(source, "errorstat_MOVED", "count") == 1
    assert stat(target, "cmdstat_get") == 4
    for _ in range(300):
        if sum(stat(node, "cmdstat_cluster|slots") for node in own.nodes) >= 1:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the slot map was not reloaded after MOVED")


async def test_ask_is_followed_without_changing_the_slot_map(
    own: RedisCluster, client: PipelinedCluster
) -> None:
    """While a slot migrates, a key that has left is read on the importing node (ASKING and the
    command in one write), every time, and the slot's other keys still on its master."""
    stay, gone = b"{ask}stay", b"{ask}gone"
    slot = key_slot(stay)
    await client.execute("SET", stay, "here")
    await client.execute("SET", gone, "there")
    source = owner(own, slot)
    target = other_than(own, source)
    start_migration(own, slot, target)
    try:
        migrate(source, target, [gone])
        reset_stats(own)
        assert await client.execute("GET", gone) == b"there"
        assert await client.execute("GET", stay) == b"here"
        await all_open(client)
        writes = count_writes(client)
        assert await client.execute("GET", gone) == b"there"
        assert writes[target.port] == 1

        assert stat(source, "errorstat_ASK", "count") == 2
        assert stat(target, "cmdstat_asking") == 2
        assert stat(target, "cmdstat_get") == 2
        assert stat(source, "cmdstat_get") == 1
        assert stat(source, "errorstat_MOVED", "count") == 0
    finally:
        finish_migration(own, slot, source, target)


async def test_redirections_without_end_fail_the_call(
    own: RedisCluster, client: PipelinedCluster
) -> None:
    """A master that sends a key to a node that does not import its slot bounces the call
    between the two; it fails after MAX_REDIRECTS with ClusterError instead of looping."""
    key = b"{loop}key"
    slot = key_slot(key)
    await client.execute("SET", b"{loop}warm", "map loaded")
    source = owner(own, slot)
    target = other_than(own, source)
    with source.client() as sync:
        sync.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))
    try:
        reset_stats(own)
        with pytest.raises(ClusterError, match="still redirected"):
            await client.execute("GET", key)
        asks = stat(source, "errorstat_ASK", "count")
        moves = stat(target, "errorstat_MOVED", "count")
        assert asks + moves == MAX_REDIRECTS + 1
    finally:
        with source.client() as sync:
            sync.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


# --- the backend on the client ---------------------------------------------------------------


def hit(key: bytes, hits: int, limit: int) -> Hit:
    return Hit(key + b"|c", hits, Window(limit, Unit.MINUTE), ttl=60, end_ms=NOW_MS + RESET_MS)


async def test_noscript_on_one_master_sends_the_script_to_that_master_only(
    own: RedisCluster,
) -> None:
    """After one master loses its script cache, apply runs the script text there (once) and the
    hashed call elsewhere; the counts are unaffected. (Plain counters added: count.lua.)"""
    keys = [key_on(own, node, "script") for node in own.nodes]
    backend = open_backend(own.url, timeout_ms=2_000)
    try:
        hits = [hit(key, 1, 10) for key in keys]
        assert [o.remaining for o in await apply(backend, hits, False, NOW_MS)] == [9] * 3
        flushed = own.nodes[1]
        with flushed.client() as sync:
            sync.script_flush()
        reset_stats(own)
        assert (
            await apply(backend, hits, False, NOW_MS) == [Outcome(False, 8, RESET_MS, True, 9)] * 3
        )
        for node in own.nodes:
            assert stat(node, "cmdstat_eval") == (1 if node is flushed else 0)
            assert stat(node, "cmdstat_evalsha") == 1
        with flushed.client() as sync:
            assert sync.script_exists(COUNT_SHA) == [True]
    finally:
        await backend.close()


async def test_a_user_and_password_reach_every_master(own: RedisCluster) -> None:
    """The URL's user and password authenticate the connections to every master; a wrong
    password fails the calls and the ping."""
    for node in own.nodes:
        with node.client() as sync:
            sync.execute_command("ACL", "SETUSER", "sidecar", "on", ">s3cret", "~*", "&*", "+@all")
    hosts = ",".join(f"{HOST}:{node.port}" for node in own.nodes)
    backend = open_backend(f"redis+cluster://sidecar:s3cret@{hosts}", timeout_ms=2_000)
    wrong = open_backend(f"redis+cluster://sidecar:wrong@{hosts}", timeout_ms=2_000)
    try:
        assert await backend.ping()
        await apply(
            backend, [hit(key_on(own, node, "auth"), 1, 5) for node in own.nodes], False, NOW_MS
        )
        for node in own.nodes:
            with node.client() as sync:
                users = [client["user"] for client in sync.client_list()]
            assert "sidecar" in users
        assert not await wrong.ping()
        with pytest.raises(StorageError):
            await apply(wrong, [hit(b"{auth}", 1, 5)], False, NOW_MS)
    finally:
        await backend.close()
        await wrong.close()
        for node in own.nodes:
            with node.client() as sync:
                sync.execute_command("ACL", "DELUSER", "sidecar")


async def test_a_stopped_master_fails_in_time_and_serves_again_when_back(own: RedisCluster) -> None:
    """With one master down, calls for its slots raise StorageError by the deadline while the
    other masters serve, the slot map is reloaded at most once per REFRESH_INTERVAL, and the same backend
    serves the master's slots again once it is back."""
    down = own.nodes[2]
    up = own.nodes[0]
    key_down, key_up = key_on(own, down, "down"), key_on(own, up, "up")
    backend = open_backend(own.url, timeout_ms=DEADLINE_MS)
    try:
        await apply(backend, [hit(key_down, 1, 100)], False, NOW_MS)
        reset_stats(own)
        await asyncio.to_thread(down.stop)
        # Well within the cluster's node timeout (5 s): the other masters still serve.
        started = time.monotonic()
        for _ in range(20):
            before = time.monotonic()
            with pytest.raises(StorageError):
                await apply(backend, [hit(key_down, 1, 100)], False, NOW_MS)
            assert time.monotonic() - before < DEADLINE_MS / 1000 + SLACK
            await apply(backend, [hit(key_up, 1, 100)], False, NOW_MS)
            await asyncio.sleep(0.02)
        refreshes = sum(stat(node, "cmdstat_cluster|slots") for node in own.nodes if node.running)
        assert refreshes <= 2 + (time.monotonic() - started) / REFRESH_INTERVAL
        assert not await backend.ping()

        await asyncio.to_thread(down.start)
        deadline = time.monotonic() + 15
        while True:
            try:
                [outcome] = await apply(backend, [hit(key_down, 1, 100)], False, NOW_MS)
                break
            except StorageError:
                # A restarted master refuses writes for a moment (CLUSTERDOWN) before it serves.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        # The restarted master has lost its counters (nothing is saved), not the backend.
        assert outcome.left_before == 100
        assert await backend.ping()
    finally:
        await backend.close()


async def test_a_silent_master_fails_calls_by_their_own_deadline(own: RedisCluster) -> None:
    """A master that holds its connections but never answers: a call with a deadline raises
    DeadlineExceeded by then, with no asyncio.timeout around it, and the backend's apply (which
    passes its deadline down) is a StorageError in time while another master answers."""
    silent, other = own.nodes[1], own.nodes[0]
    key_silent, key_other = key_on(own, silent, "silent"), key_on(own, other, "other")
    backend = open_backend(own.url, timeout_ms=DEADLINE_MS)
    client = client_of(own)
    try:
        await apply(backend, [hit(key_silent, 1, 100)], False, NOW_MS)
        assert await client.execute("SET", key_silent, "1") == b"OK"
        silent.pause()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.execute_packed(
                key_slot(key_silent),
                hiredis.pack_command(("GET", key_silent)),
                loop.time() + DEADLINE_MS / 1000,
            )
        assert time.monotonic() - started < DEADLINE_MS / 1000 + SLACK
        started = time.monotonic()
        failed, [answered] = await asyncio.gather(
            apply(backend, [hit(key_silent, 1, 100)], False, NOW_MS),
            apply(backend, [hit(key_other, 1, 100)], False, NOW_MS),
            return_exceptions=True,
        )
        assert isinstance(failed, StorageError)
        assert time.monotonic() - started < DEADLINE_MS / 1000 + SLACK
        assert answered.applied
    finally:
        silent.resume()
        await backend.close()
        await client.close()


# --- the backend through callbacks (the fast transport's path) -------------------------------


def applied(backend: Any, hits: list[Hit]) -> Awaitable[list[Outcome]]:
    """`apply` on `hits` (no all-or-nothing, at NOW_MS), awaited."""
    return apply(backend, hits, False, NOW_MS)


async def test_callbacks_reach_the_master_without_a_coroutine_once_the_map_is_loaded(
    own: RedisCluster,
) -> None:
    """The first call loads the slot map on the coroutine path; after that a one-slot request is
    one EVALSHA on its master's pipeline, with no coroutine, in one write per tick."""
    keys = [key_on(own, node, "direct") for node in own.nodes]
    backend: Any = open_backend(own.url, timeout_ms=2_000)
    try:
        assert [o.remaining for o in await applied(backend, [hit(keys[0], 1, 10)])] == [9]

        async def no_coroutine(*args: Any) -> list[Outcome]:
            raise AssertionError("a one-slot request with a known master took the coroutine")

        backend._apply = no_coroutine
        reset_stats(own)
        calls = [applied(backend, [hit(key, 1, 10)]) for key in keys for _ in range(2)]
        outcomes = await asyncio.gather(*calls)
        assert sorted(o.remaining for [o] in outcomes) == [7, 8, 8, 8, 9, 9]
        for node in own.nodes:
            assert stat(node, "cmdstat_evalsha") == 2
    finally:
        await backend.close()


async def test_moved_through_callbacks_is_followed_and_counted_once(own: RedisCluster) -> None:
    """After the slot moves, the callback's call is answered MOVED (it did not run), `apply`
    sends it again and follows the redirection: the counter moves on by one, on the new master,
    and the next call goes there directly."""
    key = key_on(own, own.nodes[0], "movedcb")
    counted = hit(key, 1, 10)
    backend = open_backend(own.url, timeout_ms=2_000)
    try:
        assert [o.remaining for o in await applied(backend, [counted])] == [9]
        slot = key_slot(counted.key)
        source = owner(own, slot)
        target = other_than(own, source)
        start_migration(own, slot, target)
        finish_migration(own, slot, source, target)
        reset_stats(own)

        assert [o.remaining for o in await applied(backend, [counted])] == [8]
        with target.client() as sync:
            assert int(sync.get(counted.key)) == 2
        assert stat(target, "cmdstat_evalsha") == 1
        moved = stat(source, "errorstat_MOVED", "count")
        assert moved >= 1

        assert [o.remaining for o in await applied(backend, [counted])] == [7]
        assert stat(source, "errorstat_MOVED", "count") == moved
        assert stat(target, "cmdstat_evalsha") == 2
    finally:
        await backend.close()


async def test_noscript_through_callbacks_runs_the_script_once(own: RedisCluster) -> None:
    """A master that lost its script cache answers the callback's EVALSHA with NOSCRIPT; `apply`
    then sends the text (EVAL) there: one count, and the script (count.lua) cached again."""
    flushed = own.nodes[1]
    key = key_on(own, flushed, "noscriptcb")
    backend = open_backend(own.url, timeout_ms=2_000)
    try:
        assert [o.remaining for o in await applied(backend, [hit(key, 1, 10)])] == [9]
        with flushed.client() as sync:
            sync.script_flush()
        reset_stats(own)
        assert [o.remaining for o in await applied(backend, [hit(key, 1, 10)])] == [8]
        assert stat(flushed, "cmdstat_eval") == 1
        with flushed.client() as sync:
            assert int(sync.get(hit(key, 1, 10).key)) == 2
            assert sync.script_exists(COUNT_SHA) == [True]
    finally:
        await backend.close()


async def test_a_stopped_master_fails_callbacks_in_time(own: RedisCluster) -> None:
    """Through callbacks, a call for a stopped master's slot is a StorageError by its deadline
    while another master serves; once the master is back, the same backend counts there again."""
    down, up = own.nodes[2], own.nodes[0]
    key_down, key_up = key_on(own, down, "downcb"), key_on(own, up, "upcb")
    backend = open_backend(own.url, timeout_ms=DEADLINE_MS)
    try:
        await applied(backend, [hit(key_down, 1, 100)])
        await asyncio.to_thread(down.stop)
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(StorageError):
                await applied(backend, [hit(key_down, 1, 100)])
            assert time.monotonic() - started < DEADLINE_MS / 1000 + SLACK
            assert (await applied(backend, [hit(key_up, 1, 100)]))[0].applied
        await asyncio.to_thread(down.start)
        deadline = time.monotonic() + 15
        while True:
            try:
                [outcome] = await applied(backend, [hit(key_down, 1, 100)])
                break
            except StorageError:  # CLUSTERDOWN for a moment after the restart
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert outcome.left_before == 100  # the restarted master saved nothing
    finally:
        await backend.close()
