"""One aiohttp listener, started and stopped the same way by every HTTP port the sidecar opens:
the HTTP port (`sidecar.http.admin`), the reference's extra ports (`sidecar.http.side_ports`) and the
injector's webhook (`sidecar.injector.webhook`, over TLS)."""

from __future__ import annotations

import ssl

from aiohttp import web

from sidecar.http.bodies import LINGERING_SECONDS

#: Seconds a stopping listener lets the requests in flight finish before it closes them.
SHUTDOWN_SECONDS = 5.0


class Listener:
    """Serves an application on `host:port` (port 0: any free one) from `start` to `stop`.

    `what` names it in the error when it cannot listen ("HTTP", "HTTPS", "metrics", ...).
    `reuse_port` shares the port with other sidecars (`serve --workers N`).
    """

    def __init__(
        self,
        what: str,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        shutdown_timeout: float = SHUTDOWN_SECONDS,
    ) -> None:
        self.what = what
        self.host = host
        self.port = port
        self._reuse_port = reuse_port
        self._shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None

    async def start(self, app: web.Application, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen (over TLS with `ssl_context`), and return the port bound; OSError naming the
        address when it cannot."""
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=self._shutdown_timeout,
            lingering_time=LINGERING_SECONDS,
        )
        await runner.setup()
        try:
            site = web.TCPSite(
                runner,
                self.host,
                self.port,
                reuse_port=self._reuse_port,
                ssl_context=ssl_context,
            )
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                f"cannot listen for {self.what} on {self.host}:{self.port}: {exc}"
            ) from exc
        self._runner = runner
        port: int = runner.addresses[0][1]
        return port

    async def stop(self) -> None:
        """Stop listening; the requests in flight finish first (up to the shutdown timeout)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
