"""Refunds: hits given back to a counter (Envoy's `is_negative_hits`, a `Hit` with `hits < 0`).

Envoy sends one when a request it counted is over (with `apply_on_stream_done`, when its stream
ends), so that a route can limit what is in flight rather than what has started. A refund is
never over a limit: it is answered OK with the counter's status after it, and it changes the
counter in the same script call as the request's charges.

- Fixed window (plain or borrowing) and sliding window: the current window's counter goes down
  by the refund, floored at 0. A counter that does not exist stays missing (no key is written),
  and one that comes to 0 is deleted (0 and no counter are the same thing). A borrowing window's
  debt, carried from the previous window, stays: the refund gives back what this window counted.
  A sliding window's previous window is not touched: what it holds has started to slide out.
- Token bucket: the tokens come back, up to the bucket's capacity (its `burst`); a debt is repaid
  first. A bucket with no state is full, and stays so; one that comes back full loses its state,
  and its credit line reopens, as when it refills.

A refund's window is the one current when it arrives: a request counted in one window and
refunded in the next gives back to the next one (the reference does the same), which the
window's end would have cleared anyway. `lua/decide.lua` mirrors this arithmetic operation for
operation.
"""

from __future__ import annotations

import math

from sidecar.algorithms import token_bucket
from sidecar.algorithms.token_bucket import Bucket


def counter(current: int, refund: int) -> int:
    """A window's counter at `current` after `refund` hits are given back: floored at 0."""
    left = current - refund
    return left if left > 0 else 0


def bucket(state: Bucket, refund: int, rate: int, period_ms: int, capacity: int) -> Bucket:
    """A refilled bucket after `refund` tokens come back: at most `capacity`, and its drawn credit
    forgotten once full (as `token_bucket.refill` does)."""
    tokens = min(float(capacity), state.tokens + refund)
    drawn = 0.0 if tokens >= capacity else state.drawn
    return Bucket(tokens, state.stamp_ms, drawn)


def bucket_answer(state: Bucket, rate: int, period_ms: int, capacity: int) -> tuple[int, int]:
    """(remaining, reset ms) of a bucket after a refund: its whole tokens, and the time until full."""
    tokens = state.tokens
    return max(0, math.floor(tokens)), token_bucket.reset_ms(tokens, rate, period_ms, capacity)
