"""A `ShouldRateLimit` servicer that does no work: the ceiling the sidecar is measured against.

It runs the same Python gRPC stack as the sidecar (grpc.aio) but skips protobuf on both ends:
the request bytes are never parsed and the answer is one pre-serialized `overall_code: OK`.
The gap between this server and the sidecar is therefore the cost of the sidecar's own work.
With `--transport fast` the same constant answer comes from the sidecar's own HTTP/2 server
(`sidecar.rls.h2`), the floor of the fast transport.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
from envoy.service.ratelimit.v3 import rls_pb2

from sidecar.cli.serve import event_loop_factory
from sidecar.cli.serve_flags import LOOP_CHOICES

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = "ShouldRateLimit"

RESPONSE: bytes = rls_pb2.RateLimitResponse(
    overall_code=rls_pb2.RateLimitResponse.OK
).SerializeToString()


async def should_rate_limit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return RESPONSE


async def serve_fast(address: str, port: int) -> None:
    from sidecar.rls.h2.server import H2Server

    async def answer(request: bytes) -> bytes:
        return RESPONSE

    server = H2Server({f"/{SERVICE}/{METHOD}": answer})
    bound = await server.listen(f"{address}:{port}")
    print(f"noop fast server listening on {address}:{bound}", flush=True)
    await _until_signalled()
    await server.stop(grace=1.0)


async def _until_signalled() -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()


async def serve(address: str, port: int) -> None:
    server = grpc.aio.server()
    # No request_deserializer / response_serializer: the handler sees and returns raw bytes.
    handler = grpc.unary_unary_rpc_method_handler(should_rate_limit)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
    )
    bound = server.add_insecure_port(f"{address}:{port}")
    if bound == 0:
        raise SystemExit(f"noop_server: cannot bind {address}:{port}")
    await server.start()
    print(f"noop servicer listening on {address}:{bound}", flush=True)
    await _until_signalled()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument("--transport", choices=("grpcio", "fast"), default="grpcio")
    parser.add_argument(
        "--loop", choices=LOOP_CHOICES, default="auto", help="event loop, as `serve --loop`"
    )
    args = parser.parse_args(argv)
    # The same loop the sidecar's `serve` runs on, so the floor is measured on equal terms.
    with asyncio.Runner(loop_factory=event_loop_factory(args.loop)) as runner:
        runner.run((serve_fast if args.transport == "fast" else serve)(args.address, args.port))


if __name__ == "__main__":
    main()
