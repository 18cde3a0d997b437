"""Where a window starts and ends: epoch blocks, or calendar periods in a time zone.

Epoch blocks (the reference's windows) are ``unit seconds × unit_multiplier`` long and aligned to
the Unix epoch: days reset at 00:00 UTC, a "month" is a 30-day block, a "year" 365 days.

Calendar windows (`calendar: true`) follow the wall clock of an IANA time zone: a day runs from
local midnight to the next local midnight (23 or 25 hours on a DST change), a week from midnight
of its first day (`week_start`, Monday by default), a month from the 1st to the 1st, a year from
1 January. A midnight that a DST change skips starts the day at the first instant that exists.
Seconds, minutes and hours are epoch blocks in any zone (every zone in use is offset by whole
minutes, and an hour must stay 3600 s across DST changes), so `calendar` only changes day, week,
month and year.
"""

from __future__ import annotations

import difflib
import hashlib
from datetime import date, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, available_timezones

from sidecar.model import Algorithm, Hit, Role, Unit, Window
from sidecar.storage.keys import (
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

_CALENDAR_UNITS = frozenset({Unit.DAY, Unit.WEEK, Unit.MONTH, Unit.YEAR})


def is_calendar_unit(unit: Unit) -> bool:
    return unit in _CALENDAR_UNITS


def epoch_window(now: float, seconds: int) -> tuple[int, int]:
    """(start, end) in Unix seconds of the epoch-aligned block of `seconds` holding `now`."""
    second = int(now)
    start = second - second % seconds
    return start, start + seconds


@lru_cache(maxsize=1_024)
def calendar_window(now: float, unit: Unit, zone: str, week_start: int = 0) -> tuple[int, int]:
    """(start, end) in Unix seconds of the calendar `unit` holding `now` in time zone `zone`.

    `week_start` is the first day of a week, 0 for Monday to 6 for Sunday. Cached: every
    descriptor of a request (and every request of the same second) asks the same question.
    """
    tz = _zone(zone)
    local = datetime.fromtimestamp(int(now), tz).date()
    if unit is Unit.DAY:
        first, following = local, local + timedelta(days=1)
    elif unit is Unit.WEEK:
        first = local - timedelta(days=(local.weekday() - week_start) % 7)
        following = first + timedelta(days=7)
    elif unit is Unit.MONTH:
        first = local.replace(day=1)
        following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    elif unit is Unit.YEAR:
        first, following = date(local.year, 1, 1), date(local.year + 1, 1, 1)
    else:
        raise ValueError(f"{unit.name.lower()} has no calendar window")
    return _midnight(first, zone), _midnight(following, zone)


def _midnight(day: date, zone: str) -> int:
    """The first instant of `day` in `zone`.

    For a midnight skipped by DST, the naive local time with fold=0 uses the offset in force
    before the change, which lands exactly on the change: the first instant of that day.
    """
    return int(datetime(day.year, day.month, day.day, tzinfo=_zone(zone)).timestamp())


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def check_zone(name: str) -> None:
    """Raise ValueError when `name` is not an IANA time zone this machine knows."""
    try:
        _zone(name)
    except (ValueError, KeyError, OSError) as exc:  # ZoneInfoNotFoundError is a KeyError
        close = difflib.get_close_matches(name, available_timezones(), n=1, cutoff=0.8)
        hint = f"did you mean '{close[0]}'?" if close else "use an IANA name like 'Asia/Shanghai'"
        hint = f" ({hint})"
        raise ValueError(f"unknown time zone '{name}'{hint}") from exc


def tag(window: Window) -> str:
    """The window kind's part of a counter key (see `storage.keys`)."""
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        return f"{window.seconds}t{window.requests_per_unit}/{window.capacity}"
    if window.calendar:
        text = f"{window.unit.name[0].lower()}@{window.timezone}"
        if window.unit is Unit.WEEK and window.week_start:
            text += f"~{window.week_start}"
    else:
        text = str(window.seconds)
    if window.algorithm is Algorithm.SLIDING_WINDOW:
        return text + "s"
    return text + "b" if window.borrow else text


def bounds(window: Window, now: int) -> tuple[int, int]:
    """(start, end) in Unix seconds of the window holding `now`."""
    if window.calendar:
        return calendar_window(now, window.unit, window.timezone, window.week_start)
    return epoch_window(now, window.seconds)


def window_hit(prefix: str, window: Window, cost: int, group: int, role: Role, now_ms: int) -> Hit:
    """The Hit that asks a backend for `cost` on `window` of the counter whose head is `prefix`."""
    kind = tag(window)
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        return Hit(bucket_key(prefix, kind), cost, window, group, role)
    now = now_ms // 1000
    if window.plain:
        suffix, start, end = plain_suffix(window, now, grouped=False)
        key = named(prefix, suffix)
        # A counter is needed until its window ends: the reference keeps it one unit from its
        # first hit, which also covers sidecars whose clocks run a little behind.
        ttl = window.seconds if not window.calendar else end - now + 1
        return Hit(key, cost, window, group, role, key, ttl, start * 1000, end * 1000)
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


#: Seconds a grouped counter outlives its window, for sidecars whose clocks run a little behind.
FIELD_GRACE = 10

_UNIT_CODES = {
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
    capacity for a token bucket (``tm10/20``). A field ends in a fixed-width keep-until after
    the code, so codes need no separator. Hashed zones could collide, so loading the rules
    refuses a tree in which two kinds of window get one code.
    """
    unit = _UNIT_CODES[window.unit]
    if window.calendar:
        text = "c" + unit
        if window.timezone != "UTC":
            text += zone_code(window.timezone)
        if window.week_start:
            text += str(window.week_start)
    else:
        text = unit if window.unit_multiplier == 1 else f"{window.unit_multiplier}{unit}"
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        return f"t{text}{window.requests_per_unit}/{window.capacity}"
    if window.algorithm is Algorithm.SLIDING_WINDOW:
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
        (window.requests_per_unit, window.capacity)
        if window.algorithm is Algorithm.TOKEN_BUCKET
        else (),
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
    if window.algorithm is Algorithm.TOKEN_BUCKET:
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
