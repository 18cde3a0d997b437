"""Counters known to be over their limit, so a request can be refused without waiting for the
backend.

A plain fixed window that is over its limit stays over until the window ends: its counter only
grows, unless a refund (`is_negative_hits`) gives hits back. The limiter forgets a counter a
refund of this sidecar takes back under its limit (`forget`); another sidecar's refund on the
same counter is not seen here, so this cache keeps answering OVER_LIMIT for it until its
window ends (README, Refunds). Remembering it until then lets the sidecar answer OVER_LIMIT at once, with the answer
the backend would give (`limit_remaining` 0, the time to the window's end). Only plain windows
qualify: a token bucket refills, a sliding window slides and a borrowing window never counts
rejections, so their "over" can end at any moment. A counter is known by its key, its field
and the limit it was found over at (`Hit.counter`), so a rule whose limit changes, or a `limit`
override of another size on the same entries, asks the backend again.

The hits refused here are still counted: the limiter adds them to the backend after answering
(`pending`, taken by `take`), summed per counter, in one call per event-loop turn that goes
ahead of any later call to the same backend. So the counters hold what they would hold without
the cache, as the reference's do with its cache off (its default), and a counter read with
another limit (an override, a reload that raised the limit, another sidecar with other rules)
gets the answer it would get there. What a flood of refused requests costs the backend is one
small write per counter per turn instead of a call each. The reply to those writes is read
(`Added`): a counter that was under its limit before them was reset meanwhile (an operator's
reset, `sidecar.operator.counter_admin`, through this sidecar or any other sharing the store), and the
cache forgets it, so a reset lifts a limit on every sidecar after one turn of refusals each.
The cache is not used with `--rejected-hits skip`, where a refused request must still be
judged as a whole and adds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import structlog

from sidecar.errors import Overloaded, StorageError
from sidecar.model import Hit, Outcome

log = structlog.get_logger("sidecar.over_limit_cache")

#: A counter as the cache knows it: its key, its field (empty for a counter under its own key)
#: and its window's limit (`Hit.counter`), so a rule that changes the limit starts afresh.
Counter = tuple[bytes, bytes, int]


class OverLimitCache:
    """Counters mapped to the Unix ms when their over-limit window ends, and the hits refused
    on them not yet added to the backend."""

    def __init__(self, max_entries: int, count: Callable[[list[Hit]], None]) -> None:
        self.max_entries = max_entries
        #: Adds refused hits to the backend (the limiter's; its reply goes to `added`).
        self.count = count
        #: Whether `flush` is due at the end of this turn of the event loop.
        self._due = False
        #: counter -> when its window ends; empty when nothing is known to be over
        self.ends: dict[Counter, int] = {}
        #: (key, field) -> a hit refused on it and the hits refused on it in all, still to be
        #: added to the backend (at most one entry per counter refused since the last `take`).
        self.pending: dict[tuple[bytes, bytes], tuple[Hit, int]] = {}

    def __len__(self) -> int:
        return len(self.ends)

    def get(self, counter: Counter, now_ms: int) -> int | None:
        """When the over-limit window of `counter` ends, or None if it is not known to be over."""
        end = self.ends.get(counter)
        if end is None:
            return None
        if end <= now_ms:
            del self.ends[counter]
            return None
        return end

    def refuse(self, hits: Sequence[Hit], now_ms: int) -> tuple[Hit, int] | None:
        """The first of one descriptor's `hits` on a plain window known to be over, with when
        that window ends; None when there is none. When there is one, the descriptor is refused
        here and the hits its plain windows would have added are queued in `pending` (a plain
        fixed window adds a rejected hit too)."""
        for hit in hits:
            if not hit.window.plain:
                continue
            end = self.get(hit.counter, now_ms)
            if end is None:
                continue
            self.queue(hits)
            return hit, end
        return None

    def queue(self, hits: Sequence[Hit]) -> None:
        """Add `hits` to the backend with the next `flush`: the hits of plain windows a refused
        descriptor would have added (a plain fixed window adds a rejected hit too), or a
        refused request's usage counts (`sidecar.core.usage`), summed per counter."""
        pending = self.pending
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self.flush)
        for refused in hits:
            if refused.hits and refused.window.plain:
                name = (refused.key, refused.field)
                queued = pending.get(name)
                pending[name] = (
                    (refused, refused.hits)
                    if queued is None
                    else (queued[0], queued[1] + refused.hits)
                )

    def flush(self) -> None:
        """Add the pending hits to the backend now: at the end of the turn that refused them,
        or sooner, ahead of the limiter's next call to the backend (one turn's calls share a
        connection, which keeps them in order), so that call counts them as the reference would.
        The reply is not read: their answers were given."""
        self._due = False
        if self.pending:
            # A failure loses them: the calls that follow meet it too, and log it.
            with contextlib.suppress(StorageError, Overloaded):
                self.count(self.take())

    def take(self) -> list[Hit]:
        """The pending hits, one per counter with the sum refused on it; none pending after."""
        hits = [
            hit if hit.hits == total else dataclasses.replace(hit, hits=total)
            for hit, total in self.pending.values()
        ]
        self.pending.clear()
        return hits

    def put(self, counter: Counter, end_ms: int, now_ms: int) -> None:
        ends = self.ends
        if len(ends) >= self.max_entries:
            for stale in [e for e, end in ends.items() if end <= now_ms]:
                del ends[stale]
            if len(ends) >= self.max_entries:
                # Still full of live windows: start again rather than grow without bound.
                ends.clear()
        ends[counter] = end_ms

    def forget(self, counter: Counter) -> None:
        """`counter` is no longer known to be over (a refund took it back under its limit)."""
        self.ends.pop(counter, None)

    def forget_named(self, names: Sequence[tuple[bytes, bytes]]) -> int:
        """Forget the counters named (key, field), whatever limit each was found over at: an
        operator reset them (`sidecar.operator.counter_admin`), so they are asked of the backend again.
        Returns how many were known. Walks the whole cache: an operator's call, not a decision's."""
        named = set(names)
        stale = [counter for counter in self.ends if (counter[0], counter[1]) in named]
        for counter in stale:
            del self.ends[counter]
        return len(stale)

    def clear(self) -> None:
        """Forget every counter known to be over (new rules: each is asked again); the pending
        hits stay, to be added."""
        self.ends.clear()


class Added:
    """What the limiter hands the backend with the refused hits it adds (`OverLimitCache.flush`):
    reads the reply. A counter the reply finds under its limit before these hits (its
    `left_before`) cannot be over, so it was reset since it was cached: the cache forgets it.
    An object rather than a closure, which would leave a cycle for the collector per flush."""

    __slots__ = ("cache", "hits")

    def __init__(self, cache: OverLimitCache, hits: Sequence[Hit]) -> None:
        self.cache = cache
        self.hits = hits

    def __call__(self, outcomes: list[Outcome] | Exception) -> None:
        if isinstance(outcomes, Exception):
            added(outcomes)
            return
        ends = self.cache.ends
        for hit, outcome in zip(self.hits, outcomes, strict=True):
            if outcome.left_before > 0:
                ends.pop(hit.counter, None)


def added(outcomes: list[Outcome] | Exception) -> None:
    """The backend's reply to refused hits added (see `OverLimitCache.flush`). A failure loses
    them, as when adding them fails at once; anything else is a bug, logged."""
    if isinstance(outcomes, Exception) and not isinstance(outcomes, StorageError | Overloaded):
        log.error("over_limit_cache_count_failed", error=repr(outcomes))
