"""Several windows of one descriptor in one grouped field (`group_counters: packed`): a user's
day and month counts of an ad in one hash field, one integer, so 2 billion counters fit in
32 GB of Redis.

Which windows pack: a limit's plain epoch windows (fixed, not borrowing, not calendar) whose
lengths divide the longest one's, at least two of them. Every boundary of the longest window
is then a boundary of each, so one field per longest window holds them all: its name is the
descriptor's head, the windows' codes shortest first, and the longest window's keep-until,
``ad|a0042|dM25l9o``, so a script prunes it as any grouped field (`sidecar.core.keys`). The
limit's other windows keep a field each.

The field's value is one integer::

    value = offset + spread × interleave(count_1, ..., count_n)

`offset` says when the field was last written: the end of its longest window minus that
instant, in units of `unit` seconds (the greatest common divisor of the lengths), rounded up,
in ``[1, spread)``; a window's count is current when that write fell in the window holding
now, that is when `offset` is at most the window's own start `start_j` counted alike (both
are multiples of `unit` before the end, so the test is exact to the second). `interleave` puts
bit k of count i at bit ``k·n + i``, so small counts make a small number (Redis stores an
integer of 0 to 127 in a listpack in two bytes: a user's day and month count of one ad in
the bench). All counts at 0 is stored as 0, which a script deletes as it deletes a count
refunded to 0. A write keeps the counts of the windows still current, sets those that ended to
0, adds its cost to its window, and moves `offset` to the later of the two writes (a sidecar
whose clock runs behind counts in the later window: a count is never lost, at worst counted
in the window after its own for the skew).

A count stops at `cap`, ``2**bits - 1``, so the value stays below 2**53 and Lua's doubles
read it exactly; only limits below the cap pack, so a count at the cap is over its limit, and
the judgement (over, remaining) is what the true count would give. Envoy's `hits_addend`
past the cap is judged as ever and counted to the cap.

`lua/decide.lua` does the same, with the slot's parameters as `Slot.argument` writes them.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from functools import lru_cache

from sidecar.algorithms.windows import epoch_window
from sidecar.model import Packing, Slot, Window

#: Values stay below 2**53: Lua reads numbers as doubles.
VALUE_BITS = 53


def plan(windows: tuple[Window, ...]) -> Packing | None:
    """The windows of a limit that share a field, or None when fewer than two can."""
    candidates = [
        (window.seconds, index)
        for index, window in enumerate(windows)
        if window.plain and not window.calendar and window.seconds > 0
    ]
    if len(candidates) < 2:
        return None
    longest = max(seconds for seconds, _ in candidates)
    nested = sorted((s, i) for s, i in candidates if longest % s == 0)
    if len(nested) < 2:
        return None
    unit = math.gcd(*(seconds for seconds, _ in nested))
    spread = longest // unit + 1
    bits = (VALUE_BITS - spread.bit_length()) // len(nested)
    cap = (1 << bits) - 1
    if any(windows[index].requests_per_unit >= cap for _, index in nested):
        return None  # a count this large cannot stop at the cap unnoticed: one field each
    return Packing(tuple(index for _, index in nested), unit, spread, cap)


@lru_cache(maxsize=1_024)
def slots(packing: Packing, lengths: tuple[int, ...], now: int) -> tuple[int, tuple[Slot, ...]]:
    """At `now` (Unix seconds): the end of the longest window and each packed window's Slot
    (`lengths` the packed windows' lengths, shortest first). Cached: every descriptor of a
    tree shares them within a second."""
    _, end = epoch_window(now, lengths[-1])
    unit = packing.unit
    # Each length divides the longest, so each start is a whole number of units before `end`.
    starts = tuple((end - (now - now % length)) // unit for length in lengths)
    offset = -(-(end - now) // unit)
    return end, tuple(
        Slot(position, packing.spread, packing.cap, offset, starts)
        for position in range(len(lengths))
    )


def decode(value: int, spread: int, n: int) -> tuple[int, list[int]]:
    """(offset, counts) of a stored value (0: nothing stored)."""
    if value <= 0:
        return 0, [0] * n
    offset, mixed = value % spread, value // spread
    counts = [0] * n
    bit = 0
    while mixed:
        for i in range(n):
            if mixed & 1:
                counts[i] |= 1 << bit
            mixed >>= 1
        bit += 1
    return offset, counts


def encode(offset: int, counts: list[int], spread: int) -> int:
    """The stored value of `counts` last written at `offset` (0 when every count is 0)."""
    n = len(counts)
    mixed = 0
    bit = 0
    left = list(counts)
    while any(left):
        for i in range(n):
            mixed |= (left[i] & 1) << (bit * n + i)
            left[i] >>= 1
        bit += 1
    return 0 if mixed == 0 else offset + spread * mixed


def count(slot: Slot, value: int | None) -> int:
    """The current count of the slot's window in a stored value."""
    if not value:
        return 0
    offset, counts = decode(value, slot.spread, len(slot.starts))
    return counts[slot.position] if offset <= slot.starts[slot.position] else 0


def add(slot: Slot, value: int | None, cost: int) -> int:
    """The value after `cost` hits on the slot's window (below 0: a refund, floored at 0, which
    leaves the rest as it was)."""
    n = len(slot.starts)
    offset, counts = decode(value or 0, slot.spread, n)
    if not value:
        offset = slot.now
    position = slot.position
    if cost < 0:
        if offset > slot.starts[position] or counts[position] == 0:
            return value or 0
        counts[position] = max(0, counts[position] + cost)
        return encode(offset, counts, slot.spread)
    counts = [c if offset <= start else 0 for c, start in zip(counts, slot.starts, strict=True)]
    counts[position] = min(slot.cap, counts[position] + cost)
    return encode(min(offset, slot.now), counts, slot.spread)
