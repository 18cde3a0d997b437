"""The gRPC transport: `ShouldRateLimit` on grpc.aio, plus `grpc.health.v1.Health`.

`ShouldRateLimit` is registered with raw bytes in and out (no (de)serializers): the service
parses and writes the protobuf itself, so grpc never builds a message we would only convert.
InvalidRequest becomes INVALID_ARGUMENT with its message. Anything else is a bug: the call gets
INTERNAL, the first exception of each type is logged with its traceback, and the server goes on.
"""

from __future__ import annotations

import time
from typing import Any

import grpc  # type: ignore[import-untyped]
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_health.v1.health import aio as health_aio  # type: ignore[import-untyped]

from sidecar.errors import InvalidRequest
from sidecar.metrics import Latency
from sidecar.rls.service import RateLimitService

SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = f"/{SERVICE_NAME}/ShouldRateLimit"
#: The name the reference registers in the gRPC health service, next to the overall "".
HEALTH_SERVICE_NAME = "ratelimit"

_OPTIONS = [
    # Without this a second server could bind the same port and silently share its traffic.
    ("grpc.so_reuseport", 0),
]

log = structlog.get_logger("sidecar.rls.server")


class GrpcServer:
    """A grpc.aio server for one RateLimitService; `start` returns the bound port."""

    def __init__(
        self, service: RateLimitService, address: str, latency: Latency | None = None
    ) -> None:
        self.service = service
        self.address = address
        self.latency = latency or Latency()
        self.health = health_aio.HealthServicer()
        self._server: Any = None
        self._logged_errors: set[type[BaseException]] = set()

    async def start(self) -> int:
        """Listen on `address` (port 0 picks a free port); NOT_SERVING until `set_serving(True)`."""
        server = grpc.aio.server(options=_OPTIONS)
        handler = grpc.unary_unary_rpc_method_handler(self._should_rate_limit)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ShouldRateLimit": handler}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.set_serving(False)
        try:
            port: int = server.add_insecure_port(self.address)
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
            return await self.service.should_rate_limit(request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        except Exception as exc:
            self.service.stats.service_error += 1
            kind = type(exc)
            if kind not in self._logged_errors:
                self._logged_errors.add(kind)
                log.exception("unexpected_error", method=METHOD, error=repr(exc))
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {kind.__name__}: {exc}")
            raise  # unreachable: abort raises
        finally:
            self.latency.observe(time.perf_counter() - started)
