"""Token buckets that may borrow: a steady refill, a burst capacity, and an optional credit line.

A bucket holds up to `capacity` tokens (`burst`, default `requests_per_unit`) and refills
continuously at `requests_per_unit` tokens per window (`unit` × `unit_multiplier`).
A hit of cost `c` is admitted when the bucket holds `c` tokens, or when the missing tokens fit in
the credit still available: between two moments the bucket is full, it may lend at most `borrow`
tokens in all. Lending drives the balance below zero (a debt); refills repay the debt before any
token can be spent again, and the credit line reopens only once the bucket is full again.

So with 10/second, burst 20 and borrow 5: 25 hits at once are admitted (20 tokens and 5 on
credit), the 26th is not; 0.5 s later the debt is repaid but the balance is 0 and the credit is
spent, so nothing is admitted until the first whole token at 0.6 s; after 2.5 s idle the bucket
is full and may lend 5 again.

A cost above `capacity + borrow` is never admitted. A check (cost 0) asks whether one more hit
would be, and changes nothing. A rejected hit never consumes (a bucket that charged rejections
would never refill for a client that keeps knocking).
`limit_remaining` is the whole tokens available now (0 while in debt). `duration_until_reset`,
on OK, is the time until the bucket is full again, debt included; on OVER_LIMIT it is the time
until this hit (its cost, or one hit for a check) would be admitted, if nothing else takes
tokens: until enough tokens have refilled (the debt repaid first) for the cost to fit in them and
what is left of the credit line, or, when the credit drawn is past the line (forced hits) or the
cost needs more than the line can ever lend before the bucket is full, until it is full. A cost
above `capacity + borrow`, which no wait admits, reports the time until full. The state is kept
until full: a full bucket and no state are the same thing. `lua/decide.lua` mirrors this arithmetic operation for
operation, so Redis and memory agree to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket's state at `stamp_ms`: its balance (negative in debt) and the credit drawn since it
    was last full."""

    tokens: float
    stamp_ms: int
    drawn: float


@dataclass(frozen=True, slots=True)
class Taken:
    over: bool
    remaining: int
    reset_ms: int
    state: Bucket  # the bucket after the hit (unchanged when over, or for a check)


def refill(state: Bucket | None, now_ms: int, rate: int, period_ms: int, capacity: int) -> Bucket:
    """The bucket at `now_ms`: refilled since its stamp, credit reopened if it is full again.

    No state means a full bucket. The float expressions are written as the Lua script computes
    them (`float * int / int`), so both round alike.
    """
    if state is None:
        return Bucket(float(capacity), now_ms, 0.0)
    elapsed = max(0, now_ms - state.stamp_ms)
    if elapsed >= reset_ms(state.tokens, rate, period_ms, capacity):
        # Full from its reset time on, exactly as if its state had expired then: the refill
        # below can round to a hair under capacity (6.999999999999999 of 7) at that instant.
        return Bucket(float(capacity), now_ms, 0.0)
    tokens = min(float(capacity), state.tokens + float(elapsed) * rate / period_ms)
    drawn = 0.0 if tokens >= capacity else state.drawn
    return Bucket(tokens, now_ms, drawn)


def reset_ms(tokens: float, rate: int, period_ms: int, capacity: int) -> int:
    """Milliseconds until a bucket holding `tokens` is full again."""
    return math.ceil((capacity - tokens) * period_ms / rate)


def take(
    bucket: Bucket,
    cost: int,
    rate: int,
    period_ms: int,
    capacity: int,
    borrow: int,
    force: bool = False,
) -> Taken:
    """Take `cost` tokens from a refilled bucket, on credit where allowed (cost 0: a check).

    `force` takes them even when over (a recorded impression is a fact): the balance may then
    fall below the credit line, and refills repay it before anything is admitted again.
    """
    need = cost if cost > 0 else 1
    tokens = bucket.tokens
    credit = max(0.0, need - max(tokens, 0.0))
    over = bucket.drawn + credit > borrow
    if (force or not over) and cost > 0:
        tokens = tokens - cost
        bucket = Bucket(tokens, bucket.stamp_ms, bucket.drawn + credit)
    return Taken(
        over, max(0, math.floor(tokens)), reset_ms(tokens, rate, period_ms, capacity), bucket
    )


def admits(bucket: Bucket, need: int, borrow: int) -> bool:
    """Whether a refilled `bucket` admits `need` tokens (`take`'s test)."""
    return not bucket.drawn + max(0.0, need - max(bucket.tokens, 0.0)) > borrow


def wait_ms(
    state: Bucket | None,
    bucket: Bucket,
    cost: int,
    rate: int,
    period_ms: int,
    capacity: int,
    borrow: int,
) -> int:
    """Milliseconds from `bucket.stamp_ms` until a hit of `cost` that `bucket` refuses would be
    admitted (see the module), if nothing else takes tokens. `state` is the stored state that
    `bucket` was refilled from (None: a full bucket), which the next request refills from too.

    The time worked out in floats can miss the refill's own rounding by a millisecond either way;
    it is moved until it is the first millisecond at which `refill` and `admits` admit the hit,
    so a client that waits it is admitted and one a millisecond earlier is not. The moves are
    bounded: forward by the time until full, where `refill` admits by its own branch, backward
    by 0; a hit admitted only once the bucket is full again (its credit spent, or asking more
    than a full bucket and its credit cover together) waits the time until full, moved back by
    at most two milliseconds.
    """
    need = cost if cost > 0 else 1
    now_ms = bucket.stamp_ms
    full = reset_ms(bucket.tokens, rate, period_ms, capacity)
    if state is not None:
        full = max(0, state.stamp_ms + reset_ms(state.tokens, rate, period_ms, capacity) - now_ms)
    target = need - (borrow - bucket.drawn)
    if state is None:
        return full
    wait, least = full, 0
    if bucket.drawn > borrow or target >= capacity or need > capacity + borrow:
        # Admitted once full, or never: `full` itself can be a millisecond past the instant
        # `refill`'s floats make the bucket full, so two steps back at most.
        least = max(0, full - 2)
    else:
        wait = min(full, max(0, math.ceil((target - bucket.tokens) * period_ms / rate)))
        while wait < full and not admits(
            refill(state, now_ms + wait, rate, period_ms, capacity), need, borrow
        ):
            wait += 1
    while wait > least and admits(
        refill(state, now_ms + wait - 1, rate, period_ms, capacity), need, borrow
    ):
        wait -= 1
    return wait
