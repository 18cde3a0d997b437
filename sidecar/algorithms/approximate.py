"""Approximate fixed windows: one sidecar's view of a shared counter, decided locally and synced
periodically (`approximate: true` rules under `--sync-interval-ms`; `sidecar.storage.aggregation`
keeps one `LocalCount` per counter and does the I/O).

A counter's view is ``known + flying + pending``: `known` is the shared count as the store last
answered it (without this sidecar's hits still on their way to it), `flying` the hits this sidecar
sent in a sync that has not answered yet, `pending` the hits it counted since. A hit is judged
on the view exactly as a plain fixed window judges it on the stored counter (`fixed_window.judge`):
a hit of cost `c` is OVER_LIMIT when ``view + c > limit``, a cost above the limit always is, a check
(cost 0) is OVER_LIMIT once ``view >= limit``; every hit is counted, admitted or not, as a plain
window counts rejected hits, so the shared counter means what it means without aggregation. No
borrowing: a borrowing window's capacity depends on the previous window's count, which would have
to be approximated too, so the rules refuse `approximate` with `borrow` (and with the other
algorithms).

A sync sends `pending` (it becomes `flying`) and learns what the counter came to in the same
round trip: `known` becomes that count, which includes the hits it sent and every other
sidecar's synced so far. A sync that fails puts its hits back into `pending`, to be sent again.
A count learned otherwise (a hit sent to the store directly, while the view was stale) counts
`flying` as already in it, which is true when it was sent after the sync (one connection keeps
order) and errs towards admitting less when not.

Overshoot: the view never counts a hit that was not made, so it lags the true count only by the
other sidecars' hits not yet synced when `known` was learned, plus those made since. With sync
interval `T`, a view used only while `known` is at most `T + d` old (`d`: the store's deadline),
and the others syncing every `T`, each other sidecar's unseen hits are those of its last
``2 × (T + d)``: with `S` sidecars each receiving `r` hits per second of one counter, a window
admits at most ``limit + (S - 1) × r × 2 × (T + d)``, and never more than ``S × limit`` (each
sidecar counts its own hits exactly). Undershoot: none with hits of 1, since a sidecar refuses only
when its view, hence the true count, has reached the limit; as with an exact window, hits of
cost `c` can leave less than `c` unused. A sync whose answer was lost (past its deadline) may be
counted twice when sent again: that errs towards admitting less, never more.
"""

from __future__ import annotations

from sidecar.algorithms import fixed_window


class LocalCount:
    """One shared counter as one sidecar sees it: `known`, `flying` and `pending` as the module
    says, and `learned_ms`, when the count in `known` was asked for (a sync's or a direct
    call's send time: the store's count is at least that recent). Pure: times are arguments."""

    __slots__ = ("flying", "known", "learned_ms", "pending")

    def __init__(self, known: int, learned_ms: int) -> None:
        self.known = known
        self.flying = 0
        self.pending = 0
        self.learned_ms = learned_ms

    @property
    def view(self) -> int:
        return self.known + self.flying + self.pending

    def judge(self, cost: int, limit: int) -> tuple[bool, int, int]:
        """Count a hit of `cost` (0: a check, which counts nothing): (over, what the window
        admits after it, what it admitted before it), as a plain window's Outcome reports."""
        current = self.known + self.flying + self.pending
        over, before, after = fixed_window.judge(0, current, cost, limit, 0)
        self.pending += cost
        return over, after, before

    def send(self) -> int:
        """Start a sync: the pending hits become flying; returns how many to add to the store."""
        sent = self.pending
        self.flying += sent
        self.pending = 0
        return sent

    def synced(self, sent: int, count: int, asked_ms: int) -> None:
        """A sync of `sent` hits, asked at `asked_ms`, answered: the counter came to `count`
        (it includes them)."""
        self.flying -= sent
        # The store's count only grows within a window; `count` may be a floor (see `count_after`).
        self.known = max(self.known + sent, count)
        self.learned_ms = max(self.learned_ms, asked_ms)

    def failed(self, sent: int) -> None:
        """A sync of `sent` hits failed: they are pending again, for the next one."""
        self.flying -= sent
        self.pending += sent

    def learn(self, count: int, asked_ms: int) -> None:
        """The counter came to `count` in a call asked at `asked_ms`, outside a sync (a hit sent
        to the store as it is): the flying hits are taken to be in it (see the module)."""
        self.known = max(self.known, count - self.flying)
        self.learned_ms = max(self.learned_ms, asked_ms)


def count_after(over: bool, remaining: int, left_before: int, cost: int, limit: int) -> int:
    """What a plain window's counter came to after a hit of `cost` the store applied, from the
    Outcome it answered (over, remaining, left_before): exact, except when the counter was
    already at or past the limit before the hit, where the Outcome only says so; then the least
    it can be (`limit + cost`), which judges every later hit as the true count would."""
    if not over:
        return limit - remaining
    if left_before > 0:
        return limit - left_before + cost
    return limit + cost
