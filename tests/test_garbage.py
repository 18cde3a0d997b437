"""A ShouldRateLimit call leaves no garbage cycle behind, on every backend and on both builds,
and neither does a connection once closed.

Every object a call makes must be freed by its reference count as the call ends: what only the
cycle collector can free piles up between its collections, and each collection is a pause of
every call in flight (README, "Garbage collection"). Compiled with mypyc, a nested function
and the environment it closes over refer to each other, so a closure made per call is a cycle
per call that the sources do not make: `make test` runs this module on both builds.

The calls go into the fast transport's protocol in this process, as a connection's reads would
bring them (raw HTTP/2 frames, eight calls a read), each on a user of its own so that every
call also prepares its plan (plans are kept by request body). With `gc.DEBUG_SAVEALL`, what the
collector finds unreachable is kept in `gc.garbage` instead of freed: after the calls and a
collection, it must be empty. Nothing is excluded: the test's own waiting (a future per read)
makes no cycle either.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import hpack
import pytest
from envoy.service.ratelimit.v3.rls_pb2 import (  # type: ignore[import-untyped]
    RateLimitRequest,
)
from support.h2peer import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    grpc_message,
    raw_frame,
    request_headers,
)

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.decision.plan import Plan
from sidecar.model import Descriptor, Hit, Request
from sidecar.rls.fast import FastServer
from sidecar.rls.h2.server import _Protocol
from sidecar.rls.server import METHOD
from sidecar.rls.service import RateLimitService
from sidecar.runner.app import Options
from sidecar.storage.backends import open_backend
from sidecar.storage.redis_client import Reply

#: Calls measured, after WARM_UP calls that open the backend's connections, load its scripts
#: and fill whatever is made once.
CALLS = 512
WARM_UP = 64
#: Calls per read, as Envoy's requests arrive together on its connection.
PER_READ = 8
#: Connections opened, used and closed.
CONNECTIONS = 32

RULES = """
domain: garbage
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: {limit}}}
    descriptors:
      - key: ad
        rate_limit: {{unit: hour, requests_per_unit: {limit}}}
"""
#: A limit no test reaches.
UNREACHED = 1_000_000


class Transport(asyncio.Transport):
    """Takes what the server writes, and tells the test when no call of its read is left."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: _Protocol | None = None
        self.idle: asyncio.Future[None] | None = None
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)
        idle = self.idle
        if idle is not None and self.protocol is not None and not self.protocol.conn.calls:
            self.idle = None
            idle.set_result(None)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _reads(first_user: int, calls: int, encoder: hpack.Encoder, first_stream: int) -> list[bytes]:
    """The bytes of `calls` calls, PER_READ a read, each on a user (and an ad) of its own."""
    reads = []
    stream_id = first_stream
    for start in range(first_user, first_user + calls, PER_READ):
        frames = []
        for user in range(start, start + PER_READ):
            request = RateLimitRequest(domain="garbage")
            for entries in ([("user", f"u{user}")], [("user", f"u{user}"), ("ad", f"a{user}")]):
                descriptor = request.descriptors.add()
                for key, value in entries:
                    entry = descriptor.entries.add()
                    entry.key, entry.value = key, value
            block = encoder.encode(request_headers(METHOD))
            body = grpc_message(request.SerializeToString())
            frames.append(raw_frame(HEADERS, END_HEADERS, stream_id, block))
            frames.append(raw_frame(DATA, END_STREAM, stream_id, body))
            stream_id += 2
        reads.append(b"".join(frames))
    return reads


class Sidecar:
    """The fast transport of a sidecar on `url`'s backend, fed calls without a socket."""

    def __init__(self, url: str, limit: int = UNREACHED) -> None:
        domain = config.parse(RULES.format(limit=limit), "rules.yaml")
        self.backend = open_backend(url, timeout_ms=1_000)
        # The limiter as `serve` builds it: the over-limit cache on (unless memory).
        limiter = Limiter(
            Rules({domain.name: domain}),
            self.backend,
            over_limit_cache=Options(config=[]).over_limit_cache,
        )
        self.service = RateLimitService(limiter)
        self.fast = FastServer(self.service, "127.0.0.1:0")
        self.transport = Transport()
        self.encoder = hpack.Encoder()
        self.next_user = 0
        self.next_stream = 1

    async def connect(self) -> None:
        await self.fast.set_serving(True)
        protocol = _Protocol(self.fast._server)
        self.transport = Transport()
        self.transport.protocol = protocol
        protocol.connection_made(self.transport)
        # The preface, SETTINGS, and room for every answer (as a peer reading them would give).
        room = (1 << 30).to_bytes(4, "big")
        await self.feed(PREFACE + raw_frame(SETTINGS, 0, 0) + raw_frame(WINDOW_UPDATE, 0, 0, room))

    def disconnect(self) -> None:
        """The connection is lost; the transport lets go of its protocol, as the event loop's
        do once they have told it."""
        transport = self.transport
        assert transport.protocol is not None
        transport.protocol.connection_lost(None)
        transport.protocol = None

    def prepare(self, calls: int) -> list[bytes]:
        """The reads of the next `calls` calls (made ahead: the client makes no garbage)."""
        reads = _reads(self.next_user, calls, self.encoder, self.next_stream)
        self.next_user += calls
        self.next_stream += 2 * calls
        return reads

    async def feed(self, data: bytes) -> None:
        """One read of the connection; returns once every call of it is answered."""
        transport = self.transport
        protocol = transport.protocol
        assert protocol is not None
        idle = transport.idle = asyncio.get_running_loop().create_future()
        protocol.data_received(data)
        if protocol.conn.calls:
            await idle
        transport.idle = None

    def decided(self) -> int:
        """Hits decided so far (each descriptor's), none failed."""
        stats = self.service.stats
        assert (stats.backend_error, stats.service_error, stats.overloaded) == (0, 0, 0)
        return sum(rule.total_hits for rule in stats.rules.values())

    def refused(self) -> tuple[int, int]:
        """Hits over their limit so far, and of those the ones the over-limit cache answered."""
        rules = self.service.stats.rules.values()
        return (
            sum(rule.over_limit for rule in rules),
            sum(rule.over_limit_with_local_cache for rule in rules),
        )

    async def close(self) -> None:
        await self.backend.close()


@pytest.fixture
async def sidecar(backend_url: str) -> AsyncIterator[Sidecar]:
    running = Sidecar(backend_url)
    await running.connect()
    yield running
    await running.close()


@contextlib.contextmanager
def _cycles() -> Iterator[list[Any]]:
    """What the cycle collector finds in cycles made inside the block (`gc.DEBUG_SAVEALL` keeps
    it in `gc.garbage`): the list is filled as the block ends."""
    found: list[Any] = []
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _kinds(objects: list[Any]) -> str:
    """The types of `objects`, most frequent first."""
    counts = Counter(type(each).__qualname__ for each in objects)
    return ", ".join(f"{count} {name}" for name, count in counts.most_common(12))


async def test_calls_leave_no_garbage_cycle(sidecar: Sidecar) -> None:
    """CALLS calls, each with two descriptors of a user of its own, decided on the backend
    (memory, Redis, Redis Cluster), leave nothing that only the cycle collector can free."""
    for data in sidecar.prepare(WARM_UP):
        await sidecar.feed(data)
    reads = sidecar.prepare(CALLS)
    before = sidecar.decided()
    with _cycles() as garbage:
        for data in reads:
            await sidecar.feed(data)
    assert sidecar.decided() - before == 2 * CALLS
    assert sidecar.refused() == (0, 0)
    assert garbage == [], (
        f"{len(garbage)} objects in cycles after {CALLS} calls "
        f"({len(garbage) / CALLS:.1f} per call): {_kinds(garbage)}"
    )


def _alive(kinds: tuple[type, ...]) -> int:
    """How many objects of `kinds` the collector tracks now (none collected first)."""
    return sum(1 for each in gc.get_objects() if isinstance(each, kinds))


async def test_a_call_on_a_new_body_leaves_nothing_of_it_alive(sidecar: Sidecar) -> None:
    """Calls on bodies never seen before leave none of their plans, hits, packed script
    arguments or Redis replies alive once answered: freed by their reference counts as each
    call ends, they are never walked or promoted by a young collection. (The packed arguments
    were kept in a table by the hit's identity, which kept about 2,000 one-off hits alive; the
    Redis client kept each call's deadline entry and Reply until its deadline timer came up.)
    Only a body seen twice gets its plan kept (`sidecar.rls.service`), and no body here is."""
    for data in sidecar.prepare(WARM_UP):
        await sidecar.feed(data)
    reads = sidecar.prepare(CALLS)
    kinds = (Hit, Plan, Request, Descriptor, Reply)
    gc.collect()
    gc.disable()
    try:
        before = _alive(kinds)
        for data in reads:
            await sidecar.feed(data)
        after = _alive(kinds)
    finally:
        gc.enable()
    assert sidecar.decided() == 2 * (WARM_UP + CALLS)
    assert after - before <= 0, f"{after - before} more alive after {CALLS} calls on new bodies"


async def test_a_closed_connection_leaves_no_garbage_cycle(sidecar: Sidecar) -> None:
    """Connections that made calls and closed are freed by their reference counts: the
    connection lets go of its protocol and of its own frame handlers as it is released."""
    for data in sidecar.prepare(WARM_UP):
        await sidecar.feed(data)
    with _cycles() as garbage:
        for _ in range(CONNECTIONS):
            sidecar.encoder = hpack.Encoder()  # a new connection's header table
            sidecar.next_stream = 1
            await sidecar.connect()
            for data in sidecar.prepare(PER_READ):
                await sidecar.feed(data)
            sidecar.disconnect()
    assert garbage == [], (
        f"{len(garbage)} objects in cycles after {CONNECTIONS} connections closed "
        f"({len(garbage) / CONNECTIONS:.1f} per connection): {_kinds(garbage)}"
    )


async def test_calls_over_their_limits_leave_no_garbage_cycle(backend_url: str) -> None:
    """Calls answered OVER_LIMIT, on Redis and Redis Cluster mostly from the over-limit cache
    (their hits added to the store afterwards), leave nothing for the cycle collector either."""
    sidecar = Sidecar(backend_url, limit=2)
    await sidecar.connect()
    try:
        users = PER_READ * 8
        for _ in range(3):  # every user at its limit, then over it
            sidecar.next_user = 0
            for data in sidecar.prepare(users):
                await sidecar.feed(data)
        reads = []
        for _ in range(CALLS // users):
            sidecar.next_user = 0
            reads += sidecar.prepare(users)
        refused = sidecar.refused()
        with _cycles() as garbage:
            for data in reads:
                await sidecar.feed(data)
        over, from_cache = sidecar.refused()
        assert over - refused[0] == 2 * CALLS
        # The memory backend answers at once: the over-limit cache is only for the others.
        assert (from_cache - refused[1] > CALLS) == (backend_url != "memory://")
    finally:
        await sidecar.close()
    assert garbage == [], (
        f"{len(garbage)} objects in cycles after {CALLS} calls over their limits "
        f"({len(garbage) / CALLS:.1f} per call): {_kinds(garbage)}"
    )
