"""OpenTelemetry tracing: spans for ShouldRateLimit and its backend call, exported over OTLP
http and grpc to receivers in the test process, their parent taken from the W3C or B3 trace
context the call carries; off, nothing of it is on a call's way."""

from __future__ import annotations

import os
import random
from pathlib import Path

import grpc
import pytest
from support.otlp import grpc_receiver, http_receiver
from support.sidecars import client, request, running_app, serve_process, write_rules

from sidecar import cli
from sidecar.rls.fast import FastServer
from sidecar.rls.h2.unary import CallbackMethod
from sidecar.rls.server import METHOD
from sidecar.telemetry.tracing import BACKEND_SPAN, SERVER_SPAN, Tracing, TracingSettings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    return write_rules(tmp_path)


async def traced_call(port: int, metadata: list[tuple[str, str]]) -> None:
    async with client(port) as rls:
        await rls.call(request("test", [("user", "alice")]), metadata=metadata, timeout=10)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_a_call_is_a_server_span_child_of_the_w3c_parent_with_its_backend_call_as_child(
    rules: Path, transport: str, protocol: str
) -> None:
    """With a `traceparent`, ShouldRateLimit's span is in that trace with that parent, of kind
    SERVER and named as the reference's otelgrpc names it; the backend call is its child; both
    reach the OTLP receiver (http or grpc) with the service's name."""
    receiver = http_receiver if protocol == "http" else grpc_receiver
    async with receiver() as received:
        settings = TracingSettings(protocol=protocol, endpoint=received.endpoint)  # type: ignore[arg-type]
        async with running_app(rules, transport=transport, tracing=settings) as app:
            await traced_call(app.grpc_port, [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")])
        # Stopping exported what was left.
        (server,) = received.named(SERVER_SPAN)
        (backend,) = received.named(BACKEND_SPAN)
    assert (server.trace_id, server.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert server.kind == SERVER_KIND and server.service == "RateLimit"
    assert server.attributes["rpc.method"] == "ShouldRateLimit"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert (backend.trace_id, backend.parent_span_id) == (TRACE_ID, server.span_id)
    assert backend.attributes["pipeline length"] == 1


@pytest.mark.parametrize(
    "metadata",
    [
        [("x-b3-traceid", TRACE_ID), ("x-b3-spanid", PARENT_ID), ("x-b3-sampled", "1")],
        [("b3", f"{TRACE_ID}-{PARENT_ID}-1")],
    ],
    ids=["b3-multi", "b3-single"],
)
async def test_b3_headers_give_the_parent_too(
    rules: Path, transport: str, metadata: list[tuple[str, str]]
) -> None:
    """Envoy's Zipkin tracer sends B3, in several headers or in one: either is the parent."""
    async with http_receiver() as received:
        settings = TracingSettings(endpoint=received.endpoint)
        async with running_app(rules, transport=transport, tracing=settings) as app:
            await traced_call(app.grpc_port, metadata)
        (server,) = received.named(SERVER_SPAN)
    assert (server.trace_id, server.parent_span_id) == (TRACE_ID, PARENT_ID)


async def test_the_sampling_rate_applies_to_calls_without_a_sampled_parent(rules: Path) -> None:
    """At sampling rate 0 a call without a parent, or with an unsampled one, makes no span;
    a sampled parent is followed all the same."""
    async with http_receiver() as received:
        settings = TracingSettings(endpoint=received.endpoint, sampling_rate=0.0)
        async with running_app(rules, tracing=settings) as app:
            await traced_call(app.grpc_port, [])
            await traced_call(app.grpc_port, [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00")])
            await traced_call(app.grpc_port, [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")])
        spans = received.named(SERVER_SPAN)
    assert [(s.trace_id, s.parent_span_id) for s in spans] == [(TRACE_ID, PARENT_ID)]


async def test_an_error_is_recorded_on_the_span_with_its_status(
    rules: Path, transport: str
) -> None:
    """A call answered INVALID_ARGUMENT (an empty domain) ends its span with that status."""
    async with http_receiver() as received:
        settings = TracingSettings(endpoint=received.endpoint)
        async with (
            running_app(rules, transport=transport, tracing=settings) as app,
            client(app.grpc_port) as rls,
        ):
            with pytest.raises(grpc.aio.AioRpcError):
                await rls.call(request("", [("user", "a")]), timeout=10)
        (server,) = received.named(SERVER_SPAN)
    assert server.attributes["rpc.grpc.status_code"] == 3


async def test_off_nothing_of_tracing_is_on_the_fast_transports_path(rules: Path) -> None:
    """Without --tracing, ShouldRateLimit is the service's own callback (no wrapper) and the
    HTTP/2 server keeps no request field (no per-call work); with it, both change."""
    async with running_app(rules) as app:
        fast = app.assembly.grpc
        assert isinstance(fast, FastServer)
        method = fast._server.methods[METHOD]
        assert isinstance(method, CallbackMethod)
        assert method.handle == fast.service.should_rate_limit
        assert fast._server.kept_fields == frozenset()
    async with http_receiver() as received:
        settings = TracingSettings(endpoint=received.endpoint)
        async with running_app(rules, tracing=settings) as app:
            fast = app.assembly.grpc
            assert isinstance(fast, FastServer)
            method = fast._server.methods[METHOD]
            assert isinstance(method, CallbackMethod)
            assert method.handle != fast.service.should_rate_limit
            assert fast._server.kept_fields


def test_the_reference_variables_turn_tracing_on_as_the_flags_do() -> None:
    """TRACING_ENABLED, TRACING_EXPORTER_PROTOCOL, TRACING_SERVICE_NAME, _NAMESPACE,
    _INSTANCE_ID and TRACING_SAMPLING_RATE set what --tracing and its flags set; off by
    default; a rate outside 0..1 is a usage error."""
    env = {
        "TRACING_ENABLED": "true",
        "TRACING_EXPORTER_PROTOCOL": "grpc",
        "TRACING_SERVICE_NAME": "rls",
        "TRACING_SERVICE_NAMESPACE": "edge",
        "TRACING_SERVICE_INSTANCE_ID": "pod-1",
        "TRACING_SAMPLING_RATE": "0.25",
    }
    base = ["serve", "--config", "r", "--reference-env"]
    expected = TracingSettings("grpc", None, "rls", "edge", "pod-1", 0.25)
    assert cli.serve.tracing_settings(cli.parse_args(base, env)) == expected
    flags = [*base, "--tracing", "--tracing-protocol", "grpc", "--tracing-service-name", "rls",
             "--tracing-service-namespace", "edge", "--tracing-service-instance-id", "pod-1",
             "--tracing-sampling-rate", "0.25"]  # fmt: skip
    assert cli.serve.tracing_settings(cli.parse_args(flags, {})) == expected
    assert cli.serve.tracing_settings(cli.parse_args(base, {})) is None
    with pytest.raises(SystemExit):
        cli.parse_args([*base, "--tracing-sampling-rate", "2"], {})


async def test_serve_with_the_reference_variables_exports_over_otlp_grpc(rules: Path) -> None:
    """`serve` with TRACING_ENABLED=true, TRACING_EXPORTER_PROTOCOL=grpc and the standard
    OTEL_EXPORTER_OTLP_ENDPOINT sends its spans in batches while it runs."""
    async with grpc_receiver() as received:
        env = {
            "TRACING_ENABLED": "true",
            "TRACING_EXPORTER_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": received.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
                "--http-address", "127.0.0.1:0", "--reference-env"]  # fmt: skip
        async with serve_process(args, {**os.environ, **env}) as served:
            for _ in range(3):
                await traced_call(
                    served.grpc_port, [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")]
                )
            spans = await received.wait_for(SERVER_SPAN, 3)
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {(TRACE_ID, PARENT_ID)}


def test_calls_without_a_parent_are_sampled_at_the_rate() -> None:
    """A root call is traced with the probability the rate gives (0: never, 1: always)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):  # type: ignore[misc]
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    random.seed(24)
    for rate, low, high in ((0.0, 0, 0), (0.25, 4_700, 5_300), (1.0, 20_000, 20_000)):
        tracing = Tracing(TracingSettings(sampling_rate=rate), exporter=Drop())
        sampled = sum(not tracing._unsampled_root() for _ in range(20_000))
        tracing.shutdown()
        assert low <= sampled <= high, (rate, sampled)


async def test_a_backend_call_outside_a_traced_call_makes_no_span(rules: Path) -> None:
    """The HTTP port's /json decides without a ShouldRateLimit span: its backend call makes no
    span of its own (no orphan root spans), while a gRPC call's backend call does."""
    import aiohttp

    async with http_receiver() as received:
        settings = TracingSettings(endpoint=received.endpoint)
        async with running_app(rules, tracing=settings) as app:
            body = {"domain": "test", "descriptors": [{"entries": [{"key": "user", "value": "b"}]}]}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{app.http_port}/json", json=body) as answer,
            ):
                assert answer.status == 200
            await traced_call(app.grpc_port, [])
        assert len(received.named(SERVER_SPAN)) == 1
        (backend,) = received.named(BACKEND_SPAN)
        assert backend.parent_span_id == received.named(SERVER_SPAN)[0].span_id


def test_opentelemetry_protos_modules_are_its_own_not_xds_protos_older_copy() -> None:
    """xds-protos ships an older copy of opentelemetry-proto's modules at the same paths (whichever
    wheel is installed last wins); every file both claim holds opentelemetry-proto's bytes, as the
    OTLP exporters need (`make venv` and the image reinstall it last)."""
    import base64
    import hashlib
    from importlib.metadata import distribution

    otel = distribution("opentelemetry-proto")
    xds_paths = {str(f) for f in distribution("xds-protos").files or ()}
    shared = [f for f in otel.files or () if str(f) in xds_paths and f.hash is not None]
    assert shared, "xds-protos no longer overlaps opentelemetry-proto: drop the reinstall step"
    replaced = []
    for f in shared:
        digest = hashlib.sha256(Path(str(f.locate())).read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:  # type: ignore[union-attr]
            replaced.append(str(f))
    assert not replaced, f"xds-protos' copies replaced opentelemetry-proto's: {replaced}"


def test_an_exporter_missing_its_messages_names_the_overlap_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should xds-protos' copy win anyway (a hand-made environment), tracing refuses to start with
    what happened and the pip command that puts opentelemetry-proto's modules back."""
    from sidecar.telemetry import tracing

    def broken(settings: TracingSettings) -> None:
        raise ImportError(
            "cannot import name 'InstrumentationScope' from "
            "'opentelemetry.proto.common.v1.common_pb2'"
        )

    monkeypatch.setattr(tracing, "_otlp_exporter", broken)
    with pytest.raises(tracing.TracingError) as raised:
        tracing._exporter(TracingSettings())
    message = str(raised.value)
    assert "InstrumentationScope" in message and "xds-protos" in message
    assert "pip install --no-deps --force-reinstall opentelemetry-proto==1." in message
