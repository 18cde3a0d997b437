"""Extra HTTP listeners where a deployment written for the reference looks for them.

The HTTP port serves everything (`sidecar.http.admin`). The reference also serves Prometheus on its
own address (`USE_PROMETHEUS`, `PROMETHEUS_ADDR`: Envoy Gateway scrapes `:19001/metrics`) and
its debug endpoints on a third (`DEBUG_PORT`, 6070: `/rlconfig`). `--metrics-address` and
`--debug-address` open those, serving the same answers as the HTTP port.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.core.rules import Rules
from sidecar.http.listener import Listener
from sidecar.telemetry import metrics


class SidePort:
    """One aiohttp listener with a few read-only routes; `start` returns the bound port."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        registry: CollectorRegistry,
        rules: Callable[[], Rules],
        *,
        metrics_path: str = "/metrics",
        rlconfig: bool = False,
        reuse_port: bool = False,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self._registry = registry
        self._rules = rules
        self._metrics_path = metrics_path
        self._rlconfig = rlconfig
        # Shared with other sidecars (`serve --workers N`), as the HTTP port is.
        self._listener = Listener(name, host, port, reuse_port=reuse_port)

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_get(self._metrics_path, self._metrics)
        if self._rlconfig:
            app.router.add_get("/", self._index)
            app.router.add_get("/rlconfig", self._rules_text)
        return app

    async def start(self) -> int:
        return await self._listener.start(self.application())

    async def stop(self) -> None:
        await self._listener.stop()

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(
            text=f"  GET  /rlconfig   loaded rules, one line per rule\n"
            f"  GET  {self._metrics_path}   Prometheus metrics\n"
        )

    async def _rules_text(self, request: web.Request) -> web.Response:
        return web.Response(text="".join(f"{line}\n" for line in self._rules().dump()))

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=metrics.render(self._registry))
        response.headers["Content-Type"] = metrics.CONTENT_TYPE
        return response
