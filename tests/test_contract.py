"""The contract every backend keeps: the same requests give the same answers on memory, Redis
and Redis Cluster, and on Valkey and Valkey Cluster (real servers, started by the fixtures)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from conftest import BACKENDS_WITH_VALKEY
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.decision.limiter import Limiter
from sidecar.model import (
    UNLIMITED_REMAINING,
    Code,
    Decision,
    Descriptor,
    Entry,
    Override,
    Request,
    Unit,
)

# Every scenario on Valkey 8 too: managed "Redis" is mostly Valkey now (ElastiCache, Memorystore).
pytestmark = pytest.mark.parametrize("backend_url", BACKENDS_WITH_VALKEY, indirect=True)

RULES = """
domain: contract
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: api
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: wide
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: check
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: conc
    rate_limit: {unit: minute, requests_per_unit: 50}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: category
    value: account
    rate_limit:
      unit: minute
      requests_per_unit: 100
      name: account
      replaces: [{name: per_user}]
  - key: name
    rate_limit: {unit: minute, requests_per_unit: 1, name: per_user}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: app
    value: a1
    descriptors:
      - key: ip
        rate_limit: {unit: minute, requests_per_unit: 4}
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 4}
      - key: iface
        rate_limit: {unit: minute, requests_per_unit: 4}
      - key: route
        rate_limit: {unit: minute, requests_per_unit: 4}
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 4}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
"""


@pytest.fixture
def contract(make_limiter: Callable[..., Limiter]) -> Callable[..., Limiter]:
    """Limiters over the contract rules on the backend under test."""
    return lambda **settings: make_limiter(RULES, **settings)


def req(*descriptors: Descriptor, hits: int = 0) -> Request:
    return Request("contract", descriptors, hits)


def d(*pairs: str, hits: int | None = None, override: Override | None = None) -> Descriptor:
    entries = tuple(Entry(*p.split("=", 1)) for p in pairs)
    return Descriptor(entries, hits, override)


async def ask(limiter: Limiter, *descriptors: Descriptor, hits: int = 0) -> Decision:
    return await should_rate_limit(limiter, req(*descriptors, hits=hits))


async def test_25_hits_on_20_per_minute(contract: Callable[..., Limiter], clock: Clock) -> None:
    """Remaining counts 19 down to 0, then five OVER_LIMIT; the next minute starts afresh."""
    limiter = contract()
    seen = []
    for _ in range(25):
        decision = await ask(limiter, d("user=alice"))
        status = decision.statuses[0]
        seen.append((decision.overall_code, status.code, status.limit_remaining))
        assert status.limit is not None and status.limit.requests_per_unit == 20
        assert status.limit.unit is Unit.MINUTE
        assert status.duration_until_reset == 60 - int(clock.now) % 60
    assert (
        seen
        == [(Code.OK, Code.OK, 19 - i) for i in range(20)]
        + [(Code.OVER_LIMIT, Code.OVER_LIMIT, 0)] * 5
    )
    clock.now += 60
    assert (await ask(limiter, d("user=alice"))).statuses[0].limit_remaining == 19


async def test_two_descriptors_one_over(contract: Callable[..., Limiter]) -> None:
    """The request is OVER_LIMIT when any descriptor is; each status is its own."""
    limiter = contract()
    for _ in range(3):
        await ask(limiter, d("api=k"))
    decision = await ask(limiter, d("user=bob"), d("api=k"))
    assert decision.overall_code is Code.OVER_LIMIT
    assert [s.code for s in decision.statuses] == [Code.OK, Code.OVER_LIMIT]
    assert decision.statuses[0].limit_remaining == 19


async def test_check_without_consuming(contract: Callable[..., Limiter]) -> None:
    """hits_addend 0 consumes nothing: OK below the limit, OVER_LIMIT once the count reaches it."""
    limiter = contract()
    check = d("check=c", hits=0)
    first = await ask(limiter, check)
    assert (first.overall_code, first.statuses[0].limit_remaining) == (Code.OK, 2)
    await ask(limiter, d("check=c"))
    below = await ask(limiter, check)
    assert (below.overall_code, below.statuses[0].limit_remaining) == (Code.OK, 1)
    await ask(limiter, d("check=c"))
    at = await ask(limiter, check)
    assert (at.overall_code, at.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 0)
    await ask(limiter, d("check=c"))  # a report is a fact: counted even over the limit
    above = await ask(limiter, check)
    assert above.overall_code is Code.OVER_LIMIT
    # The checks consumed nothing: a fresh key reports the full budget.
    assert (await ask(limiter, d("check=other", hits=0))).statuses[0].limit_remaining == 2


async def test_request_hits_addend_and_zero_means_one(contract: Callable[..., Limiter]) -> None:
    """Request-level hits_addend counts N; 0 or unset counts 1; a descriptor's own value wins."""
    limiter = contract()
    assert (await ask(limiter, d("user=h"), hits=5)).statuses[0].limit_remaining == 15
    assert (await ask(limiter, d("user=h"), hits=0)).statuses[0].limit_remaining == 14
    decision = await ask(limiter, d("user=h", hits=4), hits=9)
    assert decision.statuses[0].limit_remaining == 10
    over = await ask(limiter, d("user=h"), hits=11)
    assert over.overall_code is Code.OVER_LIMIT


async def test_replaces(contract: Callable[..., Limiter]) -> None:
    """A replaced limit is neither evaluated nor counted; its status is a bare OK."""
    limiter = contract()
    for _ in range(3):
        decision = await ask(limiter, d("category=account"), d("name=bkthomps"))
        assert decision.overall_code is Code.OK
        assert decision.statuses[1].limit is None
    # The replaced counter never moved: alone, the per-user limit still admits its one hit.
    alone = await ask(limiter, d("name=bkthomps"))
    assert alone.overall_code is Code.OK
    assert (await ask(limiter, d("name=bkthomps"))).overall_code is Code.OVER_LIMIT


async def test_unlimited(contract: Callable[..., Limiter]) -> None:
    """An unlimited rule answers OK with remaining 4294967295 and no current_limit."""
    limiter = contract()
    for _ in range(3):
        status = (await ask(limiter, d("free=x"))).statuses[0]
        assert (status.code, status.limit, status.limit_remaining) == (
            Code.OK,
            None,
            UNLIMITED_REMAINING,
        )


async def test_rule_shadow_mode(contract: Callable[..., Limiter]) -> None:
    """A shadow rule is counted but never makes a request OVER_LIMIT."""
    limiter = contract()
    for _ in range(3):
        decision = await ask(limiter, d("shadow=s"))
        assert decision.overall_code is Code.OK
        assert decision.statuses[0].code is Code.OK
    assert decision.statuses[0].limit_remaining == 0
    assert limiter.stats.rules["contract.shadow"].shadow_mode == 2


async def test_global_shadow_mode(contract: Callable[..., Limiter]) -> None:
    """Global shadow mode answers OK overall and leaves the statuses as they are."""
    limiter = contract(shadow_mode=True)
    for _ in range(4):
        decision = await ask(limiter, d("api=g"))
    assert decision.overall_code is Code.OK
    assert decision.statuses[0].code is Code.OVER_LIMIT
    assert limiter.stats.global_shadow_mode == 1


async def test_quota_mode(contract: Callable[..., Limiter]) -> None:
    """A quota descriptor over its limit blocks only when every quota descriptor is over."""
    limiter = contract()
    await ask(limiter, d("quota=a"))
    one_over = await ask(limiter, d("quota=a"), d("quota=b"))
    assert one_over.overall_code is Code.OK
    assert [s.code for s in one_over.statuses] == [Code.OVER_LIMIT, Code.OK]
    both_over = await ask(limiter, d("quota=a"), d("quota=b"))
    assert both_over.overall_code is Code.OVER_LIMIT


async def test_wildcards(contract: Callable[..., Limiter]) -> None:
    """A wildcard rule limits each matching value separately; others fall back to key-only."""
    limiter = contract()
    for _ in range(2):
        assert (await ask(limiter, d("path=/api/a"))).overall_code is Code.OK
    assert (await ask(limiter, d("path=/api/a"))).overall_code is Code.OVER_LIMIT
    assert (await ask(limiter, d("path=/api/b"))).overall_code is Code.OK
    status = (await ask(limiter, d("path=/web"))).statuses[0]
    assert status.limit is not None and status.limit.requests_per_unit == 10


async def test_deeper_and_unknown(contract: Callable[..., Limiter]) -> None:
    """A request deeper than the rules, an unmatched key and an unknown domain get a bare OK."""
    limiter = contract()
    decision = await ask(limiter, d("user=a", "extra=b"), d("nothing=here"))
    assert decision.overall_code is Code.OK
    assert all(s.limit is None and s.code is Code.OK for s in decision.statuses)
    unknown = await should_rate_limit(limiter, Request("nope", (d("user=a"),)))
    assert unknown.statuses == decision.statuses[:1]


async def test_limit_zero_blocks_everything(contract: Callable[..., Limiter]) -> None:
    """requests_per_unit 0 rejects the very first hit (the reference's black list example)."""
    limiter = contract()
    assert (await ask(limiter, d("blocked=ip"))).overall_code is Code.OVER_LIMIT


async def test_override(contract: Callable[..., Limiter]) -> None:
    """Envoy's per-descriptor limit replaces the rules for that descriptor, in a known domain."""
    limiter = contract()
    override = Override(2, Unit.HOUR)
    for expected in (Code.OK, Code.OK, Code.OVER_LIMIT):
        decision = await ask(limiter, d("anything=x", override=override))
        assert decision.overall_code is expected
    status = decision.statuses[0]
    assert status.limit is not None and status.limit.unit is Unit.HOUR


async def test_rejected_hits_count(contract: Callable[..., Limiter]) -> None:
    """By default a rejected request still counts in every counter it touched (the reference)."""
    limiter = contract()
    for _ in range(3):
        await ask(limiter, d("api=r"))
    rejected = await ask(limiter, d("wide=w"), d("api=r"))
    assert rejected.overall_code is Code.OVER_LIMIT
    assert rejected.statuses[0].limit_remaining == 4
    assert (await ask(limiter, d("wide=w"))).statuses[0].limit_remaining == 3


async def test_rejected_hits_skip(contract: Callable[..., Limiter]) -> None:
    """With skip, a request that ends OVER_LIMIT consumes nothing from any of its counters."""
    limiter = contract(rejected_hits="skip")
    for _ in range(3):
        await ask(limiter, d("api=s"))
    for _ in range(3):
        rejected = await ask(limiter, d("wide=s"), d("api=s"))
        assert rejected.overall_code is Code.OVER_LIMIT
        assert rejected.statuses[0].code is Code.OK
        assert rejected.statuses[0].limit_remaining == 5
    assert (await ask(limiter, d("wide=s"))).statuses[0].limit_remaining == 4
    # A shadow rule over its limit does not make the request OVER_LIMIT, so it still counts.
    await ask(limiter, d("shadow=skip"))
    decision = await ask(limiter, d("shadow=skip"), d("wide=s"))
    assert decision.overall_code is Code.OK
    assert decision.statuses[1].limit_remaining == 3


async def test_200_concurrent_calls_admit_exactly_50(contract: Callable[..., Limiter]) -> None:
    """Concurrent calls on one 50/minute key admit exactly 50, whatever the interleaving."""
    limiter = contract()
    decisions = await asyncio.gather(*(ask(limiter, d("conc=k")) for _ in range(200)))
    assert sum(x.overall_code is Code.OK for x in decisions) == 50


async def test_five_descriptors_sharing_a_first_entry_in_one_request(
    contract: Callable[..., Limiter],
) -> None:
    """Five limited descriptors under one first entry are decided together and each counted."""
    limiter = contract()
    request = [d("app=a1", f"{k}=v") for k in ("ip", "user", "iface", "route", "method")]
    for expected in (3, 2, 1, 0):
        decision = await ask(limiter, *request)
        assert [s.limit_remaining for s in decision.statuses] == [expected] * 5
    assert (await ask(limiter, *request)).overall_code is Code.OVER_LIMIT
