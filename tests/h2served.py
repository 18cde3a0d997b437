"""An `H2Server` with test methods for the HTTP/2 conformance tests (fixtures in conftest.py).

Echo answers its message, Wait holds every call until the test opens `gate`, Fail answers
INVALID_ARGUMENT with a message that needs percent-encoding, and Bug raises what no method
should.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from sidecar.rls.h2.connection import Limits
from sidecar.rls.h2.server import H2Server
from sidecar.rls.h2.unary import CallError, Status

ECHO, WAIT, FAIL, BUG = "/t.T/Echo", "/t.T/Wait", "/t.T/Fail", "/t.T/Bug"
MAX_STREAMS = 4


@dataclass
class Methods:
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0

    async def echo(self, message: bytes) -> bytes:
        return message

    async def wait(self, message: bytes) -> bytes:
        self.waiting += 1
        await self.gate.wait()
        return message

    async def fail(self, message: bytes) -> bytes:
        raise CallError(Status.INVALID_ARGUMENT, "no: bad input ✗")

    async def bug(self, message: bytes) -> bytes:
        raise ZeroDivisionError("a bug")


@dataclass
class Served:
    server: H2Server
    port: int
    methods: Methods


@asynccontextmanager
async def serve_h2(address: str = "127.0.0.1:0") -> AsyncIterator[Served]:
    methods = Methods()
    table = {ECHO: methods.echo, WAIT: methods.wait, FAIL: methods.fail, BUG: methods.bug}
    server = H2Server(table, Limits(max_concurrent_streams=MAX_STREAMS))
    port = await server.listen(address)
    try:
        yield Served(server, port, methods)
    finally:
        methods.gate.set()
        await server.stop(grace=1.0)
