"""Local aggregation: `approximate` windows decided in this process and synced to the store every
`--sync-interval-ms`, so that a busy counter costs the store one write per interval per
sidecar instead of one per request.

`Aggregated` wraps a backend, as `PerSecond` does. A hit on an `approximate` window whose count
this sidecar knows, freshly, is judged at once on its view (`sidecar.algorithms.approximate`:
the count the store last answered plus this sidecar's hits since) and counted there; every
other hit goes to the wrapped store as it is: those of other windows, and an approximate one
whose count is unknown (the first of its window) or stale, whose answer teaches the view the
count. A request with both waits for the store and hands on the outcomes in order.

Every `interval_ms` (`sync`), the hits counted locally go to the store in one `apply` per
FLUSH_HITS counters (one pipelined script call per hash slot), as plain adds, and the store's
answer is what each counter came to, all sidecars' synced hits included: the view learns the
global count in the round trip that writes its deltas. A view is fresh for `interval_ms` plus
the store's deadline after its count was asked: a counter hit less often than that costs a
store call per hit, as without aggregation.

Faults: a sync that fails (or is refused) keeps its hits pending and sends them again at the
next interval; meanwhile, and until a sync succeeds, no hit is judged locally: approximate hits
go to the store, so the failure mode answers them as any other while the store is down. The
hits pending for a window that has ended are sent once more, then dropped (the counter of a
window that ended is read by no one) and counted in `dropped_hits`. `close` syncs what is
pending before closing the store, so a clean restart loses no count.

Bounds: one view per counter hit in the last `interval_ms` plus deadline or with hits
pending, at most `max_counts` (a counter past that is decided by the store, as without
aggregation). A view costs about 160 bytes (tracemalloc over 20,000: the LocalCount, its key
and its dict slot), plus its counter's last Hit (about 200) once no request plan holds it. The overshoot bound is the algorithm module's:
``limit + (S - 1) × r × 2 × (interval + deadline)`` for `S` sidecars each receiving `r` hits per
second of one counter.

Usage counts (`sidecar.core.usage`) stay in the store and count a request as its answer says: when
some of a request's limits were judged here, its usage hits go to the store once every limit is
answered (`_with_usage`), so a domain with `usage` still costs the store a call per request.

One module past the usual size because decisions and syncs share one state: the views, their
pending hits and the failing flag are set by one and read by the other, on the same loop.

`--rejected-hits skip` (all or nothing) is decided by the store: a request cannot be all or
nothing across a local view and a store. The app refuses the two together.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.algorithms.approximate import LocalCount, count_after
from sidecar.algorithms.decide import Address, State
from sidecar.algorithms.fixed_window import groups_over
from sidecar.core.usage import as_refused
from sidecar.errors import StorageError
from sidecar.loop.callbacks import awaited
from sidecar.model import Dedupe, Hit, Outcome, Role, new
from sidecar.storage.base import Applied, Backend, ReportsFaults
from sidecar.storage.peers import CountsPeers

log = structlog.get_logger("sidecar.storage.aggregation")

#: Counters tracked at most, unless told otherwise.
MAX_COUNTS = 100_000
#: Counters one sync call carries at most: a script call's arguments stay a few hundred KB.
FLUSH_HITS = 1_000

Counter = tuple[bytes, bytes]


class _Tracked(LocalCount):
    """A LocalCount with the hit that last reached it: what its syncs add to (key, field, ttl)."""

    __slots__ = ("hit",)

    def __init__(self, hit: Hit, known: int, learned_ms: int) -> None:
        super().__init__(known, learned_ms)
        self.hit = hit


class Aggregated:
    """`backend` with its approximate windows decided locally and synced every `interval_ms`.

    `timeout_ms` is the store's deadline (a view is fresh for `interval_ms + timeout_ms`);
    `clock` is the sidecar's, in seconds, as the limiter's.
    """

    def __init__(
        self,
        backend: Backend,
        interval_ms: int,
        timeout_ms: int,
        *,
        clock: Callable[[], float] = time.time,
        max_counts: int = MAX_COUNTS,
    ) -> None:
        if interval_ms < 1:
            raise ValueError(f"the sync interval must be at least 1 ms, not {interval_ms}")
        self.backend = backend
        self.name = backend.name
        self.interval_ms = interval_ms
        self.fresh_ms = interval_ms + timeout_ms
        self.max_counts = max_counts
        self._clock = clock
        self._counts: dict[Counter, _Tracked] = {}
        #: A sync failed and none succeeded since: nothing is judged locally.
        self.failing = False
        self._timer: asyncio.Task[None] | None = None
        self._syncing: asyncio.Future[None] | None = None
        # What /metrics reports (AggregationCollector), since start.
        self.local_hits = 0
        self.store_hits = 0
        self.syncs = 0
        self.failed_syncs = 0
        self.synced_hits = 0
        self.dropped_hits = 0

    def __len__(self) -> int:
        return len(self._counts)

    # --- decisions ----------------------------------------------------------------------------

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """The approximate hits judged locally, the others by the store (see the module)."""
        if all_or_nothing or self.failing:
            self.backend.apply(hits, all_or_nothing, now_ms, done)
            return
        counts = self._counts
        fresh_after = now_ms - self.fresh_ms
        local: list[int] = []
        learning = False
        for position, hit in enumerate(hits):
            if hit.window.approximate:
                count = counts.get((hit.key, hit.field))
                # A refund (hits below 0) goes to the store, which floors it at 0; the views
                # learn the count it left with their next sync.
                if count is not None and count.learned_ms >= fresh_after and hit.hits >= 0:
                    local.append(position)
                else:
                    learning = True
        if not local:
            if learning:
                self.backend.apply(hits, False, now_ms, self._learning(hits, now_ms, done))
            else:
                self.backend.apply(hits, False, now_ms, done)
            return
        judged = {position: self._judge(hits[position], now_ms) for position in local}
        self.local_hits += len(local)
        if len(judged) == len(hits):
            done([judged[position] for position in range(len(hits))])
            return
        rest = [hit for position, hit in enumerate(hits) if position not in judged]
        if any(hit.role >= Role.USAGE for hit in rest):
            self._with_usage(hits, judged, now_ms, done, learning)
            return

        def answered(outcomes: list[Outcome] | Exception) -> None:
            if isinstance(outcomes, Exception):
                done(outcomes)
                return
            others = iter(outcomes)
            done([judged[at] if at in judged else next(others) for at in range(len(hits))])

        learned = self._learning(rest, now_ms, answered) if learning else answered
        self.backend.apply(rest, False, now_ms, learned)

    def _with_usage(
        self,
        hits: Sequence[Hit],
        judged: dict[int, Outcome],
        now_ms: int,
        done: Applied,
        learning: bool,
    ) -> None:
        """A request with usage hits (`sidecar.core.usage`) and hits judged here: its usage counts
        as admitted or refused by the request's answer, which the store cannot give alone, so
        the usage hits go to the store once every limit hit is answered (after the store's
        answer, when some were the store's)."""
        at_store = [
            position
            for position, hit in enumerate(hits)
            if position not in judged and hit.role < Role.USAGE
        ]
        usage_at = [
            position
            for position, hit in enumerate(hits)
            if position not in judged and hit.role >= Role.USAGE
        ]
        outcomes: dict[int, Outcome] = dict(judged)

        def count_usage() -> None:
            # The usage hits have no outcome yet, and count for nothing in it.
            limits_over = [at in outcomes and outcomes[at].over for at in range(len(hits))]
            over = groups_over(hits, limits_over)[1]
            usage = [as_refused(hits[at]) if over else hits[at] for at in usage_at]

            def counted(answer: list[Outcome] | Exception) -> None:
                if isinstance(answer, Exception):
                    done(answer)
                    return
                outcomes.update(zip(usage_at, answer, strict=True))
                done([outcomes[at] for at in range(len(hits))])

            self.backend.apply(usage, False, now_ms, counted)

        if not at_store:
            count_usage()
            return

        def answered(answer: list[Outcome] | Exception) -> None:
            if isinstance(answer, Exception):
                done(answer)
                return
            outcomes.update(zip(at_store, answer, strict=True))
            count_usage()

        limits = [hits[at] for at in at_store]
        self.backend.apply(
            limits,
            False,
            now_ms,
            self._learning(limits, now_ms, answered) if learning else answered,
        )

    def _judge(self, hit: Hit, now_ms: int) -> Outcome:
        """A hit judged and counted on its counter's local view."""
        count = self._counts[(hit.key, hit.field)]
        count.hit = hit  # the latest: a calendar window's ttl counts down
        over, remaining, left_before = count.judge(hit.hits, hit.window.requests_per_unit)
        return new(Outcome, (over, remaining, hit.end_ms - now_ms, True, left_before))

    def _learning(self, hits: Sequence[Hit], asked_ms: int, done: Applied) -> Applied:
        """`done`, after the approximate hits' outcomes have taught their views the count."""

        def learn(outcomes: list[Outcome] | Exception) -> None:
            if isinstance(outcomes, list):
                self._learn(hits, outcomes, asked_ms)
            done(outcomes)

        return learn

    def _learn(self, hits: Sequence[Hit], outcomes: list[Outcome], asked_ms: int) -> None:
        counts = self._counts
        for hit, outcome in zip(hits, outcomes, strict=True):
            if not hit.window.approximate or not outcome.applied:
                continue
            self.store_hits += 1
            limit = hit.window.requests_per_unit
            came_to = count_after(
                outcome.over, outcome.remaining, outcome.left_before, hit.hits, limit
            )
            where = (hit.key, hit.field)
            count = counts.get(where)
            if count is not None:
                count.learn(came_to, asked_ms)
            elif len(counts) < self.max_counts:
                counts[where] = _Tracked(hit, came_to, asked_ms)

    # --- usage (`sidecar.core.usage`): counted and read in the store ----------------------------

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        return await self.backend.usage_hashes(pattern)  # type: ignore[attr-defined, no-any-return]

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        return await self.backend.usage_unique(groups)  # type: ignore[attr-defined, no-any-return]

    # --- syncs --------------------------------------------------------------------------------

    def start(self) -> None:
        """Sync every `interval_ms` from now on, until `close` (needs a running event loop)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._every_interval())

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_ms / 1000)
            # Shielded: a sync cut short would leave its hits flying, neither counted by the
            # store for sure nor pending; `close` waits for it instead.
            self._syncing = asyncio.ensure_future(self.sync())
            await asyncio.shield(self._syncing)

    async def sync(self) -> None:
        """Send every counter's pending hits and learn what each came to; drop what is no longer
        needed. Syncs may overlap (a count's flying hits add up); the timer waits for each."""
        await self._sync()

    async def _sync(self) -> None:
        now_ms = int(self._clock() * 1000)
        counts = self._counts
        sending: list[tuple[_Tracked, int, bool]] = []  # (count, hits sent, its window ended)
        stale_before = now_ms - self.fresh_ms
        for where, count in list(counts.items()):
            ended = count.hit.end_ms <= now_ms
            if count.pending:
                sending.append((count, count.send(), ended))
            elif ended or count.learned_ms < stale_before:
                del counts[where]  # no use: a window that ended, or a view that is stale
        if not sending:
            return
        self.syncs += 1
        chunks = [sending[at : at + FLUSH_HITS] for at in range(0, len(sending), FLUSH_HITS)]
        answers = await asyncio.gather(
            *(self._send(chunk, now_ms) for chunk in chunks), return_exceptions=True
        )
        failure = next((a for a in answers if isinstance(a, BaseException)), None)
        if failure is None:
            if self.failing:
                self.failing = False
                log.info("sync_recovered", backend=self.name)
            return
        self.failed_syncs += 1
        if not self.failing:
            self.failing = True
            log.warning("sync_failed", backend=self.name, error=str(failure))

    async def _send(self, chunk: list[tuple[_Tracked, int, bool]], now_ms: int) -> None:
        """One store call adding `chunk`'s hits; each count learns what it came to, or takes
        its hits back when the call fails (dropped instead when its window has ended)."""
        hits = [
            dataclasses.replace(count.hit, hits=sent, group=index)
            for index, (count, sent, _) in enumerate(chunk)
        ]

        def start(done: Applied) -> None:
            self.backend.apply(hits, False, now_ms, done)

        try:
            outcomes: list[Outcome] = await awaited(start)
        except Exception:  # StorageError, Overloaded (or a bug): the hits are not lost
            for count, sent, ended in chunk:
                count.failed(sent)
                if ended:
                    self._drop(count)
            raise
        for (count, sent, ended), hit, outcome in zip(chunk, hits, outcomes, strict=True):
            limit = hit.window.requests_per_unit
            count.synced(
                sent,
                count_after(outcome.over, outcome.remaining, outcome.left_before, sent, limit),
                now_ms,
            )
            self.synced_hits += sent
            if ended and not count.pending and not count.flying:
                self._counts.pop((hit.key, hit.field), None)

    def _drop(self, count: _Tracked) -> None:
        """Forget a counter whose window ended with hits the store could not take."""
        if self._counts.pop((count.hit.key, count.hit.field), None) is None:
            return
        if count.pending:
            self.dropped_hits += count.pending
            log.warning("sync_dropped", hits=count.pending, key=count.hit.key.decode("latin-1"))

    # --- the rest of a backend ----------------------------------------------------------------

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        return await self.backend.record(batches, now_ms)

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        return await self.backend.read(addresses, now_ms)

    async def reset(self, addresses: Sequence[Address]) -> int:
        """Forget this sidecar's views of the counters at `addresses`, with their hits not yet
        synced (which would bring the counts back), then delete them in the store. Other
        sidecars' views learn the reset within `fresh_ms`; their unsynced hits still arrive."""
        for where in addresses:
            self._counts.pop(where if isinstance(where, tuple) else (where, b""), None)
        return await self.backend.reset(addresses)

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
        """Stop the timer, sync what is pending (a clean stop loses no count), close the store."""
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        if self._syncing is not None:
            with contextlib.suppress(Exception):
                await self._syncing
        try:
            await self.sync()
        except Exception as exc:  # logged: closing goes on whatever happened
            log.warning("sync_on_close_failed", error=str(exc))
        if self._counts and any(count.pending for count in self._counts.values()):
            lost = sum(count.pending for count in self._counts.values())
            log.warning("sync_lost_on_close", hits=lost)
        await self.backend.close()


class AggregationCollector(Collector):
    """`ratelimit_sidecar_aggregation_*`: the local view's work, read at scrape time."""

    def __init__(self, aggregated: Aggregated) -> None:
        self.aggregated = aggregated

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        a = self.aggregated
        for name, text, value in (
            ("local_hits", "Hits of approximate windows judged on the local view.", a.local_hits),
            (
                "store_hits",
                "Hits of approximate windows sent to the store (count unknown or stale).",
                a.store_hits,
            ),
            ("syncs", "Syncs that sent hits to the store.", a.syncs),
            ("failed_syncs", "Syncs the store failed or refused.", a.failed_syncs),
            ("synced_hits", "Hits the syncs added to the store.", a.synced_hits),
            (
                "dropped_hits",
                "Hits of windows that ended before a sync could add them.",
                a.dropped_hits,
            ),
        ):
            yield CounterMetricFamily(f"ratelimit_sidecar_aggregation_{name}", text, value=value)
        yield GaugeMetricFamily(
            "ratelimit_sidecar_aggregation_counters",
            f"Counters the local view tracks (at most {a.max_counts}).",
            value=len(a),
        )
