"""Packed counters (`group_counters: packed`) on every backend (memory, Redis, Redis Cluster):
an ad's day and month counts in one field, judged as the windows would be one field each,
across window boundaries, shared with Envoy's ShouldRateLimit, refunds and all."""

from __future__ import annotations

import gc
import random
from collections.abc import AsyncIterator

import pytest
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.algorithms import packing
from sidecar.core import config
from sidecar.core.counters import grouped_hits
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.frequency.caps import Candidate, FrequencyCaps, Impression, Verdict
from sidecar.model import Descriptor, Entry, Limit, Request, Role, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

DAY = 86_400
#: 30-day "months" are epoch blocks: this one runs from 2025-11-08 to 2025-12-08 (UTC).
MONTH_START = 680 * 30 * DAY

RULES = """
domain: ads
descriptors:
  - key: user
    group_counters: packed
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 2}
          - {unit: month, requests_per_unit: 3}
          - {unit: hour, requests_per_unit: 5, calendar: false}
      - key: campaign
        rate_limits:
          - {unit: hour, requests_per_unit: 4}
          - {unit: day, requests_per_unit: 6, calendar: true, timezone: Europe/Paris}
"""


class Sidecar:
    """The frequency API and Envoy's path over one backend, on one clock."""

    def __init__(self, backend_url: str, clock: Clock, rules: str = RULES) -> None:
        domain = config.parse(rules, "rules.yaml")
        loaded = Rules({domain.name: domain})
        self.backend: Backend = open_backend(backend_url, timeout_ms=2_000)
        self.caps = FrequencyCaps(loaded, self.backend, clock=clock)
        self.limiter = Limiter(loaded, self.backend, clock=clock)

    async def check(self, user: str, *ads: Candidate) -> list[Verdict]:
        return await self.caps.check("ads", user, ads)


@pytest.fixture
async def sidecar(backend_url: str, clock: Clock) -> AsyncIterator[Sidecar]:
    made = Sidecar(backend_url, clock)
    yield made
    await made.backend.close()


def test_the_rules_say_which_windows_share_a_field() -> None:
    """A packed tree packs a limit's plain epoch windows that nest in its longest (hour, day and
    30-day month), shortest first; a limit with one epoch window and a calendar one has nothing
    to pack."""
    domain = config.parse(RULES, "rules.yaml")
    user = next(iter(domain.root.nodes()))
    ad = next(node for node in user.children.nodes() if node.key == "ad")
    campaign = next(node for node in user.children.nodes() if node.key == "campaign")
    assert ad.limit is not None and campaign.limit is not None
    assert ad.limit.packing == packing.Packing((2, 0, 1), 3_600, 721, (1 << 14) - 1)
    assert campaign.limit.packing is None  # one epoch window and one calendar day: nothing


def test_a_week_and_a_30_day_month_do_not_nest_and_keep_a_field_each() -> None:
    """Windows whose lengths do not divide the longest's would lose counts at its boundary."""
    windows = (Window(1, Unit.WEEK), Window(1, Unit.MONTH), Window(1, Unit.DAY))
    assert packing.plan(windows) == packing.Packing((2, 1), DAY, 31, (1 << 24) - 1)
    assert packing.plan((Window(1, Unit.WEEK), Window(1, Unit.MONTH))) is None


def test_a_limit_too_large_for_the_cap_is_not_packed() -> None:
    """Counts stop at the cap; a limit at or past it keeps its fields, so judging stays exact."""
    huge = (Window(1 << 24, Unit.DAY), Window(1, Unit.MONTH))
    assert packing.plan(huge) is None


def test_values_round_trip_and_small_counts_stay_small() -> None:
    """decode(encode(x)) is x; one impression of each window is stored as a number below 128
    (two bytes in a Redis listpack)."""
    rng = random.Random(7)
    for _ in range(2_000):
        n = rng.randint(2, 4)
        spread = rng.randint(2, 800)
        counts = [rng.choice((0, 1, 2, rng.randint(0, 5_000))) for _ in range(n)]
        offset = rng.randint(1, spread - 1)
        value = packing.encode(offset, counts, spread)
        if any(counts):
            assert packing.decode(value, spread, n) == (offset, counts)
        else:
            assert value == 0
    assert packing.encode(30, [1, 1], 31) < 128


def test_the_field_is_named_by_its_codes_and_the_longest_windows_keep_until() -> None:
    """One field per ad and month, pruned as any grouped field: ``ad|a1|dM<keep-until>``."""
    limit = Limit((Window(3, Unit.MONTH), Window(2, Unit.DAY)))
    limit = Limit(limit.windows, packing=packing.plan(limit.windows))
    now = MONTH_START + 5 * DAY + 100
    hits = grouped_hits(b"rl{ads|user|u1}", "ad|a1", limit, 1, 0, Role.BLOCKING, now * 1000)
    assert [hit.field for hit in hits] == [b"ad|a1|dM" + _keep(MONTH_START + 30 * DAY)] * 2
    assert [hit.end_ms // 1000 for hit in hits] == [MONTH_START + 30 * DAY, MONTH_START + 6 * DAY]


def _keep(end: int) -> bytes:
    from sidecar.core.keys import keep_until_id

    return keep_until_id(end, False).encode()


async def test_day_and_month_share_a_field_and_count_as_two(sidecar: Sidecar, clock: Clock) -> None:
    """Two impressions use the day's 2; the next day the month has 1 left; the month after,
    all is back; each answer is the most restrictive window's."""
    clock.now = MONTH_START + 3 * DAY + 3_600 * 10 + 5
    await sidecar.caps.record("ads", [Impression("i1", "u1", "a1"), Impression("i2", "u1", "a1")])
    day_end = MONTH_START + 4 * DAY
    assert (await sidecar.check("u1", Candidate("a1")))[0] == Verdict(
        "a1", False, 0, int(day_end - clock.now)
    )
    clock.now = MONTH_START + 4 * DAY + 10
    assert (await sidecar.check("u1", Candidate("a1")))[0] == Verdict(
        "a1", True, 1, MONTH_START + 30 * DAY - int(clock.now)
    )
    await sidecar.caps.record("ads", [Impression("i3", "u1", "a1")])
    verdict = (await sidecar.check("u1", Candidate("a1")))[0]
    assert (verdict.allowed, verdict.remaining) == (False, 0)
    clock.now = MONTH_START + 30 * DAY
    assert (await sidecar.check("u1", Candidate("a1")))[0] == Verdict("a1", True, 2, DAY)


async def test_envoy_and_the_api_move_the_same_packed_counters(
    sidecar: Sidecar, clock: Clock
) -> None:
    """ShouldRateLimit spends what the API checks, and a refund gives it back, on one field."""
    clock.now = MONTH_START + 7 * DAY + 100
    envoy = Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", "a1"))),))
    statuses = (await should_rate_limit(sidecar.limiter, envoy)).statuses
    assert statuses[0].limit_remaining == 1
    assert (await sidecar.check("u1", Candidate("a1")))[0].remaining == 1
    await sidecar.caps.record("ads", [Impression("i1", "u1", "a1")])
    assert (await sidecar.check("u1", Candidate("a1")))[0].allowed is False
    refund = Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", "a1")), hits_addend=-1),))
    await should_rate_limit(sidecar.limiter, refund)
    assert (await sidecar.check("u1", Candidate("a1")))[0].remaining == 1


async def test_hourly_counts_start_over_each_hour_and_the_month_keeps_them(
    sidecar: Sidecar, clock: Clock
) -> None:
    """A write in a later hour drops the ended hour's count and keeps the day's and month's;
    a sidecar whose clock runs an hour behind counts in the later hour, never loses a hit."""
    clock.now = MONTH_START + 10 * DAY + 100
    await sidecar.caps.record("ads", [Impression("i1", "u2", "a9")])
    clock.now += 3_600
    await sidecar.caps.record("ads", [Impression("i2", "u2", "a9")])
    clock.now -= 3_600  # behind
    await sidecar.caps.record("ads", [Impression("i3", "u2", "a9")])
    clock.now += 3_600
    envoy = Request("ads", (Descriptor((Entry("user", "u2"), Entry("ad", "a9")), hits_addend=0),))
    statuses = (await should_rate_limit(sidecar.limiter, envoy)).statuses
    assert statuses[0].limit_remaining == 0  # the month: 3 of 3


async def test_checks_of_new_ads_leave_the_collector_nothing_to_walk(
    sidecar: Sidecar, clock: Clock
) -> None:
    """What a check keeps for the next (each ad's caps, 1,000 ads here) is held in tuples of
    numbers and text, which the cycle collector stops tracking: its full collections walk no
    more objects after the checks than before, and the checks leave no cycle."""
    clock.now = MONTH_START + DAY
    await sidecar.check("u0", Candidate("a-warm", "c1"))
    gc.collect()
    tracked = len(gc.get_objects())
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for n in range(20):
            ads = [Candidate(f"a{n}-{k}", f"c{k % 3}") for k in range(50)]
            verdicts = await sidecar.check(f"u{n}", *ads)
            assert all(verdict.allowed for verdict in verdicts)
        del verdicts, ads
        gc.collect()
        assert gc.garbage == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert len(gc.get_objects()) - tracked < 100


PERSON_RULES = """
domain: ads
descriptors:
  - key: person
    identifiers: [user, device]
    group_counters: packed
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 2}
          - {unit: month, requests_per_unit: 3}
"""


async def test_a_persons_packed_caps_sum_its_identifiers(backend_url: str, clock: Clock) -> None:
    """Impressions recorded under a person's phone and under their login count together in a
    check naming both, day and month alike; another person's count is their own."""
    made = Sidecar(backend_url, clock, PERSON_RULES)
    try:
        clock.now = MONTH_START + 2 * DAY + 50
        await made.caps.record(
            "ads",
            [
                Impression("i1", "", "a1", identities=[("device", "d1")]),
                Impression("i2", "u1", "a1"),
            ],
        )
        both = [("user", "u1"), ("device", "d1")]
        (verdict,) = await made.caps.check("ads", "", [Candidate("a1")], identities=both)
        assert (verdict.allowed, verdict.remaining) == (False, 0)
        clock.now += DAY
        (verdict,) = await made.caps.check("ads", "", [Candidate("a1")], identities=both)
        assert (verdict.allowed, verdict.remaining) == (True, 1)  # the month: 2 of 3
        (other,) = await made.check("u2", Candidate("a1"))
        assert (other.allowed, other.remaining) == (True, 2)
    finally:
        await made.backend.close()
