"""Leased windows: `leased: true` rules decided in this process from blocks of their windows'
budgets (a token bucket's: of its tokens) taken from the store (`--lease-ms`), so that a busy
counter costs the store a few calls per window per sidecar instead of one per request, and
never admits past its limit.

`Leased` wraps a backend, as `Aggregated` does. A hit of a leased window is judged on this
sidecar's `Lease` of its counter (`sidecar.algorithms.lease`, which states the rules): admitted
from what it holds, refused once the window is spent, or, holding nothing, made to wait for the
block its arrival asks for. Every other hit goes to the wrapped store as it is, after the leased
ones are answered (usage counts last, counted as the whole request's answer says).

Renewals: a hit that leaves its lease `due` (what is held would last less than a quarter of
`lease_ms` at its rate) schedules a renewal for the end of this turn of the event loop; the
renewal takes every lease due then, and every block going back, in one `lease.lua` call per
hash slot (`LeaseStore`). So a steady stream of requests never waits on the store: only a
window's first hit, and a hit arriving while its lease holds nothing, wait for a block. Every
quarter of `lease_ms` a tick gives back the blocks of counters idle for `lease_ms` and forgets
the leases that hold nothing or whose window ended (what they held is counted in
`expired_units`: it is the window's under-admission); it visits only those, the leases being
kept in the order of their last hit.

Faults: a renewal that fails leaves the leases as they were: what they hold is still spent,
until their windows end; what it gave back is not sent again (the store may have taken it back
before the call failed: sent twice, it would be lent twice), and counts in `lost_units`; a hit that has to wait fails with StorageError, so `--failure-mode`
answers its request as any other while the store is down. `close` (SIGTERM) gives every block
back in one call per hash slot before closing the store. A store that restarted forgot what it
had handed out: `lease.lua` then grants nothing more for the windows that started before it did
(see its header), which costs the rest of each such window, never an over-admission; a bucket
it forgot is empty, not full, until a lease after its start.

A refund (`is_negative_hits`) of a leased window gives its units back to this sidecar's lease
of the window, never beyond what it spent (`Lease.refunded`). An operator's reset (`reset`)
deletes what the store lent and drops this sidecar's leases of the counters; other sidecars
keep theirs until they run out or their window ends.

A token bucket's lease has no window: it may spend what it took for `lease_ms` from its ask (its
term), then gives back what it holds with its next call; once the bucket has no whole token
left, it refuses until the next token is due (`period / rate`), then asks again.

Bounds: one lease per counter hit in its current window, at most `max_counts` (a hit past that
is decided by the store, as without leases), each about 250 bytes (its slots, key and dict
slot); the waiters of a lease are requests in flight, bounded by the server's own limits.

Not with `--rejected-hits skip` (all or nothing is the store's to decide): the app refuses the
two together, as for `approximate`.

One module past the usual size because `Leased` is one state (the leases, their renewals, the
hits waiting for a block) that every path through it reads and writes; the stores that settle
its asks (`LeaseStore`) are small beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from importlib.resources import files
from typing import Any, Protocol

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.crc import key_slot

from sidecar.algorithms import lease
from sidecar.algorithms.decide import Address, State
from sidecar.algorithms.fixed_window import groups_over
from sidecar.algorithms.token_bucket import Bucket
from sidecar.core.usage import as_refused
from sidecar.errors import Overloaded, StorageError
from sidecar.model import Algorithm, Dedupe, Hit, Outcome, Role, new
from sidecar.storage.base import Applied, Backend, ReportsFaults, RunsCommands
from sidecar.storage.peers import CountsPeers
from sidecar.storage.scripts import execute_script

log = structlog.get_logger("sidecar.storage.leases")

SCRIPT = (files("sidecar.algorithms") / "lua" / "lease.lua").read_text(encoding="utf-8")
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
#: Leases tracked at most, unless told otherwise.
MAX_COUNTS = 100_000
#: Counters one store call carries at most: its arguments stay a few hundred KB.
CALL_COUNTERS = 1_000
#: How much earlier than the store's start a window may have started and still be lent from
#: (sidecars' and store's clocks may differ this much; see `lua/lease.lua`).
CLOCK_MARGIN_MS = 1_000


#: How long a window's counter outlives its window (`lua/lease.lua` says why): keep them equal.
LATE_MS = 10_000
#: An Ask's `kind`, as `lua/lease.lua` numbers them.
WINDOW = 0
BUCKET = 1


class Ask:
    """One counter's part of a store call: give back `returned`, ask for `want`. A window's
    (`lease.settle`): its limit, start and end (Unix ms); a bucket's
    (`lease.settle_bucket`): its rate, period (ms) and capacity."""

    __slots__ = ("key", "kind", "p1", "p2", "p3", "returned", "want")

    def __init__(self, hit: Hit, returned: int, want: int) -> None:
        window = hit.window
        self.key = hit.key
        if window.algorithm is Algorithm.TOKEN_BUCKET:
            self.kind = BUCKET
            self.p1, self.p2, self.p3 = (
                window.requests_per_unit,
                window.seconds * 1000,
                window.capacity,
            )
        else:
            self.kind = WINDOW
            self.p1, self.p2, self.p3 = window.requests_per_unit, hit.start_ms, hit.end_ms
        self.returned = returned
        self.want = want


class LeaseStore(Protocol):
    """Where the windows' `taken` counts live: each ask answered by (block, left), in order."""

    async def settle(self, asks: Sequence[Ask], now_ms: int) -> list[tuple[int, int]]: ...


class RedisLeases:
    """`lua/lease.lua` on the store's Redis, one call per hash slot (per server, standalone)."""

    def __init__(
        self, client: RunsCommands, timeout_ms: int, by_slot: bool, name: str, lease_ms: int
    ) -> None:
        self._client = client
        self._timeout = timeout_ms / 1000
        self._by_slot = by_slot
        self._lease_ms = lease_ms
        self.name = name
        #: Store calls made (`lease.lua` runs), for /metrics and the benchmarks.
        self.calls = 0

    async def settle(self, asks: Sequence[Ask], now_ms: int) -> list[tuple[int, int]]:
        groups: dict[int, list[int]] = {}
        for index, ask in enumerate(asks):
            slot = key_slot(ask.key) if self._by_slot else 0
            groups.setdefault(slot, []).append(index)
        calls = [
            positions[at : at + CALL_COUNTERS]
            for positions in groups.values()
            for at in range(0, len(positions), CALL_COUNTERS)
        ]
        try:
            async with asyncio.timeout(self._timeout):
                replies = await asyncio.gather(
                    *(self._call([asks[i] for i in c], now_ms) for c in calls)
                )
        except (Overloaded, StorageError):
            raise
        except Exception as exc:  # every failure of the client is the store's StorageError
            raise StorageError(f"{self.name}: leases: {type(exc).__name__}: {exc}") from exc
        answers: list[tuple[int, int]] = [(0, 0)] * len(asks)
        for positions, reply in zip(calls, replies, strict=True):
            for n, index in enumerate(positions):
                answers[index] = (int(reply[2 * n]), int(reply[2 * n + 1]))
        return answers

    async def _call(self, asks: Sequence[Ask], now_ms: int) -> Any:
        args: list[Any] = [len(asks), *(ask.key for ask in asks)]
        args += (CLOCK_MARGIN_MS, now_ms, self._lease_ms)
        for ask in asks:
            args += (ask.kind, ask.p1, ask.p2, ask.p3, ask.returned, ask.want)
        self.calls += 1
        return await execute_script(self._client.execute, SHA, SCRIPT, *args)


class MemoryLeases:
    """The `taken` counts in this process (memory://: one sidecar, for tests and single use);
    a count is forgotten LATE_MS after its window, at most `max_counts` kept."""

    def __init__(self, max_counts: int = MAX_COUNTS) -> None:
        self._taken: dict[bytes, tuple[int, int]] = {}  # key -> (taken, expires at, ms)
        self._buckets: dict[bytes, Bucket] = {}
        self._max_counts = max_counts
        self.calls = 0

    async def settle(self, asks: Sequence[Ask], now_ms: int) -> list[tuple[int, int]]:
        self.calls += 1
        if len(self._taken) + len(self._buckets) >= self._max_counts:
            for key in [k for k, (_, e) in self._taken.items() if e <= now_ms]:
                del self._taken[key]
            self._buckets.clear()  # a bucket forgotten is a full one: only ever less kept
        return [
            self._bucket(ask, now_ms) if ask.kind == BUCKET else self._window(ask, now_ms)
            for ask in asks
        ]

    def forget(self, keys: set[bytes]) -> int:
        """Forget the counts of `keys` (an operator's reset); returns how many there were."""
        forgotten = 0
        for key in keys:
            forgotten += (self._taken.pop(key, None) is not None) + (
                self._buckets.pop(key, None) is not None
            )
        return forgotten

    def _window(self, ask: Ask, now_ms: int) -> tuple[int, int]:
        limit, expires_ms = ask.p1, ask.p3 + LATE_MS
        taken, expires_ms = self._taken.get(ask.key, (0, expires_ms))
        if expires_ms <= now_ms:  # too late: the count may have been forgotten, so spent
            taken = limit
        taken, block = lease.settle(limit, taken, ask.returned, ask.want)
        if ask.key in self._taken or len(self._taken) < self._max_counts:
            self._taken[ask.key] = (taken, expires_ms)
        else:  # full: refuse the block rather than lend what would be forgotten
            taken -= block
            block = 0
        return block, limit - taken

    def _bucket(self, ask: Ask, now_ms: int) -> tuple[int, int]:
        state = self._buckets.get(ask.key)
        after, block = lease.settle_bucket(
            state, now_ms, ask.p1, ask.p2, ask.p3, ask.returned, ask.want
        )
        if block or ask.returned or state is None:
            self._buckets[ask.key] = after
        return block, math.floor(after.tokens)


class _Counter(lease.Lease):
    """A Lease with the hit that last reached it (key, window, ttl) and the hits waiting for its
    next block: (request, position) pairs, in arrival order."""

    __slots__ = ("bucket", "hit", "returning", "waiters")

    def __init__(self, hit: Hit, lease_ms: int, now_ms: int) -> None:
        window = hit.window
        self.bucket = window.algorithm is Algorithm.TOKEN_BUCKET
        if self.bucket:
            # A bucket's lease ends `lease_ms` after it asked; its pace is its refill rate.
            limit, end_ms, window_ms = window.capacity, now_ms + lease_ms, window.seconds * 1000
            first = min(limit, lease.first_want(window.requests_per_unit, window_ms, lease_ms))
        else:
            limit, end_ms = window.requests_per_unit, hit.end_ms
            first = lease.first_want(limit, hit.end_ms - hit.start_ms, lease_ms)
        super().__init__(limit, end_ms, first, now_ms)
        self.hit = hit
        self.returning = 0
        self.waiters: list[tuple[_Request, int]] = []


class _Request:
    """One `apply` call with leased hits, until each has its outcome."""

    __slots__ = ("done", "failed", "hits", "leased", "now_ms", "outcomes", "waiting")

    def __init__(self, hits: Sequence[Hit], now_ms: int, done: Applied) -> None:
        self.hits = hits
        self.now_ms = now_ms
        self.done = done
        self.outcomes: list[Outcome | None] = [None] * len(hits)
        self.leased: list[tuple[int, _Counter]] = []
        self.waiting = 0
        self.failed = False


class Leased:
    """`backend` with its leased windows decided on leases of `lease_ms` of demand, taken from
    `leases`. `timeout_ms` is the store's deadline; `clock` the sidecar's, in seconds."""

    def __init__(
        self,
        backend: Backend,
        leases: LeaseStore,
        lease_ms: int,
        *,
        clock: Callable[[], float] = time.time,
        max_counts: int = MAX_COUNTS,
    ) -> None:
        if lease_ms < 4:
            raise ValueError(f"a lease must cover at least 4 ms of demand, not {lease_ms}")
        self.backend = backend
        self.leases = leases
        self.name = backend.name
        self.lease_ms = lease_ms
        self.lead_ms = lease_ms // 4
        self.max_counts = max_counts
        self._clock = clock
        #: In the order of their last hit (`tick` visits the idle ones only).
        self._counts: OrderedDict[bytes, _Counter] = OrderedDict()
        self._due: dict[bytes, _Counter] = {}
        self._renewing = False
        #: `close` has begun: no block is asked for any more (what comes is given back).
        self._closing = False
        self._calls: set[asyncio.Task[None]] = set()
        self._timer: asyncio.Task[None] | None = None
        # What /metrics reports (LeaseCollector), since start.
        self.local_hits = 0
        self.waited_hits = 0
        self.renewals = 0
        self.failed_renewals = 0
        self.granted_units = 0
        self.returned_units = 0
        self.expired_units = 0
        self.lost_units = 0
        self.refunded_units = 0

    def __len__(self) -> int:
        return len(self._counts)

    # --- decisions ----------------------------------------------------------------------------

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """The leased hits judged on their leases, the others by the store (see the module)."""
        if all_or_nothing or not any(hit.window.leased for hit in hits):
            self.backend.apply(hits, all_or_nothing, now_ms, done)
            return
        request = _Request(hits, now_ms, done)
        counts = self._counts
        for position, hit in enumerate(hits):
            if not hit.window.leased:
                continue
            if hit.hits < 0:
                request.outcomes[position] = self._refund_hit(hit, now_ms)
                continue
            count = counts.get(hit.key)
            if count is None or count.hit.end_ms != hit.end_ms:
                if count is None and len(counts) >= self.max_counts:
                    continue  # decided by the store, as without leases
                if count is not None:
                    self.expired_units += count.held  # a new window: the old lease ended
                    del counts[hit.key]
                count = counts[hit.key] = _Counter(hit, self.lease_ms, now_ms)
            else:
                counts.move_to_end(hit.key)
                if count.bucket and now_ms >= count.end_ms:
                    self._end_term(count, now_ms)
            count.hit = hit  # the latest: a calendar window's ttl counts down
            request.leased.append((position, count))
            verdict = count.judge(hit.hits, now_ms)
            if verdict == lease.WAIT:
                request.waiting += 1
                count.waiters.append((request, position))
                self.waited_hits += 1
            else:
                self.local_hits += 1
                request.outcomes[position] = _outcome(verdict, hit, count, now_ms)
            # A waiting hit asks whatever its lease holds (it may hold less than the hit's cost).
            if verdict == lease.WAIT or count.due(self.lead_ms):
                self._renew_soon(count)
        if request.waiting == 0:
            self._leased_answered(request)

    def _refund_hit(self, hit: Hit, now_ms: int) -> Outcome:
        """A refund (`is_negative_hits`) of a leased window: its units back to this sidecar's
        lease of the window, never beyond what the lease spent (`Lease.refunded`); never over.
        With no lease of the window here (spent through another sidecar's, or in a window that
        ended), nothing comes back, and nothing of the window is known to report."""
        count = self._counts.get(hit.key)
        if count is None or count.hit.end_ms != hit.end_ms:
            return new(Outcome, (False, 0, max(0, hit.end_ms - now_ms), False, 0))
        before = count.remaining()
        count.refunded(-hit.hits)
        self.refunded_units += count.remaining() - before
        return new(Outcome, (False, count.remaining(), max(0, hit.end_ms - now_ms), True, before))

    def _leased_answered(self, request: _Request) -> None:
        """Every leased hit has its outcome: undo the units of descriptors another leased window
        refused (a leased window spends nothing for a refused hit), then ask the store the rest."""
        hits = request.hits
        outcomes = request.outcomes
        refused = {
            hits[p].group
            for p, _ in request.leased
            if hits[p].role is Role.BLOCKING and outcomes[p].over  # type: ignore[union-attr]
        }
        if refused:
            for position, count in request.leased:
                hit = hits[position]
                outcome = outcomes[position]
                assert outcome is not None
                if hit.group in refused and outcome.applied and hit.role is Role.BLOCKING:
                    count.refund(hit.hits)
                    outcomes[position] = outcome._replace(applied=False)
        rest = [p for p, outcome in enumerate(outcomes) if outcome is None]
        if not rest:
            request.done(outcomes)  # type: ignore[arg-type]
            return
        limits = [p for p in rest if hits[p].role < Role.USAGE]
        usage = [p for p in rest if hits[p].role >= Role.USAGE]
        if limits:
            self._store(request, limits, lambda: self._usage(request, usage))
        else:
            self._usage(request, usage)

    def _usage(self, request: _Request, usage: list[int]) -> None:
        """The usage hits (`sidecar.core.usage`), counted as admitted or refused by the request's
        answer, once every limit hit has its outcome."""
        if not usage:
            request.done(request.outcomes)  # type: ignore[arg-type]
            return
        hits = request.hits
        over = groups_over(hits, [o is not None and o.over for o in request.outcomes])[1]
        sent = [as_refused(hits[p]) if over else hits[p] for p in usage]
        self._store(request, usage, lambda: request.done(request.outcomes), sent)  # type: ignore[arg-type]

    def _store(
        self,
        request: _Request,
        positions: list[int],
        then: Callable[[], None],
        sent: Sequence[Hit] | None = None,
    ) -> None:
        def answered(outcomes: list[Outcome] | Exception) -> None:
            if isinstance(outcomes, Exception):
                self._refund(request)
                request.done(outcomes)
                return
            for position, outcome in zip(positions, outcomes, strict=True):
                request.outcomes[position] = outcome
            then()

        hits = sent if sent is not None else [request.hits[p] for p in positions]
        self.backend.apply(hits, False, request.now_ms, answered)

    def _refund(self, request: _Request) -> None:
        """A request that ends in an error admitted nothing: its leased units go back."""
        for position, count in request.leased:
            outcome = request.outcomes[position]
            if outcome is not None and outcome.applied:
                count.refund(request.hits[position].hits)
                request.outcomes[position] = None

    # --- renewals -----------------------------------------------------------------------------

    def _end_term(self, count: _Counter, now_ms: int) -> None:
        """A bucket's lease ran its term: what it holds goes back with its next call."""
        count.returning += count.give_back()
        count.end_ms = now_ms + self.lease_ms  # the next block's term starts when it is asked
        if count.returning:
            self._renew_soon(count)

    def _renew_soon(self, count: _Counter) -> None:
        if self._closing:
            return
        self._due[count.hit.key] = count
        if not self._renewing:
            self._renewing = True
            asyncio.get_running_loop().call_soon(self._renew)

    def _renew(self) -> None:
        """One store call per hash slot for every lease due and every block going back."""
        self._renewing = False
        if self._closing:
            return
        due, self._due = self._due, {}
        if not due:
            return
        now_ms = int(self._clock() * 1000)
        asks: list[Ask] = []
        counts: list[_Counter] = []
        for count in due.values():
            if count.asking:
                continue
            if count.waiters and count.exhausted:
                self._serve(count)  # nothing more to ask for: they are refused
                continue
            waiting = sum(request.hits[p].hits for request, p in count.waiters)
            want = 0
            # Hits that came within the window wait for a block even if it has ended since.
            if count.waiters or (count.end_ms > now_ms and count.due(self.lead_ms)):
                count.asked(now_ms, self.lead_ms)  # the demand measured first: it sizes the ask
                want = count.want(self.lease_ms, waiting)
            elif count.returning:
                count.asking = True
            else:
                continue
            asks.append(Ask(count.hit, count.returning, want))
            counts.append(count)
        if not asks:
            return
        task = asyncio.ensure_future(self._settle(asks, counts, now_ms))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _settle(self, asks: list[Ask], counts: list[_Counter], now_ms: int) -> None:
        self.renewals += 1
        try:
            answers = await self.leases.settle(asks, now_ms)
        except Exception as exc:  # StorageError, Overloaded (or a bug): the leases stay as they are
            self.failed_renewals += 1
            log.warning("lease_renewal_failed", backend=self.name, error=str(exc))
            for ask, count in zip(asks, counts, strict=True):
                count.failed()
                # Not sent again: the store may have taken them back before the call failed,
                # and a return counted twice would lend them twice. Lost, they under-admit.
                count.returning -= ask.returned
                self.lost_units += ask.returned
                waiters, count.waiters = count.waiters, []
                for request, _ in waiters:
                    if not request.failed:
                        request.failed = True
                        self._refund(request)
                        request.done(
                            exc if isinstance(exc, StorageError) else StorageError(str(exc))
                        )
            return
        for ask, count, (block, left) in zip(asks, counts, answers, strict=True):
            self.granted_units += block
            self.returned_units += ask.returned
            count.returning -= ask.returned
            count.granted(block, left)
            if count.bucket and ask.want:
                count.end_ms = now_ms + self.lease_ms  # its term: from when it asked
                if count.exhausted:  # no whole token left: ask again once the next is due
                    window = count.hit.window
                    token_ms = -(-window.seconds * 1000 // window.requests_per_unit)
                    count.retry_ms = now_ms + token_ms
            self._serve(count)
            if count.returning:
                self._renew_soon(count)  # given back while this call was in flight

    def _serve(self, count: _Counter) -> None:
        """A block came: the waiting hits, in order, get it; those still short wait for the next."""
        waiters, count.waiters = count.waiters, []
        now_ms = int(self._clock() * 1000)
        for request, position in waiters:
            if request.failed:
                continue
            hit = request.hits[position]
            verdict = count.judge(hit.hits, now_ms)
            count.wanted -= hit.hits  # its demand was counted when it came
            if verdict == lease.WAIT:
                count.waiters.append((request, position))
                continue
            request.outcomes[position] = _outcome(verdict, hit, count, request.now_ms)
            request.waiting -= 1
            if request.waiting == 0:
                self._leased_answered(request)
        if count.waiters or count.due(self.lead_ms):
            self._renew_soon(count)

    # --- the tick: idle blocks back, ended windows forgotten -----------------------------------

    def start(self) -> None:
        """Tick every quarter of `lease_ms` from now on, until `close` (needs a running loop)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._every_tick())

    async def _every_tick(self) -> None:
        while True:
            await asyncio.sleep(max(self.lead_ms, 1) / 1000)
            self.tick(int(self._clock() * 1000))

    def tick(self, now_ms: int) -> None:
        """Give back the blocks of idle counters; forget the leases of ended windows."""
        # The leases are kept in the order of their last hit: only the idle ones are visited.
        idle = []
        for key, count in self._counts.items():
            if now_ms - count.last_hit_ms < self.lease_ms:
                break
            idle.append((key, count))
        for key, count in idle:
            if count.asking or count.waiters or count.returning:
                continue
            ended = 0 < count.hit.end_ms <= now_ms  # a bucket's lease has no window
            if ended or not count.held:
                self.expired_units += count.held if ended else 0
                del self._counts[key]  # its window ended, or it holds nothing: forgotten
            else:
                count.returning += count.give_back()
                self._renew_soon(count)

    # --- the rest of a backend ----------------------------------------------------------------

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        return await self.backend.record(batches, now_ms)

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        return await self.backend.read(addresses, now_ms)

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        return await self.backend.usage_hashes(pattern)  # type: ignore[attr-defined, no-any-return]

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        return await self.backend.usage_unique(groups)  # type: ignore[attr-defined, no-any-return]

    async def reset(self, addresses: Sequence[Address]) -> int:
        """Delete the values at `addresses` in the store (an operator lifting a limit), and drop
        this sidecar's leases of them. A leased window's budget is what `lua/lease.lua` lent of
        it, kept at the counter's own key (on memory://, in `MemoryLeases`): deleted, the store
        lends the whole limit again. The dropped leases are not given back (a return would come
        off what the store lends from now on), and what they held is counted as expired: this
        sidecar's next hits take a fresh block. Other sidecars sharing the store cannot be told:
        they decide from the blocks they hold until those run out or their window ends, and
        their next renewal takes from the fresh budget."""
        deleted = await self.backend.reset(addresses)
        keys = {where if isinstance(where, bytes) else where[0] for where in addresses}
        if isinstance(self.leases, MemoryLeases):
            deleted += self.leases.forget(keys)
        for key in keys:
            count = self._counts.pop(key, None)
            self._due.pop(key, None)
            if count is not None:
                self.expired_units += count.held
        return deleted

    async def ping(self) -> bool:
        return await self.backend.ping()

    def fault(self) -> str | None:
        return self.backend.fault() if isinstance(self.backend, ReportsFaults) else None

    async def peers(self, name: bytes) -> int:
        backend = self.backend
        if not isinstance(backend, CountsPeers):
            raise StorageError(f"{self.name} cannot count the sidecars sharing it")
        return await backend.peers(name)

    async def leave(self, name: bytes) -> None:
        if isinstance(self.backend, CountsPeers):
            await self.backend.leave(name)

    async def close(self) -> None:
        """Stop the tick, give every block back (SIGTERM: at once), close the store."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        await self.give_back()
        await self.backend.close()

    async def give_back(self) -> None:
        """Every block held goes back to the store now, in one call per hash slot."""
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        now_ms = int(self._clock() * 1000)
        asks = []
        for count in self._counts.values():
            returned = count.give_back() + count.returning
            count.returning = 0
            if returned:
                asks.append(Ask(count.hit, returned, 0))
        if not asks:
            return
        try:
            await self.leases.settle(asks, now_ms)
        except Exception as exc:  # logged: closing goes on whatever happened
            log.warning("lease_return_on_close_failed", error=str(exc))
            return
        self.returned_units += sum(ask.returned for ask in asks)


def _outcome(verdict: int, hit: Hit, count: _Counter, now_ms: int) -> Outcome:
    remaining = count.remaining()
    if verdict == lease.ADMITTED:
        return new(Outcome, (False, remaining, hit.end_ms - now_ms, True, remaining + hit.hits))
    return new(Outcome, (True, remaining, hit.end_ms - now_ms, False, remaining))


def store_for(backend: Backend, timeout_ms: int, lease_ms: int) -> LeaseStore:
    """Where `backend`'s windows keep their `taken` counts: its Redis (one call per hash slot
    on a cluster), or this process for memory://. Raises ValueError for any other store."""
    from sidecar.storage.cluster import RedisClusterBackend
    from sidecar.storage.memory import MemoryBackend

    if isinstance(backend, MemoryBackend):
        return MemoryLeases()
    if isinstance(backend, RunsCommands):
        cluster = isinstance(backend, RedisClusterBackend)
        return RedisLeases(backend, timeout_ms, cluster, backend.name, lease_ms)
    raise ValueError(
        f"--lease-ms needs redis://, redis+cluster://, redis+sentinel:// or memory://, "
        f"not {backend.name}"
    )


class LeaseCollector(Collector):
    """`ratelimit_sidecar_lease_*`: the leases' work, read at scrape time."""

    def __init__(self, leased: Leased) -> None:
        self.leased = leased

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        a = self.leased
        for name, text, value in (
            ("local_hits", "Hits of leased windows judged at once on their lease.", a.local_hits),
            ("waited_hits", "Hits of leased windows that waited for a block.", a.waited_hits),
            ("renewals", "Renewals: store calls taking or giving back blocks.", a.renewals),
            ("failed_renewals", "Renewals the store failed or refused.", a.failed_renewals),
            ("granted_units", "Units of budget the store lent.", a.granted_units),
            ("returned_units", "Units given back (idle counters, stops).", a.returned_units),
            ("expired_units", "Units held when their window ended (unspent).", a.expired_units),
            ("lost_units", "Units whose return failed, not sent again (unspent).", a.lost_units),
            ("refunded_units", "Units refunds gave back to leases.", a.refunded_units),
        ):
            yield CounterMetricFamily(f"ratelimit_sidecar_lease_{name}", text, value=value)
        yield GaugeMetricFamily(
            "ratelimit_sidecar_lease_counters",
            f"Counters leased now (at most {a.max_counts}).",
            value=len(a),
        )
