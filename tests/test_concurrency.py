"""Concurrency limits (`algorithm: concurrency`): requests in flight, counted when they start and
closed by their refunds, each forgotten a lease after it started. On memory, Redis and Redis
Cluster (real servers, started by the fixtures), through the limiter; and the pure decision,
memory, Redis and Redis Cluster agree hit for hit on generated sequences (of named and unnamed
starts and refunds: `request_id`, see test_concurrency_ids.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from conftest import BACKENDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.callbacks import apply, should_rate_limit
from support.clock import Clock
from support.model_store import Model
from support.servers import RedisServer

from sidecar.core import config, counters
from sidecar.core.keys import descriptor_prefix
from sidecar.decision.limiter import Limiter
from sidecar.errors import NegativeHitsRefused
from sidecar.model import (
    Algorithm,
    Code,
    Decision,
    Descriptor,
    Entry,
    Outcome,
    Request,
    Role,
    Unit,
    Window,
)
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

every_backend = pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)

RULES = """
domain: inflight
descriptors:
  - key: client
    rate_limit: {algorithm: concurrency, requests_per_unit: 2, lease: 30s}
  - key: shadow
    shadow_mode: true
    rate_limit: {algorithm: concurrency, requests_per_unit: 1, lease: 30s}
  - key: closed
    rate_limit: {unit: minute, requests_per_unit: 0}
"""


@pytest.fixture
def limiters(make_limiter: Callable[..., Limiter]) -> Callable[..., Limiter]:
    """Limiters over the rules above on the backend under test, refunds taken unless told."""

    def make(**settings: object) -> Limiter:
        settings.setdefault("negative_hits", True)
        return make_limiter(RULES, **settings)

    return make


def start(pair: str = "client=a", hits: int | None = None) -> Descriptor:
    return Descriptor((Entry(*pair.split("=", 1)),), hits)


def end(pair: str = "client=a", hits: int | None = None) -> Descriptor:
    return Descriptor((Entry(*pair.split("=", 1)),), hits, is_negative_hits=True)


async def ask(limiter: Limiter, *descriptors: Descriptor) -> Decision:
    return await should_rate_limit(limiter, Request("inflight", descriptors))


async def codes(limiter: Limiter, *descriptors: Descriptor) -> list[Code]:
    return [(await ask(limiter, d)).overall_code for d in descriptors]


@every_backend
async def test_starts_are_admitted_while_fewer_than_the_limit_are_in_flight(
    limiters: Callable[..., Limiter],
) -> None:
    """Two starts pass, the third is refused; once one ends (its refund) one more passes. The
    statuses count what is in flight: the limit less the starts, and on OVER_LIMIT the time
    until the oldest start's lease ends."""
    limiter = limiters()
    first = await ask(limiter, start())
    assert (first.overall_code, first.statuses[0].limit_remaining) == (Code.OK, 1)
    assert first.statuses[0].duration_until_reset == 30
    assert (await ask(limiter, start())).statuses[0].limit_remaining == 0
    refused = await ask(limiter, start())
    assert refused.overall_code is Code.OVER_LIMIT
    assert (refused.statuses[0].limit_remaining, refused.statuses[0].duration_until_reset) == (
        0,
        30,
    )
    # The refused start's own refund (Envoy sends it for a 429 too) closes nothing in flight.
    assert (await ask(limiter, end())).statuses[0].limit_remaining == 0
    assert await codes(limiter, start()) == [Code.OVER_LIMIT]
    assert (await ask(limiter, end())).statuses[0].limit_remaining == 0
    closed = await ask(limiter, end())
    assert (closed.overall_code, closed.statuses[0].limit_remaining) == (Code.OK, 1)
    assert await codes(limiter, start(), start()) == [Code.OK, Code.OVER_LIMIT]


@every_backend
async def test_a_start_no_refund_closes_is_forgotten_after_its_lease(
    limiters: Callable[..., Limiter], clock: Clock
) -> None:
    """Starts whose refunds never come hold their places until their lease ends, then free them;
    a refused start's wait is the time until the oldest start ends, which is when one fits."""
    limiter = limiters()
    assert await codes(limiter, start()) == [Code.OK]
    clock.now += 10
    assert await codes(limiter, start()) == [Code.OK]
    clock.now += 5
    refused = await ask(limiter, start())
    assert refused.overall_code is Code.OVER_LIMIT
    assert refused.statuses[0].duration_until_reset == 15  # the first start's lease ends then
    clock.now += 14.9
    assert await codes(limiter, start()) == [Code.OVER_LIMIT]
    clock.now += 0.1
    admitted = await ask(limiter, start())
    assert (admitted.overall_code, admitted.statuses[0].limit_remaining) == (Code.OK, 0)
    clock.now += 30
    assert (await ask(limiter, start())).statuses[0].limit_remaining == 1


@every_backend
async def test_a_refund_closes_the_oldest_start_and_one_finding_nothing_changes_nothing(
    limiters: Callable[..., Limiter], clock: Clock
) -> None:
    """A refund with nothing in flight is OK with the whole limit and writes nothing; a refund
    closes the oldest start, so what is left ends with the newest one's lease."""
    limiter = limiters()
    nothing = await ask(limiter, end())
    assert (nothing.overall_code, nothing.statuses[0].limit_remaining) == (Code.OK, 2)
    assert await stored(limiter, start()) == [None]
    await ask(limiter, start())
    clock.now += 10
    await ask(limiter, start())
    after = await ask(limiter, end())
    assert (after.statuses[0].limit_remaining, after.statuses[0].duration_until_reset) == (1, 30)
    await ask(limiter, end())
    await ask(limiter, end(hits=5))
    assert (await ask(limiter, start())).statuses[0].limit_remaining == 1


@every_backend
async def test_hits_addend_counts_several_starts_and_a_cost_above_the_limit_never_fits(
    limiters: Callable[..., Limiter],
) -> None:
    """A start of 2 fills the limit of 2 and a refund of 2 empties it; a start of 3 is refused
    on an empty window and changes nothing in flight."""
    limiter = limiters()
    assert (await ask(limiter, start(hits=2))).statuses[0].limit_remaining == 0
    assert await codes(limiter, start()) == [Code.OVER_LIMIT]
    await ask(limiter, end())  # the refused start's
    assert (await ask(limiter, end(hits=2))).statuses[0].limit_remaining == 2
    too_many = await ask(limiter, start(hits=3))
    assert too_many.overall_code is Code.OVER_LIMIT
    assert too_many.statuses[0].duration_until_reset == 0
    await ask(limiter, end(hits=3))
    assert await codes(limiter, start(), start(), start()) == [Code.OK, Code.OK, Code.OVER_LIMIT]


@every_backend
async def test_a_start_counted_in_a_refused_request_is_closed_by_its_refund(
    limiters: Callable[..., Limiter],
) -> None:
    """A shadow concurrency limit over its limit lets the request through, uncounted; a start
    admitted in a request that another limit refuses is counted (the refund closes it)."""
    limiter = limiters()
    assert await codes(limiter, start("shadow=s"), start("shadow=s")) == [Code.OK, Code.OK]
    await ask(limiter, end("shadow=s"))  # the second start's: it was not counted
    assert (await ask(limiter, start("shadow=s"))).statuses[0].limit_remaining == 0
    await ask(limiter, end("shadow=s"))
    await ask(limiter, end("shadow=s"))  # the first start's: it was
    assert (await ask(limiter, start("shadow=s"))).statuses[0].limit_remaining == 0
    await ask(limiter, end("shadow=s"))
    refused = await ask(limiter, start(), start("closed=x"))
    assert refused.overall_code is Code.OVER_LIMIT
    assert refused.statuses[0].limit_remaining == 1
    assert (await ask(limiter, end(), end("closed=x"))).statuses[0].limit_remaining == 2


@every_backend
async def test_refunds_while_off_are_refused_and_change_nothing(
    limiters: Callable[..., Limiter],
) -> None:
    """Without `--negative-hits` a refund is refused (UNIMPLEMENTED) as on any rule: starts
    count, and only their leases free them."""
    limiter = limiters(negative_hits=False)
    assert await codes(limiter, start(), start()) == [Code.OK, Code.OK]
    with pytest.raises(NegativeHitsRefused):
        await ask(limiter, end())
    assert await codes(limiter, start()) == [Code.OVER_LIMIT]


@every_backend
async def test_a_check_asks_about_one_more_start_and_counts_nothing(
    limiters: Callable[..., Limiter],
) -> None:
    """A start of 0 (a check) is OK while a place is free and counts nothing."""
    limiter = limiters()
    assert (await ask(limiter, start(hits=0))).statuses[0].limit_remaining == 2
    await ask(limiter, start(hits=2))
    assert (await ask(limiter, start(hits=0))).overall_code is Code.OVER_LIMIT
    await ask(limiter, end(hits=2))
    assert (await ask(limiter, start(hits=0))).statuses[0].limit_remaining == 2


async def stored(limiter: Limiter, descriptor: Descriptor) -> list[object]:
    """What the backend holds at the descriptor's counter (None: nothing)."""
    plan = limiter.prepare(Request("inflight", (descriptor,)))
    now_ms = int(limiter._clock() * 1000)
    keys = [hit.key for item in plan.counted for hit in item.windows.at(now_ms)]
    return list(await limiter.backend.read(keys, now_ms))


# --- The renderings agree ---------------------------------------------------------------------

LIMITS = (
    Window(2, Unit.SECOND, Algorithm.CONCURRENCY, unit_multiplier=30),
    Window(3, Unit.SECOND, Algorithm.CONCURRENCY, unit_multiplier=60),
    Window(0, Unit.SECOND, Algorithm.CONCURRENCY, unit_multiplier=30),
)
_settings = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_steps = st.lists(
    st.tuples(
        st.integers(0, 40_000),  # ms since the previous request
        st.lists(
            st.tuples(
                st.integers(0, 1),  # which descriptor
                st.sampled_from([0, 1, 1, 1, 2, 3, -1, -1, -1, -2, -9]),  # its cost
                st.sampled_from(["", "", "a", "b", "c"]),  # its request id (a place's only)
            ),
            min_size=1,
            max_size=3,
        ),
        st.booleans(),  # all or nothing
    ),
    min_size=1,
    max_size=30,
)
_examples = iter(range(1_000_000))


async def agree(
    limits: tuple[Window, Window],
    roles: tuple[Role, Role],
    steps: list[tuple[int, list[tuple[int, int, str]], bool]],
    stores: dict[str, Backend],
) -> None:
    """Every store answers every request as the pure decision over a dict does."""
    domain = f"inflight-parity{next(_examples)}"
    prefixes = [descriptor_prefix(domain, [("tenant", "t"), ("d", str(i))]) for i in range(2)]
    now_ms = Clock().now * 1000
    model = Model()
    for after_ms, charges, all_or_nothing in steps:
        now_ms += after_ms
        hits = []
        for group, (d, cost, request_id) in enumerate(charges):
            hit = counters.window_hit(prefixes[d], limits[d], cost, group, roles[d], int(now_ms))
            hits.append(counters.in_flight_hit(hit, request_id) if abs(cost) == 1 else hit)
        expected = await apply(model, hits, all_or_nothing, int(now_ms))
        for name, store in stores.items():
            got = await apply(store, hits, all_or_nothing, int(now_ms))
            assert got == expected, f"{name} differs from the model: {charges}"


_limits = st.tuples(st.sampled_from(LIMITS), st.sampled_from(LIMITS))
_roles = st.tuples(*[st.sampled_from([Role.BLOCKING, Role.SHADOW, Role.QUOTA])] * 2)


@pytest.fixture
async def redis_backend(redis_url: str) -> AsyncIterator[Backend]:
    backend = open_backend(redis_url, timeout_ms=2_000)
    yield backend
    await backend.close()


@pytest.fixture
async def cluster_backend(cluster_url: str) -> AsyncIterator[Backend]:
    backend = open_backend(cluster_url, timeout_ms=2_000)
    yield backend
    await backend.close()


@_settings
@given(limits=_limits, roles=_roles, steps=_steps)
async def test_memory_matches_the_model(
    limits: tuple[Window, Window],
    roles: tuple[Role, Role],
    steps: list[tuple[int, list[tuple[int, int, str]], bool]],
) -> None:
    """The memory backend, which evicts ended states, answers as the model that keeps them."""
    await agree(limits, roles, steps, {"memory": MemoryBackend()})


@pytest.mark.redis
@settings(_settings, max_examples=100)
@given(limits=_limits, roles=_roles, steps=_steps)
async def test_redis_matches_the_model(
    limits: tuple[Window, Window],
    roles: tuple[Role, Role],
    steps: list[tuple[int, list[tuple[int, int, str]], bool]],
    redis_backend: Backend,
) -> None:
    """decide.lua's sorted sets on Redis answer every request as the Python decision does."""
    await agree(limits, roles, steps, {"redis": redis_backend})


@pytest.mark.cluster
@settings(_settings, max_examples=50)
@given(limits=_limits, roles=_roles, steps=_steps)
async def test_cluster_matches_the_model(
    limits: tuple[Window, Window],
    roles: tuple[Role, Role],
    steps: list[tuple[int, list[tuple[int, int, str]], bool]],
    cluster_backend: Backend,
) -> None:
    """Redis Cluster answers as the model (one request's limits share a slot here)."""
    await agree(limits, roles, steps, {"cluster": cluster_backend})


def test_a_concurrency_rule_loads_as_a_window_whose_lease_is_its_length() -> None:
    """`lease: 2s` is a concurrency window of 2 seconds; `5m` and a bare number are seconds too."""
    for lease, seconds in (("2s", 2), ("5m", 300), ("1h", 3600), (45, 45)):
        domain = config.parse(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: "
            f"{{algorithm: concurrency, requests_per_unit: 7, lease: {lease}}}\n",
            "rules.yaml",
        )
        window = domain.root.keys["k"].limit.windows[0]  # type: ignore[union-attr]
        assert (window.algorithm, window.requests_per_unit, window.seconds) == (
            Algorithm.CONCURRENCY,
            7,
            seconds,
        )


def test_outcome_of_a_refused_start_is_not_applied() -> None:
    """A refused start is not applied (nothing in flight), and its outcome says so."""
    window = LIMITS[0]
    prefix = descriptor_prefix("x", [("k", "v")])
    model = Model()
    outcomes: list[list[Outcome]] = []
    for cost in (2, 1):
        hit = counters.window_hit(prefix, window, cost, 0, Role.BLOCKING, 1_800_000_000_000)
        model.apply([hit], False, 1_800_000_000_000, outcomes.append)  # type: ignore[arg-type]
    assert [o[0].applied for o in outcomes] == [True, False]
    assert outcomes[1][0] == Outcome(True, 0, 30_000, False, 0)


@pytest.mark.redis
@pytest.mark.parametrize("backend_url", ["redis"], indirect=True)
async def test_on_redis_the_starts_live_no_longer_than_their_lease_and_leave_nothing_behind(
    make_limiter: Callable[..., Limiter], redis_server: RedisServer, redis_url: str
) -> None:
    """Each start is a member of the descriptor's sorted set, whose key lives until the last
    start's lease ends; a refused start's count lives a lease too; once every start and refused
    start is closed, neither key is left."""
    del redis_url  # the fixture empties the server
    limiter = make_limiter(RULES, negative_hits=True)
    await ask(limiter, start(hits=2))
    await ask(limiter, start())  # refused
    with redis_server.client() as client:
        keys = sorted(client.keys("rl{inflight|client|a}*"))
        assert keys == [b"rl{inflight|client|a}|n", b"rl{inflight|client|a}|nr"]
        assert client.zcard(keys[0]) == 2
        assert all(0 < client.pttl(key) <= 30_000 for key in keys)
        await ask(limiter, end(hits=3))
        assert client.keys("rl{inflight|client|a}*") == []
