"""Refunds (`is_negative_hits`): hits given back to a descriptor's counters, on memory, Redis and
Redis Cluster (real servers, started by the fixtures), for every algorithm; and the refunds the
sidecar refuses, which change no counter."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from conftest import BACKENDS
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.algorithms.token_bucket import Bucket
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.decision.stats import Stats
from sidecar.errors import NegativeHitsRefused
from sidecar.model import Code, Decision, Descriptor, Entry, Override, Request, Unit
from sidecar.rls.service import RateLimitService
from sidecar.rls.statuses import statuses
from sidecar.storage.backends import open_backend
from sidecar.telemetry.metrics import Latency, StatsCollector
from sidecar.telemetry.statsd import Deltas

every_backend = pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)
#: The backends the over-limit cache is used with (never memory's).
shared_backends = pytest.mark.parametrize("backend_url", BACKENDS[1:], indirect=True)

RULES = """
domain: refunds
descriptors:
  - key: per_second
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: fixed
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: borrowing
    rate_limit: {unit: minute, requests_per_unit: 5, borrow: 2}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 10, algorithm: token_bucket}
  - key: mixed
    rate_limits:
      - {unit: minute, requests_per_unit: 4, borrow: 2}
      - {unit: minute, requests_per_unit: 6, burst: 10, borrow: 3, algorithm: token_bucket}
  - key: grouped
    group_counters: true
    descriptors:
      - key: user
        rate_limits:
          - {unit: minute, requests_per_unit: 5}
          - {unit: hour, requests_per_unit: 4, algorithm: token_bucket}
"""


@pytest.fixture
def refunds(make_limiter: Callable[..., Limiter]) -> Callable[..., Limiter]:
    """Limiters over the rules above on the backend under test; refunds taken unless told."""

    def make(**settings: object) -> Limiter:
        settings.setdefault("negative_hits", True)
        return make_limiter(RULES, **settings)

    return make


def charge(pair: str, hits: int | None = None, override: Override | None = None) -> Descriptor:
    entries = tuple(Entry(*p.split("=", 1)) for p in pair.split(","))
    return Descriptor(entries, hits, override)


def refund(pair: str, hits: int | None = None, override: Override | None = None) -> Descriptor:
    entries = tuple(Entry(*p.split("=", 1)) for p in pair.split(","))
    return Descriptor(entries, hits, override, is_negative_hits=True)


async def ask(limiter: Limiter, *descriptors: Descriptor, hits: int = 0) -> Decision:
    return await should_rate_limit(limiter, Request("refunds", descriptors, hits))


async def stored(limiter: Limiter, *descriptors: Descriptor) -> list[object]:
    """What the backend holds for each window of the descriptors' rules (None: nothing)."""
    plan = limiter.prepare(Request("refunds", descriptors))
    now_ms = int(limiter._clock() * 1000)
    addresses = [
        (hit.key, hit.field) if hit.field else hit.key
        for item in plan.counted
        for hit in item.windows.at(now_ms)
    ]
    return list(await limiter.backend.read(addresses, now_ms))


async def remaining(limiter: Limiter, descriptor: Descriptor) -> int:
    return (await ask(limiter, descriptor)).statuses[0].limit_remaining


@every_backend
async def test_the_references_refund_test(refunds: Callable[..., Limiter]) -> None:
    """On 50 per second, 5 hits leave 45 remaining, a refund of 3 gives 48 (answered OK), one
    more hit 47; the rule's total_negative_hits counts the 3, its total_hits the 6."""
    limiter = refunds()
    for _ in range(5):
        decision = await ask(limiter, charge("per_second=a"))
    assert decision.statuses[0].limit_remaining == 45
    decision = await ask(limiter, refund("per_second=a", 3))
    assert decision.overall_code is Code.OK
    assert decision.statuses[0].code is Code.OK
    assert decision.statuses[0].limit_remaining == 48
    assert decision.statuses[0].duration_until_reset == 1
    assert (await ask(limiter, charge("per_second=a"))).statuses[0].limit_remaining == 47
    rule = limiter.stats.rules["refunds.per_second"]
    assert (rule.total_hits, rule.total_negative_hits) == (6, 3)


@every_backend
@pytest.mark.parametrize("key", ["fixed", "borrowing", "sliding"])
async def test_a_windows_counter_goes_down_floored_at_0(
    refunds: Callable[..., Limiter], key: str
) -> None:
    """A fixed, borrowing or sliding window's counter goes down by the refund; a refund larger
    than the count leaves 0, where the counter is gone (no key left behind)."""
    limiter = refunds()
    for _ in range(4):
        await ask(limiter, charge(f"{key}=a"))
    assert await stored(limiter, charge(f"{key}=a")) == [4]
    left = (await ask(limiter, refund(f"{key}=a", 1))).statuses[0].limit_remaining
    assert left == (4 if key == "borrowing" else 2)  # borrowing: 5 + 2 borrowed, less 3
    assert await stored(limiter, charge(f"{key}=a")) == [3]
    decision = await ask(limiter, refund(f"{key}=a", 100))
    assert decision.statuses[0].code is Code.OK
    assert decision.statuses[0].limit_remaining == (7 if key == "borrowing" else 5)
    assert await stored(limiter, charge(f"{key}=a")) == [None]
    assert await remaining(limiter, charge(f"{key}=a")) == (6 if key == "borrowing" else 4)


@every_backend
@pytest.mark.parametrize("key", ["fixed", "borrowing", "sliding", "bucket", "grouped,user"])
async def test_a_refund_of_a_counter_that_does_not_exist_writes_nothing(
    refunds: Callable[..., Limiter], key: str
) -> None:
    """A refund on a counter that holds nothing is answered OK with the whole limit left and
    leaves no key (or hash field) behind, for every algorithm and layout."""
    limiter = refunds()
    pair = key if "," in key else f"{key}=a"
    if "," in key:
        pair = "grouped=g,user=u"
    decision = await ask(limiter, refund(pair, 3))
    assert decision.statuses[0].code is Code.OK
    assert decision.statuses[0].limit is not None
    assert all(value is None for value in await stored(limiter, charge(pair)))
    if isinstance(limiter.backend, type(open_backend("memory://"))):
        assert len(limiter.backend) == 0  # type: ignore[arg-type]


@every_backend
async def test_a_bucket_gets_its_tokens_back_up_to_its_burst(
    refunds: Callable[..., Limiter], clock: Clock
) -> None:
    """A token bucket's tokens come back with the refund, never past its burst: once full it
    holds no state, as a bucket that refilled."""
    limiter = refunds()
    await ask(limiter, charge("bucket=a", 7))
    assert await remaining(limiter, refund("bucket=a", 2)) == 5
    decision = await ask(limiter, refund("bucket=a", 100))
    assert decision.statuses[0].limit_remaining == 10
    assert decision.statuses[0].duration_until_reset == 0
    assert await stored(limiter, charge("bucket=a")) == [None]
    assert await remaining(limiter, charge("bucket=a", 10)) == 0


@every_backend
async def test_a_refund_with_several_windows_gives_back_to_each(
    refunds: Callable[..., Limiter],
) -> None:
    """A descriptor of two windows in a grouped hash (a window and a bucket) gets the refund on
    both, and reports the most restrictive."""
    limiter = refunds()
    user = "grouped=g,user=u"
    await ask(limiter, charge(user, 3))
    decision = await ask(limiter, refund(user, 2))
    assert decision.statuses[0].limit_remaining == 3  # the bucket: 4 - 3 + 2
    assert (await stored(limiter, charge(user)))[0] == 1


@every_backend
async def test_a_refund_is_applied_in_the_call_of_the_requests_charges(
    refunds: Callable[..., Limiter],
) -> None:
    """A request that charges one descriptor and refunds another is decided in one call: the
    charge is judged and counted, the refund given back."""
    limiter = refunds()
    for _ in range(5):
        await ask(limiter, charge("fixed=a"))
    decision = await ask(limiter, charge("sliding=b", 2), refund("fixed=a", 2))
    assert decision.overall_code is Code.OK
    assert [s.limit_remaining for s in decision.statuses] == [3, 2]
    assert await stored(limiter, charge("sliding=b"), charge("fixed=a")) == [2, 3]


@every_backend
async def test_a_refused_charge_reaches_no_counter_through_a_later_refund_or_charge(
    refunds: Callable[..., Limiter],
) -> None:
    """A request that charges 9, refunds 1 and charges 1 on one descriptor, whose borrowing
    minute (at most 6) refuses the 9: the 9 is counted nowhere, though the bucket beside it
    admitted it and judged the later hits with it; the refund gives back to no counter (there
    is none) and the charge of 1 counts in both windows."""
    limiter = refunds()
    decision = await ask(limiter, charge("mixed=a", 9), refund("mixed=a", 1), charge("mixed=a", 1))
    assert [s.code for s in decision.statuses] == [Code.OVER_LIMIT, Code.OK, Code.OK]
    minute, bucket = await stored(limiter, charge("mixed=a"))
    assert minute == 1
    assert isinstance(bucket, Bucket) and bucket.tokens == 9


@every_backend
async def test_a_refund_is_answered_ok_even_on_a_counter_over_its_limit(
    refunds: Callable[..., Limiter],
) -> None:
    """A refund on a counter far over its limit is OK, with what remains after it (0 while it
    is still over); a refund of 0 gives nothing back and is OK too."""
    limiter = refunds()
    for _ in range(9):
        await ask(limiter, charge("fixed=a"))
    decision = await ask(limiter, refund("fixed=a", 0))
    assert (decision.overall_code, decision.statuses[0].limit_remaining) == (Code.OK, 0)
    decision = await ask(limiter, refund("fixed=a", 2))
    assert (decision.overall_code, decision.statuses[0].limit_remaining) == (Code.OK, 0)
    assert await stored(limiter, charge("fixed=a")) == [7]
    rule = limiter.stats.rules["refunds.fixed"]
    assert (rule.total_negative_hits, rule.over_limit) == (2, 4)


@every_backend
async def test_a_refund_on_an_unknown_rule_or_domain_changes_nothing(
    refunds: Callable[..., Limiter],
) -> None:
    """A refund matching no rule is answered OK with no limit, as a charge would be."""
    limiter = refunds()
    decision = await ask(limiter, refund("nobody=a", 3))
    assert decision.statuses[0].limit is None and decision.overall_code is Code.OK
    other = await should_rate_limit(limiter, Request("elsewhere", (refund("fixed=a", 3),)))
    assert other.overall_code is Code.OK
    assert await stored(limiter, charge("fixed=a")) == [None]


@every_backend
async def test_a_refund_with_an_override_gives_back_to_the_overrides_counter(
    refunds: Callable[..., Limiter],
) -> None:
    """A refund carrying a `limit` override is taken as the reference takes it: it counts down
    the counter its entries and the override's unit name (the rule's own, for the same unit),
    and reports the override's limit."""
    limiter = refunds()
    override = Override(10, Unit.MINUTE)
    for _ in range(4):
        await ask(limiter, charge("fixed=a", override=override))
    await ask(limiter, charge("fixed=a"))
    decision = await ask(limiter, refund("fixed=a", 3, override=override))
    assert decision.statuses[0].limit is not None
    assert decision.statuses[0].limit.requests_per_unit == 10
    assert decision.statuses[0].limit_remaining == 8
    assert await remaining(limiter, charge("fixed=a")) == 2
    await ask(limiter, refund("fixed=a", 1, override=Override(10, Unit.HOUR)))
    assert await stored(limiter, charge("fixed=a")) == [3]


@every_backend
@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"negative_hits": False}, "is off: run serve with --negative-hits"),
        ({"rejected_hits": "skip"}, "--rejected-hits skip"),
    ],
    ids=["negative-hits-off", "rejected-hits-skip"],
)
async def test_a_refund_the_sidecar_does_not_take_is_refused_and_changes_nothing(
    refunds: Callable[..., Limiter], settings: dict[str, object], why: str
) -> None:
    """With refunds off (the default), or under `--rejected-hits skip` (where a refused request
    added nothing, yet Envoy refunds it too), a request carrying a refund is refused
    UNIMPLEMENTED, the charges beside it included, and no counter changes: never a charge."""
    limiter = refunds(**settings)
    await ask(limiter, charge("fixed=a"))
    with pytest.raises(NegativeHitsRefused, match=why) as refused:
        await ask(limiter, refund("fixed=a", 1), charge("sliding=b"))
    assert statuses(refused.value)[0].name == "UNIMPLEMENTED"
    assert await stored(limiter, charge("fixed=a"), charge("sliding=b")) == [1, None]
    assert limiter.stats.service_error == 1
    assert limiter.stats.rules["refunds.fixed"].total_negative_hits == 0


@shared_backends
async def test_the_over_limit_cache_forgets_a_counter_a_refund_took_back_under_its_limit(
    backend_url: str, clock: Clock
) -> None:
    """A counter the over-limit cache knows to be over is asked of the store again once a
    refund takes it back under its limit, so the next request is admitted at once; a refund
    that leaves it over keeps it known (Redis and Redis Cluster: the cache needs a shared
    store)."""
    assert backend_url != "memory://"
    domain = config.parse(RULES, "rules.yaml")
    limiter = Limiter(
        Rules({domain.name: domain}),
        open_backend(backend_url, timeout_ms=1000),
        settings=Settings(negative_hits=True),
        clock=clock,
        over_limit_cache=100,
    )
    try:
        for _ in range(7):
            await ask(limiter, charge("fixed=a"))
        cache = limiter.over_limit_cache
        assert cache is not None and len(cache) == 1
        await ask(limiter, refund("fixed=a", 2))  # 7 - 2 = 5: still at the limit
        assert len(cache) == 1
        await ask(limiter, refund("fixed=a", 1))
        assert len(cache) == 0
        assert (await ask(limiter, charge("fixed=a"))).overall_code is Code.OK
    finally:
        await limiter.backend.close()


def test_total_negative_hits_is_exported_under_the_references_name() -> None:
    """A refund of 3 on a rule shows as `total_negative_hits` 3, in Prometheus
    (`ratelimit_service_rate_limit_total_negative_hits{domain, key1}`) and in statsd
    (`ratelimit.service.rate_limit.<key>.total_negative_hits`), and in no other series."""
    stats = Stats()
    stats.rules["d.k"].record(10, 4, -3, over=False, shadow=False)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in StatsCollector(stats).collect()
        for sample in family.samples
    }
    labels = (("domain", "d"), ("key1", "k"))
    assert samples[("ratelimit_service_rate_limit_total_negative_hits", labels)] == 3
    assert samples[("ratelimit_service_rate_limit_total_hits", labels)] == 0
    sent = {(s.name, s.value) for s in Deltas(stats, Latency()).take()}
    assert sent == {("ratelimit.service.rate_limit.d.k.total_negative_hits", 3)}


@pytest.mark.parametrize("backend_url", ["memory"], indirect=True)
async def test_a_refund_in_proto3_json_is_read_by_the_json_endpoint(
    refunds: Callable[..., Limiter],
) -> None:
    """`/json` reads `isNegativeHits` too (the messages of proto/envoy): a refund of 2 after 3
    hits leaves 4 of 5."""
    service = RateLimitService(refunds())
    body = {"domain": "refunds", "descriptors": [{"entries": [{"key": "fixed", "value": "j"}]}]}
    for _ in range(3):
        await service.should_rate_limit_json(json.dumps(body).encode())
    body["descriptors"][0].update(hitsAddend=2, isNegativeHits=True)  # type: ignore[index]
    code, answer = await service.should_rate_limit_json(json.dumps(body).encode())
    assert code is Code.OK
    assert json.loads(answer)["statuses"][0]["limitRemaining"] == 4
