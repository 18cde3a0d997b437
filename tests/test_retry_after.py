"""A refused hit's `duration_until_reset` is the least wait that works (issue 31, item 4): the
time until the same hit would be admitted, if nothing else is counted, for every algorithm.

Envoy 1.40's `enable_retry_after_header` turns the largest of them into `Retry-After`; the
sidecar rounds it up to whole seconds, so a client that waits `Retry-After` is admitted (see
tests/test_retry_after_envoy.py for the same through the real Envoy). Here: the property on the
pure decision, every algorithm and window kind of the parity tests, to the millisecond; then the
issue's cases on every backend (memory, Redis, Redis Cluster), as the contract suite runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.callbacks import should_rate_limit
from support.clock import Clock
from test_parity import BORROWING, BUCKETS, CALENDAR, PLAIN, SLIDING, STARTS

from sidecar.algorithms.decide import Address, State, decide
from sidecar.core import counters
from sidecar.core.keys import descriptor_prefix
from sidecar.decision.limiter import Limiter
from sidecar.model import (
    Algorithm,
    Code,
    Decision,
    Descriptor,
    Entry,
    Hit,
    Request,
    Role,
    Unit,
    Window,
)


def _never_admitted(window: Window, cost: int) -> bool:
    """Whether no wait admits a hit of `cost` on `window` (its reset then keeps its OK meaning)."""
    need = max(cost, 1)
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        return need > window.capacity + window.borrow
    return need > window.requests_per_unit + window.borrow


def _hit(window: Window, cost: int, now_ms: int) -> Hit:
    return counters.window_hit(descriptor_prefix("wait", [("d", "x")]), window, cost, 0,
                               Role.BLOCKING, now_ms)  # fmt: skip


def _over(values: dict[Address, State], window: Window, cost: int, now_ms: int) -> bool:
    """Whether the pure decision refuses a hit of `cost` at `now_ms`, changing nothing."""
    outcomes, _ = decide(values.get, [_hit(window, cost, now_ms)], now_ms, False, read_only=True)
    return outcomes[0].over


@st.composite
def _sequences(draw: st.DrawFn) -> tuple[Window, int, list[tuple[int, int]]]:
    """A window, a start, and requests of one hit as (ms after the previous one, cost), paced
    by the window's length as the parity tests pace theirs."""
    window = draw(st.one_of(*(st.sampled_from(f) for f in (PLAIN, BORROWING, SLIDING, BUCKETS,
                                                           CALENDAR))))  # fmt: skip
    length_ms = window.seconds * 1000
    start_ms = int(datetime.fromisoformat(draw(st.sampled_from(STARTS))).timestamp() * 1000)
    start_ms -= draw(st.integers(0, length_ms))
    after = st.integers(0, length_ms // draw(st.sampled_from([1, 4, 16, 64])))
    costs = st.sampled_from([0, 1, 1, 1, 2, 3, 9])
    steps = draw(st.lists(st.tuples(after, costs), min_size=1, max_size=30))
    return window, start_ms, steps


#: Found by hypothesis: a bucket whose credit is spent admits again only once full, and the
#: time until full, worked out in floats, was a millisecond past the instant the refill's own
#: floats make it full.
SPENT_CREDIT = (
    Window(3, Unit.HOUR, Algorithm.TOKEN_BUCKET, unit_multiplier=2, burst=1, borrow=2),
    1_781_526_896_789,
    [(0, 1), (1_908_966, 2), (0, 2)],
)


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=_sequences())
@example(sequence=SPENT_CREDIT)
def test_a_refused_hit_is_admitted_after_its_reset_and_not_a_millisecond_sooner(
    sequence: tuple[Window, int, list[tuple[int, int]]],
) -> None:
    """Every algorithm and window kind (plain, borrowing, sliding, buckets with burst and credit,
    calendar windows across DST changes): when a hit is refused with reset `r` ms, the same hit
    `r` ms later is admitted and `r - 1` ms later it is not, unless no wait could admit it."""
    window, now_ms, steps = sequence
    values: dict[Address, State] = {}
    for after_ms, cost in steps:
        now_ms += after_ms
        outcomes, writes = decide(values.get, [_hit(window, cost, now_ms)], now_ms, False)
        for write in writes:
            values[write.address] = write.state if write.state is not None else (
                values.get(write.address, 0) + write.amount  # type: ignore[operator]
            )  # fmt: skip
        (outcome,) = outcomes
        if not outcome.over or _never_admitted(window, cost):
            continue
        wait = outcome.reset_ms
        assert wait > 0
        assert not _over(values, window, cost, now_ms + wait), (window, cost, wait)
        assert _over(values, window, cost, now_ms + wait - 1), (window, cost, wait)


RULES = """
domain: wait
descriptors:
  - key: bucket
    rate_limit: {algorithm: token_bucket, unit: second, unit_multiplier: 10, requests_per_unit: 1,
                 burst: 2}
  - key: lender
    rate_limit: {algorithm: token_bucket, unit: second, unit_multiplier: 10, requests_per_unit: 1,
                 burst: 2, borrow: 1}
  - key: sliding
    rate_limit: {algorithm: sliding_window, unit: second, unit_multiplier: 10,
                 requests_per_unit: 2}
  - key: plain
    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2}
  - key: borrowing
    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2, borrow: 2}
  - key: several
    rate_limits:
      - {unit: second, unit_multiplier: 10, requests_per_unit: 1}
      - {algorithm: token_bucket, unit: second, unit_multiplier: 30, requests_per_unit: 1,
         burst: 1}
"""


async def _ask(limiter: Limiter, key: str, hits: int = 1) -> Decision:
    descriptor = Descriptor((Entry(key, "k"),), hits)
    return await should_rate_limit(limiter, Request("wait", (descriptor,), 0))


async def _refused_after(limiter: Limiter, clock: Clock, key: str, admitted: int) -> int:
    """Send `admitted` hits, which pass, then one more: its `duration_until_reset`."""
    for _ in range(admitted):
        assert (await _ask(limiter, key)).overall_code is Code.OK
    refused = await _ask(limiter, key)
    assert refused.overall_code is Code.OVER_LIMIT
    seconds = refused.statuses[0].duration_until_reset
    assert seconds is not None
    return seconds


async def _admitted_after(limiter: Limiter, clock: Clock, key: str, seconds: int) -> None:
    """Refused `seconds - 1` after now, admitted `seconds` after now (the clock ends there)."""
    start = clock.now
    clock.now = start + seconds - 1
    assert (await _ask(limiter, key)).overall_code is Code.OVER_LIMIT
    clock.now = start + seconds
    assert (await _ask(limiter, key)).overall_code is Code.OK


async def test_an_empty_bucket_waits_for_one_token_not_for_a_full_bucket(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """1 token per 10 s, burst 2 (the issue's case): emptied, it answers 10 s, the time to one
    token (it answered 20, the time until full); 2.5 s later, 8 (7.5 s, rounded up)."""
    limiter = make_limiter(RULES)
    assert await _refused_after(limiter, clock, "bucket", 2) == 10
    clock.now += 2.5
    assert await _refused_after(limiter, clock, "bucket", 0) == 8
    await _admitted_after(limiter, clock, "bucket", 8)


async def test_a_bucket_in_debt_waits_until_the_debt_is_repaid_and_a_token_refilled(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """1 per 10 s, burst 2, borrow 1: three hits pass (one on credit, a debt of 1); the credit
    spent, the fourth waits 20 s: 10 to repay the debt, 10 for a whole token."""
    limiter = make_limiter(RULES)
    assert await _refused_after(limiter, clock, "lender", 3) == 20
    await _admitted_after(limiter, clock, "lender", 20)


async def test_a_sliding_window_waits_until_enough_of_the_old_weight_has_slid_out(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """2 per 10 s, sliding: two hits 8.25 s into a window; the third waits 1.75 s to the window's
    end and 5 s more until half of those two has slid out of the estimate: 6.75 s, answered 7
    (the window's end, 2 s, was answered before, and a client retrying then was refused)."""
    limiter = make_limiter(RULES)
    clock.now = clock.now // 10 * 10 + 8.25
    assert await _refused_after(limiter, clock, "sliding", 2) == 7
    await _admitted_after(limiter, clock, "sliding", 7)


async def test_a_plain_window_waits_for_its_end(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """2 per 10 s, fixed: refused 3.5 s into the window, it waits 6.5 s, answered 7."""
    limiter = make_limiter(RULES)
    clock.now = clock.now // 10 * 10 + 3.5
    assert await _refused_after(limiter, clock, "plain", 2) == 7
    await _admitted_after(limiter, clock, "plain", 7)


async def test_a_borrowing_window_waits_until_the_borrowed_part_is_repaid(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """2 per 10 s, borrow 2: four hits pass 3.5 s into a window (two borrowed); the next window,
    in debt by two, admits nothing, so the fifth waits for its end: 16.5 s, answered 17."""
    limiter = make_limiter(RULES)
    clock.now = clock.now // 10 * 10 + 3.5
    assert await _refused_after(limiter, clock, "borrowing", 4) == 17
    await _admitted_after(limiter, clock, "borrowing", 17)


async def test_several_windows_report_the_longest_wait(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """1 per 10 s and a bucket of 1 per 30 s: the second hit is over both; the descriptor
    reports the bucket's 30 s, not the window's 10 (the first over)."""
    limiter = make_limiter(RULES)
    clock.now = clock.now // 30 * 30
    assert await _refused_after(limiter, clock, "several", 1) == 30
    await _admitted_after(limiter, clock, "several", 30)
