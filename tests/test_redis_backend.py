"""The Redis and Redis Cluster backends against real servers, held to the memory backend's rules.

Contract tests run on every backend (memory, Redis, Redis Cluster); the rest exercise what only a
network store has: TTLs, round trips, the script cache, dead and silent servers.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot
from support.callbacks import apply
from support.servers import HOST, RedisCluster, RedisServer, free_port

from sidecar.core import usage
from sidecar.errors import StorageError
from sidecar.model import Algorithm, Hit, Outcome, Role, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.cluster import RedisClusterBackend
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.redis import RedisBackend
from sidecar.storage.scripts import (
    COUNT_SCRIPT,
    COUNT_SHA,
    MODE_ADD,
    SCRIPT,
    SHA,
    counts,
    decide_command,
    decide_outcomes,
)

# Generous, so a loaded machine does not turn contract tests into timing tests.
TIMEOUT_MS = 2_000
# The production default, for the tests of failing calls.
DEADLINE_MS = 50
# For tests that also need a call to succeed on fresh connections (and a resumed server working
# off its backlog) on a possibly loaded machine.
RECOVERY_DEADLINE_MS = 250
# How far past its deadline a failing call may end. The failures these tests guard against are
# calls that hang (no deadline at all) or wait out someone else's deadline first, so the allowance
# can absorb a busy CI machine's scheduling delays without letting either through.
SLACK = 0.4

# Hash tags whose slots lie on three different masters of a 3-node cluster (3300, 7365, 15495).
A = b"rl{b}|a|60|0"
B = b"rl{c}|b|60|0"
C = b"rl{a}|c|60|0"

# The sidecar's clock for every call: 5 s into the current real minute, so the minute windows'
# resets are realistic and TTLs, which Redis counts in real time, stay meaningful.
NOW_MS = (int(time.time()) // 60 * 60 + 5) * 1000
RESET_MS = 55_000
START_MS, END_MS = NOW_MS - 5_000, NOW_MS + RESET_MS

Request = tuple[Sequence[Hit], bool]


def hit(
    key: bytes, hits: int, limit: int, role: Role = Role.BLOCKING, ttl: int = 60, group: int = 0
) -> Hit:
    """A hit on a plain minute window (the reference's algorithm) whose counter is `key`."""
    return Hit(key, hits, Window(limit, Unit.MINUTE), group, role, key, ttl, START_MS, END_MS)


def request(*hits: Hit) -> list[Hit]:
    """`hits` as the windows of as many descriptors: each in a group of its own."""
    return [replace(h, group=index) for index, h in enumerate(hits)]


def outcome(over: bool, remaining: int, applied: bool, left_before: int) -> Outcome:
    """A minute window's Outcome (its reset is the hit's)."""
    return Outcome(over, remaining, RESET_MS, applied, left_before)


async def run(backend: Backend, requests: Sequence[Request]) -> list[list[Outcome]]:
    return [await apply(backend, hits, all_or_nothing, NOW_MS) for hits, all_or_nothing in requests]


async def reference(requests: Sequence[Request]) -> list[list[Outcome]]:
    memory = MemoryBackend()
    try:
        return await run(memory, requests)
    finally:
        await memory.close()


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def backend_url(request: pytest.FixtureRequest) -> str:
    kind = request.param
    if kind == "memory":
        return "memory://"
    return str(request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url"))


@pytest.fixture
async def backend(backend_url: str) -> AsyncIterator[Backend]:
    opened = open_backend(backend_url, timeout_ms=TIMEOUT_MS)
    yield opened
    await opened.close()


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def store(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    """An emptied Redis or Redis Cluster, for tests that inspect the server itself."""
    if request.param == "redis":
        request.getfixturevalue("redis_url")
        server: RedisServer = request.getfixturevalue("redis_server")
        return server
    request.getfixturevalue("cluster_url")
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    return cluster


@pytest.fixture
async def store_backend(store: RedisServer | RedisCluster) -> AsyncIterator[Backend]:
    backend = open_backend(store.url, timeout_ms=TIMEOUT_MS)
    yield backend
    await backend.close()


def evalsha_calls(store: RedisServer | RedisCluster) -> int:
    """EVALSHA calls since the last CONFIG RESETSTAT, over every master."""
    calls = 0
    for node in store.nodes:
        with node.client() as client:
            stats = client.info("commandstats")
        calls += int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
        assert "cmdstat_eval" not in stats, "the script text was sent: the script cache was cold"
    return calls


def reset_stats(store: RedisServer | RedisCluster) -> None:
    for node in store.nodes:
        with node.client() as client:
            client.config_resetstat()


# --- the contract: every backend counts alike -------------------------------------------------

# One descriptor (group 0, hash tag {b}) with a plain, a borrowing and a sliding minute window and
# a token bucket, beside an independent plain counter in another slot (group 1). Once a window of
# group 0 is over, only its plain window still counts the hits.
GROUPED = (
    hit(A, 1, 5),
    Hit(
        b"rl{b}|a|60b|0",
        1,
        Window(1, Unit.MINUTE, borrow=1),
        previous=b"rl{b}|a|60b|-60",
        ttl=121,
        start_ms=START_MS,
        end_ms=END_MS,
    ),
    Hit(
        b"rl{b}|a|60s|0",
        1,
        Window(4, Unit.MINUTE, Algorithm.SLIDING_WINDOW),
        previous=b"rl{b}|a|60s|-60",
        ttl=121,
        start_ms=START_MS,
        end_ms=END_MS,
    ),
    Hit(b"rl{b}|a|60t2/3", 1, Window(2, Unit.MINUTE, Algorithm.TOKEN_BUCKET, burst=3)),
    hit(B, 1, 9, group=1),
)

SCENARIOS: dict[str, list[Request]] = {
    "hits past the limit are still added": [(request(hit(A, 1, 3)), False)] * 5,
    "a cost above the limit": [
        (request(hit(A, 5, 3)), True),
        (request(hit(A, 5, 3)), False),
        (request(hit(A, 0, 3)), False),
    ],
    "checks consume nothing and are over at the limit": [
        (request(hit(A, 0, 2)), True),
        (request(hit(A, 1, 2)), True),
        (request(hit(A, 0, 2)), True),
        (request(hit(A, 1, 2)), True),
        (request(hit(A, 0, 2)), True),
        (request(hit(A, 1, 2)), True),
        (request(hit(A, 0, 2)), False),
    ],
    "a key twice in one request sees its earlier hits": [
        (request(hit(A, 2, 5), hit(A, 3, 5), hit(A, 1, 5)), True),
        (request(hit(A, 2, 5), hit(A, 3, 5)), True),
        (request(hit(A, 2, 5), hit(A, 0, 5)), False),
        (request(hit(A, 0, 5)), False),
    ],
    "a limit of 0 rejects every hit": [
        (request(hit(A, 1, 0)), True),
        (request(hit(A, 0, 0)), True),
        (request(hit(A, 1, 0)), False),
        (request(hit(A, 0, 0)), False),
    ],
    "shadow counters never block": [
        (request(hit(A, 1, 1), hit(B, 1, 0, Role.SHADOW)), True),
        (request(hit(A, 1, 1), hit(B, 1, 0, Role.SHADOW)), True),
        (request(hit(A, 0, 9), hit(B, 0, 9)), False),
    ],
    "quota counters block only when all are over, across slots": [
        (request(hit(A, 1, 0, Role.QUOTA), hit(B, 1, 1, Role.QUOTA)), True),
        (request(hit(A, 1, 0, Role.QUOTA), hit(B, 1, 1, Role.QUOTA)), True),
        (request(hit(A, 1, 0, Role.QUOTA), hit(B, 1, 1, Role.QUOTA), hit(C, 1, 5)), True),
        (request(hit(A, 0, 9), hit(B, 0, 9), hit(C, 0, 9)), False),
    ],
    "quota counters in one slot": [
        (request(hit(A, 1, 1, Role.QUOTA), hit(b"rl{b}|q", 1, 0, Role.QUOTA), hit(C, 1, 5)), True),
        (request(hit(A, 1, 1, Role.QUOTA), hit(b"rl{b}|q", 1, 0, Role.QUOTA), hit(C, 1, 5)), True),
        (request(hit(A, 0, 9), hit(b"rl{b}|q", 0, 9), hit(C, 0, 9)), False),
    ],
    "one blocking counter over rejects the whole request, across slots": [
        (request(hit(C, 2, 2)), False),
        (request(hit(A, 1, 5), hit(B, 1, 5, Role.SHADOW), hit(C, 1, 2)), True),
        (request(hit(A, 1, 5), hit(B, 1, 5), hit(C, 0, 9)), True),
        (request(hit(A, 0, 9), hit(B, 0, 9), hit(C, 0, 9)), False),
    ],
    "without all-or-nothing every hit is added, across slots": [
        (request(hit(A, 3, 2), hit(B, 1, 5), hit(C, 1, 0)), False),
        (request(hit(A, 3, 2), hit(B, 1, 5), hit(C, 1, 0)), False),
    ],
    "a descriptor's windows are admitted together, each counting by its algorithm": [
        (list(GROUPED), False),
        (list(GROUPED), True),
        (list(GROUPED), False),
        (list(GROUPED), True),
        (list(GROUPED), False),
    ],
    "an empty request": [([], True), ([], False)],
}


@pytest.mark.parametrize("requests", list(SCENARIOS.values()), ids=list(SCENARIOS))
async def test_backends_count_like_memory(backend: Backend, requests: list[Request]) -> None:
    """The same hit sequence gives the same Outcomes on memory, Redis and Redis Cluster."""
    assert await run(backend, requests) == await reference(requests)


async def test_duplicate_keys_and_roles_give_the_documented_outcomes(backend: Backend) -> None:
    """A key's later hits see its earlier ones; shadow never blocks; over-limit adds nothing."""
    assert await apply(backend, request(hit(A, 2, 5), hit(A, 3, 5)), True, NOW_MS) == [
        outcome(False, 3, True, 5),
        outcome(False, 0, True, 3),
    ]
    # A is at 5: one more blocking hit is over, so nothing is added anywhere.
    assert await apply(backend, request(hit(B, 1, 5), hit(A, 1, 5)), True, NOW_MS) == [
        outcome(False, 5, False, 5),
        outcome(True, 0, False, 0),
    ]
    # The same over-limit counter as shadow does not block.
    assert await apply(backend, request(hit(B, 1, 5), hit(A, 1, 5, Role.SHADOW)), True, NOW_MS) == [
        outcome(False, 4, True, 5),
        outcome(True, 0, True, 0),
    ]
    # A check with a wider limit reads the counters: A at 6, B at 1.
    assert await apply(backend, request(hit(A, 0, 10), hit(B, 0, 10)), False, NOW_MS) == [
        outcome(False, 4, True, 4),
        outcome(False, 9, True, 9),
    ]


_keys = st.sampled_from([A, B, C, b"rl{b}|other", b"rl{c}|other"])
_hits = st.builds(
    hit,
    key=_keys,
    hits=st.integers(0, 4),
    limit=st.integers(0, 6),
    role=st.sampled_from([Role.BLOCKING, Role.SHADOW, Role.QUOTA]),  # the roles of limits
)
_requests = st.lists(st.tuples(st.lists(_hits, max_size=5), st.booleans()), max_size=8)
_example_ids = itertools.count()


@pytest.mark.parametrize(
    "backend_url",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
    indirect=True,
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=_requests)
async def test_random_requests_count_like_memory(backend: Backend, requests: list[Request]) -> None:
    """Any sequence of requests gives the memory backend's Outcomes on Redis and Redis Cluster."""
    # Examples share the server: a fresh key suffix per example keeps them apart (and keeps the
    # hash tags, so the slots stay the same).
    suffix = b"|example%d" % next(_example_ids)
    requests = [
        (
            [
                replace(h, key=h.key + suffix, previous=h.key + suffix, group=i)
                for i, h in enumerate(hits)
            ],
            all_or_nothing,
        )
        for hits, all_or_nothing in requests
    ]
    assert await run(backend, requests) == await reference(requests)


_adding_hits = st.builds(
    hit,
    key=st.sampled_from([b"rl{e}|x", b"rl{e}|y", b"rl{e}|z"]),
    hits=st.integers(1, 4),
    limit=st.integers(0, 6),
    role=st.sampled_from([Role.BLOCKING, Role.SHADOW, Role.QUOTA]),  # the roles of limits
    ttl=st.sampled_from([60, 3_600, 86_400]),  # none expires during an example
)


@pytest.mark.redis
@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(st.lists(_adding_hits, min_size=1, max_size=4), min_size=1, max_size=8))
async def test_count_script_answers_and_writes_as_the_decide_script(
    redis_url: str, redis_server: RedisServer, requests: list[list[Hit]]
) -> None:
    """count.lua, which runs the usual request (every hit adds to a plain window's own counter,
    not all or nothing), gives decide.lua's answers and writes: run side by side on twin
    counters, the two scripts give the same Outcomes, the same counter values and the same
    expiries after every request, with counters repeated in one request and limits passed."""
    suffix = b"|example%d" % next(_example_ids)
    backend = RedisBackend.from_url(redis_url, timeout_ms=TIMEOUT_MS)
    try:
        with redis_server.client() as client:
            client.script_load(SCRIPT)
            for hits in requests:
                counted, decided = (
                    [
                        replace(
                            h, key=h.key + suffix + twin, previous=h.key + suffix + twin, group=i
                        )
                        for i, h in enumerate(hits)
                    ]
                    for twin in (b"|count", b"|decide")
                )
                assert counts(counted, MODE_ADD)
                answer = await apply(backend, counted, False, NOW_MS)
                reply = client.execute_command(*decide_command(decided, MODE_ADD, NOW_MS))
                assert answer == decide_outcomes(decided, reply, NOW_MS)
                for one, other in zip(counted, decided, strict=True):
                    assert client.get(one.key) == client.get(other.key)
                    ttl, other_ttl = client.pttl(one.key), client.pttl(other.key)
                    assert 0 < ttl <= 86_400_000
                    assert abs(ttl - other_ttl) < 1_000  # set moments apart
    finally:
        await backend.close()


@pytest.mark.parametrize("all_or_nothing", [False, True])
async def test_concurrent_hits_admit_exactly_the_limit(
    backend: Backend, all_or_nothing: bool
) -> None:
    """200 concurrent single hits on a 50-limit counter: exactly 50 see room under the limit.

    Each sees its own count before it: 50 find room left (50 down to 1), the rest none. With
    all-or-nothing only the 50 are added; otherwise every hit is, as the reference counts them.
    """
    results = await asyncio.gather(
        *(apply(backend, [hit(A, 1, 50)], all_or_nothing, NOW_MS) for _ in range(200))
    )
    assert sum(not outcomes[0].over for outcomes in results) == 50
    left = sorted((outcomes[0].left_before for outcomes in results), reverse=True)
    assert left == [*range(50, 0, -1)] + [0] * 150
    applied = sum(outcomes[0].applied for outcomes in results)
    assert applied == (50 if all_or_nothing else 200)
    # A check under a wide limit reads the counter back.
    [check] = await apply(backend, [hit(A, 0, 1_000)], False, NOW_MS)
    assert check.left_before == 1_000 - applied


# --- what only Redis has: TTLs, round trips, the script cache ----------------------------------


async def test_ping_is_true_on_a_live_store(store_backend: Backend) -> None:
    """ping answers True while Redis (every master of a cluster) answers."""
    assert await store_backend.ping() is True


async def test_ttl_is_set_when_a_counter_is_created(
    store: RedisServer | RedisCluster, store_backend: Backend
) -> None:
    """A new counter expires after its ttl; later hits do not extend it; checks create nothing."""
    await apply(store_backend, [hit(A, 1, 10, ttl=30)], False, NOW_MS)
    with store.client() as client:
        first = client.pttl(A)
        assert 0 < first <= 30_000
        await apply(store_backend, [hit(A, 1, 10, ttl=1_000)], False, NOW_MS)
        assert 0 < client.pttl(A) <= first

        await apply(store_backend, [hit(B, 0, 10)], False, NOW_MS)
        await apply(store_backend, request(hit(C, 0, 10), hit(b"rl{a}|other", 5, 3)), True, NOW_MS)
        assert client.exists(B, C, b"rl{a}|other") == 0


async def test_one_script_call_per_hash_slot(
    store: RedisServer | RedisCluster, store_backend: Backend
) -> None:
    """Hits sharing a hash tag cost one EVALSHA; on a cluster, one per slot touched."""
    for node in store.nodes:
        with node.client() as client:
            client.script_load(SCRIPT)
            client.script_load(COUNT_SCRIPT)
    same_tag = request(*(hit(b"rl{b}|%d" % i, 1, 10) for i in range(5)))
    reset_stats(store)
    await apply(store_backend, same_tag, False, NOW_MS)
    await apply(store_backend, same_tag, True, NOW_MS)
    assert evalsha_calls(store) == 2

    three_slots = request(hit(A, 1, 10), hit(B, 1, 10), hit(C, 1, 10), hit(b"rl{b}|x", 1, 10))
    reset_stats(store)
    await apply(store_backend, three_slots, False, NOW_MS)
    assert evalsha_calls(store) == (3 if isinstance(store, RedisCluster) else 1)


# Plain counters added to run count.lua; all or nothing runs decide.lua.
SCRIPTS = pytest.mark.parametrize(
    ("all_or_nothing", "sha"), [(False, COUNT_SHA), (True, SHA)], ids=["count", "decide"]
)


@SCRIPTS
async def test_script_cache_loss_is_recovered(
    store: RedisServer | RedisCluster, store_backend: Backend, all_or_nothing: bool, sha: str
) -> None:
    """After SCRIPT FLUSH (as after a restart or a failover) apply works and reloads the script
    it runs, either script."""
    hits = request(hit(A, 1, 10), hit(B, 1, 10))
    first = await apply(store_backend, hits, all_or_nothing, NOW_MS)
    assert first == [outcome(False, 9, True, 10)] * 2
    for node in store.nodes:
        with node.client() as client:
            client.script_flush()
    second = await apply(store_backend, hits, all_or_nothing, NOW_MS)
    assert second == [outcome(False, 8, True, 9)] * 2
    cached = []
    for node in store.nodes:
        with node.client() as client:
            cached += client.script_exists(sha)
    assert any(cached)


@pytest.mark.redis
@SCRIPTS
async def test_script_cache_loss_is_recovered_through_callbacks(
    redis_url: str, redis_server: RedisServer, all_or_nothing: bool, sha: str
) -> None:
    """`apply` after SCRIPT FLUSH: the EVALSHA's NOSCRIPT is answered by EVAL of the same
    script, by the same deadline, and the outcome is the one `apply` gives."""
    backend = RedisBackend.from_url(redis_url, timeout_ms=TIMEOUT_MS)
    through = backend
    try:
        hits = request(hit(A, 1, 10), hit(B, 1, 10))
        first = await apply(through, hits, all_or_nothing, NOW_MS)
        assert first == [outcome(False, 9, True, 10)] * 2
        with redis_server.client() as client:
            client.script_flush()
        second = await apply(through, hits, all_or_nothing, NOW_MS)
        assert second == [outcome(False, 8, True, 9)] * 2
        with redis_server.client() as client:
            assert client.script_exists(sha) == [True]
    finally:
        await backend.close()


@pytest.mark.cluster
async def test_cluster_rejection_across_slots_writes_nothing(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    """An all-or-nothing request over three slots that is over its limit adds to no slot."""
    backend = RedisClusterBackend.from_url(cluster_url, timeout_ms=TIMEOUT_MS)
    try:
        await apply(backend, [hit(C, 2, 2)], False, NOW_MS)
        hits = request(hit(A, 1, 5), hit(B, 1, 5), hit(C, 1, 2))
        assert await apply(backend, hits, True, NOW_MS) == [
            outcome(False, 5, False, 5),
            outcome(False, 5, False, 5),
            outcome(True, 0, False, 0),
        ]
        with redis_cluster.client() as client:
            assert client.exists(A) == 0
            assert client.exists(B) == 0
            assert client.get(C) == b"2"

        hits = request(hit(A, 1, 5), hit(B, 1, 5), hit(C, 0, 3))
        assert await apply(backend, hits, True, NOW_MS) == [
            outcome(False, 4, True, 5),
            outcome(False, 4, True, 5),
            outcome(False, 1, True, 1),
        ]
        with redis_cluster.client() as client:
            assert [client.get(A), client.get(B), client.get(C)] == [b"1", b"1", b"2"]
    finally:
        await backend.close()


@pytest.mark.cluster
def usage_hit(role: Role = Role.USAGE, field: bytes = b"app|x|a") -> Hit:
    """A usage hit as the plan builds it (group 0), counted beside C (hash tag {a}); its keys
    live a day (END_MS may pass while the tests run, and a key set to expire then is gone)."""
    key = b"rl{a}|%u|20260101" if role is Role.USAGE else b"rl{a}|%h|20260101|app|x|user"
    return Hit(
        key, 1, usage.USAGE_WINDOW, role=role, end_ms=NOW_MS + 86_400_000,
        field=field, previous_field=field[:-1] + b"r",
    )  # fmt: skip


async def test_cluster_rejection_across_slots_with_usage_writes_no_counter(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    """Usage hits (group 0, as the plan builds them) beside an all-or-nothing request over three
    slots whose first descriptor is over: no counter is added (usage hits are no descriptor),
    and the usage counts it as refused."""
    backend = RedisClusterBackend.from_url(cluster_url, timeout_ms=TIMEOUT_MS)
    try:
        await apply(backend, [hit(C, 2, 2)], False, NOW_MS)
        hits = [*request(hit(C, 1, 2), hit(A, 1, 5), hit(B, 1, 5)), usage_hit()]
        outcomes = await apply(backend, hits, True, NOW_MS)
        assert [o.over for o in outcomes[:3]] == [True, False, False]
        assert not any(o.applied for o in outcomes[:3])
        with redis_cluster.client() as client:
            assert client.exists(A) == 0
            assert client.exists(B) == 0
            assert client.get(C) == b"2"
            assert client.hgetall(b"rl{a}|%u|20260101") == {b"app|x|r": b"1"}
    finally:
        await backend.close()


@pytest.mark.parametrize("all_or_nothing", [False, True], ids=["add", "all-or-nothing"])
async def test_cluster_usage_across_slots_counts_the_whole_requests_answer(
    redis_cluster: RedisCluster, cluster_url: str, all_or_nothing: bool
) -> None:
    """A request over several slots counts its usage as the whole request's answer says, as
    the memory backend does: refused when a limit in another slot than the usage keys' refused
    it (the usage keys' slot alone admits it), admitted when none did; and its unique count
    either way. Before, the usage keys' slot judged the request by its own limits only."""
    cluster = RedisClusterBackend.from_url(cluster_url, timeout_ms=TIMEOUT_MS)
    memory = MemoryBackend()
    requests = [
        [*request(hit(C, 1, 5), hit(A, 1, 1)), usage_hit(), usage_hit(Role.UNIQUE, b"u1")],
        [*request(hit(C, 1, 5), hit(A, 1, 1)), usage_hit(), usage_hit(Role.UNIQUE, b"u2")],
        [*request(hit(C, 1, 5), hit(B, 1, 5)), usage_hit(), usage_hit(Role.UNIQUE, b"u2")],
    ]
    try:
        answers = {}
        for name, backend in (("memory", memory), ("cluster", cluster)):
            answers[name] = [
                [o.over for o in (await apply(backend, hits, all_or_nothing, NOW_MS))[:2]]
                for hits in requests
            ]
        assert (
            answers["cluster"]
            == answers["memory"]
            == [[False, False], [False, True], [False, False]]
        )
        expected = [(b"rl{a}|%u|20260101", {b"app|x|a": 2, b"app|x|r": 1})]
        assert await memory.usage_hashes("rl{a}|%u|*") == expected
        assert await cluster.usage_hashes("rl{a}|%u|*") == expected
        unique = [[b"rl{a}|%h|20260101|app|x|user"]]
        assert await cluster.usage_unique(unique) == await memory.usage_unique(unique) == [2]
    finally:
        await cluster.close()
        await memory.close()


async def test_cluster_usage_call_failing_leaves_the_answer(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    """The usage counts of a request over several slots go in a call after its limits are
    decided; when that call fails (the usage keys' master paused), the request keeps its
    answer and its counters, only its usage counts are lost, and the loss is logged."""
    backend = RedisClusterBackend.from_url(cluster_url, timeout_ms=300)
    with redis_cluster.client() as client:
        port = client.get_node_from_key(b"rl{a}|%u|20260101").port
    [usage_master] = [node for node in redis_cluster.nodes if node.port == port]
    try:
        await apply(backend, [hit(A, 0, 5)], False, NOW_MS)  # connected before the pause
        usage_master.pause()
        try:
            with structlog.testing.capture_logs() as logs:
                outcomes = await apply(
                    backend, [*request(hit(A, 1, 5), hit(B, 1, 5)), usage_hit()], False, NOW_MS
                )
        finally:
            usage_master.resume()
        assert [(o.over, o.applied) for o in outcomes] == [
            (False, True),
            (False, True),
            (False, False),
        ]
        assert [entry["event"] for entry in logs] == ["usage_not_counted"]
        with redis_cluster.client() as client:
            assert client.get(A) == b"1"
            assert client.get(B) == b"1"
    finally:
        await backend.close()


def test_test_keys_span_three_masters() -> None:
    """The keys A, B and C above fall in slot ranges of three different masters."""
    slots = sorted(key_slot(key) for key in (A, B, C))
    assert slots[0] <= 5460 < slots[1] <= 10922 < slots[2]


# --- deadlines: a dead or silent Redis is a StorageError, in time ------------------------------


async def timed_apply(backend: Backend) -> tuple[float, BaseException | None]:
    """How long one apply took, and what it raised."""
    started = time.monotonic()
    try:
        await apply(backend, [hit(A, 1, 10)], False, NOW_MS)
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


async def expect_storage_error(backend: Backend, deadline_ms: int = DEADLINE_MS) -> None:
    elapsed, error = await timed_apply(backend)
    assert isinstance(error, StorageError)
    assert elapsed < deadline_ms / 1000 + SLACK


async def answers_within(backend: Backend, seconds: float) -> bool:
    """Whether `backend` answers a ping within `seconds`."""
    deadline = time.monotonic() + seconds
    while not await backend.ping():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.mark.redis
async def test_stopped_redis_fails_in_time_and_recovers(restartable_redis: RedisServer) -> None:
    """With Redis down apply raises StorageError by the deadline; once it is back, apply works."""
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=RECOVERY_DEADLINE_MS)
    try:
        assert await apply(backend, [hit(A, 1, 10)], False, NOW_MS) == [outcome(False, 9, True, 10)]
        await asyncio.to_thread(restartable_redis.stop)
        await expect_storage_error(backend, RECOVERY_DEADLINE_MS)
        await expect_storage_error(backend, RECOVERY_DEADLINE_MS)
        assert await backend.ping() is False

        await asyncio.to_thread(restartable_redis.start)
        # After a refused connection the client holds off a moment before it tries again.
        assert await answers_within(backend, 1.0)
        # The restarted server has lost the counters and the script, not the backend.
        assert await apply(backend, [hit(A, 1, 10)], False, NOW_MS) == [outcome(False, 9, True, 10)]
        assert await backend.ping() is True
    finally:
        await backend.close()


@pytest.mark.redis
async def test_stopped_or_paused_redis_fails_through_callbacks_in_time(
    restartable_redis: RedisServer,
) -> None:
    """`apply` hands its callback a StorageError by the deadline while Redis is stopped or
    frozen, and the outcome again once Redis is back."""
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=RECOVERY_DEADLINE_MS)
    through: Any = backend
    try:
        assert await apply(through, [hit(A, 1, 10)], False, NOW_MS) == [outcome(False, 9, True, 10)]
        restartable_redis.pause()
        await expect_storage_error(through, RECOVERY_DEADLINE_MS)
        restartable_redis.resume()
        await asyncio.to_thread(restartable_redis.stop)
        await expect_storage_error(through, RECOVERY_DEADLINE_MS)
        await asyncio.to_thread(restartable_redis.start)
        assert await answers_within(backend, 1.0)
        assert await apply(through, [hit(A, 1, 10)], False, NOW_MS) == [outcome(False, 9, True, 10)]
    finally:
        restartable_redis.resume()
        await backend.close()


@pytest.mark.redis
async def test_restarted_redis_is_used_without_error(restartable_redis: RedisServer) -> None:
    """Pooled connections to a Redis that restarted are replaced, not failed on."""
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=TIMEOUT_MS)
    try:
        await asyncio.gather(*(apply(backend, [hit(A, 1, 100)], False, NOW_MS) for _ in range(10)))
        await asyncio.to_thread(restartable_redis.restart)
        # Give the event loop a moment to see the old connections close, as a live service would.
        await asyncio.sleep(0.05)
        results = await asyncio.gather(
            *(apply(backend, [hit(A, 1, 100)], False, NOW_MS) for _ in range(10))
        )
        # The restarted server counts from zero again, every hit exactly once.
        left = sorted(outcomes[0].left_before for outcomes in results)
        assert left == list(range(91, 101))
    finally:
        await backend.close()


@pytest.mark.redis
async def test_paused_redis_fails_in_time_and_recovers(restartable_redis: RedisServer) -> None:
    """A Redis that holds connections open but never answers is a StorageError by the deadline."""
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=RECOVERY_DEADLINE_MS)
    try:
        await apply(backend, [hit(A, 1, 10)], False, NOW_MS)
        restartable_redis.pause()
        await expect_storage_error(backend, RECOVERY_DEADLINE_MS)
        assert await backend.ping() is False

        restartable_redis.resume()
        [check] = await apply(backend, [hit(A, 0, 10)], False, NOW_MS)
        # Commands sent while it was paused may have run once it resumed.
        assert check.left_before <= 9
        assert await backend.ping() is True
    finally:
        restartable_redis.resume()
        await backend.close()


@pytest.mark.redis
async def test_callers_beyond_the_pool_give_up_by_their_deadline(
    restartable_redis: RedisServer,
) -> None:
    """200 callers on a silent Redis, more than the pool holds: none waits past its deadline.

    A caller queued behind others (for a connection, or for their replies) would otherwise wait
    for the first ones to time out, twice the deadline or more. The deadline is long so that the
    allowance (0.6 s: 200 timeouts firing together keep one event loop busy, on a loaded CI
    machine noticeably so) stays well below that second deadline.
    """
    deadline_ms = 1000
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=deadline_ms)
    try:
        restartable_redis.pause()
        results = await asyncio.gather(*(timed_apply(backend) for _ in range(200)))
        assert all(isinstance(error, StorageError) for _, error in results)
        assert max(elapsed for elapsed, _ in results) < deadline_ms / 1000 + 0.6
    finally:
        restartable_redis.resume()
        await backend.close()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_silent_listener_fails_in_time(scheme: str) -> None:
    """A port that accepts TCP but never replies gives StorageError by the deadline, ping False."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOST, 0))
        # Never accepted: the kernel completes handshakes into the backlog, nobody reads.
        listener.listen(512)
        port = listener.getsockname()[1]
        backend = open_backend(f"{scheme}://{HOST}:{port}", timeout_ms=DEADLINE_MS)
        try:
            await expect_storage_error(backend)
            assert await backend.ping() is False
        finally:
            await backend.close()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_closed_port_fails_in_time(scheme: str) -> None:
    """Nothing listening is a StorageError (not a redis-py error), well within the deadline."""
    backend = open_backend(f"{scheme}://{HOST}:{free_port()}", timeout_ms=DEADLINE_MS)
    try:
        await expect_storage_error(backend)
        with pytest.raises(StorageError) as caught:
            await apply(backend, [hit(A, 1, 10)], True, NOW_MS)
        assert caught.value.__cause__ is not None
        assert await backend.ping() is False
    finally:
        await backend.close()


# --- URLs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://", "missing host"),
        ("redis://:secret@:6379", "missing host"),
        ("redis://localhost:http", "bad port"),
        ("redis://localhost:70000", "bad port"),
        ("redis://localhost:0", "bad port"),
        ("redis://localhost:6379/cache", "database must be a number"),
        ("redis://localhost:6379?ssl_cert_reqs=none", "unknown query parameter 'ssl_cert_reqs'"),
        ("rediss://localhost:6379?ssl_cert_reqs=maybe", "ssl_cert_reqs must be none"),
        ("rediss://localhost:6379?verify=no", "unknown query parameter 'verify'"),
        ("redis+cluster://", "no host:port"),
        ("redis+cluster://user:pw@", "no host:port"),
        ("redis+cluster://a:7000,:7001", "missing host"),
        ("redis+cluster://a:7000,b:port", "bad port"),
        ("redis+cluster://a:7000/2", "only database 0"),
        ("redis+cluster://a:7000?read_from_replicas=yes", "takes no query"),
        ("rediss+cluster://a:7000?verify=no", "unknown query parameter 'verify'"),
        ("rediss+cluster://a:7000#frag", "takes no query or fragment"),
        ("redis+cluster://a:7000?ssl_cert_reqs=none", "takes no query"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(url: str, reason: str) -> None:
    """A URL the backends cannot use is a ValueError that says what is wrong with it."""
    with pytest.raises(ValueError, match=reason):
        open_backend(url)


def test_password_stays_out_of_url_errors() -> None:
    """A refused URL is quoted in the error without its password."""
    with pytest.raises(ValueError) as caught:
        open_backend("redis://user:hunter2@localhost:99999")
    assert "hunter2" not in str(caught.value)
    assert "user:***@localhost" in str(caught.value)


def test_timeout_must_be_positive() -> None:
    """A deadline of zero or less is refused."""
    with pytest.raises(ValueError, match="timeout must be a positive"):
        open_backend("redis://localhost:6379", timeout_ms=0)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://localhost", RedisBackend),
        ("redis://user:p%40ss@127.0.0.1:6380/2", RedisBackend),
        ("redis://[::1]:6379/0", RedisBackend),
        ("rediss://localhost:6380?ssl_cert_reqs=none", RedisBackend),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", RedisClusterBackend),
        ("redis+cluster://user:pw@[::1]:7000/", RedisClusterBackend),
        ("rediss+cluster://127.0.0.1:7000?ssl_cert_reqs=none", RedisClusterBackend),
    ],
)
async def test_good_urls_open_without_connecting(url: str, kind: type) -> None:
    """Well-formed URLs give the matching backend; nothing connects until the first call."""
    backend = open_backend(url)
    try:
        assert isinstance(backend, kind)
    finally:
        await backend.close()
