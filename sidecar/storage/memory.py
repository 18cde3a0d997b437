"""Counters in this process's memory: the embedded default, for one sidecar with no Redis.

Decisions are atomic because `apply` and `record` never await between reading and writing.
Every stored value expires (a window counter after its ttl, a token bucket once it would be full
again, a grouped counter when its field would be pruned from its Redis hash, the ids of a horizon
bucket when their time is up), and expired values are evicted, so memory stays bounded by the
live windows even under millions of distinct descriptor values. Counters are lost on restart.

On top of that, the values kept are at most `max_counters` (MAX_COUNTERS unless the URL says
`memory://?max_counters=N`): a flood of distinct descriptor values inside one long window would
otherwise grow without bound. Storing one more evicts the value whose window ends first (the
least it can cost: that window was the nearest to being forgotten anyway), and counts it in
`evicted` (`ratelimit_sidecar_memory_evictions`). An evicted counter starts again from zero if
its descriptor comes back, so under eviction a limit can admit more than it says: size the cap
for the live windows. A counter costs about BYTES_PER_COUNTER bytes.

A grouped counter (a field of a Redis hash) is stored here under ``(hash key, field)``: Redis
prunes a hash field by field, which this mirrors by giving each field its own expiry.
"""

from __future__ import annotations

import heapq
import itertools
import re
import time
from collections.abc import Callable, Sequence

from sidecar.algorithms import fixed_window, hyperloglog, refunds
from sidecar.algorithms.decide import Address, State, decide
from sidecar.algorithms.windows import FIELD_GRACE
from sidecar.model import Dedupe, Hit, Outcome, Role
from sidecar.storage.base import Applied

#: Read on every call: on Python 3.11 an enum member read through its class is a Python call.
_USAGE = Role.USAGE

#: Values kept at most, unless told otherwise: about 340 MB at BYTES_PER_COUNTER.
MAX_COUNTERS = 1_000_000
#: What one fixed-window counter costs: tracemalloc over 100,000 new counters of 15-byte
#: descriptor values, decided through the limiter (its key, its list, its heap entry, the
#: dict's slot): 337 bytes each.
BYTES_PER_COUNTER = 340


class MemoryBackend:
    name = "memory"

    def __init__(self, max_counters: int = MAX_COUNTERS) -> None:
        if max_counters < 1:
            raise ValueError(f"max_counters must be at least 1, not {max_counters}")
        self.max_counters = max_counters
        #: Values evicted to stay within max_counters, since start.
        self.evicted = 0
        # address -> [value, expires_at_ms]; a value is a count, a bucket or a set of ids.
        self._values: dict[Address, list[object]] = {}
        # (expires_at_ms, order, address), one entry per stored value; an entry found stale when
        # it comes up (its value was written again with a later expiry) is pushed back with the
        # new time. `order` breaks ties, since a key and a (key, field) pair do not compare.
        self._expiries: list[tuple[int, int, Address]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._values)

    def __bool__(self) -> bool:
        # An empty store is still a store: never let `backend or default` replace it.
        return True

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """Answered at once through `done` (see `Backend.apply`)."""
        try:
            outcomes = self._apply(hits, all_or_nothing, now_ms)
        except Exception as exc:  # a bug: answered as one, as the Backend contract says
            done(exc)
            return
        done(outcomes)

    def _apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int) -> list[Outcome]:
        self._evict(now_ms)
        if (
            len(hits) == 1
            and hits[0].window.plain
            and hits[0].role is not _USAGE
            and hits[0].packed is None
        ):
            return [self._apply_plain(hits[0], all_or_nothing, now_ms)]
        return self._decide(hits, all_or_nothing, now_ms, False, force=False)

    def _apply_plain(self, hit: Hit, all_or_nothing: bool, now_ms: int) -> Outcome:
        """`decide` for a request of one plain window, the reference's common case, without its
        bookkeeping for many windows and algorithms (the parity tests hold it to the script)."""
        where = (hit.key, hit.field) if hit.field else hit.key
        entry = self._values.get(where)
        current: int = 0 if entry is None else entry[0]  # type: ignore[assignment]
        cost = hit.hits
        over, before, after = fixed_window.judge(0, current, cost, hit.window.requests_per_unit, 0)
        if over and all_or_nothing and hit.role is not Role.SHADOW and cost >= 0:
            return Outcome(True, before, hit.end_ms - now_ms, False, before)
        if cost > 0:
            if entry is None:
                self._store(where, cost, now_ms + hit.ttl * 1000)
            else:
                entry[0] = current + cost
        elif cost < 0:
            return self._refund_plain(hit, where, entry, current, before, now_ms)
        return Outcome(over, after, hit.end_ms - now_ms, True, before)

    def _refund_plain(
        self,
        hit: Hit,
        where: Address,
        entry: list[object] | None,
        current: int,
        before: int,
        now_ms: int,
    ) -> Outcome:
        """A refund on one plain window (`sidecar.algorithms.refunds`): never over, the counter
        down by the refund, floored at 0 (deleted there); a missing counter stays missing."""
        left = refunds.counter(current, -hit.hits)
        if entry is not None:
            if left > 0:
                entry[0] = left
            else:
                del self._values[where]
        _, _, after = fixed_window.judge(0, left, 0, hit.window.requests_per_unit, 0)
        return Outcome(False, after, hit.end_ms - now_ms, True, before)

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        """For each batch: which of its impression ids were seen before (their hits ignored);
        the hits of the others are all applied, whatever the limits."""
        self._evict(now_ms)
        answers = []
        for hits, dedupe in batches:
            duplicates = self._remember(dedupe, now_ms)
            fresh = [hit for hit in hits if not duplicates[hit.group]]
            self._decide(fresh, False, now_ms, False, force=True)
            answers.append(duplicates)
        return answers

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        self._evict(now_ms)
        values = self._values
        return [
            None if (entry := values.get(where)) is None else entry[0]  # type: ignore[misc]
            for where in addresses
        ]

    async def reset(self, addresses: Sequence[Address]) -> int:
        # The heap entries of the values dropped are skipped when they come up (`_evict`).
        values = self._values
        return sum(values.pop(where, None) is not None for where in set(addresses))

    def _remember(self, dedupe: Dedupe, now_ms: int) -> list[bool]:
        """Add each id unseen in either bucket to the current one; True for the ids seen."""
        values = self._values
        previous = values.get(dedupe.previous)
        seen_before: set[str] = previous[0] if previous is not None else set()  # type: ignore[assignment]
        entry = values.get(dedupe.current)
        duplicates = []
        for identifier in dedupe.ids:
            current: set[str] = entry[0] if entry is not None else set()  # type: ignore[assignment]
            if identifier in seen_before or identifier in current:
                duplicates.append(True)
                continue
            duplicates.append(False)
            if entry is None:
                entry = self._store(dedupe.current, current, now_ms + dedupe.ttl_ms)
            current.add(identifier)
        return duplicates

    def _decide(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, read_only: bool, force: bool
    ) -> list[Outcome]:
        values = self._values

        def read(where: Address) -> State | None:
            entry = values.get(where)
            return None if entry is None else entry[0]  # type: ignore[return-value]

        outcomes, writes = decide(read, hits, now_ms, all_or_nothing, read_only, force)
        for write in writes:
            where = write.address
            entry = values.get(where)
            if write.member:
                if entry is None:
                    registers, _ = hyperloglog.add(hyperloglog.new(), write.member)
                    self._store(where, registers, now_ms + write.ttl_ms)
                else:
                    entry[0], _ = hyperloglog.add(entry[0], write.member)  # type: ignore[arg-type]
            elif write.state is not None:
                if write.ttl_ms <= 0:
                    # A refund filled the bucket: full and no state are the same, as on Redis.
                    values.pop(where, None)
                    continue
                expires_at = now_ms + write.ttl_ms
                if write.field:
                    # Redis keeps a grouped bucket's field until its keep-until plus the grace.
                    expires_at += FIELD_GRACE * 1000
                if entry is None:
                    self._store(where, write.state, expires_at)
                else:
                    entry[0], entry[1] = write.state, expires_at
            elif entry is None:
                if write.amount < 0:
                    # A refund judged on an earlier charge of this request that was refused
                    # after all (its descriptor over): nothing stored, nothing to give back.
                    continue
                self._store(where, write.amount, now_ms + write.ttl_ms)
            else:
                entry[0] += write.amount  # type: ignore[operator]
                if write.amount < 0 and entry[0] <= 0:  # type: ignore[operator]
                    del values[where]  # a refund took it to 0: no counter, as on Redis
        return outcomes

    def _store(self, where: Address, value: object, expires_at: int) -> list[object]:
        if len(self._values) >= self.max_counters:
            self._evict_earliest()
        entry: list[object] = [value, expires_at]
        self._values[where] = entry
        heapq.heappush(self._expiries, (expires_at, next(self._order), where))
        return entry

    def _evict(self, now_ms: int) -> None:
        expiries = self._expiries
        values = self._values
        while expiries and expiries[0][0] <= now_ms:
            _, order, where = heapq.heappop(expiries)
            entry = values.get(where)
            if entry is None:
                continue
            expires_at: int = entry[1]  # type: ignore[assignment]
            if expires_at <= now_ms:
                del values[where]
            else:
                heapq.heappush(expiries, (expires_at, order, where))

    def _evict_earliest(self) -> None:
        """Make room: drop the value whose window ends first."""
        expiries = self._expiries
        values = self._values
        while expiries:
            expires_at, order, where = heapq.heappop(expiries)
            entry = values.get(where)
            if entry is None:
                continue
            kept_until: int = entry[1]  # type: ignore[assignment]
            if kept_until != expires_at:  # kept longer since: its place in the heap moves
                heapq.heappush(expiries, (kept_until, order, where))
                continue
            del values[where]
            self.evicted += 1
            return

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Every usage count hash whose key matches `pattern` (a glob as Redis's SCAN MATCH
        reads it: `*` and `?`, `\\` escaping; no `[...]` classes, which `usage.count_pattern`
        never writes), its fields as Redis would list them."""
        self._evict(int(time.time() * 1000))
        matches = _glob(pattern)
        hashes: dict[bytes, dict[bytes, int]] = {}
        for where, entry in self._values.items():
            if isinstance(where, tuple) and matches(where[0]) and isinstance(entry[0], int):
                hashes.setdefault(where[0], {})[where[1]] = entry[0]
        return list(hashes.items())

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """For each group of HyperLogLog keys, the distinct members of their union (PFCOUNT)."""
        counts = []
        for keys in groups:
            union: hyperloglog.Registers = hyperloglog.new()
            for key in keys:
                entry = self._values.get(key)
                if entry is not None:
                    union = hyperloglog.merge(union, entry[0])  # type: ignore[arg-type]
            counts.append(hyperloglog.count(union))
        return counts

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._values.clear()
        self._expiries.clear()


def _glob(pattern: str) -> Callable[[bytes], bool]:
    """A test of keys against a glob as Redis's SCAN MATCH reads it (`*`, `?`, `\\`)."""
    parts = []
    escaped = False
    for char in pattern:
        if escaped:
            parts.append(re.escape(char))
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "*":
            parts.append(".*")
        elif char == "?":
            parts.append(".")
        else:
            parts.append(re.escape(char))
    compiled = re.compile("".join(parts).encode(), re.DOTALL)
    return lambda key: compiled.fullmatch(key) is not None
