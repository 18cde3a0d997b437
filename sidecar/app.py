"""The composition root: rules, backend, limiter, service, gRPC and HTTP servers, and shutdown.

`App.start` loads the rules (ConfigError on a bad file), opens the backend (ValueError for a
URL it cannot use), starts both servers and reports SERVING once the backend answered a ping.
`App.stop` is what SIGTERM and SIGINT trigger: unhealthy everywhere first, then no new calls,
calls in flight get a grace period, then the backend is closed.

One module past the usual size because it is the composition root: it is where every part is
built from `Options` and wired to the others, in start order and stopped in reverse; each part
lives in its own module, and a new part adds its few lines here.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import structlog

from sidecar import build, config, metrics
from sidecar.admin import AdminServer
from sidecar.errors import ConfigError, Overloaded, StorageError
from sidecar.frequency.caps import DEDUPE_HORIZON, FrequencyCaps
from sidecar.frequency.service import FrequencyService
from sidecar.health import Health
from sidecar.limiter import FailureMode, Limiter, RejectedHits, Settings
from sidecar.operator_port import OperatorCollector, OperatorError, OperatorPort, OperatorSettings
from sidecar.quota.service import (
    DEFAULT_TTL_MS,
    STORE_TIMEOUT_MS,
    QuotaCollector,
    QuotaServer,
    QuotaService,
)
from sidecar.quota.store import open_store
from sidecar.rls.extras import Extras, HeaderNames
from sidecar.rls.fast import FastServer
from sidecar.rls.h2.server import unix_path
from sidecar.rls.server import GrpcServer
from sidecar.rls.service import RateLimitService
from sidecar.rls.service import service as rate_limit_service
from sidecar.rls.tls import ServerTls, TlsError, TlsFiles
from sidecar.rules import Rules
from sidecar.side_ports import SidePort
from sidecar.stats import Stats
from sidecar.statsd import StatsdError, StatsdReporter, StatsdSettings
from sidecar.storage import Backend, peers
from sidecar.storage.aggregation import Aggregated, AggregationCollector
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.per_second import PerSecond
from sidecar.tracing import Tracing, TracingError, TracingSettings
from sidecar.usage import Reader
from sidecar.usage_api import TopKeys
from sidecar.xds.client import XdsClient, XdsOptions, check_files

#: Seconds between reads of the usage top keys for /metrics.
USAGE_METRICS_INTERVAL = 30.0
#: Seconds calls in flight get to finish once shutdown starts.
SHUTDOWN_GRACE = 5.0
#: Seconds between backend pings that keep the gRPC health status current.
HEALTH_INTERVAL = 2.0

#: The cycle collector's thresholds while serving (`gc.set_threshold`; Python's are 700, 10, 10).
#: A call makes no reference cycle (tests/test_garbage.py), so a collection finds nothing to
#: free: 300,000 calls each on a user of its own (compiled, in one process, Redis) ran 934
#: collections that collected 0 objects. What one costs is its pause, every call in flight
#: waiting. A young collection walks at most about 700 × 10 objects: medians 0.05 and 1 ms,
#: at most 0.7 and 5.6 ms. A full one walks all that is kept and not frozen (`_settle`),
#: mostly the plan cache (`sidecar.rls.service`; when it held 4,096 plans, of two descriptors
#: each, about 90,000 objects: 20 to 65 ms; it holds 1,024 now) and the memory backend's
#: counters. The third threshold makes
#: full ones ten times rarer: over 1,000,000 such calls, 23 (21 over 10 ms, up to 66 ms) at 10,
#: 2 (5 ms each) at 100, none at 1,000; 100 still collects, every few hundred thousand new
#: users, what other libraries may leave in cycles. The first two stay as they are: young
#: collections walk threshold 0 × threshold 1 objects, and measured up to 81 ms at 10,000 × 10
#: and 19 ms at 700 × 100.
GC_THRESHOLDS = (700, 10, 100)

#: `fast`: the sidecar's own HTTP/2 server (sidecar.rls.h2); `grpcio`: grpc.aio.
Transport = Literal["fast", "grpcio"]
TRANSPORTS: tuple[Transport, ...] = ("fast", "grpcio")

log = structlog.get_logger("sidecar.app")


class RlsServer(Protocol):
    """What the app needs of a transport: listen, report health, drain."""

    async def start(self) -> int: ...

    async def set_serving(self, serving: bool) -> None: ...

    async def stop(self, grace: float) -> None: ...


class InvalidOption(ValueError):
    """An address or backend URL the sidecar cannot start with; the message says why."""


#: The reference's names of its response headers (LIMIT_LIMIT_HEADER and the others' defaults).
_HEADER_NAMES = HeaderNames()


@dataclass(frozen=True)
class Options:
    """What `serve` needs; the CLI fills it from flags and RLS_* variables."""

    #: Rules files or directories; empty when the rules come over xDS (`xds`).
    config: Sequence[str | Path]
    backend: str = "memory://"
    #: A second store for the counters of per-second descriptors (the reference's
    #: REDIS_PERSECOND; `sidecar.storage.per_second`).
    backend_per_second: str | None = None
    grpc_address: str = "0.0.0.0:8081"
    http_address: str = "0.0.0.0:8080"
    redis_timeout_ms: int = 50
    failure_mode: FailureMode = "allow"
    #: Under failure_mode "local": how many sidecars share the counters (see Settings); None
    #: (`--local-divisor auto`): learned from the backend (`sidecar.storage.peers`).
    local_divisor: int | None = None
    rejected_hits: RejectedHits = "count"
    #: Decide `approximate` rules locally and sync their counts every this many ms
    #: (`sidecar.storage.aggregation`); None: off, every hit is decided by the store.
    sync_interval_ms: int | None = None
    shadow_mode: bool = False
    #: Entries of the over-limit cache (0: off).
    over_limit_cache: int = 100_000
    #: Keys per usage dimension in /metrics (today's with the most calls); 0: none.
    usage_metrics_top: int = 10
    #: Name the limit behind an OVER_LIMIT answer (a `RateLimit-Policy` header, dynamic metadata).
    response_limit_name: bool = False
    #: The reference's RateLimit-Limit/-Remaining/-Reset headers on every answer with a limit
    #: (LIMIT_RESPONSE_HEADERS_ENABLED), under these names.
    response_headers: bool = False
    response_limit_header: str = _HEADER_NAMES.limit
    response_remaining_header: str = _HEADER_NAMES.remaining
    response_reset_header: str = _HEADER_NAMES.reset
    #: The reference's dynamic metadata (RESPONSE_DYNAMIC_METADATA): the request's domain and
    #: descriptors, and the passing rules' `metadata`.
    response_dynamic_metadata: bool = False
    transport: Transport = "fast"
    #: Share the gRPC and HTTP ports with other processes (SO_REUSEPORT): `serve --workers N`.
    reuse_port: bool = False
    #: A listening Unix socket inherited from the parent of `serve --workers N`.
    grpc_socket_fd: int | None = None
    #: Permission bits set on a unix:PATH gRPC socket once bound (None: as the umask left them).
    grpc_socket_mode: int | None = None
    #: Seconds an impression id is remembered at least (frequency caps' exactly-once counting).
    dedupe_horizon: int = DEDUPE_HORIZON
    #: Seconds between looks at the rules files, and at the TLS files, for a change to reload
    #: (0: only on SIGHUP).
    config_poll_seconds: float = 2.0
    #: HOST:PORT of the Rate Limit Quota Service (`sidecar.quota`); None: not served.
    rlqs_address: str | None = None
    #: A quota assignment's `assignment_time_to_live`, in ms.
    rlqs_assignment_ttl_ms: int = DEFAULT_TTL_MS
    #: TLS (and with a client CA, mTLS) on the gRPC port; None: cleartext.
    tls: TlsFiles | None = None
    #: Where to send the stats as statsd or DogStatsD (beside /metrics); None: nowhere.
    statsd: StatsdSettings | None = None
    #: OpenTelemetry tracing of ShouldRateLimit; None: off, at no cost to a call.
    tracing: TracingSettings | None = None
    #: Rules from a control plane instead of files (`sidecar.xds`).
    xds: XdsOptions | None = None
    #: Unhealthy until rules with at least one domain are loaded.
    health_requires_config: bool = False
    #: Files declaring one domain add their descriptors to it (the reference's
    #: MERGE_DOMAIN_CONFIG; rules over xDS take theirs from `xds`).
    merge_domain_config: bool = False
    #: A rule's `unit: month` with no `calendar` is the UTC calendar month (the reference's
    #: USE_CALENDAR_MONTH_RATE_LIMIT; `config.parse`), in files and over xDS (`xds` has its own).
    calendar_months: bool = False
    #: Another listener for Prometheus (HOST:PORT, at `metrics_path`), as the reference's
    #: USE_PROMETHEUS/PROMETHEUS_ADDR; /metrics on the HTTP port stays.
    metrics_address: str | None = None
    metrics_path: str = "/metrics"
    #: Another listener for /rlconfig and /metrics, as the reference's DEBUG_PORT.
    debug_address: str | None = None
    #: The operator port (`sidecar.operator_port`: counters read and reset); None: not served.
    operator: OperatorSettings | None = None

    def extras(self) -> Extras:
        """What answers carry beside their statuses; raises InvalidOption for a header name
        that cannot be one."""
        try:
            headers = HeaderNames(
                self.response_limit_header,
                self.response_remaining_header,
                self.response_reset_header,
            )
        except ValueError as exc:
            raise InvalidOption(f"response headers: {exc}") from exc
        return Extras(
            limit_name=self.response_limit_name,
            headers=headers if self.response_headers else None,
            dynamic_metadata=self.response_dynamic_metadata,
        )


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """Which event loop runs the sidecar, "uvloop" or "asyncio" (logged when it starts)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def check_grpc_address(address: str) -> None:
    """`HOST:PORT` or `unix:PATH`; raises InvalidOption if malformed."""
    path = unix_path(address)
    if path is None:
        split_address(address)
    elif not path:
        raise InvalidOption(
            f"invalid address {address!r}: expected unix:PATH, e.g. unix:/run/rls.sock"
        )


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPv6]:PORT`) as host and port; raises InvalidOption if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65_535:
        raise InvalidOption(f"invalid address {address!r}: expected HOST:PORT, e.g. 0.0.0.0:8081")
    return host.strip("[]") or "0.0.0.0", int(port)


class App:
    """One running sidecar. `backend` and `clock` may be given (tests); by default from Options."""

    def __init__(
        self,
        options: Options,
        *,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.options = options
        self.stats = Stats()
        self.latency = metrics.Latency()
        #: The cycle collector's pauses, timed from the end of `start` to `stop`.
        self.gc_pauses = metrics.GcPauses()
        self.registry = metrics.registry(self.stats, self.latency, self.gc_pauses)
        self.registry.register(metrics.LimitsCollector(lambda: self.rules))
        self._backend = backend
        self._clock = clock
        self.grpc_port = 0
        self.http_port = 0
        self.rlqs_port = 0
        self._quota: QuotaService | None = None
        self._rlqs: QuotaServer | None = None
        self._grpc: RlsServer | None = None
        self._http: AdminServer | None = None
        self._health: Health | None = None
        self._watch: asyncio.Task[None] | None = None
        self._config_watch: asyncio.Task[None] | None = None
        self._tls: ServerTls | None = None
        self._tls_watch: asyncio.Task[None] | None = None
        self._usage_watch: asyncio.Task[None] | None = None
        self._statsd: StatsdReporter | None = None
        self._tracing: Tracing | None = None
        #: `--failure-mode local --local-divisor auto`: this sidecar's name among its peers,
        #: and the task that registers it (see `sidecar.storage.peers`).
        self._peer_name = peers.own_name()
        self._peers_watch: asyncio.Task[None] | None = None
        self._limiter: Limiter | None = None
        self._caps: FrequencyCaps | None = None
        self._last_config_error: str | None = None
        #: The rules served now (replaced by reloads and xDS pushes).
        self.rules = Rules()
        self._xds: XdsClient | None = None
        self._xds_task: asyncio.Task[None] | None = None
        self._side_ports: list[SidePort] = []
        #: Bound ports of --metrics-address and --debug-address (0 when not opened).
        self.metrics_port = 0
        self.debug_port = 0
        self._operator: OperatorPort | None = None
        #: Bound port of the operator port (0 when not opened).
        self.operator_port = 0
        self._stopped = False
        #: Whether this app owns the process's collector (`run`): then what it keeps is frozen
        #: after it starts and after each change of rules (`_settle`).
        self._owns_collector = False
        self._pending: set[asyncio.Task[None]] = set()
        #: The rules' warnings already logged (each is logged once).
        self._warned: set[str] = set()

    async def start(self) -> None:
        """Load, open and listen; raises ConfigError, InvalidOption or OSError after cleaning up."""
        options = self.options
        check_grpc_address(options.grpc_address)
        http_host, http_port = split_address(options.http_address)
        if options.rlqs_address is not None:
            split_address(options.rlqs_address)
        extras = options.extras()
        side_addresses = [
            (name, split_address(address))
            for name, address in (
                ("metrics", options.metrics_address),
                ("debug", options.debug_address),
            )
            if address is not None
        ]
        # Before the rules: a bad certificate or setting is reported at once, not after the
        # wait for a control plane's first rules.
        self._open_edges(options)
        config_marks: tuple[tuple[str, int, int, int], ...] = ()
        try:
            if options.xds is not None:
                rules = await self._start_xds(options.xds)
            else:
                # Taken before loading, so a change made while loading is seen as a change;
                # _load_rules reports what is wrong.
                with contextlib.suppress(OSError, ConfigError):
                    config_marks = config.fingerprint(options.config)
                rules = self._load_rules()
        except BaseException:
            await self.stop()  # the tracer's export thread, the xDS client
            raise
        self.rules = rules
        if self._backend is None:
            try:
                self._backend = open_backend(options.backend, timeout_ms=options.redis_timeout_ms)
                if options.backend_per_second is not None:
                    self._backend = self._per_second(self._backend, options.backend_per_second)
            except ValueError as exc:
                await self.stop()  # the xDS client may be running already
                raise InvalidOption(str(exc)) from exc
        store = self._backend  # the quota service's keys live beside the counters, unwrapped
        if options.sync_interval_ms is not None:
            try:
                self._backend = self._aggregated(store, options.sync_interval_ms)
            except ValueError as exc:
                await self.stop()
                raise InvalidOption(str(exc)) from exc
        backend = self._backend
        if isinstance(backend, MemoryBackend):
            self.registry.register(metrics.MemoryCollector(backend))
        limiter = Limiter(
            rules,
            backend if self._tracing is None else self._tracing.backend(backend),
            settings=Settings(
                shadow_mode=options.shadow_mode,
                rejected_hits=options.rejected_hits,
                failure_mode=options.failure_mode,
                local_divisor=options.local_divisor or 1,
            ),
            stats=self.stats,
            clock=self._clock,
            over_limit_cache=options.over_limit_cache,
        )
        self._limiter = limiter
        service = rate_limit_service(limiter, extras)
        health = self._health = Health(
            backend,
            backend_required=options.failure_mode == "deny",
            config_required=options.health_requires_config,
        )
        health.config_loaded = bool(rules.domains)
        # Frequency caps for ad servers: on the HTTP port, and on gRPC beside Envoy's service.
        caps = FrequencyCaps(
            rules, backend, clock=self._clock, dedupe_horizon=options.dedupe_horizon
        )
        self._caps = caps
        self._grpc = self._rls_server(service, FrequencyService(caps))
        self._http = AdminServer(
            service,
            rules,
            health,
            self.registry,
            http_host,
            http_port,
            SHUTDOWN_GRACE,
            reuse_port=options.reuse_port,
            frequency=caps,
            usage_reader=backend if isinstance(backend, Reader) else None,
            clock=self._clock,
        )
        if options.rlqs_address is not None:
            # Envoy's rate_limit_quota filter, on its own port, from the same rules and backend.
            self._quota = QuotaService(
                rules,
                open_store(store, STORE_TIMEOUT_MS),
                clock=self._clock,
                ttl_ms=options.rlqs_assignment_ttl_ms,
                shadow_mode=options.shadow_mode,
            )
            self.registry.register(QuotaCollector(self._quota.stats))
            self._rlqs = QuotaServer(self._quota, options.rlqs_address)
        self._side_ports = [
            SidePort(
                name,
                host,
                port,
                self.registry,
                lambda: self.rules,
                metrics_path=options.metrics_path if name == "metrics" else "/metrics",
                rlconfig=name == "debug",
                reuse_port=options.reuse_port,
            )
            for name, (host, port) in side_addresses
        ]
        try:
            self.grpc_port = await self._grpc.start()
            socket_path = unix_path(options.grpc_address)
            if socket_path is not None and options.grpc_socket_mode is not None:
                # Connecting to a Unix socket needs write permission on it: Envoy beside the
                # sidecar in a pod usually runs as another user.
                os.chmod(socket_path, options.grpc_socket_mode)
            self.http_port = await self._http.start()
            if self._rlqs is not None:
                self.rlqs_port = await self._rlqs.start()
            for side in self._side_ports:
                bound = await side.start()
                if side.name == "metrics":
                    self.metrics_port = bound
                else:
                    self.debug_port = bound
            if options.operator is not None:
                self._operator = self._operator_port(options.operator, limiter)
                self.operator_port = await self._operator.start()
        except BaseException:
            await self.stop()
            raise
        if self._statsd is not None:
            self._statsd.start()
        health.listen(self._grpc.set_serving)
        await health.check()
        self._watch = asyncio.create_task(health.watch(HEALTH_INTERVAL))
        if (
            options.failure_mode == "local"
            and options.local_divisor is None
            and isinstance(backend, peers.CountsPeers)
        ):
            await self._count_peers(backend, limiter)
            self._peers_watch = asyncio.create_task(self._learn_peers(backend, limiter))
        if options.config_poll_seconds > 0 and options.xds is None:
            self._config_watch = asyncio.create_task(
                self._watch_config(config_marks, options.config_poll_seconds)
            )
        if options.usage_metrics_top > 0 and isinstance(backend, Reader):
            # Today's top keys per usage dimension for /metrics, read in the background.
            top = TopKeys(lambda: self.rules, backend, options.usage_metrics_top, self._clock)
            self.registry.register(metrics.UsageCollector(top))
            self._usage_watch = asyncio.create_task(top.watch(USAGE_METRICS_INTERVAL))
        if options.config_poll_seconds > 0 and self._tls is not None:
            # Rules over xDS or from files, the certificate rotates on disk all the same.
            self._tls_watch = asyncio.create_task(
                self._tls.watch(options.config_poll_seconds, asyncio.sleep)
            )
        log.info(
            "started",
            grpc_port=self.grpc_port,
            http_port=self.http_port,
            rlqs_port=self.rlqs_port or None,
            metrics_port=self.metrics_port or None,
            debug_port=self.debug_port or None,
            operator_port=self.operator_port or None,
            rules="xds" if options.xds is not None else "files",
            grpc_address=options.grpc_address,
            http_address=options.http_address,
            transport=options.transport,
            tls="off" if options.tls is None else "mtls" if options.tls.client_ca else "tls",
            build=build.name(),
            loop=loop_name(asyncio.get_running_loop()),
            backend=backend.name,
            healthy=health.healthy,
            failure_mode=options.failure_mode,
            rejected_hits=options.rejected_hits,
            sync_interval_ms=options.sync_interval_ms,
            shadow_mode=options.shadow_mode,
            pid=os.getpid(),
        )
        self.gc_pauses.watch()

    def _open_edges(self, options: Options) -> None:
        """TLS on the gRPC port, the statsd reporter and the tracer, as `options` ask."""
        if options.tls is not None:
            try:
                self._tls = ServerTls(options.tls)
            except TlsError as exc:
                raise InvalidOption(f"gRPC TLS: {exc}") from exc
        if options.statsd is not None:
            try:
                self._statsd = StatsdReporter(options.statsd, self.stats, self.latency)
            except StatsdError as exc:
                raise InvalidOption(f"statsd: {exc}") from exc
        if options.tracing is not None:
            try:
                self._tracing = Tracing(options.tracing)
            except TracingError as exc:
                raise InvalidOption(f"tracing: {exc}") from exc

    def _per_second(self, main: Backend, url: str) -> PerSecond:
        if self.options.rejected_hits == "skip":
            raise ValueError(
                "--backend-per-second with --rejected-hits skip: two stores cannot decide one "
                "request all or nothing (use one of them)"
            )
        return PerSecond(main, open_backend(url, timeout_ms=self.options.redis_timeout_ms))

    def _aggregated(self, store: Backend, interval_ms: int) -> Aggregated:
        """`store` with `approximate` rules decided locally and synced every `interval_ms`."""
        if isinstance(store, MemoryBackend):
            raise ValueError(
                "--sync-interval-ms needs a shared store (redis://, redis+cluster:// or "
                "redis+sentinel://): memory:// counters are already local"
            )
        if self.options.rejected_hits == "skip":
            raise ValueError(
                "--sync-interval-ms with --rejected-hits skip: a request cannot be all or "
                "nothing across a local view and a store (use one of them)"
            )
        aggregated = Aggregated(
            store, interval_ms, self.options.redis_timeout_ms, clock=self._clock
        )
        aggregated.start()
        self.registry.register(AggregationCollector(aggregated))
        return aggregated

    def _operator_port(self, settings: OperatorSettings, limiter: Limiter) -> OperatorPort:
        """The operator port, on the store the limiter decides on (without tracing's wrapper);
        a reset also clears the counters from this process's over-limit cache."""
        cache = limiter.over_limit_cache
        assert self._backend is not None
        try:
            port = OperatorPort(
                settings,
                lambda: self.rules,
                self._backend,
                forget=cache.forget if cache is not None else lambda names: None,
                clock=self._clock,
                reuse_port=self.options.reuse_port,
            )
        except OperatorError as exc:
            raise InvalidOption(str(exc)) from exc
        self.registry.register(OperatorCollector(port.stats))
        return port

    def _rls_server(
        self, service: RateLimitService, frequency_service: FrequencyService
    ) -> RlsServer:
        options = self.options
        if options.transport == "grpcio":
            return GrpcServer(
                service,
                options.grpc_address,
                self.latency,
                reuse_port=options.reuse_port,
                frequency_service=frequency_service,
                tls=self._tls,
                tracing=self._tracing,
            )
        sock = None
        if options.grpc_socket_fd is not None:
            sock = socket.socket(fileno=options.grpc_socket_fd)
        return FastServer(
            service,
            options.grpc_address,
            self.latency,
            reuse_port=options.reuse_port,
            sock=sock,
            frequency_service=frequency_service,
            tls=self._tls,
            tracing=self._tracing,
        )

    @property
    def health(self) -> Health:
        """The serving state (after `start`)."""
        assert self._health is not None, "App.start() first"
        return self._health

    def _load_rules(self) -> Rules:
        try:
            rules = config.load(
                self.options.config,
                self.options.merge_domain_config,
                self.options.calendar_months,
            )
        except ConfigError:
            self.stats.config_load_error += 1
            raise
        self.stats.config_load_success += 1
        for domain in rules.domains.values():
            log.info("config_loaded", summary=domain.summary())
        self._warn(rules)
        return rules

    def _warn(self, rules: Rules) -> None:
        """Log each warning of the rules (see `sidecar.rules.ConfigWarning`) once, not at every reload."""
        for warning in rules.warnings():
            text = str(warning)
            if text not in self._warned:
                self._warned.add(text)
                log.warning("config_warning", warning=text)

    def reload(self) -> bool:
        """Load the rules again and serve them from the next call; keep the old ones on error.

        As the reference does: a bad file is counted (config_load_error) and logged once per
        distinct error, and the service goes on with the rules it had. Counters are untouched:
        their keys depend on the descriptors and windows, not on the rules' order.
        Rules from xDS are not reloaded: they change when the control plane pushes.
        """
        if self.options.xds is not None:
            log.info("config_reload_skipped", reason="rules come from xDS")
            return False
        try:
            rules = config.load(
                self.options.config,
                self.options.merge_domain_config,
                self.options.calendar_months,
            )
        except ConfigError as exc:
            self._reject_rules(exc)
            return False
        self._serve_rules(rules)
        log.info("config_reloaded", summaries=[d.summary() for d in rules.domains.values()])
        return True

    def _serve_rules(self, rules: Rules) -> None:
        """Serve `rules` from the next call on (a reload, or an xDS push)."""
        self._last_config_error = None
        self.stats.config_load_success += 1
        self._warn(rules)
        self.rules = rules
        if self._limiter is not None:
            self._limiter.rules = rules
            if self._limiter.over_limit_cache is not None:
                self._limiter.over_limit_cache.clear()  # what it knew was for the old limits
        if self._caps is not None:
            self._caps.set_rules(rules)
        if self._http is not None:
            self._http.rules = rules
        if self._quota is not None:
            self._quota.set_rules(rules)
        if self._owns_collector:
            _settle()
        if self._health is not None:
            # Health listeners are coroutines (the gRPC health status); the HTTP check and the
            # 2 s watch would catch up anyway, this makes it prompt.
            task = asyncio.get_running_loop().create_task(
                self._health.set_config_loaded(bool(rules.domains))
            )
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _reject_rules(self, error: ConfigError) -> None:
        """Count and log (once per distinct error) rules that cannot be served; the rules
        served before stay."""
        self.stats.config_load_error += 1
        if str(error) != self._last_config_error:
            self._last_config_error = str(error)
            log.warning("config_load_error", error=str(error), kept="previous rules")

    async def _start_xds(self, options: XdsOptions) -> Rules:
        """Start the xDS client; unless told to start without rules, wait for its first."""
        try:
            check_files(options)
        except OSError as exc:
            raise InvalidOption(f"xDS TLS: {exc}") from exc

        def applied(rules: Rules, version: str) -> None:
            self._serve_rules(rules)
            log.info(
                "config_loaded_xds",
                version=version,
                summaries=[d.summary() for d in rules.domains.values()],
            )

        def rejected(error: ConfigError, version: str) -> None:
            self._reject_rules(error)

        client = self._xds = XdsClient(options, applied, rejected)
        self._xds_task = asyncio.create_task(client.run())
        if options.force_start:
            log.info("xds_started_without_rules", server=options.server)
            return Rules()
        log.info("xds_waiting_for_rules", server=options.server, node_id=options.node_id)
        await client.first_rules.wait()
        return self.rules

    def reload_all(self) -> None:
        """SIGHUP: the rules, and the TLS files when they changed."""
        self.reload()
        if self._tls is not None:
            self._tls.reload()

    async def _watch_config(
        self, marks: tuple[tuple[str, int, int, int], ...], interval: float
    ) -> None:
        """Reload when the rules files change (polling their stat: no inotify needed, and a
        Kubernetes ConfigMap's symlink swap shows as a change)."""
        while True:
            await asyncio.sleep(interval)
            try:
                current = config.fingerprint(self.options.config)
            except (OSError, ConfigError):
                continue  # mid-swap, or a path gone: look again next time
            if current != marks:
                marks = current
                self.reload()

    async def _learn_peers(self, backend: peers.CountsPeers, limiter: Limiter) -> None:
        """Every PEERS_INTERVAL, register this sidecar with the backend and divide local limits
        by how many share it; while the backend fails, the last count stands (the first
        registration is made by `start`, so the count is known once it returns)."""
        while True:
            await asyncio.sleep(peers.PEERS_INTERVAL)
            await self._count_peers(backend, limiter)

    async def _count_peers(self, backend: peers.CountsPeers, limiter: Limiter) -> None:
        with contextlib.suppress(StorageError, Overloaded):  # failing or busy: keep the last
            limiter.share_with(await backend.peers(self._peer_name))

    async def stop(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Drain and stop; safe to call twice and after a failed start."""
        if self._stopped:
            return
        self._stopped = True
        if self._health is not None:
            await self._health.drain()
        for task in (
            self._watch,
            self._config_watch,
            self._peers_watch,
            self._tls_watch,
            self._usage_watch,
            self._xds_task,
        ):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._peers_watch is not None and isinstance(self._backend, peers.CountsPeers):
            await self._backend.leave(self._peer_name)
        stops = []
        if self._grpc is not None:
            stops.append(self._grpc.stop(grace))
        if self._http is not None:
            stops.append(self._http.stop())
        if self._rlqs is not None:
            # Streams never finish on their own: Envoys reconnect to another sidecar (or to
            # this one restarted) and keep their assignments meanwhile.
            stops.append(self._rlqs.stop(min(grace, 1.0)))
        stops.extend(side.stop() for side in self._side_ports)
        if self._operator is not None:
            stops.append(self._operator.stop())
        await asyncio.gather(*stops)
        if self._statsd is not None:
            await self._statsd.stop()  # what the last calls counted goes out too
        if self._tracing is not None:
            await asyncio.to_thread(self._tracing.shutdown)  # the last spans go out too
        if self._backend is not None:
            await self._backend.close()
        self.gc_pauses.unwatch()

    async def _start_unless(self, stopping: asyncio.Event) -> bool:
        """`start`, unless `stopping` is set first (a sidecar waiting for its first rules over
        xDS must still stop on SIGTERM); returns whether it started."""
        starting = asyncio.ensure_future(self.start())
        signalled = asyncio.ensure_future(stopping.wait())
        await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if starting.done():
            starting.result()  # raises what start raised
            return True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await self.stop()
        return False

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit status (0)."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        # Before starting: a SIGTERM that comes as soon as "started" is logged (a supervisor
        # stopping its workers) must stop the sidecar in order, not kill it.
        for signum in signals:
            loop.add_signal_handler(signum, stopping.set)
        try:
            if not await self._start_unless(stopping):
                log.info("stopped", before="the first rules arrived")
                return 0
            loop.add_signal_handler(signal.SIGHUP, self.reload_all)
            gc.set_threshold(*GC_THRESHOLDS)
            self._owns_collector = True
            _settle()
            await stopping.wait()
            log.info("stopping", grace_seconds=SHUTDOWN_GRACE)
            await self.stop()
        finally:
            for signum in (*signals, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        log.info("stopped", total_requests=self.stats.total_requests)
        return 0


def _settle() -> None:
    """Collect, then freeze what is left: what exists once the sidecar has started (modules,
    rules, servers) or has taken new rules lives until the process ends or the rules change.
    Out of the collector's sight, it is not walked again by every full collection
    (GC_THRESHOLDS), whose pause then grows only with what serving keeps since.

    Frozen objects are still freed by their reference counts, as the old rules are when new ones
    replace them (loading and dropping rules leaves nothing to collect), and as a closed
    connection is (`Connection.release`); only what would end in a cycle after this is never
    collected. The collection costs a full collection's pause once per change of rules (20 to
    40 ms with 4,096 plans cached, compiled; the cache holds at most 1,024 now).
    """
    gc.collect()
    gc.freeze()
