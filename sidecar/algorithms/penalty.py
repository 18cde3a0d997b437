"""Penalties that escalate: a descriptor that goes over its limit is blocked for a while, longer
each time it trips again, the way fail2ban's escalating bans work.

A rule's `penalty` (`model.Penalty`: block, escalate, max, forget_after) is asked as one more
hit of its descriptor, after its windows, at a key of its own beside theirs (same hash slot),
so one script call still decides the request. Its state is a `Block`: until when the
descriptor is blocked, and how many times in a row it tripped (`strikes`).

- A hit of the descriptor (or a check) while it is blocked is over, whatever its windows hold:
  it is answered OVER_LIMIT with the time left in the block as its reset (Envoy's
  Retry-After), and adds nothing to any of the descriptor's counters: a blocked client is
  refused at no cost, and its limit's windows see only the traffic admitted before and after.
  In shadow mode (`shadow_mode: true`) the block is reported (over, counted in the stats) but
  not enforced: the hits are counted as they would be without a penalty.
- A hit that is not blocked and whose descriptor its windows find over trips the penalty: the
  descriptor is blocked from now on, for `block` the first time, each later strike `escalate`
  times the one before (rounded down to the millisecond), never more than `max`. The tripping
  request itself is answered as its windows answer it, its reset the block's length.
- The strikes are forgotten once the descriptor has stayed clear for `forget_after` after its
  last block ended: the next trip is a first strike again.
- A check (`hits_addend: 0`) never trips a penalty, nor does a refund (`is_negative_hits`),
  which is never blocked either; a read-only call (the operator port) writes nothing.

The state is stored as "<until ms>:<strikes>" and kept until `forget_after` past the block's
end, after which it says nothing anyway. `lua/decide.lua` renders the same rules, operation for
operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.model import Penalty


@dataclass(frozen=True, slots=True)
class Block:
    """A descriptor's penalty state: blocked until `until_ms` (Unix ms), after `strikes` trips
    in a row."""

    until_ms: int
    strikes: int

    def text(self) -> bytes:
        """How the state is stored (and how `lua/decide.lua` writes it)."""
        return b"%d:%d" % (self.until_ms, self.strikes)


def parse(raw: bytes) -> Block:
    """A stored state, as `Block.text` wrote it."""
    until, _, strikes = raw.partition(b":")
    return Block(int(until), int(strikes))


def length_ms(penalty: Penalty, strikes: int) -> int:
    """The block of the `strikes`-th trip in a row: `block_ms`, then `escalate` times the one
    before (rounded down), at most `max_ms`."""
    return _escalation(penalty, strikes)[0]


def level(penalty: Penalty, strikes: int) -> int:
    """Which step of the escalation `strikes` trips in a row reach: 1 for the first block, one
    more each time the block grew, no more once it stopped growing (at `max_ms`)."""
    return _escalation(penalty, strikes)[1]


def _escalation(penalty: Penalty, strikes: int) -> tuple[int, int]:
    """(the block's length, its step) after `strikes` trips in a row. The loop runs at most
    `strikes - 1` times (one a trip the descriptor served a block for) and stops once the
    length stops growing, at `max_ms` or when `escalate` is too small to add a millisecond."""
    length, step = penalty.block_ms, 1
    for _ in range(strikes - 1):
        grown = min(penalty.max_ms, math.floor(length * penalty.escalate))
        if grown <= length:
            break
        length, step = grown, step + 1
    return length, step


def remembered(stored: Block | None, penalty: Penalty, now_ms: int) -> Block | None:
    """`stored`, unless its strikes are forgotten at `now_ms` (`forget_after_ms` past its
    block's end): then None, as if nothing were stored (a store may keep it a while longer)."""
    if stored is None or stored.until_ms + penalty.forget_after_ms <= now_ms:
        return None
    return stored


def blocked(stored: Block | None, now_ms: int) -> bool:
    """Whether a descriptor whose state is `stored` is blocked at `now_ms`."""
    return stored is not None and stored.until_ms > now_ms


def trip(stored: Block | None, penalty: Penalty, now_ms: int) -> Block:
    """The state after a trip at `now_ms` (not blocked): one more strike, unless the last block
    ended `forget_after_ms` ago or more (or there was none), then the first."""
    stored = remembered(stored, penalty, now_ms)
    strikes = 1 if stored is None else stored.strikes + 1
    return Block(now_ms + length_ms(penalty, strikes), strikes)


def keep_ms(block: Block, penalty: Penalty, now_ms: int) -> int:
    """How long a state written at `now_ms` must be kept: until its strikes are forgotten."""
    return block.until_ms - now_ms + penalty.forget_after_ms


def parameters(penalty: Penalty) -> tuple[int, str, int, int]:
    """The penalty's four script parameters (p1..p4 of `lua/decide.lua`): the escalation as the
    shortest text that reads back as the same double, so both renderings multiply alike."""
    return (penalty.block_ms, repr(penalty.escalate), penalty.max_ms, penalty.forget_after_ms)
