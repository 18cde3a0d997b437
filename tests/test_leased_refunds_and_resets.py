"""A `leased: true` rule's refunds and operator resets, through the limiter, on memory, a real
Redis and a real Redis Cluster: a refund (`is_negative_hits`) gives its units back to the
sidecar's lease, never beyond what the lease spent, and an operator's reset drops the sidecar's
leases of the descriptor, so that its next hits are decided on a fresh budget."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable

import pytest
from conftest import BACKENDS
from support.callbacks import should_rate_limit

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.model import Code, Descriptor, Entry, Request
from sidecar.operator import counter_admin
from sidecar.storage.backends import open_backend
from sidecar.storage.leases import Leased, store_for

every_backend = pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)

LIMIT = 10
RULES = f"""\
domain: shop
descriptors:
  - key: user
    leased: true
    rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}
"""
LEASE_MS = 1_000


class Clock:
    """Time the test sets, 5 s into the next real minute: a window that starts after the
    session's Redis did (`lua/lease.lua` lends nothing of one that started before)."""

    def __init__(self) -> None:
        self.now = math.floor(time.time() / 60) * 60 + 65.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def make(backend_url: str) -> AsyncIterator[Callable[[Clock], Limiter]]:
    """Limiters (refunds taken) over a Leased backend on the backend under test; each is
    closed (its blocks given back) at the end."""
    made: list[Leased] = []

    def build(clock: Clock) -> Limiter:
        backend = open_backend(backend_url, timeout_ms=1_000)
        leased = Leased(backend, store_for(backend, 1_000, LEASE_MS), LEASE_MS, clock=clock)
        made.append(leased)
        rules = Rules({"shop": config.parse(RULES, "rules.yaml")})
        return Limiter(rules, leased, settings=Settings(negative_hits=True), clock=clock)

    yield build
    for leased in made:
        await leased.close()


def user(name: str) -> tuple[Entry, ...]:
    return (Entry("user", name),)


async def hit(limiter: Limiter, name: str) -> Code:
    request = Request("shop", (Descriptor(user(name)),))
    return (await should_rate_limit(limiter, request)).overall_code


async def refund(limiter: Limiter, name: str, units: int) -> Code:
    request = Request("shop", (Descriptor(user(name), units, is_negative_hits=True),))
    return (await should_rate_limit(limiter, request)).overall_code


async def admitted(limiter: Limiter, name: str, tries: int) -> int:
    return [await hit(limiter, name) for _ in range(tries)].count(Code.OK)


@every_backend
async def test_a_refund_gives_units_back_to_the_lease_never_beyond_what_it_spent(
    make: Callable[[Clock], Limiter],
) -> None:
    """10 a minute, spent: a refund of 2 is answered OK and gives 2 back to the lease, which
    admits 2 more; a refund of 50 gives back only the 10 the lease spent, never more: 10 more
    are admitted, then the window refuses. A refund for a user this sidecar leased nothing of
    gives nothing back: that user still has the limit, no more."""
    limiter = make(Clock())
    assert await admitted(limiter, "alice", LIMIT + 1) == LIMIT
    assert await refund(limiter, "alice", 2) is Code.OK
    assert await admitted(limiter, "alice", 3) == 2
    assert await refund(limiter, "alice", 50) is Code.OK
    assert await admitted(limiter, "alice", LIMIT + 1) == LIMIT
    assert await refund(limiter, "bob", 5) is Code.OK
    assert await admitted(limiter, "bob", LIMIT + 1) == LIMIT


@every_backend
async def test_a_reset_drops_the_serving_sidecars_leases_of_the_descriptor(
    make: Callable[[Clock], Limiter],
) -> None:
    """A leased user refused for the rest of its window: an operator's reset (the operator
    port's `counter_admin.reset`) deletes what the store lent and drops this sidecar's lease,
    so that the next hits get a fresh budget (the limit again) instead of the spent lease's
    refusals. Another user's lease is left as it was."""
    clock = Clock()
    limiter = make(clock)
    assert await admitted(limiter, "alice", LIMIT + 1) == LIMIT
    assert await admitted(limiter, "carol", 3) == 3
    located = counter_admin.locate(limiter.rules, "shop", user("alice"), int(clock() * 1000))
    await counter_admin.reset(limiter.backend, located)
    assert await admitted(limiter, "alice", LIMIT + 1) == LIMIT
    assert await admitted(limiter, "carol", LIMIT) == LIMIT - 3
