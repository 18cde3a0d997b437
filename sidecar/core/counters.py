"""Where a request's counters are named: the Hit that asks a backend for a cost on one window of
a descriptor's counter, under the counter's own key or as a field of its descriptor's hash
(`group_counters`).

A key or field is the descriptor's part (`sidecar.core.keys`, which also hash-tags it for a
Redis Cluster) followed by the window's: its kind (`tag` in a key, `code` in a field) and where
it starts or how long it must be kept. When each window starts and ends is
`sidecar.algorithms.windows`'. Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Final

from sidecar.algorithms.packing import slots as packing_slots
from sidecar.algorithms.windows import FIELD_GRACE, bounds
from sidecar.core.keys import (
    ANCHORED_FIELD_END,
    BUCKET_FIELD_END,
    base36,
    bucket_key,
    counter_field,
    field_suffix,
    keep_until_id,
    named,
    window_key,
    window_suffix,
)
from sidecar.model import Algorithm, Hit, Limit, Packing, Role, Slot, Unit, Window

#: Enum members read through their class cost a Python-level descriptor call each on
#: Python 3.11; as finals they are static reads.
_TOKEN_BUCKET: Final = Algorithm.TOKEN_BUCKET
_SLIDING_WINDOW: Final = Algorithm.SLIDING_WINDOW
_CONCURRENCY: Final = Algorithm.CONCURRENCY
#: The tags of a concurrency limit's two keys: its starts in flight and its refused starts
#: (`sidecar.algorithms.concurrency`). A limit or lease changed by a reload keeps them.
IN_FLIGHT_TAG: Final = "n"
REFUSED_TAG: Final = "nr"
#: Windows anchored on events (`sidecar.algorithms.anchored`), and their letter in keys and fields.
_ANCHORED = {Algorithm.FIRST_EVENT: "f", Algorithm.COOLDOWN: "k", Algorithm.LIFETIME: "l"}


def tag(window: Window) -> str:
    """The window kind's part of a counter key (see `core.keys`)."""
    if window.algorithm is _TOKEN_BUCKET:
        return f"{window.seconds}t{window.requests_per_unit}/{window.capacity}"
    if window.algorithm is _CONCURRENCY:
        return IN_FLIGHT_TAG
    letter = _ANCHORED.get(window.algorithm)
    if letter is not None:
        # A lifetime's end tells two flights apart: `l1798675200` (`l1798675200~7776000` with
        # a TTL); the others are their interval: `600k`, `86400f`.
        if window.algorithm is Algorithm.LIFETIME:
            return f"l{window.ends}~{window.seconds}" if window.seconds else f"l{window.ends}"
        return f"{window.seconds}{letter}"
    if window.calendar:
        text = f"{window.unit.name[0].lower()}@{window.timezone}"
        if window.unit is Unit.WEEK and window.week_start:
            text += f"~{window.week_start}"
    else:
        text = str(window.seconds)
    if window.algorithm is _SLIDING_WINDOW:
        return text + "s"
    return text + "b" if window.borrow else text


#: Seconds a plain window's counter outlives its window, at least (see `window_hit`).
LATE_SECONDS: Final = 1


def window_hit(prefix: str, window: Window, cost: int, group: int, role: Role, now_ms: int) -> Hit:
    """The Hit that asks a backend for `cost` on `window` of the counter whose head is `prefix`."""
    now = now_ms // 1000
    if window.plain:
        suffix, start, end = plain_suffix(window, now, grouped=False)
        key = named(prefix, suffix)
        # A counter is needed until its window ends, and a little longer: a call that reaches
        # the store late (queued behind others, or sent by a sidecar whose clock runs behind)
        # must still find it, not start it afresh and admit what the window already refused.
        # So it lives at least LATE_SECONDS past its window's end, whenever its first hit came
        # (the reference keeps it one unit from its latest hit).
        ttl = window.seconds + LATE_SECONDS if not window.calendar else end - now + LATE_SECONDS
        return Hit(key, cost, window, group, role, key, ttl, start * 1000, end * 1000)
    kind = tag(window)
    if window.algorithm is _TOKEN_BUCKET or window.algorithm in _ANCHORED:
        return Hit(bucket_key(prefix, kind), cost, window, group, role)
    if window.algorithm is _CONCURRENCY:
        # Its starts in flight, and beside them (same slot) its refused starts.
        key = bucket_key(prefix, kind)
        return Hit(key, cost, window, group, role, bucket_key(prefix, REFUSED_TAG))
    start, end = bounds(window, now)
    key = window_key(prefix, kind, start)
    # Borrowing and sliding windows read the previous window, so a counter lives until the end
    # of the window after its own.
    previous_start = bounds(window, start - 1)[0]
    next_end = bounds(window, end)[1]
    return Hit(
        key,
        cost,
        window,
        group,
        role,
        window_key(prefix, kind, previous_start),
        next_end - now + 1,
        start * 1000,
        end * 1000,
    )


def in_flight_hit(hit: Hit, request_id: str) -> Hit:
    """A concurrency window's `hit` (`window_hit`'s) naming its request (`request_id`, see
    `sidecar.algorithms.concurrency`): the id travels as its `previous_field`, which a
    concurrency window has no other use for (`decide.lua` reads it as the hit's `previous`)."""
    return Hit(
        hit.key, hit.hits, hit.window, hit.group, hit.role, hit.previous,
        previous_field=request_id.encode(),
    )  # fmt: skip


_UNIT_CODES: Final = {
    Unit.SECOND: "s",
    Unit.MINUTE: "m",
    Unit.HOUR: "h",
    Unit.DAY: "d",
    Unit.WEEK: "w",
    Unit.MONTH: "M",
    Unit.YEAR: "y",
}


@lru_cache(maxsize=1_024)
def code(window: Window) -> str:
    """The window kind's part of a grouped counter's field: as short as can be told apart.

    ``[multiplier]unit`` for epoch windows (``d``, ``5m``, ``M`` a 30-day month), ``+`` after it
    when it borrows and ``~`` when it slides; ``c`` and the unit for calendar windows, then
    three base-36 characters of the zone's hash unless it is UTC, then the first day of the
    week unless Monday (``cd``, ``cdk7q``, ``cw6``); ``t``, the period, the rate, ``/`` and the
    capacity for a token bucket (``tm10/20``); ``f``, ``k`` or ``l`` for a window from the first
    event, a cooldown or a lifetime, then its interval (``f24h``, ``k10m``), a lifetime's end
    first, in base-36 seconds, and ``.`` (``lufc1s0.90d``; ``lufc1s0.`` without a TTL). A field
    ends in a fixed-width keep-until (or a marker) after the code, so codes need no separator. Hashed zones could collide, so loading the rules
    refuses a tree in which two kinds of window get one code.
    """
    unit = _UNIT_CODES[window.unit]
    letter = _ANCHORED.get(window.algorithm)
    if letter is not None:
        interval = "" if not window.seconds else unit
        if window.unit_multiplier > 1:
            interval = f"{window.unit_multiplier}{unit}"
        if window.algorithm is Algorithm.LIFETIME:
            return f"l{base36(window.ends)}.{interval}"
        return letter + interval
    if window.calendar:
        text = "c" + unit
        if window.timezone != "UTC":
            text += zone_code(window.timezone)
        if window.week_start:
            text += str(window.week_start)
    else:
        text = unit if window.unit_multiplier == 1 else f"{window.unit_multiplier}{unit}"
    if window.algorithm is _TOKEN_BUCKET:
        return f"t{text}{window.requests_per_unit}/{window.capacity}"
    if window.algorithm is _SLIDING_WINDOW:
        return text + "~"
    return text + "+" if window.borrow else text


def zone_code(zone: str) -> str:
    """Three base-36 characters standing for a time zone in window codes."""
    digest = int.from_bytes(hashlib.sha256(zone.encode()).digest()[:8], "big")
    return base36(digest % 36**3).rjust(3, "0")


def kind(window: Window) -> tuple[object, ...]:
    """What makes two windows count alike: the same kind must have one code, others not."""
    return (
        window.unit,
        window.unit_multiplier,
        window.algorithm,
        window.borrow > 0,
        window.calendar,
        window.timezone if window.calendar else "",
        window.week_start if window.calendar else 0,
        (window.requests_per_unit, window.capacity) if window.algorithm is _TOKEN_BUCKET else (),
        window.ends,
    )


def field_hit(
    key: bytes, head: str, window: Window, cost: int, group: int, role: Role, now_ms: int
) -> Hit:
    """The Hit for `window` of a grouped counter: field `head|<code><keep-until>` of hash `key`.

    A window's keep-until is its end for a plain window, the end of the next window for
    borrowing and sliding ones (the next window reads it); the previous window's field follows
    from it. The hash must live until the keep-until plus `FIELD_GRACE`.
    """
    window_code = code(window)
    if window.algorithm is _TOKEN_BUCKET:
        field = counter_field(head, window_code, BUCKET_FIELD_END)
        return Hit(key, cost, window, group, role, key, 0, field=field, previous_field=field)
    now = now_ms // 1000
    if window.plain:
        suffix, start, end = plain_suffix(window, now, grouped=True)
        field = named(head, suffix)
        return Hit(
            key,
            cost,
            window,
            group,
            role,
            key,
            end - now + FIELD_GRACE,
            start * 1000,
            end * 1000,
            field,
            field,
        )
    # (Looked up once a window is known not to be plain: an enum member hashes in Python.)
    if window.algorithm in _ANCHORED:
        field = counter_field(head, window_code, ANCHORED_FIELD_END)
        return Hit(key, cost, window, group, role, key, 0, field=field, previous_field=field)
    start, end = bounds(window, now)
    next_end = bounds(window, end)[1]
    return Hit(
        key,
        cost,
        window,
        group,
        role,
        key,
        next_end - now + FIELD_GRACE,
        start * 1000,
        end * 1000,
        counter_field(head, window_code, keep_until_id(next_end, window.seconds < 60)),
        counter_field(head, window_code, keep_until_id(end, window.seconds < 60)),
    )


def grouped_hits(
    key: bytes, head: str, limit: Limit, cost: int, group: int, role: Role, now_ms: int
) -> list[Hit]:
    """The Hits for every window of `limit` on a grouped counter (`field_hit`), the windows
    its `packing` puts together in one field (`packed_hits`) in their order among the others."""
    packing = limit.packing
    windows = limit.windows
    if packing is None:
        return [field_hit(key, head, w, cost, group, role, now_ms) for w in windows]
    packed = packed_hits(key, head, limit, packing, cost, group, role, now_ms)
    shared = dict(zip(packing.windows, packed, strict=True))
    return [
        shared[index] if index in shared else field_hit(key, head, w, cost, group, role, now_ms)
        for index, w in enumerate(windows)
    ]


def packed_hits(
    key: bytes,
    head: str,
    limit: Limit,
    packing: Packing,
    cost: int,
    group: int,
    role: Role,
    now_ms: int,
) -> list[Hit]:
    """The Hits of the windows `packing` shares in one field (shortest first): field
    ``head|<their codes><the longest's keep-until>`` of hash `key` (see `sidecar.algorithms.packing`), kept
    as long as the longest window."""
    now = now_ms // 1000
    windows = [limit.windows[index] for index in packing.windows]
    field, end, slots = packed_field(head, packing, tuple(windows), now)
    ttl = end - now + FIELD_GRACE
    hits = []
    for window, slot in zip(windows, slots, strict=True):
        start = now - now % window.seconds
        hits.append(
            Hit(
                key,
                cost,
                window,
                group,
                role,
                key,
                ttl,
                start * 1000,
                (start + window.seconds) * 1000,
                field,
                field,
                slot,
            )
        )
    return hits


def packed_field(
    head: str, packing: Packing, windows: tuple[Window, ...], now: int
) -> tuple[bytes, int, tuple[Slot, ...]]:
    """The packed field of `windows` (shortest first) at `now` (Unix seconds), the end of its
    longest window, and each window's Slot in it."""
    end, slots = packing_slots(packing, tuple(w.seconds for w in windows), now)
    longest = windows[-1]
    codes = "".join(code(w) for w in windows)
    suffix = field_suffix(codes, keep_until_id(end, longest.seconds < 60))
    return named(head, suffix), end, slots


def plain_suffix(window: Window, now: int, grouped: bool) -> tuple[str, int, int]:
    """How a plain window's counter at `now` (Unix seconds) is named after its descriptor's part
    (`|tag|start` in a key, `|<code><keep-until>` in a grouped field), and the window's start and
    end (Unix seconds). Every descriptor with this window shares them, so a caller naming many
    counters at once (a frequency-cap check) works them out once."""
    start, end = bounds(window, now)
    if grouped:
        suffix = field_suffix(code(window), keep_until_id(end, window.seconds < 60))
    else:
        suffix = window_suffix(tag(window), start)
    return suffix, start, end
