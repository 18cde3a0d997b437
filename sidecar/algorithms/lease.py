"""Leases: a fixed window's budget (or a token bucket's tokens) handed out in blocks to the
sidecars that share it, so that each decides its requests in memory and asks the store only
when its block runs low (`leased: true` rules under `--lease-ms`; `sidecar.storage.leases` does
the I/O, `lua/lease.lua` is the store's side). Pure: no I/O, every time is an argument.

The store keeps one number per counter, `taken`: the budget of the window handed out so far
(spent, or held by some sidecar). A holder's call returns what it gives back and asks for a
block (`settle`): the store takes the return off `taken`, then grants

    grant = min(want, ceil(2 × (limit - taken) / 3))

and adds it to `taken`. Rules, each tested in `tests/test_lease.py`:

- Never past the limit: ``taken <= limit`` after every call, and a holder admits only what it
  was granted and has not given back, so what a window admits (spent) plus what is held is at
  most `taken`, hence at most the limit, whatever happens to a holder. A hit of cost `c` is
  admitted when the holder holds `c` units (a cost above the limit never is); a refused hit
  spends nothing (unlike a plain window, whose counter counts rejected hits too).
- Sized by demand: a holder asks for what covers its demand over the next `lease_ms` (its
  rate of hits, measured between its calls over at least `lead_ms`; before it has one, the
  rule's average pace over `lease_ms`), less what it holds. A block is at most two thirds of
  what is left, so blocks shrink as the budget runs low, down to single units: the last requests of a window are decided one unit at a time, as
  exactly as a store call per request would. Taking a fixed part of what is left also keeps
  the calls per window near ``S + log3(limit) + S`` for `S` holders under any demand above the
  limit (a first block each, the shrinking ones, and an answer each that the window is spent);
  two thirds rather than a half saves a third of those calls, and leaves the others a third.
- Renewed ahead of need: a holder is `due` once what it holds would last less than `lead_ms` at
  its rate, so a steady stream of requests never waits on the store; only the first hit of a
  window, and hits arriving while a holder holds nothing, wait for a block.
- Given back: a holder whose counter had no hit for `lease_ms` returns what it holds (`idle`);
  a sidecar that stops returns everything at once. A holder that dies returns nothing: the
  store cannot tell what it spent from what it held (reclaiming what it held when it died
  would count as unspent what it may have admitted), so its block stays taken until the window
  ends, where every block ends: a lease is never used past its window.
- Exhausted: an answer that leaves nothing (``limit - taken == 0``) tells the holder the window
  is spent; it refuses the rest of the window without asking again.
- Refunds (Envoy's `is_negative_hits`): the units go back to the holder's lease, never beyond
  what it spent in its window (`refunded`): the store's `taken` does not change (the units are
  still out of it, held now instead of spent), so a refund never lends a unit twice, whoever
  sends it. A refund of units another holder spent gives nothing back here.

Token buckets (`settle_bucket`) are leased the same way, their tokens for the budget: a block is
at most two thirds of the whole tokens the bucket holds after what comes back, and a holder may
spend it for `lease_ms` from when it asked (its term); what it holds then goes back. A bucket
never gives a token twice, so a leased bucket admits no more than its tokens; a token may be
spent up to `lease_ms` after it left the bucket, so over a span `t` a bucket admits at most
``capacity + rate × (t + lease_ms)``. An answer that leaves no whole token makes the holder
refuse until the next token is due (``period / rate``), then ask again.

Under-admission bound: at the end of a window the budget not admitted is what holders still
hold, plus what dead holders held, plus what came back after the others saw the window spent.
A holder whose demand holds holds at most one block's worth of demand (``rate × lease_ms``,
and two thirds of what was left when it took it), and a busy holder spends that before the
window ends unless its block came in its last `lease_ms`; so a window whose demand stays above
the limit under-admits at most ``sum over holders of min(rate × lease_ms, its last block)``
plus what the holders that died or went idle held (each at most its largest block plus what
it held when it asked). Tested on random holders, demands, deaths and returns.
"""

from __future__ import annotations

import math

from sidecar.algorithms import token_bucket
from sidecar.algorithms.token_bucket import Bucket


def grant(limit: int, taken: int, want: int) -> int:
    """The block a holder asking for `want` gets when `taken` of `limit` is out already."""
    left = limit - taken
    if want <= 0 or left <= 0:
        return 0
    return min(want, -(-left * 2 // 3))  # two thirds, rounded up


def settle(limit: int, taken: int, returned: int, want: int) -> tuple[int, int]:
    """One holder's call: (`taken` after it, the block granted). `returned` comes off first (never
    below 0: a return to a counter the store forgot is ignored by the caller)."""
    taken = max(0, taken - returned)
    block = grant(limit, taken, want)
    return taken + block, block


def settle_bucket(
    state: Bucket | None,
    now_ms: int,
    rate: int,
    period_ms: int,
    capacity: int,
    returned: int,
    want: int,
    forgotten: bool = False,
) -> tuple[Bucket, int]:
    """One holder's call on a token bucket: (the bucket after it, the block granted). `state`
    None is a full bucket, or an empty one when the store may have `forgotten` it (it restarted
    less than a lease ago). Returned tokens go back first (up to the capacity); the block is at
    most two thirds of the whole tokens then in it."""
    if state is None and forgotten:
        bucket = Bucket(0.0, now_ms, 0.0)
    else:
        bucket = token_bucket.refill(state, now_ms, rate, period_ms, capacity)
    tokens = min(float(capacity), bucket.tokens + returned)
    block = grant(math.floor(tokens), 0, want)
    return Bucket(tokens - block, now_ms, bucket.drawn), block


#: What `Lease.judge` answers.
ADMITTED = 0
OVER = 1
WAIT = 2


class Lease:
    """One holder's lease of one counter's window: `held` units it may admit, what it spent,
    and its measured demand. Pure, with `__slots__` (one per counter in use)."""

    __slots__ = (
        "asking",
        "end_ms",
        "exhausted",
        "first_want",
        "held",
        "last_hit_ms",
        "left",
        "limit",
        "rate",
        "retry_ms",
        "since_ms",
        "spent",
        "taken",
        "wanted",
    )

    def __init__(self, limit: int, end_ms: int, first_want: int, now_ms: int) -> None:
        self.limit = limit
        self.end_ms = end_ms
        self.first_want = max(1, first_want)
        self.held = 0
        self.taken = 0  # what this holder took in this window, net of what it gave back
        self.spent = 0
        self.left = limit  # what the store had left at its last answer
        self.exhausted = False
        self.retry_ms = end_ms  # when an exhausted lease may ask again (a bucket refills)
        self.asking = False
        self.rate = 0.0  # hits per ms, measured between blocks
        self.wanted = 0  # hits asked for since `since_ms` (admitted or not)
        self.since_ms = now_ms
        self.last_hit_ms = now_ms

    def judge(self, cost: int, now_ms: int) -> int:
        """ADMITTED (spent from what is held), OVER, or WAIT (too little held, the window not
        spent: a block must come first). A check (cost 0) is admitted while a unit is held."""
        self.last_hit_ms = now_ms
        self.wanted += cost
        if cost > self.limit:
            return OVER
        if self.exhausted and now_ms >= self.retry_ms:
            self.exhausted = False
        if max(cost, 1) <= self.held:
            self.held -= cost
            self.spent += cost
            return ADMITTED
        if self.exhausted or now_ms >= self.end_ms:
            return OVER
        return WAIT

    def refund(self, cost: int) -> None:
        """Undo an admitted hit the request did not use (another of its windows refused it)."""
        self.held += cost
        self.spent -= cost

    def refunded(self, units: int) -> int:
        """A refund of `units`: what it spent comes back to what it holds, never more than it
        spent; returns how many came back. Its demand is untouched (it was asked for)."""
        back = min(units, max(0, self.spent))
        self.held += back
        self.spent -= back
        return back

    def due(self, lead_ms: int) -> bool:
        """Whether to ask for a block now: what is held would last less than `lead_ms`."""
        if self.asking or self.exhausted:
            return False
        if self.rate == 0:  # no demand measured (a new or idle lease): due once it is short
            return self.held == 0 and self.wanted > 0
        return self.held < max(1.0, self.rate * lead_ms)

    def want(self, lease_ms: int, waiting: int = 0) -> int:
        """What to ask for: `lease_ms` of demand less what is held, and at least `waiting`."""
        cover = math.ceil(self.rate * lease_ms) if self.rate > 0 else self.first_want
        return max(1, waiting, cover - self.held)

    def asked(self, now_ms: int, span_ms: int = 1) -> None:
        """A call asking for a block has been sent: measure the demand since the last measure,
        when `span_ms` at least have passed (a hit just after a block is no rate)."""
        self.asking = True
        elapsed = now_ms - self.since_ms
        if elapsed >= max(1, span_ms):  # else the last measure stands, and this one goes on
            self.rate = self.wanted / elapsed
            self.wanted = 0
            self.since_ms = now_ms

    def granted(self, block: int, left: int) -> None:
        """The store answered: `block` more units, `left` not handed out after it."""
        self.asking = False
        self.held += block
        self.taken += block
        self.left = left
        if left <= 0:
            self.exhausted = True

    def failed(self) -> None:
        """The call failed: what is held stays usable until the window ends."""
        self.asking = False

    def give_back(self) -> int:
        """Everything held, given back (idle, or the sidecar stops); the demand is measured
        afresh."""
        returned = self.held
        self.held = 0
        self.rate = 0.0
        self.wanted = 0
        self.taken -= returned
        return returned

    def idle(self, now_ms: int, lease_ms: int) -> bool:
        """No hit for `lease_ms` while holding something: what is held should go back."""
        return self.held > 0 and not self.asking and now_ms - self.last_hit_ms >= lease_ms

    def remaining(self) -> int:
        """What the window may still admit, as far as this holder knows: what it holds plus what
        the store had left at its last answer (others may have taken some since)."""
        return self.held + max(0, self.left)


def first_want(limit: int, window_ms: int, lease_ms: int) -> int:
    """A new holder's first ask: the rule's average pace over `lease_ms`, at least 1."""
    return max(1, -(-limit * lease_ms // max(1, window_ms)))
