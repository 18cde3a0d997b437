"""OpenTelemetry tracing of ShouldRateLimit, as the reference traces it: off unless asked.

With `--tracing` (the reference's TRACING_ENABLED), each ShouldRateLimit call is a server
span named `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` (the name the
reference's otelgrpc interceptor gives it), whose parent is the trace context Envoy sent:
W3C `traceparent`/`tracestate`, B3 (`b3`, or `x-b3-*`) and W3C `baggage`, the reference's
propagators. The backend call it makes is a child span, `Redis Pipeline Execution` as the
reference names it (whatever the backend). Sampling is the reference's: a sampled parent is
followed, and a call without one is sampled at `--tracing-sampling-rate` (one left out makes
no span at all, which is most of what tracing would cost it). Spans leave in
batches from the SDK's own thread over OTLP (http, or grpc), to the endpoint the standard
`OTEL_EXPORTER_OTLP_*` variables (or `--tracing-endpoint`) name, with their headers,
certificate and timeout (in milliseconds, as the specification has it: `export_timeout`).

Off, tracing costs a call nothing: the transports are then built exactly as without this
module (no wrapper, no header kept, no context set), which `make bench-instructions` shows.
The SDK is imported only when tracing is on, from the `tracing` extra.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: Where the request's trace context comes from: the fields Envoy's tracers send.
TRACE_FIELDS = frozenset(
    {
        b"traceparent",
        b"tracestate",
        b"baggage",
        b"b3",
        b"x-b3-traceid",
        b"x-b3-spanid",
        b"x-b3-parentspanid",
        b"x-b3-sampled",
        b"x-b3-flags",
    }
)
SERVER_SPAN = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
_RPC_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": "envoy.service.ratelimit.v3.RateLimitService",
    "rpc.method": "ShouldRateLimit",
}
BACKEND_SPAN = "Redis Pipeline Execution"

Protocol = Literal["http", "grpc"]
Fields = Sequence[tuple[bytes, bytes]]
Answer = Callable[[bytes | Exception], None]
Handle = Callable[[bytes, Answer], None]


class TracingError(ValueError):
    """Tracing cannot start: the SDK is missing, or a setting cannot be used."""


@dataclass(frozen=True)
class TracingSettings:
    protocol: Protocol = "http"
    #: The OTLP endpoint; None: the exporter's own (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    #: OTEL_EXPORTER_OTLP_ENDPOINT, else localhost's 4318 for http and 4317 for grpc).
    endpoint: str | None = None
    service_name: str = "RateLimit"
    service_namespace: str = ""
    #: Empty: a random UUID, as the reference does.
    service_instance_id: str = ""
    #: For calls without a sampled parent: 1 samples all, 0 none.
    sampling_rate: float = 1.0


class Tracing:
    """One sidecar's tracer provider, and the wrappers that trace its calls.

    `exporter` replaces the OTLP exporter (tests); it gets spans in batches all the same.
    """

    def __init__(self, settings: TracingSettings, exporter: Any = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.baggage.propagation import W3CBaggagePropagator
            from opentelemetry.context import Context
            from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise TracingError(
                f"tracing needs OpenTelemetry's SDK ({exc.name} is missing): "
                "pip install 'ratelimit-sidecar[tracing]'"
            ) from exc
        if not 0.0 <= settings.sampling_rate <= 1.0:
            raise TracingError(
                f"sampling rate must be within 0 and 1, got {settings.sampling_rate}"
            )
        self.settings = settings
        resource = Resource.create(
            {
                "service.name": settings.service_name,
                "service.namespace": settings.service_namespace,
                "service.instance.id": settings.service_instance_id or str(uuid.uuid4()),
            }
        )
        self.provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sampling_rate))
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(settings)))
        self.tracer = self.provider.get_tracer("ratelimit")
        # The reference's propagators (W3C trace context, B3 in both forms, W3C baggage), each
        # with the field that makes it find something, in the order a composite propagator
        # would ask them (a later one wins): a call asks only those whose fields it carries.
        self._by_field = (
            ("traceparent", TraceContextTextMapPropagator()),
            ("x-b3-traceid", B3MultiFormat()),
            ("b3", B3SingleFormat()),
            ("baggage", W3CBaggagePropagator()),
        )
        self._root = Context()  # no parent: a root span, sampled by the rate
        self._trace = trace
        self._server_kind = trace.SpanKind.SERVER

    # --- the server span --------------------------------------------------------------------------

    def _unsampled_root(self) -> bool:
        """For a call without a parent: whether the rate leaves it out. The sampler would say
        the same of the random trace id it would draw (TraceIdRatioBased), but only after
        making the span and its ids; an unsampled call is a fifth of the cost this way."""
        rate = self.settings.sampling_rate
        return rate < 1.0 and (rate <= 0.0 or random.random() >= rate)

    def _start(self, fields: Fields) -> tuple[Any, Any]:
        """The call's span, child of the context in `fields`, and that context with it."""
        parent = self._root
        if fields:
            carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in fields}
            for field, propagator in self._by_field:
                if field in carrier:
                    parent = propagator.extract(carrier, parent)
        span = self.tracer.start_span(SERVER_SPAN, context=parent, kind=self._server_kind)
        if span.is_recording():  # sampled: what an unsampled call need not build
            span.set_attributes(_RPC_ATTRIBUTES)
        return span, self._trace.set_span_in_context(span, parent)

    def _end(self, span: Any, result: bytes | BaseException, status: int | None = None) -> None:
        """End the call's span with its gRPC status: 0 for a response, else `status`, or the
        status the exception carries (a transport's CallError), or UNKNOWN."""
        if not span.is_recording():
            return  # not sampled: nothing to record, and ending it does nothing
        if isinstance(result, BaseException):
            from opentelemetry.trace import Status, StatusCode

            if status is None:
                status = int(getattr(result, "status", 2))
            span.set_attribute("rpc.grpc.status_code", status)
            span.record_exception(result)
            span.set_status(Status(StatusCode.ERROR, f"{type(result).__name__}: {result}"))
        else:
            span.set_attribute("rpc.grpc.status_code", 0)
        span.end()

    def callback(
        self,
        handle: Handle,
        fields: Callable[[], Fields],
        errors: Callable[[Exception], Exception] | None = None,
    ) -> Handle:
        """A CallbackMethod's `handle`, traced: the span starts as the call does and ends with
        its answer; the backend call made meanwhile is its child (`backend`). `errors` is the
        method's own: an exception is turned into its status here (once), so the span records
        the status the client gets."""
        from opentelemetry import context

        start, end, unsampled = self._start, self._end, self._unsampled_root

        def traced(message: bytes, answer: Answer) -> None:
            found = fields()
            if not found and unsampled():
                handle(message, answer)  # a root the rate leaves out: no span at all
                return
            span, ctx = start(found)
            ended = False

            def answered(result: bytes | Exception) -> None:
                nonlocal ended
                if ended:
                    return  # a second answer is ignored, as the server ignores it
                ended = True
                if (
                    isinstance(result, Exception)
                    and errors is not None
                    and not hasattr(result, "status")  # not mapped yet (a CallError is)
                ):
                    result = errors(result)
                end(span, result)
                answer(result)

            token = context.attach(ctx)
            try:
                handle(message, answered)
            except Exception as exc:  # raised before answering: that is the answer
                answered(exc)
            finally:
                context.detach(token)

        return traced

    def grpc_interceptors(self) -> list[Any]:
        """For grpc.aio: the interceptor that traces ShouldRateLimit from its metadata."""
        return [_grpc_interceptor(self)]

    # --- the backend span ---------------------------------------------------------------------------

    def backend(self, backend: Any) -> Any:
        """`backend` with each decision's store call (`apply`) a child span of the call's
        span, and everything else as it is."""
        return _TracedBackend(backend, self)

    def _child(self, hits: Sequence[Any]) -> Any:
        """The backend call's span, under the call's span; None when no call's span is being
        recorded (the call was not sampled, or the store call is not a call's: then no span)."""
        if not self._trace.get_current_span().is_recording():
            return None
        return self.tracer.start_span(BACKEND_SPAN, attributes={"pipeline length": len(hits)})

    def shutdown(self) -> None:
        """Export the spans still waiting, then stop (blocks: run it off the event loop)."""
        self.provider.shutdown()


def _exporter(settings: TracingSettings) -> Any:
    try:
        return _otlp_exporter(settings)
    except ImportError as exc:
        if "opentelemetry.proto" not in str(exc):
            raise TracingError(
                f"tracing needs the OTLP exporters ({exc.name} is missing): "
                "pip install 'ratelimit-sidecar[tracing]'"
            ) from exc
        # xds-protos carries an older copy of opentelemetry-proto's modules at the same paths;
        # installed after opentelemetry-proto, it replaces messages the exporters import.
        raise TracingError(
            f"the OTLP exporter cannot import its messages ({exc}): xds-protos' older copy of "
            "opentelemetry-proto's modules was installed over opentelemetry-proto's own; put "
            "them back with pip install --no-deps --force-reinstall "
            f"opentelemetry-proto=={_version('opentelemetry-proto')}"
        ) from exc


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "<version>"


#: The exporter's timeout variables, the more specific first.
TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def export_timeout(environ: Mapping[str, str]) -> float | None:
    """Seconds an export may take, from the first of `TIMEOUT_VARIABLES` set, in milliseconds
    as the OpenTelemetry specification and the reference's (Go) exporter read them; None when
    neither is set. Python's exporters read them in seconds, so a Deployment's 10000 (10 s)
    would let one export hang for hours: the value is read here and given to the exporter."""
    for name in TIMEOUT_VARIABLES:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        if not raw.isdigit() or int(raw) == 0:
            raise TracingError(f"{name}={raw!r}: expected milliseconds, a whole number above 0")
        return int(raw) / 1000
    return None


def _otlp_exporter(settings: TracingSettings) -> Any:
    endpoint = settings.endpoint
    options: dict[str, Any] = {}
    timeout = export_timeout(os.environ)
    if timeout is not None:
        options["timeout"] = timeout
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if endpoint is not None:
            options.update(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        return OTLPSpanExporter(**options)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    if endpoint is not None:
        options["endpoint"] = endpoint
    return HttpExporter(**options)


class _TracedBackend:
    """A backend whose store calls for decisions are spans; the rest is the backend's own."""

    def __init__(self, backend: Any, tracing: Tracing) -> None:
        self._backend = backend
        self._tracing = tracing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def apply(self, hits: Sequence[Any], *args: Any) -> None:
        span = self._tracing._child(hits)
        if span is None:
            self._backend.apply(hits, *args)
            return
        *rest, done = args

        def applied(outcomes: Any) -> None:
            span.end()
            done(outcomes)

        try:
            self._backend.apply(hits, *rest, applied)
        except BaseException:
            span.end()
            raise


def _grpc_interceptor(tracing: Tracing) -> Any:
    import grpc  # type: ignore[import-untyped]
    from opentelemetry import context

    class TracingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if details.method != "/" + SERVER_SPAN or handler is None:
                return handler
            inner = handler.unary_unary
            fields = [
                (key.encode("latin-1"), value.encode("latin-1"))
                for key, value in (details.invocation_metadata or ())
                if isinstance(value, str) and key.encode("latin-1") in TRACE_FIELDS
            ]

            async def traced(request: Any, grpc_context: Any) -> Any:
                if not fields and tracing._unsampled_root():
                    return await inner(request, grpc_context)
                span, ctx = tracing._start(fields)
                token = context.attach(ctx)
                try:
                    response = await inner(request, grpc_context)
                except BaseException as exc:
                    code = grpc_context.code()  # what the handler aborted with, if it did
                    tracing._end(span, exc, None if code is None else int(code.value[0]))
                    raise
                finally:
                    context.detach(token)
                tracing._end(span, response)
                return response

            return grpc.unary_unary_rpc_method_handler(
                traced,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return TracingInterceptor()
