"""A small xDS control plane for the tests: grpc.aio's AggregatedDiscoveryService, state of the
world, serving `RateLimitConfig` resources on a loopback port, over TLS with client
certificates when given them.

`push` sends the whole state to every open stream (and to streams opened later); every
request a client sends is kept in `requests`, so tests can read the ACKs and NACKs. `stop` and
`start` again on the same port is a control plane restart.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from sidecar.proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2
from sidecar.xds.convert import TYPE_URL


@dataclass(frozen=True)
class Received:
    """A request a client sent, with the stream's metadata and the client certificate's name."""

    request: discovery_pb2.DiscoveryRequest
    metadata: dict[str, str]
    peer_common_name: str | None


def pack(*configs: rls_conf_pb2.RateLimitConfig) -> list[any_pb2.Any]:
    resources = []
    for message in configs:
        resource = any_pb2.Any()
        resource.Pack(message, type_url_prefix="type.googleapis.com/")
        resources.append(resource)
    return resources


class ControlPlane(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, tls: tuple[Path, Path, Path] | None = None) -> None:
        """`tls`: this server's certificate and key, and the CA client certificates must have."""
        self.tls = tls
        self.port = 0
        self.requests: list[Received] = []
        self.streams = 0
        self._state: discovery_pb2.DiscoveryResponse | None = None
        self._queues: list[asyncio.Queue[discovery_pb2.DiscoveryResponse]] = []
        self._nonces = itertools.count(1)
        self._server: grpc.aio.Server | None = None
        self._received = asyncio.Condition()

    async def start(self) -> int:
        """Listen on 127.0.0.1 (the same port again after a stop); returns the port."""
        server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)
        address = f"127.0.0.1:{self.port}"
        if self.tls is None:
            port = server.add_insecure_port(address)
        else:
            cert, key, client_ca = self.tls
            credentials = grpc.ssl_server_credentials(
                [(key.read_bytes(), cert.read_bytes())],
                root_certificates=client_ca.read_bytes(),
                require_client_auth=True,
            )
            port = server.add_secure_port(address, credentials)
        await server.start()
        self._server, self.port = server, port
        return port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
            self._queues.clear()

    def push(self, version: str, resources: Sequence[any_pb2.Any], type_url: str = TYPE_URL) -> str:
        """Send this state to every stream, now and on connection; returns its nonce."""
        response = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=type_url, nonce=str(next(self._nonces))
        )
        response.resources.extend(resources)
        self._state = response
        for queue in self._queues:
            queue.put_nowait(response)
        return response.nonce

    async def answer(self, nonce: str, timeout: float = 10.0) -> Received:
        """The client's request answering the response with `nonce` (its ACK or NACK)."""
        async with asyncio.timeout(timeout), self._received:
            while True:
                for received in self.requests:
                    if received.request.response_nonce == nonce:
                        return received
                await self._received.wait()

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        self.streams += 1
        metadata = {item.key: item.value for item in context.invocation_metadata() or ()}
        names = context.auth_context().get("x509_common_name") or [b""]
        peer = names[0].decode() or None
        queue: asyncio.Queue[discovery_pb2.DiscoveryResponse] = asyncio.Queue()
        self._queues.append(queue)
        if self._state is not None:
            queue.put_nowait(self._state)

        async def read() -> None:
            async for request in request_iterator:
                async with self._received:
                    self.requests.append(Received(request, metadata, peer))
                    self._received.notify_all()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await queue.get()
        finally:
            reader.cancel()
            if queue in self._queues:
                self._queues.remove(queue)
