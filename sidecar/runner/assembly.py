"""The list of parts a sidecar runs (`sidecar.runner.parts`), built from its `Options`.

`Assembly.build` reads top to bottom in start order: the edges a bad setting stops at once (TLS,
statsd, tracing), the rules (files, or the xDS client that waits for its first push), the
backend, the decision path and what reads the rules, the listeners, the background watches,
and last the health report. Each part is added to `parts` as soon as it exists, so a build that
fails half way leaves a list the caller stops, in reverse, like any other.

A new part is one `self.parts.append(...)` (a listener, one `listeners.listeners.append(...)`);
a new consumer of rules is one `reading_rules(...)` entry.

One module past the usual size because it is where every part is built from `Options` and
wired to the others, in start order; each part itself lives in its own module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry

from sidecar import build
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.core.usage import Reader
from sidecar.decision.limiter import Limiter, Settings
from sidecar.decision.stats import Stats
from sidecar.errors import ConfigError, Overloaded, StorageError
from sidecar.frequency.caps import FrequencyCaps
from sidecar.frequency.service import FrequencyService
from sidecar.http.admin import AdminServer
from sidecar.http.health import Health
from sidecar.http.side_ports import SidePort
from sidecar.operator.port import OperatorCollector, OperatorError, OperatorPort
from sidecar.quota.service import STORE_TIMEOUT_MS, QuotaCollector, QuotaServer, QuotaService
from sidecar.quota.store import open_store
from sidecar.reports.usage import TopKeys
from sidecar.rls.fast import FastServer
from sidecar.rls.h2.server import unix_path
from sidecar.rls.server import GrpcServer
from sidecar.rls.service import RateLimitService
from sidecar.rls.service import service as rate_limit_service
from sidecar.rls.tls import ServerTls, TlsError
from sidecar.runner.options import InvalidOption, Options, split_address
from sidecar.runner.parts import Listener, Listeners, Part, background, closing, reading_rules
from sidecar.storage import Backend, peers
from sidecar.storage.aggregation import Aggregated, AggregationCollector
from sidecar.storage.backends import open_backend
from sidecar.storage.leases import LeaseCollector, Leased
from sidecar.storage.leases import store_for as leases_store
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.per_second import PerSecond
from sidecar.telemetry import metrics
from sidecar.telemetry.statsd import StatsdError, StatsdReporter
from sidecar.telemetry.tracing import Tracing, TracingError
from sidecar.xds.client import XdsClient, check_files

#: Seconds between reads of the usage top keys for /metrics.
USAGE_METRICS_INTERVAL = 30.0
#: Seconds calls in flight get to finish once shutdown starts.
SHUTDOWN_GRACE = 5.0
#: Seconds between backend pings that keep the gRPC health status current.
HEALTH_INTERVAL = 2.0

log = structlog.get_logger("sidecar.app")


class RlsServer(Protocol):
    """What the app needs of a transport: listen, report health, drain."""

    async def start(self) -> int: ...

    async def set_serving(self, serving: bool) -> None: ...

    async def stop(self, grace: float) -> None: ...


class Host(Protocol):
    """What the parts need of the app that runs them: its counters and metrics, its clock, the
    rules it serves, and how a new set of rules reaches every part."""

    stats: Stats
    latency: metrics.Latency
    registry: CollectorRegistry
    clock: Callable[[], float]
    rules: Rules

    def load_rules(self) -> Rules: ...

    def serve_rules(self, rules: Rules) -> None: ...

    def reject_rules(self, error: ConfigError) -> None: ...

    def reload(self) -> bool: ...


class Assembly:
    """Builds the parts of one sidecar from `options` (`build`), in start order, into `parts`;
    keeps the few a caller looks at (the limiter, the gRPC server, TLS, health, the ports)."""

    def __init__(self, options: Options, host: Host, backend: Backend | None = None) -> None:
        self.options = options
        self.host = host
        self.parts: list[Part] = []
        self.backend = backend
        self.listeners = Listeners()
        self.tls: ServerTls | None = None
        self.statsd: StatsdReporter | None = None
        self.tracing: Tracing | None = None
        self.limiter: Limiter | None = None
        self.grpc: RlsServer | None = None
        self.health: Health | None = None
        #: `--failure-mode local --local-divisor auto`: this sidecar's name among its peers.
        self.peer_name = peers.own_name()
        #: Health notifications in flight (see `_health_part`).
        self._pending: set[asyncio.Task[None]] = set()

    def build(self) -> None:
        """Every part, in start order; raises InvalidOption or ConfigError (the parts built
        until then are in `parts`, for the caller to stop)."""
        options = self.options
        http_host, http_port = split_address(options.http_address)
        for address in (options.rlqs_address, options.metrics_address, options.debug_address):
            if address is not None:
                split_address(address)
        extras = options.extras()
        # Before the rules: a bad certificate or setting is reported at once, not after the
        # wait for a control plane's first rules.
        self._edges()
        marks = self._rules()
        store = self._store()
        backend = self.backend = self._decided_by(store)
        if isinstance(backend, MemoryBackend):
            self.host.registry.register(metrics.MemoryCollector(backend))
        rules = self.host.rules
        limiter = self.limiter = Limiter(
            rules,
            backend if self.tracing is None else self.tracing.backend(backend),
            settings=Settings(
                shadow_mode=options.shadow_mode,
                rejected_hits=options.rejected_hits,
                failure_mode=options.failure_mode,
                local_divisor=options.local_divisor or 1,
                negative_hits=options.negative_hits,
            ),
            stats=self.host.stats,
            clock=self.host.clock,
            over_limit_cache=options.over_limit_cache,
        )
        self.parts.append(reading_rules("limiter", self._limiter_rules))
        service = rate_limit_service(limiter, extras)
        health = self.health = Health(
            backend,
            backend_required=options.failure_mode == "deny",
            config_required=options.health_requires_config,
        )
        health.config_loaded = bool(rules.domains)
        # Frequency caps for ad servers: on the HTTP port, and on gRPC beside Envoy's service.
        caps = FrequencyCaps(
            rules, backend, clock=self.host.clock, dedupe_horizon=options.dedupe_horizon
        )
        self.parts.append(reading_rules("frequency caps", caps.set_rules))
        grpc = self.grpc = self._rls_server(service, FrequencyService(caps))
        self.listeners.listeners.append(Listener("grpc", self._start_grpc, grpc.stop))
        admin = AdminServer(
            service,
            rules,
            health,
            self.host.registry,
            http_host,
            http_port,
            SHUTDOWN_GRACE,
            reuse_port=options.reuse_port,
            frequency=caps,
            usage_reader=backend if isinstance(backend, Reader) else None,
            clock=self.host.clock,
        )
        self.listeners.listeners.append(Listener("http", admin.start, _graceless(admin.stop)))
        self.parts.append(reading_rules("admin", functools.partial(setattr, admin, "rules")))
        self._quota(store)
        self._side_ports()
        self._operator_port(limiter)
        self.parts.append(self.listeners.part())
        self._watches(backend, limiter, marks)
        self.parts.append(self._health_part(health, grpc))

    def summary(self) -> dict[str, object]:
        """What the "started" log says of the parts: ports, where rules come from, the build."""
        options, ports, tls = self.options, self.listeners.ports, self.options.tls
        return {
            "grpc_port": ports.get("grpc", 0),
            "http_port": ports.get("http", 0),
            "rlqs_port": ports.get("rlqs"),
            "metrics_port": ports.get("metrics"),
            "debug_port": ports.get("debug"),
            "operator_port": ports.get("operator"),
            "rules": "xds" if options.xds is not None else "files",
            "grpc_address": options.grpc_address,
            "http_address": options.http_address,
            "transport": options.transport,
            "tls": "off" if tls is None else "mtls" if tls.client_ca else "tls",
            "build": build.name(),
            "backend": self.backend.name if self.backend is not None else None,
            "failure_mode": options.failure_mode,
            "rejected_hits": options.rejected_hits,
            "sync_interval_ms": options.sync_interval_ms,
            "lease_ms": options.lease_ms,
            "shadow_mode": options.shadow_mode,
        }

    def _edges(self) -> None:
        """TLS on the gRPC port, the statsd reporter and the tracer, as the options ask."""
        options = self.options
        if options.tls is not None:
            try:
                self.tls = ServerTls(options.tls)
            except TlsError as exc:
                raise InvalidOption(f"gRPC TLS: {exc}") from exc
        if options.tracing is not None:
            try:
                tracing = self.tracing = Tracing(options.tracing)
            except TracingError as exc:
                raise InvalidOption(f"tracing: {exc}") from exc

            async def shut_down() -> None:
                await asyncio.to_thread(tracing.shutdown)  # the last spans go out too

            self.parts.append(closing("tracing", shut_down))
        if options.statsd is not None:
            try:
                reporter = self.statsd = StatsdReporter(
                    options.statsd, self.host.stats, self.host.latency
                )
            except StatsdError as exc:
                raise InvalidOption(f"statsd: {exc}") from exc

            async def start() -> None:
                reporter.start()

            # Stopped after the listeners: what the last calls counted goes out too.
            self.parts.append(Part("statsd", start, _graceless(reporter.stop)))

    def _rules(self) -> tuple[tuple[str, int, int, int], ...]:
        """The first rules from files (ConfigError), or the xDS client's part, which waits for
        them when it starts; returns the files' marks for `_watch_config`."""
        options = self.options
        if options.xds is not None:
            self._xds()
            return ()
        marks: tuple[tuple[str, int, int, int], ...] = ()
        # Taken before loading, so a change made while loading is seen as a change;
        # load_rules reports what is wrong.
        with contextlib.suppress(OSError, ConfigError):
            marks = config.fingerprint(options.config)
        rules = self.host.rules = self.host.load_rules()
        # The list files the rules read, known once they are loaded (`sidecar.core.lists`).
        with contextlib.suppress(OSError):
            marks += config.fingerprint((), rules)
        return marks

    def _xds(self) -> None:
        options = self.options.xds
        assert options is not None
        try:
            check_files(options)
        except OSError as exc:
            raise InvalidOption(f"xDS TLS: {exc}") from exc
        host = self.host

        def applied(rules: Rules, version: str) -> None:
            host.serve_rules(rules)
            log.info(
                "config_loaded_xds",
                version=version,
                summaries=[d.summary() for d in rules.domains.values()],
            )

        def rejected(error: ConfigError, version: str) -> None:
            host.reject_rules(error)

        client = XdsClient(options, applied, rejected)
        running = background("xds", client.run)

        async def start() -> None:
            """Unless told to start without rules, the next parts start after the first."""
            await running.start()
            if options.force_start:
                log.info("xds_started_without_rules", server=options.server)
                return
            log.info("xds_waiting_for_rules", server=options.server, node_id=options.node_id)
            await client.first_rules.wait()

        self.parts.append(Part("xds", start, running.stop))

    def _store(self) -> Backend:
        """Where counters live (the quota service's keys live there too, unwrapped)."""
        options = self.options
        if self.backend is None:
            try:
                self.backend = open_backend(options.backend, timeout_ms=options.redis_timeout_ms)
                if options.backend_per_second is not None:
                    self.backend = self._per_second(self.backend, options.backend_per_second)
            except ValueError as exc:
                raise InvalidOption(str(exc)) from exc
        self.parts.insert(0, closing("backend", self._close_backend))  # closed last
        return self.backend

    async def _close_backend(self) -> None:
        if self.backend is not None:  # the store, or what wraps it (`_decided_by`)
            await self.backend.close()

    def _decided_by(self, store: Backend) -> Backend:
        """What decides the hits: `store`, or with --sync-interval-ms a local view of it, and
        with --lease-ms, leases of its windows for `leased` rules."""
        options = self.options
        backend = store
        try:
            if options.sync_interval_ms is not None:
                backend = self.backend = self._aggregated(store, options.sync_interval_ms)
            if options.lease_ms is not None:
                backend = self._leased(backend, store, options.lease_ms)
        except ValueError as exc:
            raise InvalidOption(str(exc)) from exc
        return backend

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
            store, interval_ms, self.options.redis_timeout_ms, clock=self.host.clock
        )
        aggregated.start()
        self.host.registry.register(AggregationCollector(aggregated))
        return aggregated

    def _leased(self, backend: Backend, store: Backend, lease_ms: int) -> Leased:
        """`backend` with `leased` rules decided from leases of `store`'s windows."""
        if self.options.rejected_hits == "skip":
            raise ValueError(
                "--lease-ms with --rejected-hits skip: a request cannot be all or nothing "
                "across leases and a store (use one of them)"
            )
        leased = Leased(
            backend,
            leases_store(store, self.options.redis_timeout_ms, lease_ms),
            lease_ms,
            clock=self.host.clock,
        )
        leased.start()
        self.host.registry.register(LeaseCollector(leased))
        return leased

    def _limiter_rules(self, rules: Rules) -> None:
        limiter = self.limiter
        assert limiter is not None
        limiter.rules = rules
        if limiter.over_limit_cache is not None:
            limiter.over_limit_cache.clear()  # what it knew was for the old limits

    def _rls_server(
        self, service: RateLimitService, frequency_service: FrequencyService
    ) -> RlsServer:
        options = self.options
        if options.transport == "grpcio":
            return GrpcServer(
                service,
                options.grpc_address,
                self.host.latency,
                reuse_port=options.reuse_port,
                frequency_service=frequency_service,
                tls=self.tls,
                tracing=self.tracing,
            )
        sock = None
        if options.grpc_socket_fd is not None:
            sock = socket.socket(fileno=options.grpc_socket_fd)
        return FastServer(
            service,
            options.grpc_address,
            self.host.latency,
            reuse_port=options.reuse_port,
            sock=sock,
            frequency_service=frequency_service,
            tls=self.tls,
            tracing=self.tracing,
        )

    async def _start_grpc(self) -> int:
        assert self.grpc is not None
        port = await self.grpc.start()
        socket_path = unix_path(self.options.grpc_address)
        if socket_path is not None and self.options.grpc_socket_mode is not None:
            # Connecting to a Unix socket needs write permission on it: Envoy beside the
            # sidecar in a pod usually runs as another user.
            os.chmod(socket_path, self.options.grpc_socket_mode)
        return port

    def _quota(self, store: Backend) -> None:
        """Envoy's rate_limit_quota filter, on its own port, from the same rules and backend."""
        options = self.options
        if options.rlqs_address is None:
            return
        quota = QuotaService(
            self.host.rules,
            open_store(store, STORE_TIMEOUT_MS),
            clock=self.host.clock,
            ttl_ms=options.rlqs_assignment_ttl_ms,
            shadow_mode=options.shadow_mode,
        )
        self.host.registry.register(QuotaCollector(quota.stats))
        self.parts.append(reading_rules("quota", quota.set_rules))
        rlqs = QuotaServer(quota, options.rlqs_address)

        async def stop(grace: float) -> None:
            # Streams never finish on their own: Envoys reconnect to another sidecar (or to
            # this one restarted) and keep their assignments meanwhile.
            await rlqs.stop(min(grace, 1.0))

        self.listeners.listeners.append(Listener("rlqs", rlqs.start, stop))

    def _side_ports(self) -> None:
        """--metrics-address and --debug-address, the reference's other ports."""
        options = self.options
        host = self.host
        for name, address in (
            ("metrics", options.metrics_address),
            ("debug", options.debug_address),
        ):
            if address is None:
                continue
            side_host, side_port = split_address(address)
            side = SidePort(
                name,
                side_host,
                side_port,
                host.registry,
                lambda: host.rules,
                metrics_path=options.metrics_path if name == "metrics" else "/metrics",
                rlconfig=name == "debug",
                reuse_port=options.reuse_port,
            )
            self.listeners.listeners.append(Listener(name, side.start, _graceless(side.stop)))

    def _operator_port(self, limiter: Limiter) -> None:
        """The operator port (`--operator-address`: counters read and reset), on the store the
        limiter decides on (without tracing's wrapper); a reset also clears the counters from
        this process's over-limit cache."""
        settings = self.options.operator
        if settings is None:
            return
        assert self.backend is not None
        cache = limiter.over_limit_cache
        host = self.host
        try:
            port = OperatorPort(
                settings,
                lambda: host.rules,
                self.backend,
                forget=cache.forget_named if cache is not None else lambda names: None,
                clock=host.clock,
                reuse_port=self.options.reuse_port,
            )
        except OperatorError as exc:
            raise InvalidOption(str(exc)) from exc
        host.registry.register(OperatorCollector(port.stats))
        self.listeners.listeners.append(Listener("operator", port.start, _graceless(port.stop)))

    def _watches(
        self, backend: Backend, limiter: Limiter, marks: tuple[tuple[str, int, int, int], ...]
    ) -> None:
        """The background tasks: peers, the rules files, usage for /metrics, the TLS files."""
        options = self.options
        if (
            options.failure_mode == "local"
            and options.local_divisor is None
            and isinstance(backend, peers.CountsPeers)
        ):
            self.parts.append(self._peers_part(backend, limiter))
        if options.config_poll_seconds > 0 and options.xds is None:
            self.parts.append(background("config watch", lambda: self._watch_config(marks)))
        if options.usage_metrics_top > 0 and isinstance(backend, Reader):
            # Today's top keys per usage dimension for /metrics, read in the background.
            host = self.host
            top = TopKeys(lambda: host.rules, backend, options.usage_metrics_top, host.clock)
            host.registry.register(metrics.UsageCollector(top))
            self.parts.append(background("usage", lambda: top.watch(USAGE_METRICS_INTERVAL)))
        tls = self.tls
        if options.config_poll_seconds > 0 and tls is not None:
            # Rules over xDS or from files, the certificate rotates on disk all the same.
            self.parts.append(
                background(
                    "tls watch", lambda: tls.watch(options.config_poll_seconds, asyncio.sleep)
                )
            )

    async def _watch_config(self, marks: tuple[tuple[str, int, int, int], ...]) -> None:
        """Reload when the rules files, or the list files they read, change (polling their
        stat: no inotify needed, and a Kubernetes ConfigMap's symlink swap shows as a change)."""
        while True:
            await asyncio.sleep(self.options.config_poll_seconds)
            try:
                current = config.fingerprint(self.options.config, self.host.rules)
            except (OSError, ConfigError):
                continue  # mid-swap, or a path gone: look again next time
            if current != marks:
                marks = current
                self.host.reload()

    def _peers_part(self, backend: peers.CountsPeers, limiter: Limiter) -> Part:
        """Register this sidecar with the backend and divide local limits by how many share it:
        once at start (so the count is known once started), then every PEERS_INTERVAL; while
        the backend fails, the last count stands. At stop, leave."""
        name = self.peer_name

        async def count() -> None:
            with contextlib.suppress(StorageError, Overloaded):  # failing or busy: keep the last
                limiter.share_with(await backend.peers(name))

        async def learn() -> None:
            while True:
                await asyncio.sleep(peers.PEERS_INTERVAL)
                await count()

        watch = background("peers", learn)

        async def start() -> None:
            await count()
            await watch.start()

        async def stop(grace: float) -> None:
            await watch.stop(grace)
            await backend.leave(name)

        return Part("peers", start, stop)

    def _health_part(self, health: Health, grpc: RlsServer) -> Part:
        """Last to start (the first answer once everything listens) and first to stop:
        unhealthy everywhere before anything closes."""
        watch = background("health watch", lambda: health.watch(HEALTH_INTERVAL))

        async def start() -> None:
            health.listen(grpc.set_serving)
            await health.check()
            await watch.start()

        async def stop(grace: float) -> None:
            await health.drain()
            await watch.stop(grace)

        def rules_changed(rules: Rules) -> None:
            # Health listeners are coroutines (the gRPC health status); the HTTP check and the
            # 2 s watch would catch up anyway, this makes it prompt.
            task = asyncio.get_running_loop().create_task(
                health.set_config_loaded(bool(rules.domains))
            )
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        return Part("health", start, stop, rules_changed)


def _graceless(stop: Callable[[], Awaitable[object]]) -> Callable[[float], Awaitable[None]]:
    """A `stop()` that takes no grace (the HTTP servers keep their own) as a part's stop."""

    async def stopping(grace: float) -> None:
        await stop()

    return stopping
