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
   With `force` (recording impressions, which are facts) every hit is applied, whatever the
   limits say: windows go past their limit and buckets below their credit line.
   A refund is applied as its descriptor is (never over, it is unless the request is all or
   nothing and over): a counter's decrease, or a bucket's tokens back, and nothing written
   for a counter or bucket that holds nothing.

A counter is addressed by its key, or by (hash key, field) when its tree groups its counters
in one hash (`group_counters`, see `core.keys`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.algorithms import (
    anchored,
    fixed_window,
    refunds,
    sliding_window,
    token_bucket,
    windows,
)
from sidecar.algorithms.anchored import Span
from sidecar.algorithms.token_bucket import Bucket
from sidecar.model import Algorithm, Hit, Outcome, Role, Window

#: Algorithm codes, as the Lua script knows them. A bucket and an anchored window keep a state
#: and work out their own reset; the others are counters in windows on the clock.
PLAIN, BORROWING, SLIDING, BUCKET, ANCHORED = 0, 1, 2, 3, 4

State = int | Bucket | Span
#: Where a value is stored: a key, or (hash key, field) for a grouped counter.
Address = bytes | tuple[bytes, bytes]


def address(key: bytes, field: bytes) -> Address:
    return (key, field) if field else key


#: Read on every call: on Python 3.11 an enum member read through its class is a Python call.
_TOKEN_BUCKET, _SLIDING_WINDOW = Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW
_FIXED_WINDOW = Algorithm.FIXED_WINDOW


def code(window: Window) -> int:
    algorithm = window.algorithm
    if algorithm is _FIXED_WINDOW:  # nearly every window: asked first
        return BORROWING if window.borrow else PLAIN
    if algorithm is _TOKEN_BUCKET:
        return BUCKET
    return SLIDING if algorithm is _SLIDING_WINDOW else ANCHORED


@dataclass(frozen=True, slots=True)
class Write:
    """A change to one stored value: add `amount` to a counter (created with `ttl_ms`), store a
    bucket's or an anchored window's `state` for `ttl_ms`, or add `member` to a HyperLogLog (kept `ttl_ms` from its
    creation). `field` is set for a counter in a grouped hash or a usage count's hash."""

    key: bytes
    amount: int = 0
    state: Bucket | Span | None = None
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
    #: A bucket's or an anchored window's state after the hit (a refund's: None, nothing to
    #: write).
    state: Bucket | Span | None
    #: A refund's change to a window's counter (0 or less).
    given_back: int = 0


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

    outcomes: list[Outcome] = []
    writes: list[Write] = []
    blocked = read_only or (all_or_nothing and request_over)
    for hit, j in zip(hits, judged, strict=True):
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
        remaining, reset_ms = j.after if applied else j.before
        outcomes.append(Outcome(j.over, remaining, reset_ms, applied, j.before[0]))
        if applied and hit.hits > 0:
            if algorithm >= BUCKET:
                if j.state is not None:
                    writes.append(Write(hit.key, state=j.state, ttl_ms=j.after[1], field=hit.field))
            else:
                writes.append(
                    Write(hit.key, amount=hit.hits, ttl_ms=hit.ttl * 1000, field=hit.field)
                )
        elif applied and hit.hits < 0:
            if j.state is not None:
                writes.append(Write(hit.key, state=j.state, ttl_ms=j.after[1], field=hit.field))
            elif j.given_back:
                writes.append(Write(hit.key, amount=j.given_back, field=hit.field))
    return outcomes, writes


#: Where a usage hit's judgement would be: it has none.
_UNJUDGED = _Judged(False, (0, 0), (0, 0), None)
_USAGE, _UNIQUE = Role.USAGE, Role.UNIQUE


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
        return _refund(hit, algorithm, here, value, seen, now_ms)
    if algorithm >= BUCKET:  # a state, not a count (one comparison for the usual window)
        stored = value(here)
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
