"""Sliding windows, by the weighted previous/current counter.

Sliding window (`algorithm: sliding_window`): each window of `W` seconds (epoch-aligned, `unit` ×
`unit_multiplier`) keeps one counter. At a point `e` seconds into the current window the number
of hits in the last `W` seconds is estimated as ``previous × (W − e) / W + current``: the previous
window's hits are assumed to be spread evenly. A hit of cost `c` is admitted when
``estimate + c <= limit``; a check asks whether one more hit would be.
Error: none when the previous window's hits were spread evenly. In the worst case, where all of
them came at its very end, the true count over the last `W` seconds can exceed the limit by up to
``previous × e / W`` (less than one limit's worth); bursts at the start of the previous window are
over-counted instead, rejecting early. Over a boundary it always does far better than a fixed
window (100/hour: 100 hits at minute 59 leave only one or two hits for minute 61, not 100).
`limit_remaining` is ``floor(limit − estimate)`` after this hit. `duration_until_reset`, on OK,
is the time until the current window ends and its count starts to slide out; on OVER_LIMIT it is
the time until this hit (its cost, or one hit for a check) would be admitted, if nothing else is
counted: until enough of the previous window's weight has slid out for the cost to fit, or, when
the current window's count leaves no room for it, into the next window until enough of the
current one's has (both as the estimate weighs them, to the millisecond). A cost above the limit,
which no wait admits, reports the time until the current window ends. Counters live two windows.

A sliding window never counts a rejected hit. `lua/decide.lua` mirrors this arithmetic.
"""

from __future__ import annotations

import math


def judge(
    previous: int, current: int, elapsed_ms: int, window_ms: int, cost: int, limit: int
) -> tuple[bool, int, int]:
    """(over, remaining if not applied, remaining if applied) for a hit `elapsed_ms` into the window.

    `float(previous) * ...` rounds as the Lua script's doubles do.
    """
    estimate = float(previous) * (window_ms - elapsed_ms) / window_ms + current
    need = cost if cost > 0 else 1
    over = estimate + need > limit
    return over, max(0, math.floor(limit - estimate)), max(0, math.floor(limit - estimate - cost))


def over_at(
    previous: int, current: int, elapsed_ms: int, window_ms: int, need: int, limit: int
) -> bool:
    """Whether `judge` refuses `need` hits `elapsed_ms` after the current window's start, which
    may be past its end (then `current` is the previous window's count, and nothing is new)."""
    if elapsed_ms < window_ms:
        estimate = float(previous) * (window_ms - elapsed_ms) / window_ms + current
    else:
        estimate = float(current) * (2 * window_ms - elapsed_ms) / window_ms
    return estimate + need > limit


def wait_ms(
    previous: int, current: int, elapsed_ms: int, window_ms: int, cost: int, limit: int
) -> int:
    """Milliseconds until a hit of `cost` that `judge` refuses `elapsed_ms` into the window would
    be admitted (see the module), if nothing else is counted.

    The time worked out in floats is moved by a millisecond until it is the first one at which
    `judge`'s own expression admits the hit (a client that waits it is admitted, one a
    millisecond earlier is not). The estimate only falls with time, so the moves are bounded:
    forward by the next window's end, where it is 0, backward by 1 ms (the hit is refused now)."""
    need = cost if cost > 0 else 1
    if need > limit:
        return window_ms - elapsed_ms
    if current + need <= limit:
        at = window_ms - (limit - current - need) * window_ms / previous
    else:
        at = 2 * window_ms - (limit - need) * window_ms / current
    wait = max(1, math.ceil(at) - elapsed_ms)
    while over_at(previous, current, elapsed_ms + wait, window_ms, need, limit):
        wait += 1
    while wait > 1 and not over_at(
        previous, current, elapsed_ms + wait - 1, window_ms, need, limit
    ):
        wait -= 1
    return wait
