"""The limiter's straight path decides exactly as its general path.

A plan is straight (`Plan.straight`) when every descriptor the store must decide has one window
and blocks; `Limiter.decide` then reads each hit's outcome as its status in one pass. The
tests here run generated request sequences through two limiters on the same rules, one as it is
and one whose plans are never straight, and require the same answer bytes, statistics,
over-limit cache and counters, request after request: on the memory backend and on a real Redis
(where the over-limit cache is on), with every `rejected_hits` and global shadow setting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from envoy.service.ratelimit.v3.rls_pb2 import (  # type: ignore[import-untyped]
    RateLimitResponse,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.clock import Clock

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.decision.plan import Plan
from sidecar.decision.stats import Stats
from sidecar.model import Descriptor, Entry, Request
from sidecar.rls import convert
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

#: One window per rule, every algorithm and a few other shapes a request can mix: no rule, an
#: unlimited rule, a shadow rule and two windows on one descriptor (those make a plan general).
RULES = """
domain: {domain}
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: 3}}
  - key: ip
    rate_limit: {{unit: hour, requests_per_unit: 5}}
  - key: borrowing
    rate_limit: {{unit: minute, requests_per_unit: 2, borrow: 2}}
  - key: bucket
    rate_limit: {{algorithm: token_bucket, unit: minute, requests_per_unit: 4}}
  - key: sliding
    rate_limit: {{algorithm: sliding_window, unit: minute, requests_per_unit: 3}}
  - key: unlimited
    rate_limit: {{unlimited: true}}
  - key: shadow
    shadow_mode: true
    rate_limit: {{unit: minute, requests_per_unit: 1}}
  - key: both
    rate_limits:
      - {{unit: minute, requests_per_unit: 2}}
      - {{unit: hour, requests_per_unit: 4}}
"""
STRAIGHT_KEYS = ("user", "ip", "borrowing", "bucket", "sliding")
OTHER_KEYS = ("nothing", "unlimited", "shadow", "both")

descriptors = st.lists(
    st.builds(
        lambda key, value, addend: Descriptor((Entry(key, value),), addend),
        st.sampled_from(STRAIGHT_KEYS + STRAIGHT_KEYS + OTHER_KEYS),
        st.sampled_from(("a", "b")),
        st.one_of(st.none(), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=3,
)
#: (milliseconds since the previous request, its descriptors, its hits_addend)
steps = st.lists(
    st.tuples(st.sampled_from((0, 0, 1, 700, 20_000)), descriptors, st.integers(0, 2)),
    min_size=1,
    max_size=25,
)
SETTINGS = [
    Settings(),
    Settings(rejected_hits="skip"),
    Settings(shadow_mode=True),
    Settings(failure_mode="deny"),
]

_examples = itertools.count()
_settings = settings(
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def plan(limiter: Limiter, request: Request, straight: bool = True) -> Plan:
    """`limiter`'s plan of `request`; with `straight` false, the same plan made to take the
    general path (the plan is changed, not the limiter: a compiled Limiter cannot be patched)."""
    prepared = limiter.prepare(request)
    return prepared if straight else dataclasses.replace(prepared, positions=())


async def decide(limiter: Limiter, prepared: Plan) -> bytes:
    """What the fast transport gets for a plan: `decide`'s encoded answer."""
    answered: asyncio.Future[bytes | Exception] = asyncio.get_running_loop().create_future()
    limiter.decide(prepared, convert.response_bytes, answered.set_result)
    answer = await answered
    assert isinstance(answer, bytes), answer
    return answer


def stats_by_rule(stats: Stats, domain: str) -> dict[str, object]:
    """The statistics, rules named without their domain (each limiter has a domain of its own)."""
    return {
        "rules": {key.removeprefix(domain): value for key, value in stats.rules.items()},
        "totals": (
            stats.total_requests,
            stats.global_shadow_mode,
            stats.backend_error,
            stats.service_error,
        ),
    }


async def assert_same(
    make: Callable[[str], Limiter], steps: list[tuple[int, list[Descriptor], int]], clock: Clock
) -> None:
    number = next(_examples)
    domains = f"straight{number}x", f"general{number}x"
    straight, general = make(domains[0]), make(domains[1])
    for index, (after_ms, request_descriptors, hits_addend) in enumerate(steps):
        clock.now += after_ms / 1000
        answers = [
            await decide(
                limiter,
                plan(limiter, Request(domain, tuple(request_descriptors), hits_addend), path),
            )
            for limiter, domain, path in zip(
                (straight, general), domains, (True, False), strict=True
            )
        ]
        assert answers[0] == answers[1], f"request {index}: {request_descriptors}"
        assert stats_by_rule(straight.stats, domains[0]) == stats_by_rule(
            general.stats, domains[1]
        ), f"request {index}"
        caches = [limiter.over_limit_cache for limiter in (straight, general)]
        if caches[0] is not None and caches[1] is not None:
            ends = [sorted(caches[0].ends.values()), sorted(caches[1].ends.values())]
            assert ends[0] == ends[1], f"request {index}"


@pytest.fixture
async def limiters(
    backend_url: str, clock: Clock
) -> AsyncIterator[Callable[[Settings], Callable[[str], Limiter]]]:
    """`limiters(settings)(domain)`: a limiter on the backend under test, with the over-limit
    cache (on wherever it can be: not on the memory backend)."""
    backends: list[Backend] = []

    def with_settings(chosen: Settings) -> Callable[[str], Limiter]:
        def make(domain: str) -> Limiter:
            rules = config.parse(RULES.format(domain=domain), "rules.yaml")
            backend = open_backend(backend_url, timeout_ms=2_000)
            backends.append(backend)
            return Limiter(
                Rules({domain: rules}),
                backend,
                settings=chosen,
                clock=clock,
                over_limit_cache=1_000,
            )

        return make

    yield with_settings
    for backend in backends:
        await backend.close()


@pytest.mark.parametrize(
    "backend_url", ["memory", pytest.param("redis", marks=pytest.mark.redis)], indirect=True
)
@pytest.mark.parametrize(
    "chosen", SETTINGS, ids=lambda s: f"{s.rejected_hits}-{s.shadow_mode}-{s.failure_mode}"
)
@_settings
@given(steps=steps)
async def test_the_straight_path_decides_as_the_general_path(
    limiters: Callable[[Settings], Callable[[str], Limiter]],
    chosen: Settings,
    steps: list[tuple[int, list[Descriptor], int]],
    clock: Clock,
) -> None:
    """Request after request, a limiter taking the straight path answers the same bytes, keeps
    the same statistics and over-limit cache as one that never takes it."""
    await assert_same(limiters(chosen), steps, clock)


def test_a_plan_is_straight_when_each_counted_descriptor_has_one_blocking_window() -> None:
    """Straight: one or more counted descriptors, one window each, all blocking (no rule and
    unlimited rules may sit beside them). A shadow rule, two windows or nothing counted is not."""
    rules = config.parse(RULES.format(domain="d"), "rules.yaml")
    limiter = Limiter(Rules({"d": rules}), open_backend("memory://"))

    def plan_of(*keys: str) -> Plan:
        return limiter.prepare(
            Request("d", tuple(Descriptor((Entry(key, "v"),)) for key in keys), 0)
        )

    one = plan_of("user")
    assert one.straight
    assert one.positions == ((one.counted[0], 0),)
    two = plan_of("user", "nothing", "bucket", "unlimited")
    assert two.straight
    assert [(item.index, position) for item, position in two.positions] == [(0, 0), (2, 1)]
    assert not plan_of("shadow").straight
    assert not plan_of("user", "both").straight
    assert not plan_of("nothing", "unlimited").straight
    assert plan_of("shadow").positions == ()


@pytest.mark.parametrize("failure_mode", ["allow", "deny"])
async def test_a_store_that_fails_is_answered_by_the_failure_mode_on_both_paths(
    failure_mode: str, clock: Clock
) -> None:
    """A straight plan whose store call fails is answered as the general path answers it: OK
    with no limit, or OVER_LIMIT for each descriptor, and one backend error counted each."""
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    answers = []
    for domain, path in (("d", "straight"), ("d", "general")):
        rules = config.parse(RULES.format(domain=domain), "rules.yaml")
        backend = open_backend(f"redis://127.0.0.1:{port}", timeout_ms=50)
        limiter = Limiter(
            Rules({domain: rules}),
            backend,
            settings=Settings(failure_mode=failure_mode),  # type: ignore[arg-type]
            clock=clock,
        )
        request = Request(
            domain, (Descriptor((Entry("user", "a"),)), Descriptor((Entry("ip", "b"),))), 0
        )
        prepared = plan(limiter, request, path == "straight")
        assert prepared.straight == (path == "straight")
        try:
            answers.append(await decide(limiter, prepared))
        finally:
            await backend.close()
        assert limiter.stats.backend_error == 1
    assert answers[0] == answers[1]
    decoded = RateLimitResponse.FromString(answers[0])
    expected = 2 if failure_mode == "deny" else 1  # OVER_LIMIT, OK
    assert decoded.overall_code == expected
    assert [status.code for status in decoded.statuses] == (
        [2, 2] if failure_mode == "deny" else [1, 1]
    )
