"""An operator's read and reset of one descriptor's counters (`sidecar.operator.counter_admin`), on every
backend and algorithm: the state agrees with what ShouldRateLimit answers a check, a reset
lifts the limit, and no descriptor value, however crafted, reaches another domain's counters."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.decision.limiter import Limiter
from sidecar.decision.plan import MAX_ENTRIES, MAX_VALUE_LENGTH
from sidecar.errors import InvalidRequest, UnknownDomain
from sidecar.model import Code, Descriptor, Entry, Request
from sidecar.operator import counter_admin

RULES = """\
domain: shop
descriptors:
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 3, name: per-minute}
  - key: borrowing
    rate_limit: {unit: hour, requests_per_unit: 3, borrow: 2}
  - key: sliding
    rate_limit: {algorithm: sliding_window, unit: minute, requests_per_unit: 3}
  - key: bucket
    rate_limit: {algorithm: token_bucket, unit: hour, requests_per_unit: 3, burst: 4}
  - key: several
    rate_limits:
      - {unit: minute, requests_per_unit: 5}
      - {unit: day, requests_per_unit: 3, calendar: true, timezone: Asia/Shanghai}
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: minute, requests_per_unit: 2}
          - {algorithm: token_bucket, unit: hour, requests_per_unit: 5, burst: 3}
  - key: member
    group_counters: packed
    descriptors:
      - key: ad
        rate_limits:
          - {unit: minute, requests_per_unit: 2}
          - {unit: hour, requests_per_unit: 4}
  - key: path
    value: /api/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: quiet
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
"""

#: Each limited descriptor, and how many hits of 1 pass before it refuses.
LIMITED = [
    ([("plain", "10.0.0.1")], 3),
    ([("borrowing", "a")], 5),
    ([("sliding", "a")], 3),
    ([("bucket", "a")], 4),
    ([("several", "a")], 3),
    ([("user", "u1"), ("ad", "7")], 2),
    ([("member", "m1"), ("ad", "7")], 2),
    ([("path", "/api/orders")], 2),
]


def entries(pairs: list[tuple[str, str]]) -> tuple[Entry, ...]:
    return tuple(Entry(k, v) for k, v in pairs)


async def hit(limiter: Limiter, pairs: list[tuple[str, str]], hits: int = 1) -> Code:
    request = Request("shop", (Descriptor(entries(pairs), hits_addend=hits),))
    return (await should_rate_limit(limiter, request)).overall_code


async def state(limiter: Limiter, clock: Clock, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    located = counter_admin.locate(limiter.rules, "shop", entries(pairs), int(clock() * 1000))
    return await counter_admin.state(limiter.backend, located)


async def reset(limiter: Limiter, clock: Clock, pairs: list[tuple[str, str]]) -> int:
    located = counter_admin.locate(limiter.rules, "shop", entries(pairs), int(clock() * 1000))
    return await counter_admin.reset(limiter.backend, located)


async def check(limiter: Limiter, pairs: list[tuple[str, str]]) -> tuple[Code, int, int | None]:
    """What ShouldRateLimit answers a check of the descriptor: code, remaining, reset."""
    request = Request("shop", (Descriptor(entries(pairs), hits_addend=0),))
    (status,) = (await should_rate_limit(limiter, request)).statuses
    return status.code, status.limit_remaining, status.duration_until_reset


@pytest.mark.parametrize(("pairs", "admitted"), LIMITED, ids=[p[0][0][0] for p in LIMITED])
async def test_the_state_is_what_a_check_is_answered_and_a_reset_lifts_the_limit(
    make_limiter: Callable[..., Limiter],
    clock: Clock,
    pairs: list[tuple[str, str]],
    admitted: int,
) -> None:
    """Once a descriptor is refused, its state says OVER_LIMIT with the very remaining and
    reset a check gets from ShouldRateLimit, each window's count and limit; a reset deletes its
    counters, after which the state is back to the full limit and a hit is admitted."""
    limiter = make_limiter(RULES)
    for _ in range(admitted):
        assert await hit(limiter, pairs) is Code.OK
        clock.now += 0.001
    assert await hit(limiter, pairs) is Code.OVER_LIMIT

    refused = await state(limiter, clock, pairs)
    code, remaining, until = await check(limiter, pairs)
    assert (refused["code"], refused["limit_remaining"], refused["duration_until_reset"]) == (
        code.name,
        remaining,
        until,
    )
    assert refused["code"] == "OVER_LIMIT"
    assert any(window["over"] for window in refused["windows"]), refused

    assert await reset(limiter, clock, pairs) >= 1
    lifted = await state(limiter, clock, pairs)
    code, remaining, until = await check(limiter, pairs)
    assert (lifted["code"], lifted["limit_remaining"], lifted["duration_until_reset"]) == (
        "OK",
        remaining,
        until,
    )
    assert code is Code.OK
    for window in lifted["windows"]:
        assert window.get("count", 0) == 0
        assert window.get("previous", 0) == 0
    assert await hit(limiter, pairs) is Code.OK


async def test_a_window_reports_its_count_limit_remaining_and_reset(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """A plain minute window at 2 of 3, 5 s into its minute: count 2, remaining 1, reset in
    55 s at the minute's end, and the rule that applies by its key and name."""
    limiter = make_limiter(RULES)
    pairs = [("plain", "10.0.0.1")]
    await hit(limiter, pairs)
    await hit(limiter, pairs)
    answer = await state(limiter, clock, pairs)
    assert answer["rule"]["key"] == "shop.plain"
    assert answer["rule"]["name"] == "per-minute"
    (window,) = answer["windows"]
    assert (window["count"], window["requests_per_unit"], window["limit_remaining"]) == (2, 3, 1)
    assert window["duration_until_reset"] == 55
    assert answer["code"] == "OK"


async def test_a_token_bucket_reports_its_tokens_and_a_reset_fills_it(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """A bucket of 4 refilled 3 an hour, emptied at once, holds 0 tokens; reset, it is full."""
    limiter = make_limiter(RULES)
    pairs = [("bucket", "b")]
    assert await hit(limiter, pairs, hits=4) is Code.OK
    (window,) = (await state(limiter, clock, pairs))["windows"]
    assert window["tokens"] == 0
    assert await reset(limiter, clock, pairs) == 1
    (window,) = (await state(limiter, clock, pairs))["windows"]
    assert window["tokens"] == 4


async def test_a_shared_counter_is_named_by_its_pattern_and_reset_for_every_value(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """Under share_threshold every value of the pattern shares one counter: the state says it
    is counted as the pattern, and resetting through one value lifts it for another."""
    limiter = make_limiter(RULES)
    await hit(limiter, [("path", "/api/a")], hits=2)
    assert await hit(limiter, [("path", "/api/b")]) is Code.OVER_LIMIT
    answer = await state(limiter, clock, [("path", "/api/c")])
    assert answer["counted_as"] == [{"key": "path", "value": "/api/*"}]
    await reset(limiter, clock, [("path", "/api/c")])
    assert await hit(limiter, [("path", "/api/b")]) is Code.OK


async def test_windows_sharing_a_packed_field_report_their_own_counts(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """A minute and an hour in one field (`group_counters: packed`): after 2 hits and a minute,
    the minute's count is 0 and the hour's 2."""
    limiter = make_limiter(RULES)
    pairs = [("member", "m1"), ("ad", "7")]
    await hit(limiter, pairs, hits=2)
    clock.now += 60
    minute, hour = (await state(limiter, clock, pairs))["windows"]
    assert (minute["count"], hour["count"]) == (0, 2)


async def test_a_reset_leaves_the_other_descriptors_of_a_grouped_hash(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """Grouped counters share their first entry's hash: resetting (user u1, ad 7) deletes its
    fields only, and (user u1, ad 8) keeps its count."""
    limiter = make_limiter(RULES)
    await hit(limiter, [("user", "u1"), ("ad", "7")], hits=2)
    await hit(limiter, [("user", "u1"), ("ad", "8")], hits=2)
    await reset(limiter, clock, [("user", "u1"), ("ad", "7")])
    kept = await state(limiter, clock, [("user", "u1"), ("ad", "8")])
    assert kept["code"] == "OVER_LIMIT"
    assert kept["windows"][0]["count"] == 2
    assert (await state(limiter, clock, [("user", "u1"), ("ad", "7")]))["code"] == "OK"


async def test_shadow_unlimited_and_unmatched_descriptors_say_so(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """A shadow rule over its limit is answered OK but reported as over; an unlimited rule
    has no window; a descriptor no rule matches has no rule."""
    limiter = make_limiter(RULES)
    await hit(limiter, [("quiet", "q")], hits=2)
    shadow = await state(limiter, clock, [("quiet", "q")])
    assert (shadow["code"], shadow["would_be_over"], shadow["rule"]["shadow_mode"]) == (
        "OK",
        True,
        True,
    )
    free = await state(limiter, clock, [("free", "f")])
    assert (free["code"], free["windows"], free["rule"]["unlimited"]) == ("OK", [], True)
    none = await state(limiter, clock, [("nothing", "n")])
    assert (none["code"], none["windows"], none["rule"]) == ("OK", [], None)


TWO_DOMAINS = """\
domain: "{name}"
descriptors:
  - key: k
    rate_limit: {{unit: minute, requests_per_unit: 1}}
  - key: b
    rate_limit: {{unit: minute, requests_per_unit: 1}}
    descriptors:
      - key: k
        rate_limit: {{unit: minute, requests_per_unit: 1}}
"""

#: Entries sent to domain `a` that try to name domain `a|b`'s counter of (k, v) through the
#: characters of the key layout (`rl{a|b|k|v}|60|...` unescaped): braces, separators, escapes.
CRAFTED = [
    [("b", "k|v")],
    [("b", "k|v}|60")],
    [("k", "v")],
    [("k", "v}")],
    [("k", "}|b|k|v")],
    [("k", "v}|60")],
    [("b", "k"), ("k", "v")],
    [("b}", "k"), ("k", "v")],
    [("k", "%7D")],
    [("k", "*")],
    [("k", "rl{b|k|v}")],
    [("k|b|k", "v")],
]


async def test_no_crafted_descriptor_reaches_another_domains_counters(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """Domain a|b's counter of (k, v) is over its limit; resets in domain a of every descriptor
    built from the key layout's characters (a|b's counter would be `rl{a|b|k|v}|...` were
    values not escaped, as (b, k|v) of domain a would) delete nothing of it, nor do domains
    named after it (refused as unknown): its descriptor is still refused, its count unchanged."""
    limiter = make_limiter(TWO_DOMAINS.format(name="a"))
    other = make_limiter(TWO_DOMAINS.format(name="a|b"))
    limiter.rules.domains.update(other.rules.domains)
    victim = Request("a|b", (Descriptor((Entry("k", "v"),)),))
    for _ in range(3):
        await should_rate_limit(limiter, victim)
    now_ms = int(clock() * 1000)
    before = await counter_admin.state(
        limiter.backend, counter_admin.locate(limiter.rules, "a|b", [Entry("k", "v")], now_ms)
    )
    assert before["windows"][0]["count"] == 3

    for pairs in CRAFTED:
        located = counter_admin.locate(limiter.rules, "a", entries(pairs), now_ms)
        await counter_admin.reset(limiter.backend, located)
    for name in ("a|b}", "a|b|k|v", "a|b|k", "rl{a|b", "*", "b"):
        with pytest.raises(UnknownDomain):
            counter_admin.locate(limiter.rules, name, [Entry("k", "v")], now_ms)

    after = await counter_admin.state(
        limiter.backend, counter_admin.locate(limiter.rules, "a|b", [Entry("k", "v")], now_ms)
    )
    assert after["windows"][0]["count"] == 3
    assert (await should_rate_limit(limiter, victim)).overall_code is Code.OVER_LIMIT


@pytest.mark.parametrize(
    ("domain", "pairs", "reason"),
    [
        ("", [("k", "v")], "rate limit domain must not be empty"),
        ("shop", [("k", "v")] * (MAX_ENTRIES + 1), "descriptors[0] has 33 entries (at most 32)"),
        ("shop", [("k", "v" * (MAX_VALUE_LENGTH + 1))], "descriptors[0]: entry too long"),
    ],
)
def test_a_descriptor_the_service_would_refuse_is_refused_with_its_reason(
    domain: str, pairs: list[tuple[str, str]], reason: str
) -> None:
    """The decision path's bounds hold here too, with the same reasons."""
    from sidecar.core import config
    from sidecar.core.rules import Rules

    shop = config.parse(RULES, "rules.yaml")
    with pytest.raises(InvalidRequest, match=re.escape(reason)):
        counter_admin.locate(Rules({"shop": shop}), domain, entries(pairs), 0)


PER_SECOND = """\
domain: shop
descriptors:
  - key: burst
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: slow
    rate_limit: {unit: minute, requests_per_unit: 2}
"""


@pytest.mark.redis
async def test_a_per_second_store_is_read_and_reset_where_the_decision_path_keeps_them(
    redis_url: str, clock: Clock
) -> None:
    """With `--backend-per-second`, a descriptor whose windows are all in seconds is counted on
    the second store: its state is read there (OVER_LIMIT), and its reset deletes it there; a
    minute descriptor's stays on the main store."""
    from sidecar.core import config
    from sidecar.core.rules import Rules
    from sidecar.storage.backends import open_backend
    from sidecar.storage.per_second import PerSecond

    backend = PerSecond(
        open_backend(redis_url, timeout_ms=1000), open_backend(redis_url + "/1", timeout_ms=1000)
    )
    shop = config.parse(PER_SECOND, "rules.yaml")
    limiter = Limiter(Rules({"shop": shop}), backend, clock=clock)
    try:
        for pairs in ([("burst", "a")], [("slow", "a")]):
            await hit(limiter, pairs, hits=3)
            assert (await state(limiter, clock, pairs))["code"] == "OVER_LIMIT"
            assert await reset(limiter, clock, pairs) == 1
            assert (await state(limiter, clock, pairs))["code"] == "OK"
            assert await hit(limiter, pairs) is Code.OK
    finally:
        await backend.close()
