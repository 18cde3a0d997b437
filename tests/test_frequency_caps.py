"""Frequency caps on every backend (memory, Redis, Redis Cluster): batch checks, exactly-once
impressions, calendar boundaries, and the counters Envoy's ShouldRateLimit shares with the API."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from support.callbacks import apply, should_rate_limit
from support.clock import Clock

from sidecar.algorithms.decide import Address, State
from sidecar.algorithms.fixed_window import request_is_over
from sidecar.core import config
from sidecar.core.matching import match
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, most_restrictive
from sidecar.decision.plan import descriptor_hits
from sidecar.errors import InvalidRequest, UnknownDomain
from sidecar.frequency.caps import (
    DEDUPE_MARGIN,
    Candidate,
    FrequencyCaps,
    Impression,
    Recorded,
    Verdict,
)
from sidecar.model import (
    UNLIMITED_REMAINING,
    Code,
    Dedupe,
    Descriptor,
    Entry,
    Hit,
    Request,
    Role,
)
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.base import Applied

RULES = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 3, calendar: true, timezone: Asia/Shanghai, name: daily}
          - {unit: month, requests_per_unit: 4, calendar: true, timezone: Asia/Shanghai}
      - key: ad
        value: premium
        rate_limit: {unit: day, requests_per_unit: 1}
      - key: ad
        value: house
        rate_limit: {unlimited: true}
      - key: campaign
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: app
    rate_limit: {unit: minute, requests_per_unit: 10}
"""

SHANGHAI = ZoneInfo("Asia/Shanghai")
DAY = 86_400


def at(*fields: int) -> float:
    return datetime(*fields, tzinfo=SHANGHAI).timestamp()  # type: ignore[misc]


def shanghai_day_end(now: float) -> float:
    local = datetime.fromtimestamp(now, SHANGHAI)
    midnight = datetime(local.year, local.month, local.day, tzinfo=SHANGHAI).timestamp()
    return midnight + DAY


class CountingBackend:
    """A backend that counts the calls a check makes (one read is one round trip per slot)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.reads = 0

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        self.backend.apply(hits, all_or_nothing, now_ms, done)

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        self.reads += 1
        return await self.backend.read(addresses, now_ms)

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        return await self.backend.record(batches, now_ms)

    async def ping(self) -> bool:
        return await self.backend.ping()

    async def close(self) -> None:
        await self.backend.close()


@dataclass
class Sidecar:
    """The API and Envoy's path over one backend, on one clock."""

    caps: FrequencyCaps
    limiter: Limiter
    backend: CountingBackend

    async def record(self, *impressions: Impression) -> list[Recorded]:
        return await self.caps.record("ads", impressions)

    async def check(self, user: str, *ads: Candidate) -> list[Verdict]:
        return await self.caps.check("ads", user, ads)


@pytest.fixture
async def make_sidecar(backend_url: str, clock: Clock) -> AsyncIterator[Callable[..., Sidecar]]:
    """Sidecars on the backend under test: ``make(rules=RULES, dedupe_horizon=...)``."""
    opened: list[Backend] = []

    def make(rules: str = RULES, dedupe_horizon: int = DAY, plan_cache_size: int = 100) -> Sidecar:
        domain = config.parse(rules, "rules.yaml")
        loaded = Rules({domain.name: domain})
        backend = CountingBackend(open_backend(backend_url, timeout_ms=2_000))
        opened.append(backend)
        caps = FrequencyCaps(
            loaded,
            backend,
            clock=clock,
            dedupe_horizon=dedupe_horizon,
            plan_cache_size=plan_cache_size,
        )
        return Sidecar(caps, Limiter(loaded, backend, clock=clock), backend)

    yield make
    for backend in opened:
        await backend.close()


def impressions(user: str, ad: str, count: int, campaign: str | None = None) -> list[Impression]:
    return [Impression(f"{user}-{ad}-{campaign}-{n}", user, ad, campaign) for n in range(count)]


async def test_a_batch_of_50_ads_with_mixed_caps_is_decided_in_one_backend_call(
    make_sidecar: Callable[..., Sidecar], clock: Clock
) -> None:
    """50 candidates in one check: each ad answers from its own caps and its campaign's, in
    request order; an ad at its daily cap is refused with the day's reset, a value-specific rule
    and an unlimited rule apply, unknown campaigns cap nothing yet; the check consumes nothing
    and costs one backend call."""
    sidecar = make_sidecar()
    clock.now = at(2026, 6, 15, 10, 0, 0)
    day_reset = int(shanghai_day_end(clock.now) - clock.now)
    epoch_day_reset = DAY - int(clock.now) % DAY
    for i in range(40):
        await sidecar.record(*impressions("u1", f"a{i:02d}", i % 4))
    await sidecar.record(*impressions("u1", "other", 5, campaign="full"))
    await sidecar.record(*impressions("u1", "premium", 1))

    candidates = [Candidate(f"a{i:02d}") for i in range(40)]
    candidates += [Candidate(f"a{i:02d}", "full") for i in range(40, 45)]
    candidates += [Candidate("premium"), Candidate("house", "full")]
    candidates += [Candidate(f"a{i:02d}", "fresh") for i in range(47, 50)]
    sidecar.backend.reads = 0
    verdicts = await sidecar.check("u1", *candidates)

    expected = [
        Verdict(f"a{i:02d}", True, 3 - i % 4, day_reset)
        if i % 4 < 3
        else Verdict(f"a{i:02d}", False, 0, day_reset)
        for i in range(40)
    ]
    # Their own caps are untouched, but the campaign has had its 5 impressions today.
    expected += [Verdict(f"a{i:02d}", False, 0, epoch_day_reset) for i in range(40, 45)]
    expected += [Verdict("premium", False, 0, epoch_day_reset)]
    # The ad is unlimited, its campaign is not.
    expected += [Verdict("house", False, 0, epoch_day_reset)]
    expected += [Verdict(f"a{i:02d}", True, 3, day_reset) for i in range(47, 50)]
    assert verdicts == expected
    assert sidecar.backend.reads == 1
    assert await sidecar.check("u1", *candidates) == expected


async def test_the_caps_kept_between_checks_are_bounded_and_forget_what_was_not_used_lately(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """A sidecar keeps the caps of at most `plan_cache_size` descriptors between checks, in two
    generations of half of it: a descriptor checked again since the last turn is kept, one not
    checked since is forgotten at the next, and answers stay the same."""
    sidecar = make_sidecar(plan_cache_size=4)
    await sidecar.record(*impressions("u1", "a1", 2))
    before = await sidecar.check("u1", Candidate("a1"), Candidate("a2", "c1"))
    assert sidecar.caps.cached() == [
        ("ad", "a1", "impression"),
        ("ad", "a2", "impression"),
        ("campaign", "c1", "impression"),
    ]
    await sidecar.check("u2", Candidate("a1"))
    await sidecar.check("u2", Candidate("a3"))
    assert sidecar.caps.cached() == [
        ("campaign", "c1", "impression"),
        ("ad", "a1", "impression"),
        ("ad", "a3", "impression"),
    ]
    assert await sidecar.check("u1", Candidate("a1"), Candidate("a2", "c1")) == before
    assert [verdict.remaining for verdict in before] == [1, 3]
    assert len(sidecar.caps.cached()) <= 4


async def test_new_rules_apply_from_the_next_check_on_ads_already_checked(
    make_sidecar: Callable[..., Sidecar], clock: Clock
) -> None:
    """A rules reload forgets the caps kept between checks: an ad checked under the old rules
    is judged by the new ones from the next check, within the same second."""
    sidecar = make_sidecar()
    clock.now = at(2026, 6, 15, 10, 0, 0)
    await sidecar.record(*impressions("u1", "a1", 3))
    assert (await sidecar.check("u1", Candidate("a1")))[0].allowed is False
    domain = config.parse(RULES.replace("requests_per_unit: 3,", "requests_per_unit: 5,"), "r.yaml")
    sidecar.caps.set_rules(Rules({domain.name: domain}))
    assert sidecar.caps.cached() == []
    verdict = (await sidecar.check("u1", Candidate("a1")))[0]
    assert (verdict.allowed, verdict.remaining) == (True, 1)  # the month's 4 still hold


async def test_an_ad_with_no_cap_is_allowed_with_unlimited_remaining(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """An unlimited ad without campaign is allowed with remaining 4294967295 and reset 0."""
    sidecar = make_sidecar()
    await sidecar.record(*impressions("u1", "house", 50))
    assert await sidecar.check("u1", Candidate("house")) == [
        Verdict("house", True, UNLIMITED_REMAINING, 0)
    ]


async def test_a_campaign_cap_blocks_an_ad_whose_own_cap_is_not_reached(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """Impressions of other ads fill the campaign's 5 per day: the campaign's fresh ad is then
    refused, while the same ad checked without its campaign is allowed."""
    sidecar = make_sidecar()
    for ad in ("b1", "b2", "b3", "b4"):
        await sidecar.record(*impressions("u1", ad, 1, campaign="c1"))
    allowed = await sidecar.check("u1", Candidate("fresh", "c1"))
    assert (allowed[0].allowed, allowed[0].remaining) == (True, 1)
    await sidecar.record(*impressions("u1", "b5", 1, campaign="c1"))

    blocked, alone = await sidecar.check("u1", Candidate("fresh", "c1"), Candidate("fresh"))
    assert (blocked.allowed, blocked.remaining) == (False, 0)
    assert (alone.allowed, alone.remaining) == (True, 3)


async def test_100_concurrent_records_of_one_impression_count_it_once(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """The same impression id recorded by 100 concurrent calls is counted by exactly one of them,
    on the ad's caps and on its campaign's; the others answer duplicate."""
    sidecar = make_sidecar()
    impression = Impression("imp-1", "u1", "a1", "c1")
    answers = await asyncio.gather(*(sidecar.record(impression) for _ in range(100)))
    counted = [answer[0].counted for answer in answers]
    assert counted.count(True) == 1
    ad, campaign = await sidecar.check("u1", Candidate("a1"), Candidate("x", "c1"))
    assert ad.remaining == 2  # 3 per day, one impression
    assert campaign.remaining == 3  # the ad's own 3 per day is lower than the campaign's 5 - 1


async def test_records_of_different_ids_on_one_cap_all_count_even_past_it(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """Impressions are facts: 6 ids on an ad capped at 3 a day are all counted (a batch, then
    single records), and Envoy's path sees the count past the limit."""
    sidecar = make_sidecar()
    first = await sidecar.record(*impressions("u1", "a1", 4))
    rest = [await sidecar.record(Impression(f"late-{n}", "u1", "a1")) for n in range(2)]
    assert [r.counted for r in first] + [r[0].counted for r in rest] == [True] * 6

    check = Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", "a1")), hits_addend=0),))
    decision = await should_rate_limit(sidecar.limiter, check)
    assert decision.overall_code is Code.OVER_LIMIT
    # Each window reports what it admits: nothing, and the month too is past its 4.
    assert decision.statuses[0].limit_remaining == 0
    verdict = (await sidecar.check("u1", Candidate("a1")))[0]
    assert (verdict.allowed, verdict.remaining) == (False, 0)


async def test_a_batch_repeating_an_id_counts_it_once_and_keeps_order(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """Results follow the request; the second occurrence of an id in one batch is a duplicate,
    and ids are per user: the same id for two users counts for each."""
    sidecar = make_sidecar()
    results = await sidecar.record(
        Impression("i1", "u1", "a1"),
        Impression("i1", "u2", "a1"),
        Impression("i2", "u1", "a1"),
        Impression("i1", "u1", "a1"),
    )
    assert results == [
        Recorded("i1", True),
        Recorded("i1", True),
        Recorded("i2", True),
        Recorded("i1", False),
    ]
    u1, u2 = [(await sidecar.check(user, Candidate("a1")))[0].remaining for user in ("u1", "u2")]
    assert (u1, u2) == (1, 2)


async def test_windows_reset_at_the_calendar_day_and_month_in_the_caps_zone(
    make_sidecar: Callable[..., Sidecar], clock: Clock
) -> None:
    """3 per Shanghai day and 4 per Shanghai month: the day's cap lifts at local midnight while
    the month's count goes on; at the month's first midnight both start afresh."""
    sidecar = make_sidecar()
    clock.now = at(2026, 1, 30, 23, 59, 30)
    await sidecar.record(*impressions("u1", "a1", 3))
    late = (await sidecar.check("u1", Candidate("a1")))[0]
    assert late == Verdict("a1", False, 0, 30)

    clock.now = at(2026, 1, 31, 0, 0, 5)
    next_day = (await sidecar.check("u1", Candidate("a1")))[0]
    # The day has 3 again, but the month only 1: the month is the most restrictive window.
    month_reset = int(at(2026, 2, 1) - clock.now)
    assert next_day == Verdict("a1", True, 1, month_reset)
    await sidecar.record(Impression("jan-31", "u1", "a1"))
    assert (await sidecar.check("u1", Candidate("a1")))[0] == Verdict("a1", False, 0, month_reset)

    clock.now = at(2026, 2, 1, 0, 0, 1)
    february = (await sidecar.check("u1", Candidate("a1")))[0]
    assert february == Verdict("a1", True, 3, DAY - 1)


async def test_envoy_and_the_api_move_the_same_counters(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """ShouldRateLimit with [(user, u1), (ad, a1)] spends what the API checks, and impressions
    recorded through the API are what Envoy's check sees."""
    sidecar = make_sidecar()
    envoy = Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", "a1"))),))
    decision = await should_rate_limit(sidecar.limiter, envoy)
    assert decision.statuses[0].limit_remaining == 2
    assert (await sidecar.check("u1", Candidate("a1")))[0].remaining == 2

    await sidecar.record(Impression("imp-1", "u1", "a1", "c1"))
    check = Request(
        "ads",
        (
            Descriptor((Entry("user", "u1"), Entry("ad", "a1")), hits_addend=0),
            Descriptor((Entry("user", "u1"), Entry("campaign", "c1")), hits_addend=0),
        ),
    )
    statuses = (await should_rate_limit(sidecar.limiter, check)).statuses
    assert [s.limit_remaining for s in statuses] == [1, 4]
    await should_rate_limit(sidecar.limiter, envoy)
    assert (await sidecar.check("u1", Candidate("a1")))[0].allowed is False


@pytest.mark.parametrize("offset", [0, DAY - 1], ids=["bucket start", "bucket end"])
async def test_a_repeat_just_inside_the_horizon_is_refused_and_one_long_after_counts(
    make_sidecar: Callable[..., Sidecar], clock: Clock, offset: int
) -> None:
    """With a one-day horizon, an id recorded at the start or the end of a horizon bucket is
    still refused one second before the horizon ends; two horizons (and the margin) later it is
    forgotten and counts again."""
    sidecar = make_sidecar(dedupe_horizon=DAY)
    clock.now = (clock.now // DAY) * DAY + offset
    recorded = clock.now
    assert (await sidecar.record(Impression("imp-1", "u1", "house")))[0].counted
    clock.now = recorded + DAY - 1
    assert not (await sidecar.record(Impression("imp-1", "u1", "house")))[0].counted
    clock.now = recorded + 2 * DAY + DEDUPE_MARGIN + 1
    assert (await sidecar.record(Impression("imp-1", "u1", "house")))[0].counted


async def test_unknown_domains_and_domains_without_caps_are_refused(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """A domain no rules declare, or one without user → ad rules, raises UnknownDomain."""
    sidecar = make_sidecar()
    with pytest.raises(UnknownDomain, match="unknown domain 'nope'"):
        await sidecar.caps.check("nope", "u1", [Candidate("a1")])
    plain = make_sidecar(
        "domain: plain\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, requests_per_unit: 1}\n"
    )
    with pytest.raises(UnknownDomain, match="domain 'plain' has no frequency caps"):
        await plain.caps.record("plain", [Impression("i", "u1", "a1")])


@pytest.mark.parametrize(
    ("impression", "message"),
    [
        (Impression("", "u1", "a1"), r"impressions\[0\].id must be a non-empty string"),
        (
            Impression("x" * 129, "u1", "a1"),
            r"impressions\[0\].id is too long \(at most 128 bytes\)",
        ),
        (Impression("é" * 65, "u1", "a1"), "at most 128 bytes"),
        (Impression("a\nb", "u1", "a1"), "must be printable text"),
        (Impression("i", "", "a1"), r"impressions\[0\].user must be a non-empty string"),
        (Impression("i", "u1", "a1", ""), r"impressions\[0\].campaign must be a non-empty"),
    ],
)
async def test_bad_impressions_are_refused_whole(
    make_sidecar: Callable[..., Sidecar], impression: Impression, message: str
) -> None:
    """An impression with a bad id or value refuses the whole batch, counting nothing."""
    sidecar = make_sidecar()
    with pytest.raises(InvalidRequest, match=message):
        await sidecar.record(impression, Impression("good", "u1", "a1"))
    assert (await sidecar.check("u1", Candidate("a1")))[0].remaining == 3


async def test_batch_sizes_are_bounded(make_sidecar: Callable[..., Sidecar]) -> None:
    """At most 100 ads per check and 1,000 impressions per record; an empty batch is fine."""
    sidecar = make_sidecar()
    with pytest.raises(InvalidRequest, match=r"too many ads: 101 \(at most 100 per check\)"):
        await sidecar.check("u1", *[Candidate(f"a{i}") for i in range(101)])
    many = [Impression(f"i{i}", "u1", "a1") for i in range(1_001)]
    with pytest.raises(InvalidRequest, match=r"too many impressions: 1001"):
        await sidecar.caps.record("ads", many)
    assert await sidecar.check("u1") == []
    assert await sidecar.record() == []


async def test_without_group_counters_the_api_uses_the_reference_layout(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """Caps work the same on a tree that keeps one key per counter (no group_counters)."""
    sidecar = make_sidecar(RULES.replace("    group_counters: true\n", ""))
    await sidecar.record(*impressions("u1", "a1", 2, campaign="c1"))
    await sidecar.record(*impressions("u1", "a2", 3, campaign="c1"))
    first, second = await sidecar.check("u1", Candidate("a1", "c1"), Candidate("a1"))
    assert (first.allowed, first.remaining, second.remaining) == (False, 0, 1)


@pytest.mark.redis
async def test_the_over_limit_cache_tells_the_counters_of_one_user_apart(
    redis_url: str, clock: Clock
) -> None:
    """With the over-limit cache on, an ad known to be over does not refuse the user's other
    ads, although all of them live in one hash."""
    domain = config.parse(RULES.replace(", calendar: true, timezone: Asia/Shanghai", ""), "r.yaml")
    backend = open_backend(redis_url, timeout_ms=2_000)
    limiter = Limiter(Rules({"ads": domain}), backend, clock=clock, over_limit_cache=100)
    try:

        def ask(ad: str) -> Request:
            return Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", ad))),))

        codes = [(await should_rate_limit(limiter, ask("a1"))).overall_code for _ in range(5)]
        assert codes == [Code.OK] * 3 + [Code.OVER_LIMIT] * 2
        assert limiter.over_limit_cache is not None and len(limiter.over_limit_cache) == 1
        assert (await should_rate_limit(limiter, ask("a2"))).overall_code is Code.OK
    finally:
        await backend.close()


SCRIPT_RULES = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: hour, requests_per_unit: 4}
          - {unit: hour, requests_per_unit: 6, algorithm: sliding_window}
      - key: ad
        value: promo-*
        share_threshold: true
        rate_limits:
          - {unit: minute, unit_multiplier: 30, requests_per_unit: 5, borrow: 2}
          - {unit: day, requests_per_unit: 9, calendar: true, timezone: America/New_York}
      - key: ad
        value: burst
        rate_limit: {algorithm: token_bucket, unit: hour, requests_per_unit: 3, burst: 4, borrow: 1}
      - key: campaign
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 2}
      - key: campaign
        value: strict
        rate_limit: {unit: day, requests_per_unit: 3}
"""


async def script_verdicts(
    sidecar: Sidecar, user: str, candidates: Sequence[Candidate], now_ms: int
) -> list[Verdict]:
    """The verdicts as first specified: every window a cost-0 hit through the backend's script,
    most restrictive over the ad's windows then its campaign's."""
    domain = sidecar.caps.rules.domains["ads"]
    verdicts = []
    for candidate in candidates:
        groups = []
        for key, value in (("ad", candidate.ad), ("campaign", candidate.campaign)):
            found = (
                None if value is None else match(domain, (Entry("user", user), Entry(key, value)))
            )
            if found is None or found.limit.unlimited:
                continue
            hits = descriptor_hits("ads", found, 0, len(groups), now_ms)
            groups.append((found.limit.role, await apply(sidecar.backend, hits, False, now_ms)))
        if not groups:
            verdicts.append(Verdict(candidate.ad, True, UNLIMITED_REMAINING, 0))
            continue
        over = [any(o.over for o in outcomes) for _, outcomes in groups]
        allowed = not request_is_over(over, [role for role, _ in groups])
        blocking = [o for role, outcomes in groups if role is not Role.SHADOW for o in outcomes]
        if not blocking:
            verdicts.append(Verdict(candidate.ad, allowed, UNLIMITED_REMAINING, 0))
            continue
        chosen = blocking[most_restrictive(blocking)]
        verdicts.append(
            Verdict(candidate.ad, allowed, chosen.remaining, -(-chosen.reset_ms // 1000))
        )
    return verdicts


async def test_checks_answer_as_the_script_would(
    make_sidecar: Callable[..., Sidecar], clock: Clock
) -> None:
    """A check reads the counters and judges them in Python; on random histories of records and
    Envoy hits over every kind of window (sliding, borrowing, bucket, calendar, share_threshold
    wildcards, shadow caps), its verdicts are those of cost-0 hits through the script."""
    sidecar = make_sidecar(SCRIPT_RULES)
    rng = random.Random(7)
    ads = ["a1", "a2", "promo-x", "promo-y", "burst"]
    campaigns = [None, "c1", "strict"]
    clock.now = datetime(2026, 3, 8, 4, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    for step in range(60):
        clock.now += rng.choice((0, 5, 60, 400, 900))
        ad, campaign = rng.choice(ads), rng.choice(campaigns)
        if rng.random() < 0.6:
            await sidecar.record(Impression(f"i{step}", "u1", ad, campaign))
        else:
            entries = (Entry("user", "u1"), Entry("ad", ad))
            await should_rate_limit(sidecar.limiter, Request("ads", (Descriptor(entries),)))
        candidates = [Candidate(a, c) for a in ads for c in campaigns]
        now_ms = int(clock.now * 1000)
        expected = await script_verdicts(sidecar, "u1", candidates, now_ms)
        assert await sidecar.check("u1", *candidates) == expected, f"step {step}"
