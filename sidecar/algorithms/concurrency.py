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

The bound, and its price, without request ids. A refund does not say which start it closes
(Envoy sends the same descriptor for every request), so it closes the oldest. Then, while every
request ends within its lease, the count never falls below the requests really in flight: the
starts counted are, one for one, no older than the requests still running, which are younger
than their lease, so a lease ends none of them; no more than `requests_per_unit` run at once. A
request that runs longer than its lease is forgotten at its lease's end (one more may start
then), and its refund, when it comes, closes another start: set the lease above the longest
request. A lost refund holds its place until the oldest start counted ends: at most a lease
after the last start admitted once lost refunds fill the limit (nothing more is admitted, so
nothing newer stays), but under traffic that keeps starting requests, each refund passing the
place on to a newer start, it holds it until the traffic ebbs. Without request identities a
lost refund and a request still running look the same until the lease tells them apart; this
rule errs on the side of never admitting past the limit.

With request ids (the rule's `request_id`, the descriptor entry that carries the request's
identity, Envoy's `x-request-id`): a start of one place that names its request is kept under
its id (`named`, member `=<id>`), and the refund that names the same id closes exactly it, and
nothing else: a refund whose id is not in flight (refused, never started, its lease ended)
changes nothing. So a lost refund's place is kept only until its own lease ends, whatever the
traffic. A start of an id already in flight (a client that chose its id, a retry with the same
one) is refused, and the start in flight under that id is `disputed` (member `!<id>`): counted
until its lease ends, closed by no refund, since the two requests' refunds cannot be told
apart and either could come first; while it lasts, starts of that id are refused. A refused
start with an id is remembered nowhere (its refund finds its id not in flight). The price: a
client that sets its own ids may, by racing a refused request's refund against an admitted
request of the same id, close that request's place early; let Envoy set the id (README).
Starts without an id (or of more than one place) keep the rules above, in the same limit: a
refund without an id closes refused starts, then the oldest start without one.

Storage: the starts in flight cost one entry each, at most `requests_per_unit` (starts past it
are refused, so a hostile client can add none): an int in a tuple here (with its id, a dict
entry of at most MAX_REQUEST_ID characters), a sorted set member on
Redis (about 32 bytes a start up to 128 of them, about 130 past that: 1.3 MB for 10,000, the
most a rule may allow); the refused count is one small value. `lua/decide.lua` (algorithm 5)
mirrors this operation for operation: a sorted set of ends at the counter's key (members
`<end>:<n>`, or `=<id>` and `!<id>` for named starts), trimmed of those past, and the refused
count at its second key.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

#: The longest request id a start may name (characters): it is kept while the start is in
#: flight. A UUID is 36, a W3C traceparent 55.
MAX_REQUEST_ID: Final = 128
#: A named start's member: its refund closes it (`OWN`), or a second start of its id was seen
#: and no refund may (`DISPUTED`). Members without an id are `<end>:<n>` on Redis: a digit first.
OWN: Final = b"="
DISPUTED: Final = b"!"


@dataclass(frozen=True, slots=True)
class InFlight:
    """A descriptor's requests in flight: `ends` (Unix ms, oldest first) of the counted starts
    without an id, the `refused` ones whose refunds are to come, kept until `refused_until`
    (Unix ms), and the starts that named their request, `named`: member (`OWN` or `DISPUTED`
    and the id) to end (Unix ms). Never changed in place: each change is a new state."""

    ends: tuple[int, ...] = ()
    refused: int = 0
    refused_until: int = 0
    named: Mapping[bytes, int] = field(default_factory=dict)

    def keep_ms(self, now_ms: int) -> int:
        """How long the state must be kept from `now_ms`: until its last start and its refused
        count end (0: nothing left, no state)."""
        last = self.ends[-1] if self.ends else 0
        if self.named:
            last = max(last, max(self.named.values()))
        if self.refused:
            last = max(last, self.refused_until)
        return max(0, last - now_ms)


class Judged(NamedTuple):
    """A start judged: over, (remaining, reset ms) without it and with it, the state once it is
    counted and the state once it is not (a refused start awaiting its refund, or a disputed
    id; None: nothing to remember)."""

    over: bool
    before: tuple[int, int]
    after: tuple[int, int]
    counted: InFlight | None
    refused: InFlight | None


def every_end(state: InFlight) -> tuple[int, ...]:
    """The ends of all the starts in flight, named or not, oldest first."""
    if not state.named:
        return state.ends
    return tuple(sorted(state.ends + tuple(state.named.values())))


def live(stored: InFlight | None, now_ms: int) -> InFlight:
    """The state at `now_ms`: the starts and the refused count that have not ended."""
    if stored is None:
        return _EMPTY
    ends = stored.ends
    first = bisect.bisect_right(ends, now_ms)
    refused = stored.refused if stored.refused_until > now_ms else 0
    named = stored.named
    if named and min(named.values()) <= now_ms:
        named = {member: end for member, end in named.items() if end > now_ms}
    if first == 0 and refused == stored.refused and named is stored.named:
        return stored
    return InFlight(ends[first:], refused, stored.refused_until if refused else 0, named)


_EMPTY = InFlight()


def answer(state: InFlight, limit: int, now_ms: int) -> tuple[int, int]:
    """(remaining, reset ms) of a live state: the places left, and when the oldest start ends."""
    ends = every_end(state)
    return max(0, limit - len(ends)), (ends[0] - now_ms if ends else 0)


def wait_ms(state: InFlight, cost: int, limit: int, now_ms: int) -> int:
    """When a start of `cost` the live `state` refuses would fit, if nothing else comes: once
    enough of the oldest starts have ended; a cost above the limit, once all have."""
    ends = every_end(state)
    if not ends:
        return 0
    need = cost if cost > 0 else 1
    if need > limit:
        return ends[-1] - now_ms
    return ends[len(ends) + need - limit - 1] - now_ms


def take(
    stored: InFlight | None,
    now_ms: int,
    cost: int,
    limit: int,
    lease_ms: int,
    force: bool,
    request_id: bytes = b"",
) -> Judged:
    """Judge a start of `cost` (0: a check) at `now_ms` on the state `stored`; `request_id`
    (a start of one place only) names its request."""
    state = live(stored, now_ms)
    if request_id:
        held = _held(state, request_id)
        if held is not None:
            return _duplicate(state, request_id, held, limit, now_ms)
    need = cost if cost > 0 else 1
    over = len(state.ends) + len(state.named) + need > limit
    before = answer(state, limit, now_ms)
    if over:
        before = (before[0], wait_ms(state, cost, limit, now_ms))
    if cost <= 0:
        return Judged(over, before, before, None, None)
    end = now_ms + lease_ms
    counted = None
    if request_id:
        if force or not over:
            named = dict(state.named)
            named[OWN + request_id] = end
            counted = InFlight(state.ends, state.refused, state.refused_until, named)
        after = answer(counted, limit, now_ms) if counted is not None else before
        # Refused, it is remembered nowhere: its refund finds its id not in flight.
        return Judged(over, before, after, counted, None)
    if force or not over:
        # After every start that ends no later (another sidecar's clock may run ahead).
        at = bisect.bisect_right(state.ends, end)
        ends = state.ends[:at] + (end,) * cost + state.ends[at:]
        counted = InFlight(ends, state.refused, state.refused_until, state.named)
    refused = InFlight(state.ends, state.refused + cost, end, state.named)
    after = answer(counted, limit, now_ms) if counted is not None else before
    return Judged(over, before, after, counted, refused)


def _held(state: InFlight, request_id: bytes) -> int | None:
    """The end of the start in flight under `request_id`, disputed or not (None: none)."""
    named = state.named
    held = named.get(OWN + request_id)
    return named.get(DISPUTED + request_id) if held is None else held


def _duplicate(state: InFlight, request_id: bytes, held: int, limit: int, now_ms: int) -> Judged:
    """A start of an id already in flight: refused, its reset the time until that start's lease
    ends; the start in flight becomes disputed (None: it already was, nothing to write)."""
    before = (answer(state, limit, now_ms)[0], held - now_ms)
    own = OWN + request_id
    disputed = None
    if own in state.named:
        named = {member: end for member, end in state.named.items() if member != own}
        named[DISPUTED + request_id] = held
        disputed = InFlight(state.ends, state.refused, state.refused_until, named)
    return Judged(True, before, before, None, disputed)


def refund(
    stored: InFlight | None, now_ms: int, given: int, request_id: bytes = b""
) -> InFlight | None:
    """The state after `given` starts are closed: with `request_id`, the start of that id (one
    place) if it is in flight and not disputed; without, refused ones first, then the oldest
    counted without an id. None when nothing changes (nothing to write)."""
    state = live(stored, now_ms)
    if request_id:
        own = OWN + request_id
        if own not in state.named:
            return None
        named = {member: end for member, end in state.named.items() if member != own}
        return InFlight(state.ends, state.refused, state.refused_until, named)
    from_refused = min(given, state.refused)
    from_ends = min(given - from_refused, len(state.ends))
    if from_refused == 0 and from_ends == 0:
        return None
    refused = state.refused - from_refused
    return InFlight(
        state.ends[from_ends:], refused, state.refused_until if refused else 0, state.named
    )
