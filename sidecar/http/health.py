"""Whether this sidecar should receive traffic, as the reference's health components decide it.

Healthy means: not draining (no SIGTERM yet) and, when the answers depend on it, the backend
answered its last ping. They depend on it under `--failure-mode deny`. Under `allow` (the
default) a sidecar whose backend is down still answers correctly, by failing open, so it stays
healthy: reporting otherwise would make Kubernetes pull every gateway pod out of its Service
during a Redis outage, and make an Envoy that health-checks its rate limit cluster fail the
calls that the failure mode would have allowed. The backend's state is still logged on every
change and kept in `backend_ok`.
One backend failure is unhealthy under every failure mode: a backend that has not answered
since the start because of the sidecar's own configuration (it refuses our credentials, or its
host name does not resolve; `storage.failures.fault`). Waiting will not cure it, and Kubernetes
then keeps the pod out of its Service: a rollout carrying a wrong REDIS_AUTH stops at its first
pod while the old ones serve, as the reference's own health check (unhealthy until its first
ping answers) would stop it. The failure mode still answers every call meanwhile. Once the
backend has answered, the same failure later (a password rotated on the server) is an outage
like any other: pulling every pod at once would turn it into the gateway's own outage.
With `--health-requires-config` (the reference's HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED) it
is also unhealthy until rules with at least one domain are loaded, and again whenever a reload
or an xDS push leaves none.
One `Health` feeds both the gRPC health service and HTTP `/healthcheck`; listeners hear every
change, so the gRPC status follows the backend without a probe having to ask.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from sidecar.storage import Backend
from sidecar.storage.base import ReportsFaults

#: How long a health ping may take before the backend counts as down.
PING_TIMEOUT = 2.0

Listener = Callable[[bool], Awaitable[None]]

log = structlog.get_logger("sidecar.health")


class Health:
    def __init__(
        self, backend: Backend, backend_required: bool = True, config_required: bool = False
    ) -> None:
        self.backend = backend
        self.backend_required = backend_required
        self.config_required = config_required
        #: Whether the rules served have at least one domain (see `set_config_loaded`).
        self.config_loaded = False
        self.draining = False
        self.backend_ok: bool | None = None  # None until the first ping
        #: Whether the backend has answered a ping since the start.
        self.backend_answered = False
        #: Why the backend fails, when it is the configuration (see the module's docstring).
        self.backend_fault: str | None = None
        self._listeners: list[Listener] = []
        self._reported: bool | None = None

    @property
    def healthy(self) -> bool:
        if self.draining or (self.config_required and not self.config_loaded):
            return False
        if self.backend_fault is not None and not self.backend_answered:
            return False
        return self.backend_ok is True or not self.backend_required

    @property
    def reason(self) -> str:
        """Why the sidecar is unhealthy, for `/healthcheck`'s 500."""
        if self.draining:
            return "shutting down"
        if self.config_required and not self.config_loaded:
            return "no rules loaded"
        if self.backend_fault is not None:
            return f"backend unusable: {self.backend_fault}"
        return "backend unavailable"

    async def set_config_loaded(self, loaded: bool) -> None:
        """Record whether the rules now served have at least one domain."""
        if loaded != self.config_loaded:
            self.config_loaded = loaded
            if self.config_required:
                log.info("config_health", loaded=loaded)
        await self._notify()

    def listen(self, listener: Listener) -> None:
        """Call `listener(healthy)` on every change from now on."""
        self._listeners.append(listener)

    async def check(self) -> bool:
        """Ping the backend now; returns whether the sidecar is healthy."""
        try:
            async with asyncio.timeout(PING_TIMEOUT):
                ok = await self.backend.ping()
        except TimeoutError:
            ok = False
        fault = None
        if not ok and isinstance(self.backend, ReportsFaults):
            fault = self.backend.fault()
        self.backend_answered = self.backend_answered or ok
        was_ok, was_fault = self.backend_ok, self.backend_fault
        self.backend_ok, self.backend_fault = ok, fault
        # Once per change, with why when it is known: not on every ping of an outage.
        if fault is not None and fault != was_fault:
            log.error(
                "backend_unhealthy", backend=self.backend.name, fault=fault, healthy=self.healthy
            )
        elif not ok and fault is None and was_ok is not False:
            log.warning("backend_unhealthy", backend=self.backend.name)
        elif ok and was_ok is False:
            log.info("backend_healthy", backend=self.backend.name)
        await self._notify()
        return self.healthy

    async def drain(self) -> None:
        """Report unhealthy for good: the process is shutting down."""
        self.draining = True
        await self._notify()

    async def watch(self, interval: float) -> None:
        """Ping the backend every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.check()

    async def _notify(self) -> None:
        healthy = self.healthy
        if healthy == self._reported:
            return
        self._reported = healthy
        for listener in self._listeners:
            await listener(healthy)
