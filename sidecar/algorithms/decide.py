"""One request's windows decided together, whatever their algorithms: the memory backend's core.

`lua/decide.lua` does the same on Redis, operation for operation (same float expressions, same
order), so memory, Redis and Redis Cluster give identical answers; keep the two in step.

Three phases:
1. Each hit is judged against its window (`over`), and its state after the hit is worked out.
   A counter repeated in one request sees the earlier hits on it as added. A refused hit's
   reset is when its window would admit it (each algorithm's `wait_ms`: Envoy's Retry-After).
2. A descriptor is over when any of its windows is; the request is OVER_LIMIT when a blocking
   descriptor is over, or when it has quota descriptors and all of them are (shadow ones never).
   A refund (`hits < 0`, `refunds`) is never over: its counter's state after it is worked out.
3. Hits are applied (usage hits, roles USAGE and UNIQUE, are not judged: they count the request
   as admitted or refused, see `sidecar.core.usage`): a plain fixed window counts every hit, admitted or not (the reference's
   behaviour); a token bucket, a borrowing window or a sliding window counts a hit only when its
   descriptor was admitted (so does a window anchored on events, `sidecar.algorithms.anchored`).
   With all-or-nothing, a request that is OVER_LIMIT applies nothing.
   A concurrency window (`concurrency`) counts a start when its descriptor was admitted, and
   otherwise remembers it as refused, so that its stream-done refund closes nothing in flight
   (not when the request is all or nothing and over, nor in read only: no refund follows those).
   With `force` (recording impressions, which are facts) every hit is applied, whatever the
   limits say: windows go past their limit and buckets below their credit line.
   A refund is applied as its descriptor is (never over, it is unless the request is all or
   nothing and over): a counter's decrease, or a bucket's tokens back, and nothing written
   for a counter or bucket that holds nothing.
   A hit judged with an earlier hit on its counter as added (phase 1) keeps that judgement,
   but only applied hits reach the store: a counter takes each applied hit's change, and a
   bucket's or an anchored window's state, written whole, is worked out again without the
   earlier hits that were not applied (`_rewrite`).

A counter is addressed by its key, or by (hash key, field) when its tree groups its counters
in one hash (`group_counters`, see `storage.keys`). With `group_counters: packed` one field
holds several plain windows of a descriptor (`Hit.packed`, `sidecar.algorithms.packing`): each is judged on
its own count, and applying it writes what it adds to the field's integer.

One module past the usual size because it is one decision written as `lua/decide.lua` writes it,
operation for operation, for every algorithm: split, the two could no longer be read side by side,
and the parity tests hold them to one answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.algorithms import (
    anchored,
    concurrency,
    fixed_window,
    packing,
    penalty,
    refunds,
    sliding_window,
    token_bucket,
    windows,
)
from sidecar.algorithms.anchored import Span
from sidecar.algorithms.concurrency import InFlight
from sidecar.algorithms.penalty import Block
from sidecar.algorithms.token_bucket import Bucket
from sidecar.model import Algorithm, Hit, Outcome, Role, Slot, Window

#: Algorithm codes, as the Lua script knows them. A bucket, an anchored window and a concurrency
#: window (IN_FLIGHT) keep a state and work out their own reset; the others are counters in
#: windows on the clock. A penalty (`sidecar.algorithms.penalty`) is no window: the last hit of
#: its descriptor, judged with it.
PLAIN, BORROWING, SLIDING, BUCKET, ANCHORED, IN_FLIGHT, PENALTY = 0, 1, 2, 3, 4, 5, 6

State = int | Bucket | Span | InFlight | Block
#: Where a value is stored: a key, or (hash key, field) for a grouped counter.
Address = bytes | tuple[bytes, bytes]


def address(key: bytes, field: bytes) -> Address:
    return (key, field) if field else key


#: Read on every call: on Python 3.11 an enum member read through its class is a Python call.
_TOKEN_BUCKET, _SLIDING_WINDOW = Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW
_FIXED_WINDOW = Algorithm.FIXED_WINDOW
_CONCURRENCY = Algorithm.CONCURRENCY
_PENALTY = Algorithm.PENALTY


def code(window: Window) -> int:
    algorithm = window.algorithm
    if algorithm is _FIXED_WINDOW:  # nearly every window: asked first
        return BORROWING if window.borrow else PLAIN
    if algorithm is _TOKEN_BUCKET:
        return BUCKET
    if algorithm is _SLIDING_WINDOW:
        return SLIDING
    if algorithm is _PENALTY:
        return PENALTY
    return IN_FLIGHT if algorithm is _CONCURRENCY else ANCHORED


@dataclass(frozen=True, slots=True)
class Write:
    """A change to one stored value: add `amount` to a counter (created with `ttl_ms`), store a
    bucket's or an anchored window's `state` for `ttl_ms`, or add `member` to a HyperLogLog (kept `ttl_ms` from its
    creation). `field` is set for a counter in a grouped hash or a usage count's hash."""

    key: bytes
    amount: int = 0
    state: Bucket | Span | InFlight | Block | None = None
    ttl_ms: int = 0
    field: bytes = b""
    #: A unique count's member, added to the HyperLogLog at `key` (see `sidecar.core.usage`).
    member: bytes = b""

    @property
    def address(self) -> Address:
        return address(self.key, self.field)


@dataclass(frozen=True, slots=True)
class _Judged:
    over: bool
    before: tuple[int, int]  # (remaining, reset_ms) if the hit is not applied
    after: tuple[int, int]  # ... if it is
    #: A bucket's, an anchored window's or a concurrency window's state after the hit (a
    #: refund's: None when there is nothing to write).
    state: Bucket | Span | InFlight | None
    #: A refund's change to a window's counter (0 or less).
    given_back: int = 0
    #: What applying the hit adds to its stored value, when that is not its cost: a packed
    #: field's (`sidecar.algorithms.packing`).
    amount: int | None = None
    #: A concurrency window's state when its start is not counted (see `concurrency`).
    refused: InFlight | None = None


def decide(
    read: Callable[[Address], State | None],
    hits: Sequence[Hit],
    now_ms: int,
    all_or_nothing: bool,
    read_only: bool = False,
    force: bool = False,
) -> tuple[list[Outcome], list[Write]]:
    """Outcomes for `hits`, and the writes that apply them. `read` gives a stored value or None."""
    seen: dict[Address, State | None] = {}

    def value(where: Address) -> State | None:
        if where not in seen:
            seen[where] = read(where)
        return seen[where]

    judged = [
        _judge(hit, value, seen, now_ms, force) if hit.role < _USAGE else _UNJUDGED for hit in hits
    ]

    group_over, request_over = fixed_window.groups_over(hits, [j.over for j in judged])
    penalised: dict[int, _Penalised] | None = None
    for j in judged:
        if j is _PENALTY_HIT:  # some descriptor has a penalty: judged once its windows are
            penalised = _penalties(hits, judged, value, group_over, now_ms, read_only, force)
            overs = [j.over for j in judged]
            for position, judged_penalty in penalised.items():
                overs[position] = judged_penalty.blocked and judged_penalty.enforced
            group_over, request_over = fixed_window.groups_over(hits, overs)
            break

    outcomes: list[Outcome] = []
    writes: list[Write] = []
    blocked = read_only or (all_or_nothing and request_over)
    # A bucket's or an anchored window's write is its whole state, judged with the request's
    # earlier hits on it as applied. Where one of those was not (its descriptor refused), the
    # states written after it are worked out again from what is really there (`_rewrite`):
    # `presumed` holds such addresses, `states` what this request has written to each.
    presumed: set[Address] = set()
    states: dict[Address, Bucket | Span | InFlight | None] = {}
    for position, (hit, j) in enumerate(zip(hits, judged, strict=True)):
        if j is _PENALTY_HIT:
            assert penalised is not None
            _penalty_answer(hit, penalised.get(position), now_ms, outcomes, writes)
            continue
        if j is _UNJUDGED:
            # Usage (`sidecar.core.usage`): counted as the request's answer says, never by a check
            # or a recording (the limiter sends none with them).
            # Its "reset" is when it expires, as for any window (Redis's reply is read so).
            counted = not read_only and not force
            outcomes.append(Outcome(False, 0, hit.end_ms - now_ms, counted, 0))
            if counted:
                writes.append(_usage_write(hit, request_over, now_ms))
            continue
        algorithm = code(hit.window)
        applied = force or (not blocked and (algorithm == PLAIN or not group_over[hit.group]))
        p = None if penalised is None else _group_penalty(penalised, hit.group)
        if p is not None and p.blocked and p.enforced:
            applied = False  # a blocked descriptor's hits count nowhere
        remaining, reset_ms = j.after if applied else j.before
        if p is None or force:
            outcomes.append(Outcome(j.over, remaining, reset_ms, applied, j.before[0]))
        elif p.blocked:
            outcomes.append(Outcome(True, 0, p.block.until_ms - now_ms, applied, 0))
        elif p.tripped and j.over:
            outcomes.append(
                Outcome(True, remaining, p.block.until_ms - now_ms, applied, j.before[0])
            )
        else:
            outcomes.append(Outcome(j.over, remaining, reset_ms, applied, j.before[0]))
        if algorithm == IN_FLIGHT:
            # Counted, refused or closed: the state kept as long as its last start or refused
            # count lasts (see `concurrency`).
            in_flight = j.state if applied else None if hit.hits < 0 else j.refused
            if isinstance(in_flight, InFlight) and not (blocked and hit.hits > 0):
                writes.append(Write(hit.key, state=in_flight, ttl_ms=in_flight.keep_ms(now_ms)))
            continue
        state, ttl_ms = j.state, j.after[1]
        if algorithm >= BUCKET and hit.hits != 0:
            here = address(hit.key, hit.field)
            if not applied:
                if state is not None and not j.over:
                    presumed.add(here)
                continue
            if here in presumed:
                real = states[here] if here in states else read(here)
                state, ttl_ms = _rewrite(hit, algorithm, real, now_ms)
            if state is not None or here in presumed:
                states[here] = state
        if applied and hit.hits > 0:
            if algorithm >= BUCKET:
                if state is not None:
                    writes.append(Write(hit.key, state=state, ttl_ms=ttl_ms, field=hit.field))
            else:
                amount = hit.hits if j.amount is None else j.amount
                writes.append(Write(hit.key, amount=amount, ttl_ms=hit.ttl * 1000, field=hit.field))
        elif applied and hit.hits < 0:
            if state is not None:
                writes.append(Write(hit.key, state=state, ttl_ms=ttl_ms, field=hit.field))
            elif j.given_back:
                writes.append(Write(hit.key, amount=j.given_back, field=hit.field))
    return outcomes, writes


#: Where a usage hit's judgement would be: it has none.
_UNJUDGED = _Judged(False, (0, 0), (0, 0), None)
#: Where a penalty's judgement will be: it is judged after its descriptor's windows
#: (`_penalties`).
_PENALTY_HIT = _Judged(False, (0, 0), (0, 0), None)


@dataclass(frozen=True, slots=True)
class _Penalised:
    """A descriptor's penalty judged (`sidecar.algorithms.penalty`): its state after this call,
    whether it was `blocked` (the hits refused), whether it `tripped` now (a block started),
    and whether the block is `enforced` (not a shadow rule's)."""

    group: int
    block: Block
    blocked: bool
    tripped: bool
    enforced: bool


def _penalties(
    hits: Sequence[Hit],
    judged: list[_Judged],
    value: Callable[[Address], State | None],
    group_over: dict[int, bool],
    now_ms: int,
    read_only: bool,
    force: bool,
) -> dict[int, _Penalised]:
    """Each penalty hit's judgement, by its position: blocked while its block lasts (a refund
    never is), tripped when its descriptor's windows are over (`group_over`) and the hit adds
    (a check, a refund, a read-only or a recording call never trips one)."""
    found: dict[int, _Penalised] = {}
    if force:
        return found  # recordings (impressions) are facts: no penalty applies
    for position, (hit, j) in enumerate(zip(hits, judged, strict=True)):
        if j is not _PENALTY_HIT:
            continue
        the_penalty = hit.window.penalty
        assert the_penalty is not None
        stored = value(hit.key)
        state = penalty.remembered(
            stored if isinstance(stored, Block) else None, the_penalty, now_ms
        )
        enforced = hit.role is not _SHADOW
        if hit.hits >= 0 and penalty.blocked(state, now_ms):
            assert state is not None
            found[position] = _Penalised(hit.group, state, True, False, enforced)
        elif hit.hits > 0 and group_over.get(hit.group, False) and not read_only:
            block = penalty.trip(state, the_penalty, now_ms)
            found[position] = _Penalised(hit.group, block, False, True, enforced)
        else:
            found[position] = _Penalised(hit.group, state or Block(0, 0), False, False, enforced)
    return found


def _group_penalty(penalised: dict[int, _Penalised], group: int) -> _Penalised | None:
    for p in penalised.values():
        if p.group == group:
            return p
    return None


def _penalty_answer(
    hit: Hit,
    p: _Penalised | None,
    now_ms: int,
    outcomes: list[Outcome],
    writes: list[Write],
) -> None:
    """A penalty hit's Outcome (over: blocked; remaining: the strikes; reset: the time left in
    the block, blocked or tripped; applied: tripped now) and the write of a new block."""
    if p is None:  # a recording: no answer is read
        outcomes.append(Outcome(False, 0, 0, False, 0))
        return
    block = p.block
    reset_ms = block.until_ms - now_ms if p.blocked or p.tripped else 0
    outcomes.append(Outcome(p.blocked, block.strikes, reset_ms, p.tripped, 0))
    if p.tripped:
        the_penalty = hit.window.penalty
        assert the_penalty is not None
        writes.append(
            Write(hit.key, state=block, ttl_ms=penalty.keep_ms(block, the_penalty, now_ms))
        )


_USAGE, _UNIQUE, _SHADOW = Role.USAGE, Role.UNIQUE, Role.SHADOW


def _usage_write(hit: Hit, refused: bool, now_ms: int) -> Write:
    """A usage hit's write: its hits to the admitted field (`field`) or the refused one
    (`previous_field`), or its member (`field`) to the HyperLogLog at `key`; either kept until
    the hit's `end_ms`."""
    ttl_ms = hit.end_ms - now_ms
    if hit.role is _UNIQUE:
        return Write(hit.key, ttl_ms=ttl_ms, member=hit.field)
    return Write(
        hit.key, amount=hit.hits, ttl_ms=ttl_ms, field=hit.previous_field if refused else hit.field
    )


def _judge(
    hit: Hit,
    value: Callable[[Address], State | None],
    seen: dict[Address, State | None],
    now_ms: int,
    force: bool,
) -> _Judged:
    window = hit.window
    cost = hit.hits
    algorithm = code(window)
    here = address(hit.key, hit.field)
    if cost < 0:
        if algorithm == PENALTY:  # a refund's penalty: never blocked, never tripped
            return _PENALTY_HIT
        return _refund(hit, algorithm, here, value, seen, now_ms)
    if algorithm >= BUCKET:  # a state, not a count (one comparison for the usual window)
        if algorithm == PENALTY:
            return _PENALTY_HIT
        stored = value(here)
        if algorithm == IN_FLIGHT:
            return _start(hit, stored, seen, here, now_ms, force)
        if algorithm == ANCHORED:
            span = anchored.take(
                stored if isinstance(stored, Span) else None, now_ms, cost, window, force
            )
            if span.state is not None:
                seen[here] = span.state
            return _Judged(span.over, span.before, span.after, span.state)
        rate, period_ms = window.requests_per_unit, window.seconds * 1000
        capacity = window.capacity
        bucket = token_bucket.refill(
            stored if isinstance(stored, Bucket) else None, now_ms, rate, period_ms, capacity
        )
        taken = token_bucket.take(bucket, cost, rate, period_ms, capacity, window.borrow, force)
        before = (
            max(0, math.floor(bucket.tokens)),
            token_bucket.reset_ms(bucket.tokens, rate, period_ms, capacity),
        )
        if taken.over:
            # Refused: its reset is when it would be admitted (see `token_bucket`).
            wait = token_bucket.wait_ms(
                stored if isinstance(stored, Bucket) else None,
                bucket, cost, rate, period_ms, capacity, window.borrow,
            )  # fmt: skip
            before = (before[0], wait)
        if (force or not taken.over) and cost > 0:
            seen[here] = taken.state
        return _Judged(taken.over, before, (taken.remaining, taken.reset_ms), taken.state)

    if hit.packed is not None:
        return _judge_packed(hit, hit.packed, value(here), here, seen, now_ms)
    current = _count(value(here))
    limit = window.requests_per_unit
    if algorithm == SLIDING:
        previous = _count(value(address(hit.previous, hit.previous_field)))
        window_ms = window.seconds * 1000
        over, before_left, after_left = sliding_window.judge(
            previous, current, now_ms - hit.start_ms, window_ms, cost, limit
        )
    else:
        previous = (
            _count(value(address(hit.previous, hit.previous_field)))
            if algorithm == BORROWING
            else 0
        )
        over, before_left, after_left = fixed_window.judge(
            previous, current, cost, limit, window.borrow
        )
    if algorithm == PLAIN or not over or force:
        seen[here] = current + cost
    reset_ms = hit.end_ms - now_ms
    if over and algorithm != PLAIN:
        reset_ms = _wait_ms(hit, algorithm, previous, current, now_ms)
    return _Judged(over, (before_left, reset_ms), (after_left, reset_ms), None)


def _start(
    hit: Hit,
    stored: State | None,
    seen: dict[Address, State | None],
    here: Address,
    now_ms: int,
    force: bool,
) -> _Judged:
    """A concurrency window's start judged (see `concurrency`): its state counted, and refused."""
    window = hit.window
    taken = concurrency.take(
        stored if isinstance(stored, InFlight) else None,
        now_ms, hit.hits, window.requests_per_unit, window.seconds * 1000, force,
        hit.previous_field,  # its request id, if it names one (`counters.in_flight_hit`)
    )  # fmt: skip
    # A later hit of the request on this counter sees this one counted, or refused: a start's
    # descriptor is over exactly when its one window is (a concurrency limit stands alone).
    if taken.counted is not None and (force or not taken.over):
        seen[here] = taken.counted
    elif taken.refused is not None:
        seen[here] = taken.refused
    return _Judged(taken.over, taken.before, taken.after, taken.counted, refused=taken.refused)


def _refund(
    hit: Hit,
    algorithm: int,
    here: Address,
    value: Callable[[Address], State | None],
    seen: dict[Address, State | None],
    now_ms: int,
) -> _Judged:
    """A refund's judgement (never over, see `refunds`): the state after it, and its write."""
    window = hit.window
    refund = -hit.hits
    stored = value(here)
    if algorithm == IN_FLIGHT:
        limit = hit.window.requests_per_unit
        state = stored if isinstance(stored, InFlight) else None
        before = concurrency.answer(concurrency.live(state, now_ms), limit, now_ms)
        closed = concurrency.refund(state, now_ms, refund, hit.previous_field)
        if closed is None:
            return _Judged(False, before, before, None)
        seen[here] = closed
        return _Judged(False, before, concurrency.answer(closed, limit, now_ms), closed)
    if algorithm == ANCHORED:
        # A frequency cap's event window counts impressions recorded, not requests in flight:
        # a refund gives nothing back, and is answered as a check of the window.
        span = anchored.take(stored if isinstance(stored, Span) else None, now_ms, 0, window, False)
        return _Judged(False, span.before, span.before, None)
    if algorithm == BUCKET:
        rate, period_ms = window.requests_per_unit, window.seconds * 1000
        capacity = window.capacity
        bucket = token_bucket.refill(
            stored if isinstance(stored, Bucket) else None, now_ms, rate, period_ms, capacity
        )
        before = refunds.bucket_answer(bucket, rate, period_ms, capacity)
        if not isinstance(stored, Bucket):  # no state: full, and nothing to write
            return _Judged(False, before, before, None)
        after_state = refunds.bucket(bucket, refund, rate, period_ms, capacity)
        seen[here] = after_state
        after = refunds.bucket_answer(after_state, rate, period_ms, capacity)
        return _Judged(False, before, after, after_state)

    if hit.packed is not None:
        return _refund_packed(hit, hit.packed, stored, here, seen, now_ms)
    current = _count(stored)
    left = refunds.counter(current, refund)
    limit = window.requests_per_unit
    if algorithm == SLIDING:
        previous = _count(value(address(hit.previous, hit.previous_field)))
        elapsed_ms, window_ms = now_ms - hit.start_ms, window.seconds * 1000
        _, before_left, _ = sliding_window.judge(previous, current, elapsed_ms, window_ms, 0, limit)
        _, after_left, _ = sliding_window.judge(previous, left, elapsed_ms, window_ms, 0, limit)
    else:
        previous = (
            _count(value(address(hit.previous, hit.previous_field)))
            if algorithm == BORROWING
            else 0
        )
        _, before_left, _ = fixed_window.judge(previous, current, 0, limit, window.borrow)
        _, after_left, _ = fixed_window.judge(previous, left, 0, limit, window.borrow)
    if left != current:
        seen[here] = left
    reset_ms = hit.end_ms - now_ms
    return _Judged(False, (before_left, reset_ms), (after_left, reset_ms), None, left - current)


def _judge_packed(
    hit: Hit,
    slot: Slot,
    stored: State | None,
    here: Address,
    seen: dict[Address, State | None],
    now_ms: int,
) -> _Judged:
    """A plain window sharing a packed field (`sidecar.algorithms.packing`): judged on its own count, its
    hits added to the field's value (a check changes nothing)."""
    value = _count(stored)
    current = packing.count(slot, value)
    over, before_left, after_left = fixed_window.judge(
        0, current, hit.hits, hit.window.requests_per_unit, 0
    )
    amount = 0
    if hit.hits > 0:
        after = packing.add(slot, value, hit.hits)
        seen[here] = after
        amount = after - value
    reset_ms = hit.end_ms - now_ms
    return _Judged(over, (before_left, reset_ms), (after_left, reset_ms), None, 0, amount)


def _refund_packed(
    hit: Hit,
    slot: Slot,
    stored: State | None,
    here: Address,
    seen: dict[Address, State | None],
    now_ms: int,
) -> _Judged:
    """A refund on a window sharing a packed field: its count down, floored at 0."""
    value = _count(stored)
    limit = hit.window.requests_per_unit
    current = packing.count(slot, value)
    left = refunds.counter(current, -hit.hits)
    after = packing.add(slot, value, left - current)
    if after != value:
        seen[here] = after
    _, before_left, _ = fixed_window.judge(0, current, 0, limit, 0)
    _, after_left, _ = fixed_window.judge(0, left, 0, limit, 0)
    reset_ms = hit.end_ms - now_ms
    return _Judged(False, (before_left, reset_ms), (after_left, reset_ms), None, after - value)


def _rewrite(
    hit: Hit, algorithm: int, real: State | None, now_ms: int
) -> tuple[Bucket | Span | None, int]:
    """The state a bucket's or an anchored window's applied `hit` writes, and for how long, worked
    out again on `real`, what is stored once the request's applied hits before it are: the same
    steps as `_judge` and `_refund`, taken whatever the limits say (with fewer hits counted
    before it, a hit admitted on more is admitted on less). None: nothing to write."""
    window = hit.window
    if algorithm == ANCHORED:
        span = anchored.take(
            real if isinstance(real, Span) else None, now_ms, hit.hits, window, True
        )
        return span.state, span.after[1]
    rate, period_ms, capacity = window.requests_per_unit, window.seconds * 1000, window.capacity
    stored = real if isinstance(real, Bucket) else None
    if hit.hits < 0 and stored is None:
        return None, 0  # no state: full, and a refund writes nothing
    bucket = token_bucket.refill(stored, now_ms, rate, period_ms, capacity)
    if hit.hits < 0:
        after = refunds.bucket(bucket, -hit.hits, rate, period_ms, capacity)
        return after, token_bucket.reset_ms(after.tokens, rate, period_ms, capacity)
    taken = token_bucket.take(bucket, hit.hits, rate, period_ms, capacity, window.borrow, True)
    return taken.state, taken.reset_ms


def _wait_ms(hit: Hit, algorithm: int, previous: int, current: int, now_ms: int) -> int:
    """When a sliding or borrowing window that refuses `hit` would admit it (see their modules),
    from the counts it was judged on."""
    window = hit.window
    if algorithm == SLIDING:
        return sliding_window.wait_ms(
            previous, current, now_ms - hit.start_ms, window.seconds * 1000,
            hit.hits, window.requests_per_unit,
        )  # fmt: skip
    wait = hit.end_ms - now_ms
    if fixed_window.next_window_wait(current, hit.hits, window.requests_per_unit, window.borrow):
        wait += windows.next_length_ms(window, hit.end_ms)
    return wait


def _count(stored: State | None) -> int:
    return stored if isinstance(stored, int) else 0
