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
`limit_remaining` is ``floor(limit − estimate)`` after this hit; `duration_until_reset` is the time
until the current window ends and its count starts to slide out. Counters live two windows.

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
