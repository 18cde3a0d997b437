"""The composition root: rules, backend, limiter, service, gRPC and HTTP servers, and shutdown.

`App.start` loads the rules (ConfigError on a bad file), opens the backend (ValueError for a
URL it cannot use), starts both servers and reports SERVING once the backend answered a ping.
`App.stop` is what SIGTERM and SIGINT trigger: unhealthy everywhere first, then no new calls,
calls in flight get a grace period, then the backend is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar import config, metrics
from sidecar.admin import AdminServer
from sidecar.errors import ConfigError
from sidecar.health import Health
from sidecar.limiter import FailureMode, Limiter, RejectedHits, Settings
from sidecar.rls.server import GrpcServer
from sidecar.rls.service import RateLimitService
from sidecar.stats import Stats
from sidecar.storage import Backend, open_backend

#: Seconds calls in flight get to finish once shutdown starts.
SHUTDOWN_GRACE = 5.0
#: Seconds between backend pings that keep the gRPC health status current.
HEALTH_INTERVAL = 2.0

log = structlog.get_logger("sidecar.app")


class InvalidOption(ValueError):
    """An address or backend URL the sidecar cannot start with; the message says why."""


@dataclass(frozen=True)
class Options:
    """What `serve` needs; the CLI fills it from flags and RLS_* variables."""

    config: Sequence[str | Path]
    backend: str = "memory://"
    grpc_address: str = "0.0.0.0:8081"
    http_address: str = "0.0.0.0:8080"
    redis_timeout_ms: int = 50
    failure_mode: FailureMode = "allow"
    rejected_hits: RejectedHits = "count"
    shadow_mode: bool = False


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
        self.registry = metrics.registry(self.stats, self.latency)
        self._backend = backend
        self._clock = clock
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: GrpcServer | None = None
        self._http: AdminServer | None = None
        self._health: Health | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Load, open and listen; raises ConfigError, InvalidOption or OSError after cleaning up."""
        options = self.options
        split_address(options.grpc_address)
        http_host, http_port = split_address(options.http_address)
        rules = self._load_rules()
        if self._backend is None:
            try:
                self._backend = open_backend(options.backend, timeout_ms=options.redis_timeout_ms)
            except ValueError as exc:
                raise InvalidOption(str(exc)) from exc
        backend = self._backend
        limiter = Limiter(
            rules,
            backend,
            settings=Settings(
                shadow_mode=options.shadow_mode,
                rejected_hits=options.rejected_hits,
                failure_mode=options.failure_mode,
            ),
            stats=self.stats,
            clock=self._clock,
        )
        service = RateLimitService(limiter)
        health = self._health = Health(backend)
        self._grpc = GrpcServer(service, options.grpc_address, self.latency)
        self._http = AdminServer(
            service, rules, health, self.registry, http_host, http_port, SHUTDOWN_GRACE
        )
        try:
            self.grpc_port = await self._grpc.start()
            self.http_port = await self._http.start()
        except BaseException:
            await self.stop()
            raise
        health.listen(self._grpc.set_serving)
        await health.check()
        self._watch = asyncio.create_task(health.watch(HEALTH_INTERVAL))
        log.info(
            "started",
            grpc_port=self.grpc_port,
            http_port=self.http_port,
            grpc_address=options.grpc_address,
            http_address=options.http_address,
            backend=backend.name,
            healthy=health.healthy,
            failure_mode=options.failure_mode,
            rejected_hits=options.rejected_hits,
            shadow_mode=options.shadow_mode,
            pid=os.getpid(),
        )

    @property
    def health(self) -> Health:
        """The serving state (after `start`)."""
        assert self._health is not None, "App.start() first"
        return self._health

    def _load_rules(self) -> config.Rules:
        try:
            rules = config.load(self.options.config)
        except ConfigError:
            self.stats.config_load_error += 1
            raise
        self.stats.config_load_success += 1
        for domain in rules.domains.values():
            log.info("config_loaded", summary=domain.summary())
        return rules

    async def stop(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Drain and stop; safe to call twice and after a failed start."""
        if self._stopped:
            return
        self._stopped = True
        if self._health is not None:
            await self._health.drain()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        stops = []
        if self._grpc is not None:
            stops.append(self._grpc.stop(grace))
        if self._http is not None:
            stops.append(self._http.stop())
        await asyncio.gather(*stops)
        if self._backend is not None:
            await self._backend.close()

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit status (0)."""
        await self.start()
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            loop.add_signal_handler(signum, stopping.set)
        try:
            await stopping.wait()
            log.info("stopping", grace_seconds=SHUTDOWN_GRACE)
            await self.stop()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)
        log.info("stopped", total_requests=self.stats.total_requests)
        return 0
