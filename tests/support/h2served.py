"""An `H2Server` with test methods for the HTTP/2 conformance tests (fixtures in conftest.py).

Echo answers its message, Wait holds every call until the test opens `gate`, Fail answers
INVALID_ARGUMENT with a message that needs percent-encoding, and Bug raises what no method
should. Then is a CallbackMethod whose message says how it answers (see `Methods.then`), with
`errors` and `observe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from sidecar.rls.h2.connection import Limits
from sidecar.rls.h2.server import H2Server
from sidecar.rls.h2.unary import Answer, CallbackMethod, CallError, Method, Status

ECHO, WAIT, FAIL, BUG, THEN = "/t.T/Echo", "/t.T/Wait", "/t.T/Fail", "/t.T/Bug", "/t.T/Then"
MAX_STREAMS = 4


@dataclass
class Methods:
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    #: What Then's `observe` was given, one duration per call.
    durations: list[float] = field(default_factory=list)

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

    def then(self, message: bytes, answer: Answer) -> None:
        """b"now" answers at once, b"later" on the loop's next turn, b"twice" twice; b"raise"
        raises, b"error later" answers an exception later, b"call-error" a CallError."""
        loop = asyncio.get_running_loop()
        if message == b"now":
            answer(b"answered now")
        elif message == b"later":
            loop.call_soon(answer, b"answered later")
        elif message == b"twice":
            answer(b"first")
            answer(b"second")
        elif message == b"raise":
            raise KeyError("raised")
        elif message == b"error later":
            loop.call_soon(answer, KeyError("answered"))
        elif message == b"call-error":
            answer(CallError(Status.NOT_FOUND, "as it is"))

    @staticmethod
    def then_errors(exc: Exception) -> CallError:
        return CallError(Status.FAILED_PRECONDITION, f"mapped {exc!r}")


@dataclass
class Served:
    server: H2Server
    port: int
    methods: Methods


@asynccontextmanager
async def serve_h2(address: str = "127.0.0.1:0") -> AsyncIterator[Served]:
    methods = Methods()
    table: dict[str, Method | CallbackMethod] = {
        ECHO: methods.echo,
        WAIT: methods.wait,
        FAIL: methods.fail,
        BUG: methods.bug,
        THEN: CallbackMethod(
            methods.then, errors=methods.then_errors, observe=methods.durations.append
        ),
    }
    server = H2Server(table, Limits(max_concurrent_streams=MAX_STREAMS))
    port = await server.listen(address)
    try:
        yield Served(server, port, methods)
    finally:
        methods.gate.set()
        await server.stop(grace=1.0)
