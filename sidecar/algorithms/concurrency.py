"""Concurrency limits: at most `requests_per_unit` requests in flight, each forgotten a lease
after it started if no refund closed it.

Envoy counts a request when it starts (a hit) and gives it back when its stream ends (a refund,
`is_negative_hits` with `apply_on_stream_done`). A refund that never comes (Envoy restarted, a
stream reset, Envoy failing open while the sidecar was down) would otherwise hold its place for
ever; here every start ends `lease` seconds after it began, closed or not.

State per descriptor: the end of each counted start (Unix ms, oldest first) and the refused
starts whose refunds are still to come (a count, kept until a lease after the latest).

- A start of cost `c` (0: a check, asks about one more) is admitted while the starts in flight
  plus `c` stay within `requests_per_unit`; it adds `c` starts that end a lease from now. A cost
  above the limit is never admitted. Nothing is borrowed.
- A refused start adds nothing in flight, yet Envoy sends its stream-done refund all the same
  (for a request it answered 429 too). So a start the window did not count (refused, or its
  request refused by all or nothing) is remembered as refused, and a refund closes a refused
  start before it closes a counted one: the 429's refund gives back nothing that is in flight.
- A refund of `r` closes `r` starts: refused ones first, then the oldest counted ones; one that
  finds nothing changes nothing (no state is written). It is answered OK with the state after it.
- `limit_remaining` is the limit less the starts in flight. `duration_until_reset` is the time
  until the oldest start in flight ends (0 when none is); on OVER_LIMIT, until enough of them
  have ended for the cost to fit (for a cost above the limit, until the last ends): a true upper
  bound on the wait, reached earlier when refunds come.

The bound, and its price. A refund does not say which start it closes (Envoy sends the same
descriptor for every request), so it closes the oldest. Then, while every request ends within
its lease, the count never falls below the requests really in flight: the starts counted are,
one for one, no older than the requests still running, which are younger than their lease, so a
lease ends none of them; no more than `requests_per_unit` run at once. A request that runs
longer than its lease is forgotten at its lease's end (one more may start then), and its
refund, when it comes, closes another start: set the lease above the longest request. A lost
refund holds its place until the oldest start counted ends: at most a lease after the last
start admitted once lost refunds fill the limit (nothing more is admitted, so nothing newer
stays), but under traffic that keeps starting requests, each refund passing the place on to a
newer start, it may hold it longer. Without request identities a lost refund and a request
still running look the same until the lease tells them apart; this rule errs on the side of
never admitting past the limit.

Storage: the starts in flight cost one entry each, at most `requests_per_unit` (starts past it
are refused, so a hostile client can add none): an int in a tuple here, a sorted set member on
Redis (about 32 bytes a start up to 128 of them, about 130 past that: 1.3 MB for 10,000, the
most a rule may allow); the refused count is one small value. `lua/decide.lua` (algorithm 5)
mirrors this operation for operation: a sorted set of ends at the counter's key, trimmed of
those past, and the refused count at its second key.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class InFlight:
    """A descriptor's requests in flight: `ends` (Unix ms, oldest first) of the counted starts,
    and the `refused` starts whose refunds are to come, kept until `refused_until` (Unix ms)."""

    ends: tuple[int, ...] = ()
    refused: int = 0
    refused_until: int = 0

    def keep_ms(self, now_ms: int) -> int:
        """How long the state must be kept from `now_ms`: until its last start and its refused
        count end (0: nothing left, no state)."""
        last = self.ends[-1] if self.ends else 0
        if self.refused:
            last = max(last, self.refused_until)
        return max(0, last - now_ms)


class Judged(NamedTuple):
    """A start judged: over, (remaining, reset ms) without it and with it, the state once it is
    counted and the state once it is not (a refused start awaiting its refund)."""

    over: bool
    before: tuple[int, int]
    after: tuple[int, int]
    counted: InFlight | None
    refused: InFlight | None


def live(stored: InFlight | None, now_ms: int) -> InFlight:
    """The state at `now_ms`: the starts and the refused count that have not ended."""
    if stored is None:
        return _EMPTY
    ends = stored.ends
    first = bisect.bisect_right(ends, now_ms)
    refused = stored.refused if stored.refused_until > now_ms else 0
    if first == 0 and refused == stored.refused:
        return stored
    return InFlight(ends[first:], refused, stored.refused_until if refused else 0)


_EMPTY = InFlight()


def answer(state: InFlight, limit: int, now_ms: int) -> tuple[int, int]:
    """(remaining, reset ms) of a live state: the places left, and when the oldest start ends."""
    ends = state.ends
    return max(0, limit - len(ends)), (ends[0] - now_ms if ends else 0)


def wait_ms(state: InFlight, cost: int, limit: int, now_ms: int) -> int:
    """When a start of `cost` the live `state` refuses would fit, if nothing else comes: once
    enough of the oldest starts have ended; a cost above the limit, once all have."""
    ends = state.ends
    if not ends:
        return 0
    need = cost if cost > 0 else 1
    if need > limit:
        return ends[-1] - now_ms
    return ends[len(ends) + need - limit - 1] - now_ms


def take(
    stored: InFlight | None, now_ms: int, cost: int, limit: int, lease_ms: int, force: bool
) -> Judged:
    """Judge a start of `cost` (0: a check) at `now_ms` on the state `stored`."""
    state = live(stored, now_ms)
    need = cost if cost > 0 else 1
    over = len(state.ends) + need > limit
    before = answer(state, limit, now_ms)
    if over:
        before = (before[0], wait_ms(state, cost, limit, now_ms))
    if cost <= 0:
        return Judged(over, before, before, None, None)
    end = now_ms + lease_ms
    counted = None
    if force or not over:
        # After every start that ends no later (another sidecar's clock may run ahead).
        at = bisect.bisect_right(state.ends, end)
        ends = state.ends[:at] + (end,) * cost + state.ends[at:]
        counted = InFlight(ends, state.refused, state.refused_until)
    refused = InFlight(state.ends, state.refused + cost, end)
    after = answer(counted, limit, now_ms) if counted is not None else before
    return Judged(over, before, after, counted, refused)


def refund(stored: InFlight | None, now_ms: int, given: int) -> InFlight | None:
    """The state after `given` starts are closed: refused ones first, then the oldest counted;
    None when nothing changes (nothing to write)."""
    state = live(stored, now_ms)
    from_refused = min(given, state.refused)
    from_ends = min(given - from_refused, len(state.ends))
    if from_refused == 0 and from_ends == 0:
        return None
    refused = state.refused - from_refused
    return InFlight(state.ends[from_ends:], refused, state.refused_until if refused else 0)
