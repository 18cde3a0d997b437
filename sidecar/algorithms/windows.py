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
from datetime import date, datetime, timedelta
from functools import lru_cache
from typing import Final
from zoneinfo import ZoneInfo, available_timezones

from sidecar.model import Unit, Window

_CALENDAR_UNITS: Final = frozenset({Unit.DAY, Unit.WEEK, Unit.MONTH, Unit.YEAR})


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
    return midnight(first, zone), midnight(following, zone)


def midnight(day: date, zone: str) -> int:
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


#: Seconds a grouped counter outlives its window, for sidecars whose clocks run a little behind.
FIELD_GRACE: Final = 10


def bounds(window: Window, now: int) -> tuple[int, int]:
    """(start, end) in Unix seconds of the window holding `now`."""
    if window.calendar:
        return calendar_window(now, window.unit, window.timezone, window.week_start)
    return epoch_window(now, window.seconds)


def next_length_ms(window: Window, end_ms: int) -> int:
    """How long the window that follows the one ending at `end_ms` lasts, in milliseconds: its
    `seconds` for epoch blocks, the calendar's next day, week, month or year otherwise (a
    borrowing window that refuses a hit may have to wait for its end)."""
    if not window.calendar:
        return window.seconds * 1000
    start, end = bounds(window, end_ms // 1000)
    return (end - start) * 1000
