"""Beyond fixed windows, on every backend: borrowing windows and token buckets, sliding windows,
several windows per descriptor, and calendar windows in a time zone (issue 3's acceptance)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.model import Code, Decision, Descriptor, Entry, Request, Unit
from sidecar.storage.memory import MemoryBackend

RULES = """
domain: algo
descriptors:
  - key: app
    rate_limit: {unit: hour, requests_per_unit: 1000, borrow: 300}
  - key: api_key
    rate_limit:
      algorithm: token_bucket
      unit: second
      requests_per_unit: 10
      burst: 20
      borrow: 5
  - key: plain_bucket
    rate_limit: {algorithm: token_bucket, unit: minute, requests_per_unit: 6}
  - key: ip
    rate_limit: {algorithm: sliding_window, unit: hour, requests_per_unit: 100}
  - key: five_minutes
    rate_limit: {algorithm: sliding_window, unit: minute, unit_multiplier: 5, requests_per_unit: 10}
  - key: user
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 5, calendar: true, timezone: Asia/Shanghai, name: daily}
          - {unit: month, requests_per_unit: 20, calendar: true, timezone: Asia/Shanghai, name: monthly}
  - key: mixed
    rate_limits:
      - {unit: minute, requests_per_unit: 3}
      - {algorithm: token_bucket, unit: second, requests_per_unit: 1, burst: 2}
  - key: week
    rate_limit: {unit: week, requests_per_unit: 1, calendar: true, timezone: UTC, week_start: sunday}
"""

SHANGHAI = ZoneInfo("Asia/Shanghai")
HOUR = 3600.0


def at(*fields: int, zone: ZoneInfo = SHANGHAI) -> float:
    return datetime(*fields, tzinfo=zone).timestamp()  # type: ignore[misc]


def d(*pairs: str, hits: int | None = None) -> Descriptor:
    return Descriptor(tuple(Entry(*p.split("=", 1)) for p in pairs), hits)


async def ask(limiter: Limiter, *descriptors: Descriptor, hits: int = 0) -> Decision:
    return await should_rate_limit(limiter, Request("algo", descriptors, hits))


async def admitted(limiter: Limiter, descriptor: Descriptor, tries: int) -> int:
    """How many of `tries` single hits are admitted."""
    count = 0
    for _ in range(tries):
        count += (await ask(limiter, descriptor)).overall_code is Code.OK
    return count


async def test_borrowing_window_repays_its_debt_in_the_next_window(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """1000/hour with borrow 300: hour 1 admits 1,300 (the 1,301st is rejected), hour 2 starts in
    debt and admits exactly 700 without borrowing, hour 3 admits up to 1,300 again."""
    limiter = make_limiter(RULES)
    clock.now = (clock.now // HOUR) * HOUR + 10
    for _ in range(13):
        assert (await ask(limiter, d("app=a1", hits=100))).overall_code is Code.OK
    first = await ask(limiter, d("app=a1"))
    assert first.overall_code is Code.OVER_LIMIT
    assert first.statuses[0].limit_remaining == 0

    clock.now += HOUR
    status = (await ask(limiter, d("app=a1", hits=0))).statuses[0]
    assert (status.code, status.limit_remaining) == (Code.OK, 700)
    for _ in range(6):
        assert (await ask(limiter, d("app=a1", hits=100))).overall_code is Code.OK
    assert await admitted(limiter, d("app=a1"), 101) == 100

    clock.now += HOUR
    for _ in range(13):
        assert (await ask(limiter, d("app=a1", hits=100))).overall_code is Code.OK
    assert (await ask(limiter, d("app=a1"))).overall_code is Code.OVER_LIMIT


async def test_token_bucket_lends_then_repays(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """10/second, burst 20, borrow 5: 25 hits at once pass and the 26th does not; at +0.5 s the
    debt is repaid but nothing is admitted (the credit is spent); at +0.6 s one whole token is."""
    limiter = make_limiter(RULES)
    start = clock.now
    assert await admitted(limiter, d("api_key=k"), 26) == 25
    status = (await ask(limiter, d("api_key=k", hits=0))).statuses[0]
    assert (status.code, status.limit_remaining, status.duration_until_reset) == (
        Code.OVER_LIMIT,
        0,
        1,  # refused: 0.6 s until a whole token (the debt of 5 repaid first), rounded up
    )
    clock.now = start + 0.25
    assert await admitted(limiter, d("api_key=k"), 1) == 0
    clock.now = start + 0.5
    assert await admitted(limiter, d("api_key=k"), 1) == 0
    clock.now = start + 0.6
    assert await admitted(limiter, d("api_key=k"), 2) == 1


async def test_token_bucket_refills_and_never_charges_rejections(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """6/minute: 6 at once, then one token every 10 s; knocking while empty costs nothing."""
    limiter = make_limiter(RULES)
    start = clock.now
    assert await admitted(limiter, d("plain_bucket=p"), 10) == 6
    clock.now = start + 9.9
    assert await admitted(limiter, d("plain_bucket=p"), 5) == 0
    clock.now = start + 10
    assert await admitted(limiter, d("plain_bucket=p"), 3) == 1
    clock.now = start + 70
    status = (await ask(limiter, d("plain_bucket=p", hits=0))).statuses[0]
    assert (status.code, status.limit_remaining, status.duration_until_reset) == (Code.OK, 6, 0)
    big = await ask(limiter, d("plain_bucket=p", hits=7))
    assert big.overall_code is Code.OVER_LIMIT  # a cost above capacity is never admitted
    assert (await ask(limiter, d("plain_bucket=p", hits=6))).overall_code is Code.OK


async def test_sliding_window_closes_the_boundary_gap(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """100/hour sliding: 100 hits at minute 59, then 100 at minute 61: the second burst is
    almost all rejected (a fixed window would admit all 200); the weighted estimate admits one."""
    limiter = make_limiter(RULES)
    hour = (clock.now // HOUR) * HOUR
    clock.now = hour + 59 * 60
    assert await admitted(limiter, d("ip=1.2.3.4"), 100) == 100
    clock.now = hour + 61 * 60
    assert await admitted(limiter, d("ip=1.2.3.4"), 100) == 1
    # Two hours on, the old hits have slid out completely.
    clock.now = hour + 181 * 60
    assert await admitted(limiter, d("ip=1.2.3.4"), 100) == 100


async def test_sliding_window_of_several_units(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """unit_multiplier: a 5-minute sliding window of 10. Full one minute in, a refused hit
    waits 240 s for the window's end, then 30 s more until a tenth of its 10 hits has slid out
    of the estimate; a hit 1 s earlier is still refused."""
    limiter = make_limiter(RULES)
    start = clock.now = (clock.now // 300) * 300 + 60
    assert await admitted(limiter, d("five_minutes=x"), 12) == 10
    status = (await ask(limiter, d("five_minutes=x", hits=0))).statuses[0]
    assert status.duration_until_reset == 270
    assert status.limit is not None and status.limit.unit is Unit.MINUTE
    clock.now = start + 269
    assert await admitted(limiter, d("five_minutes=x"), 1) == 0
    clock.now = start + 270
    assert await admitted(limiter, d("five_minutes=x"), 2) == 1


async def test_calendar_day_and_month_in_shanghai(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """5 a day and 20 a month, calendar, Asia/Shanghai: the 6th hit of a local day is rejected;
    23:59:59 and 00:00:01 local fall in different days; the 21st hit of the month is rejected
    although no day passed 5; the day's reset is the time to the next local midnight."""
    limiter = make_limiter(RULES)
    ad = d("user=u1", "ad=a1")
    clock.now = at(2026, 11, 1, 9, 0, 0)
    assert await admitted(limiter, ad, 6) == 5
    status = (await ask(limiter, d("user=u1", "ad=a1", hits=0))).statuses[0]
    assert status.duration_until_reset == 15 * 3600  # 09:00 to midnight, Shanghai time
    assert status.window is not None and status.window.name == "daily"

    clock.now = at(2026, 11, 2, 23, 59, 59)
    assert await admitted(limiter, ad, 6) == 5
    clock.now = at(2026, 11, 3, 0, 0, 1)
    assert await admitted(limiter, ad, 1) == 1  # a new local day, two seconds later

    # Another user: 5 on each of four days is 20 this month, and no day went over.
    other = d("user=u2", "ad=a1")
    for day in (1, 2, 3, 4):
        clock.now = at(2026, 11, day, 12, 0, 0)
        assert await admitted(limiter, other, 5) == 5
    clock.now = at(2026, 11, 5, 12, 0, 0)
    decision = await ask(limiter, other)
    assert decision.overall_code is Code.OVER_LIMIT
    status = decision.statuses[0]
    assert status.window is not None and status.window.name == "monthly"
    assert status.duration_until_reset == round(at(2026, 12, 1, 0, 0, 0) - clock.now)
    clock.now = at(2026, 12, 1, 0, 0, 0)
    assert await admitted(limiter, other, 1) == 1


async def test_several_windows_report_the_most_restrictive(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """rate_limits: a minute window and a bucket; the status names the window that binds, and a
    hit the bucket refuses is not charged to the bucket."""
    limiter = make_limiter(RULES)
    first = (await ask(limiter, d("mixed=m"))).statuses[0]
    assert first.window is not None and first.window.unit is Unit.SECOND  # bucket: 1 left
    assert first.limit_remaining == 1
    assert await admitted(limiter, d("mixed=m"), 3) == 1  # the bucket (burst 2) binds
    # The minute window counted the two refused hits (a plain window counts every hit): it is
    # full, and now it binds, while the bucket (never charged for refusals) has refilled.
    clock.now += 1
    second = (await ask(limiter, d("mixed=m"))).statuses[0]
    assert second.code is Code.OVER_LIMIT
    assert second.window is not None and second.window.unit is Unit.MINUTE
    clock.now += 60
    assert await admitted(limiter, d("mixed=m"), 3) == 2  # a full bucket of 2 again


async def test_checks_consume_nothing_on_any_algorithm(
    make_limiter: Callable[..., Limiter],
) -> None:
    """A per-descriptor hits_addend of 0 asks about one more hit and changes no counter."""
    limiter = make_limiter(RULES)
    for key in ("app=c", "api_key=c", "ip=c", "five_minutes=c", "mixed=c"):
        for _ in range(3):
            decision = await ask(limiter, d(key, hits=0))
            assert decision.overall_code is Code.OK
        fresh = (await ask(limiter, d(key.replace("=c", "=fresh"), hits=0))).statuses[0]
        assert decision.statuses[0].limit_remaining == fresh.limit_remaining


async def test_skip_makes_the_request_all_or_nothing_across_algorithms(
    make_limiter: Callable[..., Limiter],
) -> None:
    """--rejected-hits skip: a request refused by one window consumes nothing from any window."""
    limiter = make_limiter(RULES, rejected_hits="skip")
    assert await admitted(limiter, d("plain_bucket=s"), 6) == 6
    refused = await ask(limiter, d("app=s"), d("ip=s"), d("plain_bucket=s"))
    assert refused.overall_code is Code.OVER_LIMIT
    assert refused.statuses[0].limit_remaining == 1300
    assert refused.statuses[1].limit_remaining == 100
    assert (await ask(limiter, d("app=s", hits=0))).statuses[0].limit_remaining == 1300


async def test_calendar_week_starts_on_the_configured_day(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """A calendar week with week_start sunday resets at midnight between Saturday and Sunday."""
    limiter = make_limiter(RULES)
    utc = ZoneInfo("UTC")
    clock.now = at(2026, 11, 21, 23, 0, 0, zone=utc)  # a Saturday
    assert await admitted(limiter, d("week=w"), 2) == 1
    clock.now = at(2026, 11, 22, 0, 0, 0, zone=utc)  # Sunday: a new week
    assert await admitted(limiter, d("week=w"), 2) == 1


MONTHLY = """
domain: algo
descriptors:
  - key: plan
    rate_limit: {unit: month, requests_per_unit: 2}
"""
UTC = ZoneInfo("UTC")


@pytest.mark.parametrize("calendar_months", [True, False], ids=["calendar", "30-days"])
async def test_a_month_is_the_calendar_month_only_with_calendar_months(
    calendar_months: bool,
) -> None:
    """`unit: month`, 2 a month, on the memory backend: with calendar_months (the reference's
    USE_CALENDAR_MONTH_RATE_LIMIT) the month filled on 10 November resets at 1 December 00:00
    UTC, and its reset says so; without, it is the reference's 30-day block from the epoch,
    which runs to 3 December 00:00 UTC, and refuses until then."""
    domain = config.parse(MONTHLY, "rules.yaml", calendar_months=calendar_months)
    clock = Clock(at(2026, 11, 10, 12, 0, 0, zone=UTC))
    limiter = Limiter(
        Rules({domain.name: domain}), MemoryBackend(), settings=Settings(), clock=clock
    )
    plan = d("plan=p")
    assert await admitted(limiter, plan, 2) == 2
    refused = (await ask(limiter, plan)).statuses[0]
    resets = at(2026, 12, 1, zone=UTC) if calendar_months else at(2026, 12, 3, zone=UTC)
    assert (refused.code, refused.duration_until_reset) == (
        Code.OVER_LIMIT,
        round(resets - clock.now),
    )

    clock.now = at(2026, 11, 30, 23, 59, 59, zone=UTC)
    assert await admitted(limiter, plan, 1) == 0
    clock.now = at(2026, 12, 1, zone=UTC)
    if not calendar_months:
        assert await admitted(limiter, plan, 1) == 0
        clock.now = at(2026, 12, 2, 23, 59, 59, zone=UTC)
        assert await admitted(limiter, plan, 1) == 0
        clock.now = at(2026, 12, 3, zone=UTC)
    assert await admitted(limiter, plan, 3) == 2
