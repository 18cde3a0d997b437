"""The gRPC transport: `ShouldRateLimit` on grpc.aio, plus `grpc.health.v1.Health`.

`ShouldRateLimit` is registered with raw bytes in and out (no (de)serializers): the service
parses and writes the protobuf itself, so grpc never builds a message we would only convert.
When given a FrequencyService, the same server also answers the project's own
`ratelimit_sidecar.frequency.v1.FrequencyCaps` (raw bytes too). An error's status is
`sidecar.rls.statuses`' (a bug is INTERNAL, the first exception of each type logged with its
traceback, and the server goes on).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_health.v1.health import aio as health_aio  # type: ignore[import-untyped]

from sidecar.frequency import service as frequency
from sidecar.loop.callbacks import awaited
from sidecar.rls.service import RateLimitService
from sidecar.rls.statuses import Answers, is_bug
from sidecar.rls.tls import ServerTls
from sidecar.telemetry.metrics import Latency
from sidecar.telemetry.tracing import Tracing

SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = f"/{SERVICE_NAME}/ShouldRateLimit"
#: The name the reference registers in the gRPC health service, next to the overall "".
HEALTH_SERVICE_NAME = "ratelimit"


#: grpc's status for each of ours, by number.
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class GrpcServer:
    """A grpc.aio server for one RateLimitService; `start` returns the bound port."""

    def __init__(
        self,
        service: RateLimitService,
        address: str,
        latency: Latency | None = None,
        *,
        reuse_port: bool = False,
        frequency_service: frequency.FrequencyService | None = None,
        tls: ServerTls | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.service = service
        self.tls = tls
        self.tracing = tracing
        self.frequency = frequency_service
        self.address = address
        # Without reuse_port a second server cannot bind the same port and silently share its
        # traffic; only worker processes (`serve --workers N`) share one on purpose.
        self.reuse_port = reuse_port
        self.latency = latency or Latency()
        self.health = health_aio.HealthServicer()
        self._server: Any = None
        self._answers = Answers()

    async def start(self) -> int:
        """Listen on `address` (port 0 picks a free port); NOT_SERVING until `set_serving(True)`."""
        tls = self.tls
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", int(self.reuse_port))],
            interceptors=[
                *(() if tls is None else tls.grpc_interceptors()),
                *(() if self.tracing is None else self.tracing.grpc_interceptors()),
            ]
            or None,
        )
        handler = grpc.unary_unary_rpc_method_handler(self._should_rate_limit)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ShouldRateLimit": handler}),)
        )
        if self.frequency is not None:
            server.add_generic_rpc_handlers((self._frequency_handlers(self.frequency),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.set_serving(False)
        try:
            port: int = (
                server.add_insecure_port(self.address)
                if tls is None
                else server.add_secure_port(self.address, tls.grpc_credentials())
            )
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {self.address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot listen for gRPC on {self.address}")
        await server.start()
        self._server = server
        return port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", HEALTH_SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING for good, refuse new calls, and give calls in flight `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def _should_rate_limit(self, request: bytes, context: Any) -> bytes:
        started = time.perf_counter()
        try:
            return await awaited(lambda done: self.service.should_rate_limit(request, done))
        except Exception as exc:
            if is_bug(exc):  # the limiter and the service count the refusals they make
                self.service.stats.refused(exc)
            await self._abort(context, METHOD, exc)
            raise  # unreachable: abort raises
        finally:
            self.latency.observe(time.perf_counter() - started)

    async def _abort(self, context: Any, method: str, exc: Exception) -> None:
        """End the call with the status and message for what `method` raised."""
        status, message = self._answers.grpc(method, exc)
        await context.abort(_CODES[status], message)

    # --- FrequencyCaps (sidecar.frequency.service) ----------------------------------------------

    def _frequency_handlers(self, service: frequency.FrequencyService) -> Any:
        methods = {
            "CheckAds": (frequency.CHECK_ADS, service.check_ads),
            "RecordImpressions": (frequency.RECORD_IMPRESSIONS, service.record_impressions),
        }
        return grpc.method_handlers_generic_handler(
            frequency.SERVICE_NAME,
            {
                name: grpc.unary_unary_rpc_method_handler(self._frequency_call(path, call))
                for name, (path, call) in methods.items()
            },
        )

    def _frequency_call(
        self, method: str, call: Callable[[bytes], Awaitable[bytes]]
    ) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handle(request: bytes, context: Any) -> bytes:
            try:
                return await call(request)
            except Exception as exc:
                await self._abort(context, method, exc)
                raise  # unreachable: abort raises

        return handle
