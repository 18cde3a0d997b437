"""The fast transport: `ShouldRateLimit`, `grpc.health.v1.Health/Check` and the project's own
FrequencyCaps on the sidecar's own HTTP/2 server (`sidecar.rls.h2`) instead of grpc.aio.

It answers exactly as the grpc.aio transport (`sidecar.rls.server`) does: an error's status is
`sidecar.rls.statuses`' (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, or INTERNAL for a bug, the
first exception of each type logged with its traceback), and health reports "" and
"ratelimit", NOT_SERVING for good once stopping starts. Only unary
calls exist here: Health/Watch and reflection are grpcio's. TLS is the event loop's, with the
context and the client SAN check of `sidecar.rls.tls`; tracing wraps ShouldRateLimit's method
only when it is on (`sidecar.telemetry.tracing`).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2  # type: ignore[import-untyped]

from sidecar.frequency import service as frequency
from sidecar.rls.h2.server import H2Server
from sidecar.rls.h2.unary import CallbackMethod, CallError, Method, Status
from sidecar.rls.server import HEALTH_SERVICE_NAME, METHOD
from sidecar.rls.service import RateLimitService
from sidecar.rls.statuses import Answers, is_bug
from sidecar.rls.tls import ServerTls
from sidecar.telemetry.metrics import Latency
from sidecar.telemetry.tracing import TRACE_FIELDS, Tracing

HEALTH_CHECK = "/grpc.health.v1.Health/Check"

_SERVING: bytes = health_pb2.HealthCheckResponse(
    status=health_pb2.HealthCheckResponse.SERVING
).SerializeToString()
_NOT_SERVING: bytes = health_pb2.HealthCheckResponse(
    status=health_pb2.HealthCheckResponse.NOT_SERVING
).SerializeToString()


class FastServer:
    """The same contract as `GrpcServer`: `start` returns the bound port (0 for a Unix socket)."""

    def __init__(
        self,
        service: RateLimitService,
        address: str,
        latency: Latency | None = None,
        *,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
        frequency_service: frequency.FrequencyService | None = None,
        tls: ServerTls | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.service = service
        self.tls = tls
        self.address = address
        self.latency = latency or Latency()
        self.reuse_port = reuse_port
        self.sock = sock
        self._health: dict[str, bytes] = {"": _NOT_SERVING, HEALTH_SERVICE_NAME: _NOT_SERVING}
        self._stopping = False
        self._answers = Answers()
        # The hot path: the service's own method, answering through a callback, timed and its
        # errors turned into statuses by the server.
        should_rate_limit = CallbackMethod(
            service.should_rate_limit,
            errors=self._should_rate_limit_error,
            observe=self.latency.observe,
        )
        if tracing is not None:  # without it, nothing of tracing is on a call's way
            should_rate_limit = self._traced(should_rate_limit, tracing)
        methods: dict[str, Method | CallbackMethod] = {
            METHOD: should_rate_limit,
            HEALTH_CHECK: self._check,
        }
        if frequency_service is not None:
            methods[frequency.CHECK_ADS] = self._frequency_call(
                frequency.CHECK_ADS, frequency_service.check_ads
            )
            methods[frequency.RECORD_IMPRESSIONS] = self._frequency_call(
                frequency.RECORD_IMPRESSIONS, frequency_service.record_impressions
            )
        admit = tls.admits_transport if tls is not None and tls.files.client_san else None
        kept = TRACE_FIELDS if tracing is not None else frozenset()
        self._server = H2Server(methods, admit=admit, kept_fields=kept)

    def _traced(self, method: CallbackMethod, tracing: Tracing) -> CallbackMethod:
        """ShouldRateLimit as a span, child of the trace context the call's fields carry."""

        def fields() -> tuple[tuple[bytes, bytes], ...]:
            return self._server.request_fields

        handle = tracing.callback(method.handle, fields, method.errors)
        return CallbackMethod(handle, errors=method.errors, observe=method.observe)

    async def start(self) -> int:
        """Listen on `address`; NOT_SERVING until `set_serving(True)`."""
        return await self._server.listen(
            self.address,
            reuse_port=self.reuse_port,
            sock=self.sock,
            tls=None if self.tls is None else self.tls.listening,
        )

    async def set_serving(self, serving: bool) -> None:
        if self._stopping:
            return  # stopping is for good, as grpc's enter_graceful_shutdown
        status = _SERVING if serving else _NOT_SERVING
        for name in self._health:
            self._health[name] = status

    async def stop(self, grace: float) -> None:
        """NOT_SERVING for good, GOAWAY to every client, and give calls in flight `grace` seconds."""
        await self.set_serving(False)
        self._stopping = True
        await self._server.stop(grace)

    def _should_rate_limit_error(self, exc: Exception) -> CallError:
        """The CallError for what ShouldRateLimit raised; a bug is counted (the limiter and the
        service count the refusals they make)."""
        if is_bug(exc):
            self.service.stats.refused(exc)
        return CallError(*self._answers.grpc(METHOD, exc))

    def _frequency_call(self, path: str, call: Callable[[bytes], Awaitable[bytes]]) -> Method:
        async def handle(request: bytes) -> bytes:
            try:
                return await call(request)
            except Exception as exc:
                raise CallError(*self._answers.grpc(path, exc)) from exc

        return handle

    async def _check(self, request: bytes) -> bytes:
        try:
            service = health_pb2.HealthCheckRequest.FromString(request).service
        except DecodeError as exc:
            raise CallError(
                Status.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {exc}"
            ) from exc
        answer = self._health.get(service)
        if answer is None:
            raise CallError(Status.NOT_FOUND, f"unknown service {service!r}")
        return answer
