"""The Rate Limit Quota Service on grpc.aio: `RateLimitQuotaService/StreamRateLimitQuotas`.

One stream is one Envoy (one `rate_limit_quota` filter config): its first report names the
domain, and every report lists its buckets' allowed and denied requests since the last one.
Each bucket is matched against the rules (`buckets.resolve`); for a limited bucket the report's
allowed requests go to the shared store, and `allocator.allocate` decides the Envoy's next
assignment from the window's total and every Envoy's holder, which the store then keeps (read
again and allocated again, at most `ATTEMPTS` times, when another sidecar wrote in between).
Every report is answered with one action per bucket it lists (a new lease block: two, a reset;
see `convert.assignment_actions`).

Between reports the stream pushes what Envoy would otherwise miss: a refresh `REFRESH_MARGIN_MS`
before an assignment expires (counting what the Envoy may have admitted since its report), a
second decision `RETRY_MS` after a constrained one (once per report), a new block to an Envoy
whose lease its demand spends before its next report (`Assignment.dry_ms`: as it runs out, or
after another Envoy's report that may give budget back), the
next window's assignment as a spent window's DENY_ALL ends or as a lease ends with its window,
and an `abandon_action` for a bucket
whose rule was removed. A bucket no rule limits gets ALLOW_ALL (as ShouldRateLimit answers OK),
refreshed likewise without touching the store.

When the store fails, the bucket gets no action: Envoy keeps its last assignment until it
expires, then follows its `expired_assignment_behavior` (a new bucket its
`no_assignment_behavior`); the next report tries the store again.

Bounds: `MAX_BUCKETS` buckets per stream (past it the stream ends RESOURCE_EXHAUSTED); a bucket
id of at most 8 entries of at most 1,024 characters (else INVALID_ARGUMENT, see `convert`).

One module past the usual size because it is one stream's life: the reports it answers and the
pushes it schedules between them share the stream's buckets and its refresher; the pure parts
live apart (allocator.py, buckets.py, convert.py, store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped]
import structlog
from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc  # type: ignore[import-untyped]
from envoy.service.rate_limit_quota.v3.rlqs_pb2 import (  # type: ignore[import-untyped]
    RateLimitQuotaResponse,
)
from prometheus_client import Metric
from prometheus_client.registry import Collector

from sidecar.core.rules import Rules
from sidecar.errors import InvalidRequest, OverBound, Overloaded, StorageError
from sidecar.quota import convert
from sidecar.quota.allocator import (
    WINDOW_GRACE_MS,
    Assignment,
    Blanket,
    Holder,
    allocate,
    counted,
    lease_owed,
    owed_since,
)
from sidecar.quota.buckets import Bucket, resolve
from sidecar.quota.store import QuotaStore
from sidecar.rls.statuses import statuses

SERVICE_NAME = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
#: An assignment's `assignment_time_to_live` unless `--rlqs-assignment-ttl` says otherwise:
#: Envoy 1.40 reports every 5 s (whatever `reporting_interval` says), so a report's interval and
#: a second. Longer TTLs commit more of the budget ahead and leave less to share.
DEFAULT_TTL_MS = 6_000
#: Deadline of one store call: a decision is not on a request's path (Envoy enforces its last
#: assignment meanwhile), so it may wait longer than a ShouldRateLimit call.
STORE_TIMEOUT_MS = 1_000
#: A refresh goes this long before an assignment expires (at most a quarter of the TTL).
REFRESH_MARGIN_MS = 500
#: A constrained assignment (see `Assignment.constrained`) is decided again this soon, once
#: per report: Envoys that report together are decided one after the other, and the first
#: ones see the others' assignments still holding budget they are about to give back.
RETRY_MS = 250
#: Buckets one stream may hold.
MAX_BUCKETS = 10_000
#: Reads and writes of the store per decision when other sidecars keep writing in between.
ATTEMPTS = 3
#: The longest the refresh task sleeps (it also wakes when the rules change, or a retry is due).
TICK_MS = 1_000

log = structlog.get_logger("sidecar.quota")


@dataclass
class QuotaStats:
    """What the quota service counts, for `/metrics` (`QuotaCollector`)."""

    streams: int = 0
    reports: int = 0
    assignments: dict[str, int] = field(default_factory=dict)
    #: Shadow mode: the assignments that would have been enforced, by kind.
    shadow: dict[str, int] = field(default_factory=dict)
    abandons: int = 0
    store_errors: int = 0
    conflicts: int = 0
    invalid_streams: int = 0

    def count(self, assignment: Assignment) -> None:
        kind = assignment.blanket.value
        self.assignments[kind] = self.assignments.get(kind, 0) + 1
        if assignment.enforced is not None:
            kind = assignment.enforced.blanket.value
            self.shadow[kind] = self.shadow.get(kind, 0) + 1


@dataclass
class _Held:
    """One bucket of one stream: its rule (None: no rule limits it), this Envoy's holder, when
    it last reported, and when to refresh it."""

    bucket: Bucket | None
    holder: Holder | None = None
    reported_ms: int | None = None
    refresh_ms: int | None = None
    #: Whether a constrained assignment was decided again since the last report.
    retried: bool = False
    #: The interval between its last two reports (Envoy's reporting interval), ms.
    interval_ms: int | None = None
    #: When its lease is predicted spent before its next report (`Assignment.dry_ms`): the
    #: refresh due then is a dry push.
    dry_at: int | None = None

    def next_report_ms(self) -> int | None:
        """When its next report is due, if it reported twice."""
        if self.reported_ms is None or self.interval_ms is None:
            return None
        return self.reported_ms + self.interval_ms


class QuotaService:
    """Decides the assignments of every stream from `rules` and the shared `store`."""

    def __init__(
        self,
        rules: Rules,
        store: QuotaStore,
        *,
        clock: Callable[[], float] = time.time,
        ttl_ms: int = DEFAULT_TTL_MS,
        shadow_mode: bool = False,
    ) -> None:
        self.rules = rules
        self.store = store
        self.stats = QuotaStats()
        self._clock = clock
        self.ttl_ms = ttl_ms
        self._shadow_mode = shadow_mode
        self._sessions: set[_Session] = set()
        self._last_error = ""

    def set_rules(self, rules: Rules) -> None:
        """Serve `rules` from now on: every stream re-matches its buckets and abandons those
        whose rule is gone."""
        self.rules = rules
        for session in self._sessions:
            session.rules_changed = True
            session.wake.set()

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def resolve(self, domain: str, bucket: tuple[tuple[str, str], ...]) -> Bucket | None:
        return resolve(self.rules, domain, dict(bucket), self._shadow_mode)

    async def StreamRateLimitQuotas(self, request_iterator: Any, context: Any) -> None:
        """One Envoy's stream, until it ends or the server stops."""
        session = _Session(self, context)
        self._sessions.add(session)
        self.stats.streams += 1
        refresher = asyncio.create_task(session.refresh_forever())
        try:
            await session.read_forever()
        except (InvalidRequest, OverBound) as exc:
            # A report that breaks the protocol, or too many buckets: the stream ends with the
            # status `sidecar.rls.statuses` gives the error (INVALID_ARGUMENT, RESOURCE_EXHAUSTED).
            self.stats.invalid_streams += 1
            status, _ = statuses(exc)
            log.warning(
                "rlqs_stream_refused", envoy=session.envoy, status=status.name, error=str(exc)
            )
            await context.abort(grpc.StatusCode[status.name], str(exc))
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            self._sessions.discard(session)
            self.stats.streams -= 1

    async def decide(
        self,
        envoy: str,
        held: _Held,
        allowed: int,
        demand: float | None,
        now_ms: int,
        report: bool = True,
    ) -> Assignment | None:
        """The next assignment of a limited bucket, or None when the store failed. `report`:
        answering Envoy's report (else a refresh pushed between reports: a dry push when its
        lease was predicted spent)."""
        bucket = held.bucket
        assert bucket is not None
        budget = bucket.budget
        if budget.limit is None:
            assignment, held.holder = allocate(budget, envoy, demand, [], 0, now_ms, self.ttl_ms)
            return assignment
        start, _ = budget.window(now_ms)
        if not budget.shadow_mode:  # shadow: Envoy admitted under ALLOW_ALL, count it all
            allowed = counted(held.holder, allowed, start, now_ms)
        owed = holds = 0.0
        if not budget.pace:
            owed, holds = lease_owed(held.holder, allowed, start, now_ms, report)
        elif demand is None and held.holder is not None:
            owed = owed_since(held.holder, start, now_ms)
        try:
            for _ in range(ATTEMPTS):
                reported = await self.store.report(bucket.key, start, budget.window_ms, allowed)
                allowed = 0  # counted once, whatever happens next
                others = [h for name, h in reported.holders.items() if name != envoy]
                assignment, holder = allocate(
                    budget,
                    envoy,
                    demand,
                    others,
                    reported.used,
                    now_ms,
                    self.ttl_ms,
                    owed=owed,
                    current=held.holder,
                    holds=holds,
                    next_report_ms=held.next_report_ms(),
                    dry=not report and held.dry_at is not None and held.dry_at <= now_ms,
                )
                # Holders whose assignments ended before this window commit nothing any more.
                # (A lease ends with its window: kept a TTL more, its Envoy shares the next.)
                drop = [h.envoy for h in others if h.expires_ms + self.ttl_ms <= start]
                keep_ms = 2 * budget.window_ms + self.ttl_ms
                if await self.store.assign(bucket.key, holder, reported.version, drop, keep_ms):
                    held.holder = holder
                    return assignment
                self.stats.conflicts += 1
        except (StorageError, Overloaded) as exc:
            self.stats.store_errors += 1
            if str(exc) != self._last_error:
                self._last_error = str(exc)
                log.warning("rlqs_store_error", error=str(exc), kept="Envoy's last assignment")
            return None
        return None  # others kept writing: Envoy keeps its assignment until the next report


class _Session:
    """One stream: its Envoy's buckets, the reader and the refresher."""

    def __init__(self, service: QuotaService, context: Any) -> None:
        self.service = service
        self.context = context
        self.envoy = secrets.token_hex(8)
        self.domain: str | None = None
        self.buckets: dict[tuple[tuple[str, str], ...], _Held] = {}
        #: Set when the rules change, or a refresh is due sooner than the refresher sleeps.
        self.wake = asyncio.Event()
        self.rules_changed = False
        # Decisions of one stream run one at a time (a report and a refresh of the same bucket
        # must not both replace its holder), and so do writes to the stream.
        self._lock = asyncio.Lock()

    async def read_forever(self) -> None:
        while True:
            message = await self.context.read()
            if message is grpc.aio.EOF:
                return
            await self.handle(message)

    async def handle(self, message: Any) -> None:
        if self.domain is None:
            if not message.domain:
                raise InvalidRequest("the first usage report of a stream must name its domain")
            self.domain = message.domain
        elif message.domain and message.domain != self.domain:
            raise InvalidRequest(
                f"usage report for domain {message.domain!r} on a stream of {self.domain!r}"
            )
        lines = convert.usages(message)
        self.service.stats.reports += 1
        async with self._lock:
            now = self.service.now_ms()
            actions = []
            for line in lines:
                held = self.buckets.get(line.bucket)
                if held is None:
                    if len(self.buckets) >= MAX_BUCKETS:
                        raise OverBound(
                            f"more than {MAX_BUCKETS} buckets on one stream; split the filter's "
                            "bucket_id_builder into fewer buckets"
                        )
                    held = self.buckets[line.bucket] = _Held(
                        self.service.resolve(self.domain, line.bucket)
                    )
                demand = None
                if held.reported_ms is not None and now > held.reported_ms:
                    demand = (line.allowed + line.denied) * 1000 / (now - held.reported_ms)
                    held.interval_ms = now - held.reported_ms
                held.reported_ms = now
                held.retried = False
                actions += await self._action(line.bucket, held, line.allowed, demand, now)
            await self._send(actions)

    async def refresh_forever(self) -> None:
        """Push refreshes as assignments near their end, and abandons when rules change."""
        while True:
            due = [held.refresh_ms for held in self.buckets.values() if held.refresh_ms]
            wait_ms = min([TICK_MS, *(d - self.service.now_ms() for d in due)])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0, wait_ms) / 1000):
                    await self.wake.wait()
            async with self._lock:
                actions: list[Any] = []
                self.wake.clear()
                if self.rules_changed:
                    self.rules_changed = False
                    actions += self._rematch()
                now = self.service.now_ms()
                for bucket_id, held in list(self.buckets.items()):
                    if held.refresh_ms is not None and held.refresh_ms <= now:
                        actions += await self._action(bucket_id, held, 0, None, now, report=False)
                await self._send(actions)

    def _rematch(self) -> Iterator[Any]:
        """Match every bucket against the new rules: abandon those whose rule is gone, refresh
        the others at once (their limit may have changed)."""
        assert self.domain is not None
        now = self.service.now_ms()
        for bucket_id, held in list(self.buckets.items()):
            bucket = self.service.resolve(self.domain, bucket_id)
            if held.bucket is not None and bucket is None:
                del self.buckets[bucket_id]
                self.service.stats.abandons += 1
                yield convert.abandon_action(bucket_id)
                continue
            if bucket != held.bucket:
                held.bucket = bucket
                held.refresh_ms = now

    async def _action(
        self,
        bucket_id: tuple[tuple[str, str], ...],
        held: _Held,
        allowed: int,
        demand: float | None,
        now_ms: int,
        report: bool = True,
    ) -> list[Any]:
        """The actions that answer or refresh one bucket (none when the store failed)."""
        service = self.service
        if held.bucket is None:
            assignment: Assignment | None = Assignment(Blanket.ALLOW_ALL, service.ttl_ms)
        else:
            assignment = await service.decide(self.envoy, held, allowed, demand, now_ms, report)
        if assignment is None:
            # Try again at the next report, or in a second if the assignment runs out first.
            held.refresh_ms = now_ms + TICK_MS
            return []
        service.stats.count(assignment)
        log.debug(
            "rlqs_assignment",
            envoy=self.envoy,
            bucket=dict(bucket_id),
            strategy=assignment.blanket.value,
            rate=assignment.rate,
            max_tokens=assignment.max_tokens,
            ttl_ms=assignment.ttl_ms,
            report=demand is not None or allowed > 0,
            demand=held.holder.demand if held.holder is not None else None,
        )
        held.refresh_ms = _refresh_at(assignment, now_ms)
        held.dry_at = None
        if assignment.dry_ms is not None:
            # Its lease runs out before its next report: a new block is pushed then.
            held.dry_at = now_ms + assignment.dry_ms
            held.refresh_ms = min(held.refresh_ms, held.dry_at)
            self.wake.set()
        if assignment.constrained and not held.retried:
            held.retried = True
            held.refresh_ms = min(held.refresh_ms, now_ms + RETRY_MS)
            self.wake.set()  # sooner than the refresher may be sleeping
        return convert.assignment_actions(bucket_id, assignment)

    async def _send(self, actions: list[Any]) -> None:
        if actions:
            await self.context.write(RateLimitQuotaResponse(bucket_action=actions))


def _refresh_at(assignment: Assignment, now_ms: int) -> int:
    """When to push this bucket's next assignment if Envoy does not report before: as a spent
    window (or one whose lease ends with it) turns, or a little before the assignment expires."""
    expires = now_ms + assignment.ttl_ms
    if assignment.spent:
        return expires - WINDOW_GRACE_MS
    if assignment.turns:  # a lease that ends with its window: the next one's, as it begins
        return expires
    return expires - min(REFRESH_MARGIN_MS, assignment.ttl_ms // 4)


class QuotaServer:
    """A grpc.aio server for the QuotaService on its own address; `start` returns the port."""

    def __init__(self, service: QuotaService, address: str) -> None:
        self.service = service
        self.address = address
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        server = grpc.aio.server()
        rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(self.service, server)
        port = int(server.add_insecure_port(self.address))
        await server.start()
        self._server = server
        return port

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)


class QuotaCollector(Collector):
    """`ratelimit_sidecar_quota_*` on `/metrics`, read from QuotaStats when scraped; counters
    under exactly these names (no `_total`), as the sidecar's others."""

    def __init__(self, stats: QuotaStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        streams = Metric("ratelimit_sidecar_quota_streams", "RLQS streams open.", "gauge")
        streams.add_sample("ratelimit_sidecar_quota_streams", {}, float(stats.streams))
        yield streams
        plain = (
            ("reports", "Usage reports received.", stats.reports),
            ("abandons", "Buckets abandoned because their rule was removed.", stats.abandons),
            (
                "store_errors",
                "Decisions the shared store failed (no action sent).",
                stats.store_errors,
            ),
            ("conflicts", "Decisions made again: another sidecar wrote first.", stats.conflicts),
            ("invalid_streams", "Streams ended for an invalid report.", stats.invalid_streams),
        )
        for name, text, value in plain:
            yield _counter(name, text, {"": value})
        yield _counter("assignments", "Assignments sent, by strategy.", stats.assignments)
        yield _counter(
            "shadow", "Shadow mode: assignments not enforced, by strategy.", stats.shadow
        )


def _counter(name: str, text: str, values: dict[str, int]) -> Metric:
    """A counter named `ratelimit_sidecar_quota_<name>`; `values` by strategy ("": no label)."""
    full = f"ratelimit_sidecar_quota_{name}"
    metric = Metric(full, text, "counter")
    for strategy, value in sorted(values.items()):
        metric.add_sample(full, {"strategy": strategy} if strategy else {}, float(value))
    return metric
