"""Whether this sidecar should receive traffic, as the reference's health components decide it.

Healthy means: not draining (no SIGTERM yet) and the backend answered its last ping.
One `Health` feeds both the gRPC health service and HTTP `/healthcheck`; listeners hear every
change, so the gRPC status follows the backend without a probe having to ask.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from sidecar.storage import Backend

#: How long a health ping may take before the backend counts as down.
PING_TIMEOUT = 2.0

Listener = Callable[[bool], Awaitable[None]]

log = structlog.get_logger("sidecar.health")


class Health:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.draining = False
        self.backend_ok: bool | None = None  # None until the first ping
        self._listeners: list[Listener] = []
        self._reported: bool | None = None

    @property
    def healthy(self) -> bool:
        return self.backend_ok is True and not self.draining

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
        if ok != self.backend_ok:
            if not ok:
                log.warning("backend_unhealthy", backend=self.backend.name)
            elif self.backend_ok is not None:
                log.info("backend_healthy", backend=self.backend.name)
            self.backend_ok = ok
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
