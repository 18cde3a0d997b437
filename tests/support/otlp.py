"""OTLP trace receivers in the test process: http (POST /v1/traces, protobuf) and grpc
(`opentelemetry.proto.collector.trace.v1.TraceService/Export`), both on free loopback ports.
Every span they receive is kept with its resource's attributes, and the grpc receivers keep
each export's metadata (the exporter's headers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    endpoint: str = ""
    port: int = 0
    #: Each grpc export's metadata, in the order received.
    metadata: list[dict[str, str]] = field(default_factory=list)

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        self.requests += 1
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            resource=resource,
                        )
                    )

    def named(self, name: str) -> list[Span]:
        return [span for span in self.spans if span.name == name]

    async def wait_for(self, name: str, count: int = 1, timeout: float = 15.0) -> list[Span]:
        async with asyncio.timeout(timeout):
            while len(self.named(name)) < count:
                await asyncio.sleep(0.05)
        return self.named(name)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@asynccontextmanager
async def http_receiver() -> AsyncIterator[Received]:
    received = Received()

    async def export(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        received.take(message)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    received.endpoint = f"http://127.0.0.1:{port}/v1/traces"
    try:
        yield received
    finally:
        await runner.cleanup()


@asynccontextmanager
async def grpc_receiver() -> AsyncIterator[Received]:
    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        async def Export(
            self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
        ) -> trace_service_pb2.ExportTraceServiceResponse:
            received.metadata.append(dict(context.invocation_metadata()))
            received.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    received.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield received
    finally:
        await server.stop(0)


@contextmanager
def threaded_grpc_receiver() -> Iterator[Received]:
    """The grpc receiver on grpc's own threads, for tests that block (processes started and
    polled by tests/support/envoys.py)."""
    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(
            self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
        ) -> trace_service_pb2.ExportTraceServiceResponse:
            received.metadata.append(dict(context.invocation_metadata()))
            received.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    received.port = port
    received.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield received
    finally:
        server.stop(0).wait()
