"""Windows anchored on events rather than on the clock: a window from the first event, a
lifetime cap, and a cooldown.

One state serves the three: a `Span`, the events counted in the open window and when it ends.
No window is open until a hit is counted; the first one opens it, and it ends
- `first_event`: `unit` × `unit_multiplier` after that hit (a cap that resets N hours after the
  first impression that opened it, not at a clock boundary);
- `lifetime`: at the rule's `ends` (a flight's end), or its interval after the first hit (a TTL),
  whichever comes first; past `ends` no window opens, so the cap counts and limits nothing;
- `cooldown`: its interval after the *last* counted hit: every counted hit restarts it, so two
  counted events are never closer than the interval, and one more is admitted once it has run
  (`remaining` 1 then, 0 while it runs; its reset is the time until the next is admitted).

At the limit: a window admits hits while its count plus the cost stays within
`requests_per_unit` (a cooldown's is 1); a check (cost 0) asks about one more. A cost above the
limit is never admitted. A refused hit counts nothing and moves no end (an anchored window is
not a plain one, whose count includes refusals); with `force` (a recorded impression is a fact)
it counts whatever the window holds, and a cooldown restarts. Nothing is borrowed.
`duration_until_reset` is the time until the open window ends, or the length a window opened now
would have. The state is kept until its end, so it costs one counter's storage while the window
is open and nothing after: a lifetime cap's until its flight ends or its TTL runs out.

`lua/decide.lua` mirrors this (algorithm 4) operation for operation; the state travels as
``"<count> <end ms>"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from sidecar.model import Algorithm, Window


@dataclass(frozen=True, slots=True)
class Span:
    """An open anchored window: the hits counted in it and when it ends (Unix ms)."""

    count: int
    end_ms: int


class Taken(NamedTuple):
    """A hit judged on an anchored window: over, (remaining, reset ms) without it and with it,
    and the state with it (None: nothing to keep, a lifetime past its end)."""

    over: bool
    before: tuple[int, int]
    after: tuple[int, int]
    state: Span | None


def parameters(window: Window) -> tuple[int, int, int, int]:
    """(limit, interval ms, ends ms, restarts) of an anchored window, as the script takes them."""
    restarts = 1 if window.algorithm is Algorithm.COOLDOWN else 0
    return window.requests_per_unit, window.seconds * 1000, window.ends * 1000, restarts


def take(stored: Span | None, now_ms: int, cost: int, window: Window, force: bool) -> Taken:
    """Judge `cost` hits (0: a check) at `now_ms` on the window whose stored state is `stored`."""
    limit, length_ms, ends_ms, restarts = parameters(window)
    fresh = now_ms + length_ms if length_ms > 0 else 0
    if ends_ms > 0 and (fresh == 0 or ends_ms < fresh):
        fresh = ends_ms
    count, end = 0, fresh
    if stored is not None and stored.end_ms > now_ms:
        count, end = stored.count, stored.end_ms
    need = cost if cost > 0 else 1
    over = count + need > limit
    after_end = fresh if restarts == 1 else end
    state = None
    if (force or not over) and cost > 0 and after_end > now_ms:
        state = Span(count + cost, after_end)
    return Taken(
        over,
        (max(0, limit - count), max(0, end - now_ms)),
        (max(0, limit - count - cost), max(0, after_end - now_ms)),
        state,
    )
