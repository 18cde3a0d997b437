"""The fast transport's HTTP/2 server against hostile peers: each attack class ends with the
connection it came on (GOAWAY ENHANCE_YOUR_CALM, a refused stream, a closed socket), its cost
bounded, and the server still answering a legitimate client on another connection. Bounds are
the named constants of `sidecar.rls.h2.connection` and `sidecar.rls.h2.server`."""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import hpack
import pytest
from hyperframe.frame import RstStreamFrame
from support.certs import Authority
from support.h2peer import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    NO_ERROR,
    PING,
    PREFACE,
    SETTINGS,
    Peer,
    answered,
    call,
    connection_error,
    grpc_message,
    raw_frame,
    request_headers,
    split_frames,
)
from support.h2served import ECHO, WAIT, Methods, Served

from sidecar.rls.h2.connection import (
    CONTROL_BUDGET,
    CONTROL_PER_REQUEST,
    DEFAULT_LIMITS,
    MAX_CONTINUATIONS,
    MAX_EMPTY_FRAMES,
    Connection,
    Limits,
)
from sidecar.rls.h2.server import H2Server, _Protocol
from sidecar.rls.h2.streams import CLOSED_STREAMS_REMEMBERED
from sidecar.rls.h2.unary import CallbackMethod, Method
from sidecar.rls.tls import ServerTls, TlsFiles

ENHANCE_YOUR_CALM = 0xB
RESOURCE_EXHAUSTED = b"8"


async def legitimate_call_answered(served: Served) -> None:
    """A client on a connection of its own still gets its call answered."""
    peer = await Peer.connect(served.port, track=False)
    try:
        peer.start()
        peer.send(call(peer, 1, ECHO, b"still here"))
        assert await answered(peer, 1) == {b"grpc-status": b"0"}
    finally:
        await peer.close()


def calls_of(
    connection_bytes: bytes, limits: Limits = DEFAULT_LIMITS
) -> tuple[Connection, list[int]]:
    """A sans-IO Connection fed `connection_bytes` in one read, and the streams it called."""
    called: list[int] = []
    conn = Connection(lambda stream_id, path, message: called.append(stream_id), limits)
    conn.receive(connection_bytes)
    return conn, called


def goaway_code(data: bytes) -> int | None:
    """The error code of the first GOAWAY in `data` (the server's frames), if any."""
    pos = 0
    while pos + 9 <= len(data):
        size = int.from_bytes(data[pos : pos + 3])
        kind = data[pos + 3]
        if kind == 7:
            return int.from_bytes(data[pos + 13 : pos + 17])
        pos += 9 + size
    return None


# --- header blocks --------------------------------------------------------------------------


async def test_a_flood_of_empty_continuation_frames_is_enhance_your_calm(
    raw: Peer, served: Served
) -> None:
    """A header block continued by empty CONTINUATION frames (which never reach the size
    limit) ends the connection with ENHANCE_YOUR_CALM after MAX_EMPTY_FRAMES of them, however
    many follow: 100,000 were sent here."""
    raw.send(raw_frame(HEADERS, 0, 1, raw.block(request_headers(ECHO))[:3]))
    raw.send(raw_frame(CONTINUATION, 0, 1) * 100_000)
    await connection_error(raw, ENHANCE_YOUR_CALM)
    await legitimate_call_answered(served)


async def test_a_header_block_in_too_many_small_frames_is_enhance_your_calm(
    raw: Peer, served: Served
) -> None:
    """A header block split into 1-byte CONTINUATION frames ends the connection with
    ENHANCE_YOUR_CALM once it passes MAX_CONTINUATIONS frames, long before its size would."""
    block = raw.block(request_headers(ECHO, filler="x" * 200))
    assert len(block) > MAX_CONTINUATIONS + 2
    frames = [raw_frame(HEADERS, 0, 1, block[:1])]
    frames += [raw_frame(CONTINUATION, 0, 1, block[at : at + 1]) for at in range(1, len(block))]
    raw.send(*frames)
    goaway = await connection_error(raw, ENHANCE_YOUR_CALM)
    assert b"frames" in goaway.additional_data


def test_the_size_of_a_header_block_is_counted_once_per_frame() -> None:
    """The block's size is a running total: a block over twice the header list limit, in
    frames of 2 KiB, is refused as too large (what the sum over all frames used to find,
    at a cost that grew with the square of the frames)."""
    limits = Limits(max_header_list_size=4_096)
    chunk = b"\x00" * 2_048
    frames = raw_frame(HEADERS, 0, 1, chunk) + raw_frame(CONTINUATION, 0, 1, chunk) * 8
    conn, called = calls_of(_preface() + frames, limits)
    assert conn.closed and not called
    out = conn.data_to_send()
    assert goaway_code(out) == ENHANCE_YOUR_CALM
    assert b"too large" in out


# --- empty and control frames ---------------------------------------------------------------


async def test_empty_data_frames_in_a_row_are_enhance_your_calm(raw: Peer) -> None:
    """DATA frames with nothing in them and no END_STREAM: past MAX_EMPTY_FRAMES in a row,
    ENHANCE_YOUR_CALM."""
    raw.send(raw_frame(HEADERS, END_HEADERS, 1, raw.block(request_headers(ECHO))))
    raw.send(raw_frame(DATA, 0, 1) * (MAX_EMPTY_FRAMES + 1))
    await connection_error(raw, ENHANCE_YOUR_CALM)


def test_a_few_empty_frames_between_useful_ones_are_fine() -> None:
    """Empty frames that are not in a long row (a client flushing early) are read as usual."""
    block_frames = b""
    for stream_id in range(1, 2 * MAX_EMPTY_FRAMES, 2):
        block_frames += _headers(stream_id) + raw_frame(DATA, 0, stream_id)
        block_frames += raw_frame(DATA, END_STREAM, stream_id, grpc_message(b"x"))
    conn, called = calls_of(_preface() + block_frames)
    assert not conn.closed
    assert len(called) == MAX_EMPTY_FRAMES


def test_streams_refused_past_the_concurrency_limit_spend_the_control_budget() -> None:
    """HEADERS frames opening streams past MAX_CONCURRENT_STREAMS are refused (RST_STREAM
    REFUSED_STREAM), and each costs the control budget, as rapid reset's streams would: a
    flood of them ends with ENHANCE_YOUR_CALM rather than a reset written for every one."""
    flood = b"".join(_headers(stream_id) for stream_id in range(1, 2 * 5_000, 2))
    conn, called = calls_of(_preface() + flood, Limits(max_concurrent_streams=4))
    assert conn.closed and not called
    assert goaway_code(conn.data_to_send()) == ENHANCE_YOUR_CALM


def test_a_flood_of_streams_answered_before_their_requests_end_keeps_bounded_state() -> None:
    """Once one stream holds the connection's buffer bound, every new stream whose first DATA
    does not end it is answered RESOURCE_EXHAUSTED at once, and closed by RST_STREAM NO_ERROR:
    20,000 of them leave one stream open and at most 2 × CLOSED_STREAMS_REMEMBERED closed ids
    remembered (the bound of what a connection keeps is max_concurrent_streams streams and
    those ids, however long the flood); the late DATA the peer sends on them is ignored."""
    limits = Limits(max_buffered_bytes=16_384)
    conn, called = calls_of(_preface() + _headers(1) + raw_frame(DATA, 0, 1, bytes(16_384)), limits)
    flood = range(3, 3 + 2 * 20_000, 2)
    conn.receive(
        b"".join(_headers(stream_id) + raw_frame(DATA, 0, stream_id, b"x") for stream_id in flood)
    )
    written, _ = split_frames(conn.data_to_send())
    assert not conn.closed and not called
    assert list(conn.streams) == [1]
    assert len(conn.closed_streams) <= 2 * CLOSED_STREAMS_REMEMBERED
    resets = [(f.stream_id, f.error_code) for f in written if isinstance(f, RstStreamFrame)]
    assert resets == [(stream_id, NO_ERROR) for stream_id in flood]

    conn.receive(b"".join(raw_frame(DATA, END_STREAM, s, b"y") for s in flood[-100:]))
    assert conn.data_to_send() == b"" and not conn.closed


async def test_a_ping_flood_is_enhance_your_calm(raw: Peer, served: Served) -> None:
    """PING frames beyond CONTROL_BUDGET, with no request to earn them, end the connection
    with ENHANCE_YOUR_CALM; the server goes on answering others."""
    raw.send(raw_frame(PING, 0, 0, bytes(8)) * (CONTROL_BUDGET + 10))
    await connection_error(raw, ENHANCE_YOUR_CALM)
    await legitimate_call_answered(served)


def test_control_frames_earned_by_requests_are_allowed() -> None:
    """Each request gives back CONTROL_PER_REQUEST units of the control budget: a client that
    sends a PING and a WINDOW_UPDATE with each of 3,000 requests (more than the budget) keeps
    its connection."""
    chunk = b""
    for index in range(3_000):
        stream_id = 2 * index + 1
        chunk += _headers(stream_id) + raw_frame(DATA, END_STREAM, stream_id, grpc_message(b"x"))
        chunk += raw_frame(PING, 0, 0, bytes(8)) + raw_frame(8, 0, 0, struct.pack(">I", 1))
    called: list[int] = []

    def answer_at_once(stream_id: int, path: str, message: bytes) -> None:
        called.append(stream_id)
        conn.respond(stream_id, message)

    conn = Connection(answer_at_once, Limits(max_calls_per_read=10_000))
    conn.receive(_preface() + chunk)
    assert not conn.closed
    assert len(called) == 3_000
    assert CONTROL_BUDGET < 3_000 * 2 and CONTROL_PER_REQUEST > 2


async def test_settings_moving_the_windows_of_many_open_streams_is_enhance_your_calm() -> None:
    """With 1,000 streams open, SETTINGS frames changing the initial window (each walks every
    open stream) run out of the control budget after a few dozen: ENHANCE_YOUR_CALM, not a
    CPU held for every frame of a 100,000-frame flood."""
    async with server_with() as (_, port, _methods):
        raw = await Peer.connect(port, track=False)
        raw.start()
        raw.send(*(_headers(stream_id) for stream_id in range(1, 2_000, 2)))
        flips = [
            raw_frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 70_000 + i % 2))
            for i in range(100_000)
        ]
        raw.send(*flips)
        await connection_error(raw, ENHANCE_YOUR_CALM)
        await raw.close()
        other = await Peer.connect(port, track=False)
        other.start()
        other.send(call(other, 1, ECHO))
        assert await answered(other, 1) == {b"grpc-status": b"0"}
        await other.close()


# --- bodies buffered across connections -----------------------------------------------------


@asynccontextmanager
async def server_with(**options: object) -> AsyncIterator[tuple[H2Server, int, Methods]]:
    methods = Methods()
    table: dict[str, Method | CallbackMethod] = {ECHO: methods.echo, WAIT: methods.wait}
    limits = options.pop("limits", Limits())
    tls = options.pop("tls", None)
    server = H2Server(table, limits, **options)  # type: ignore[arg-type]
    port = await server.listen("127.0.0.1:0", tls=tls)  # type: ignore[arg-type]
    try:
        yield server, port, methods
    finally:
        methods.gate.set()
        await server.stop(grace=1.0)


async def until(done: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            await asyncio.sleep(0.01)


async def test_bodies_buffered_by_all_connections_share_one_bound_given_back_on_close() -> None:
    """Request bodies that never end are held within `max_buffered_bytes_all` over all
    connections: past it, the stream that would go over is answered RESOURCE_EXHAUSTED. When
    the connections close, every byte they held is given back (the account returns to 0)."""
    limits = Limits(max_buffered_bytes=1 << 20, max_buffered_bytes_all=1 << 20)
    async with server_with(limits=limits) as (server, port, _):
        peers = [await Peer.connect(port, track=False) for _ in range(3)]
        chunk = b"\x00\x00\x10\x00\x00" + bytes(16_379)  # a prefix promising 1 MiB, never sent
        for peer in peers:
            peer.start()
            peer.send(_headers(1, peer), *[raw_frame(DATA, 0, 1, chunk)] * 25)
        await until(lambda: server.budget.used > 0)
        for peer in peers:
            await peer.quiet(0.5)  # whatever the server answers
        refused = [peer for peer in peers if peer.ended(1)]
        assert refused, "a stream over the shared bound is refused"
        for peer in refused:
            assert peer.trailers(1)[b"grpc-status"] == RESOURCE_EXHAUSTED
        assert 0 < server.budget.used <= limits.max_buffered_bytes_all
        for peer in peers:
            await peer.close()
        await until(lambda: not server.protocols)
        assert server.budget.used == 0


# --- fairness and calls in flight -----------------------------------------------------------


def test_one_read_starts_at_most_max_calls_per_read_calls_and_resumes_later() -> None:
    """A read holding 200 whole calls starts 64 (`max_calls_per_read`) and keeps the rest as a
    backlog; each `resume` starts the next 64, until all are started in order."""
    chunk = b"".join(
        _headers(stream_id) + raw_frame(DATA, END_STREAM, stream_id, grpc_message(b"x"))
        for stream_id in range(1, 400, 2)
    )
    conn, called = calls_of(_preface() + chunk, Limits(max_calls_per_read=64))
    assert len(called) == 64 and conn.backlog
    rounds = 1
    while conn.backlog:
        conn.resume()
        rounds += 1
    assert called == list(range(1, 400, 2))
    assert rounds == 4


async def test_calls_in_one_read_past_the_per_read_bound_are_all_answered(raw: Peer) -> None:
    """Through the server: 300 calls in one write are all answered, a turn of the loop at a
    time."""
    raw.send(*(call(raw, stream_id, ECHO) for stream_id in range(1, 600, 2)))
    await raw.until(lambda p: all(p.ended(s) for s in range(1, 600, 2)))


async def test_at_the_bound_of_calls_in_flight_connections_stop_reading_until_answers() -> None:
    """With `max_calls_in_flight` calls waiting, the server starts no more: a new call on
    another connection is put aside, not started, and is answered once the calls in flight
    come down to `resume_calls_in_flight`."""
    async with server_with(max_calls_in_flight=4, resume_calls_in_flight=2) as (
        server,
        port,
        methods,
    ):
        busy = await Peer.connect(port, track=False)
        busy.start()
        busy.send(*(call(busy, stream_id, WAIT) for stream_id in (1, 3, 5, 7)))
        await until(lambda: server.in_flight() == 4)
        other = await Peer.connect(port, track=False)
        other.start()
        await asyncio.sleep(0.1)
        other.send(call(other, 1, ECHO))
        await other.quiet(0.3)
        assert not other.ended(1)
        methods.gate.set()
        assert await answered(other, 1) == {b"grpc-status": b"0"}
        await busy.until(lambda p: all(p.ended(s) for s in (1, 3, 5, 7)))
        await busy.close()
        await other.close()


def waiting(server: H2Server) -> int:
    """Connections held with something put aside to read."""
    return sum(1 for protocol in server.held if protocol.conn.unread)


async def test_held_connections_take_their_turns_oldest_connection_first() -> None:
    """At the bound of calls in flight, what connections send waits; once the calls come down,
    the connections take their turns oldest first: a client connected before a flood of new
    connections is started before all of them, though it sent last (a gateway's connections to
    its sidecar are kept; a flood's are new)."""
    started: list[bytes] = []
    methods = Methods()

    async def record(message: bytes) -> bytes:
        started.append(message)
        return message

    server = H2Server(
        {ECHO: record, WAIT: methods.wait}, max_calls_in_flight=4, resume_calls_in_flight=2
    )
    port = await server.listen("127.0.0.1:0")
    peers: list[Peer] = []  # the flood's
    opened: list[Peer] = []
    try:
        gateway = await Peer.connect(port, track=False)
        busy = await Peer.connect(port, track=False)
        opened += [gateway, busy]
        gateway.start()
        busy.start()
        busy.send(*(call(busy, stream_id, WAIT) for stream_id in (1, 3, 5, 7)))
        await until(lambda: server.in_flight() == 4)
        for n in range(20):
            peer = await Peer.connect(port, track=False)
            opened.append(peer)
            peer.start()
            peer.send(call(peer, 1, ECHO, b"flood %d" % n))
            peers.append(peer)
            await until(lambda: waiting(server) == len(peers))
        gateway.send(call(gateway, 1, ECHO, b"gateway"))
        await until(lambda: waiting(server) == 21)
        methods.gate.set()
        assert await answered(gateway, 1) == {b"grpc-status": b"0"}
        for peer in peers:
            await peer.until(lambda p: p.ended(1))
        assert started == [b"gateway", *(b"flood %d" % n for n in range(20))]
    finally:
        methods.gate.set()
        for peer in opened:
            await peer.close()
        await server.stop(grace=1.0)


class Gates:
    """A method whose each call waits for its own message's gate; records the order started."""

    def __init__(self) -> None:
        self.started: list[bytes] = []
        self.gates: dict[bytes, asyncio.Event] = {}

    def gate(self, message: bytes) -> asyncio.Event:
        return self.gates.setdefault(message, asyncio.Event())

    async def wait(self, message: bytes) -> bytes:
        self.started.append(message)
        await self.gate(message).wait()
        return message


@asynccontextmanager
async def gated_server(
    max_calls: int, resume_calls: int
) -> AsyncIterator[tuple[H2Server, Gates, Callable[[], Awaitable[Peer]]]]:
    """A server of `Gates.wait` with these bounds on calls in flight, and a function opening a
    started connection to it; every gate opened and every connection closed on the way out."""
    gates = Gates()
    server = H2Server(
        {WAIT: gates.wait}, max_calls_in_flight=max_calls, resume_calls_in_flight=resume_calls
    )
    port = await server.listen("127.0.0.1:0")
    opened: list[Peer] = []

    async def connect() -> Peer:
        peer = await Peer.connect(port, track=False)
        opened.append(peer)
        peer.start()
        return peer

    try:
        yield server, gates, connect
    finally:
        for event in gates.gates.values():
            event.set()
        for peer in opened:
            await peer.close()
        await server.stop(grace=1.0)


async def test_a_round_lets_go_only_the_connections_the_room_takes() -> None:
    """When the calls in flight come down, only as many held connections take their turn as
    there is room for calls; the others stay held in their places, untouched (no callback is
    scheduled for them: a flood's hundreds of held connections cost nothing per round), and
    take their turns in later rounds, oldest first, until every call is answered."""
    loop = asyncio.get_running_loop()
    touched: set[object] = set()  # the connections a callback was scheduled for
    call_soon = loop.call_soon

    def watched(callback: Callable[..., object], *args: object, **kwargs: Any) -> asyncio.Handle:
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, _Protocol):
            touched.add(owner)
        return call_soon(callback, *args, **kwargs)

    async with gated_server(4, 2) as (server, gates, connect):
        busy = await connect()
        busy.send(*(call(busy, 1 + 2 * n, WAIT, b"busy %d" % n) for n in range(4)))
        await until(lambda: server.in_flight() == 4)
        flood: list[Peer] = []
        for n in range(20):
            peer = await connect()
            peer.send(call(peer, 1, WAIT, b"flood %d" % n))
            flood.append(peer)
            await until(lambda: waiting(server) == len(flood))
        loop.call_soon = watched  # type: ignore[method-assign]
        try:
            for n in range(3):
                gates.gate(b"busy %d" % n).set()
            await until(lambda: len(gates.started) == 7)
            await asyncio.sleep(0.05)
        finally:
            del loop.call_soon  # the loop's own method again
        assert gates.started[4:] == [b"flood 0", b"flood 1", b"flood 2"]
        # busy's (answering) and three of the flood's at most, not one per held connection
        assert len(touched) <= 4, len(touched)
        assert waiting(server) == 17
        gates.gate(b"busy 3").set()
        for n in range(20):
            gates.gate(b"flood %d" % n).set()
        for peer in flood:
            assert await answered(peer, 1) == {b"grpc-status": b"0"}
        assert gates.started[4:] == [b"flood %d" % n for n in range(20)]
        assert not server.held


async def test_connections_closed_while_held_leave_no_growing_queue() -> None:
    """Connections that close while held leave the queue of held connections; what the server
    keeps for their order stays within twice the connections still held (plus 64), however
    many come and go, and the one left is still served."""
    async with gated_server(1, 0) as (server, gates, connect):
        busy = await connect()
        busy.send(call(busy, 1, WAIT, b"busy"))
        await until(lambda: server.in_flight() == 1)
        kept = await connect()
        kept.send(call(kept, 1, WAIT, b"kept"))
        await until(lambda: waiting(server) == 1)
        for _ in range(3):
            gone = [await connect() for _ in range(100)]
            for n, peer in enumerate(gone):
                peer.send(call(peer, 1, WAIT, b"gone %d" % n))
            await until(lambda: waiting(server) == 101)
            for peer in gone:
                await peer.close()
            # busy's (it stopped reading when it filled the bound) and kept's
            await until(lambda: len(server.held) == 2)
            assert len(server._held_order) <= 2 * len(server.held) + 64
        gates.gate(b"busy").set()
        gates.gate(b"kept").set()
        assert await answered(kept, 1) == {b"grpc-status": b"0"}
        assert not any(message.startswith(b"gone") for message in gates.started)


# --- connections ----------------------------------------------------------------------------


async def test_connections_past_the_bound_are_closed_at_once() -> None:
    """With `max_connections` open, one more is closed as soon as it is accepted; the open
    ones keep working."""
    async with server_with(max_connections=2) as (server, port, _):
        kept = [await Peer.connect(port, track=False) for _ in range(2)]
        for peer in kept:
            peer.start()
        await until(lambda: len(server.protocols) == 2)
        extra = await Peer.connect(port, track=False)
        await extra.closed()
        kept[0].send(call(kept[0], 1, ECHO))
        assert await answered(kept[0], 1) == {b"grpc-status": b"0"}
        for peer in [*kept, extra]:
            await peer.close()


async def test_a_connection_stuck_mid_frame_or_mid_body_is_closed() -> None:
    """A connection that stops in the middle of a frame, or of a request body, and sends
    nothing for `frame_timeout` is closed; one that is only idle between calls is not."""
    async with server_with(sweep_interval=0.1, frame_timeout=0.3, idle_timeout=60) as (
        server,
        port,
        _,
    ):
        mid_frame = await Peer.connect(port, track=False)
        mid_frame.start()
        mid_frame.send(raw_frame(PING, 0, 0, bytes(8))[:12])
        mid_body = await Peer.connect(port, track=False)
        mid_body.start()
        mid_body.send(_headers(1, mid_body), raw_frame(DATA, 0, 1, b"\x00\x00"))
        idle = await Peer.connect(port, track=False)
        idle.start()
        idle.send(call(idle, 1, ECHO))
        await answered(idle, 1)
        await mid_frame.closed(5)
        await mid_body.closed(5)
        await idle.quiet(0.5)
        assert not idle.eof
        for peer in (mid_frame, mid_body, idle):
            await peer.close()
        await until(lambda: not server.protocols)


async def test_an_idle_connection_is_closed_with_goaway_after_the_idle_timeout() -> None:
    """A connection with nothing open that sends nothing for `idle_timeout` gets GOAWAY
    NO_ERROR and is closed (Envoy opens a new one when it needs one)."""
    async with server_with(sweep_interval=0.1, idle_timeout=0.3) as (_, port, _methods):
        idle = await Peer.connect(port, track=False)
        idle.start()
        idle.send(call(idle, 1, ECHO))
        await answered(idle, 1)
        await idle.closed(5)
        assert idle.goaways()[-1].error_code == 0
        await idle.close()


# --- helpers ------------------------------------------------------------------------------------


def _preface() -> bytes:
    return PREFACE + raw_frame(SETTINGS, 0, 0)


_BLOCK: list[bytes] = []


def _headers(stream_id: int, peer: Peer | None = None) -> bytes:
    """A HEADERS frame opening `stream_id` for ECHO. Its fields are never indexed, so the same
    block can be sent on any stream, in any order."""
    if not _BLOCK:
        encoder = hpack.Encoder()
        _BLOCK.append(
            encoder.encode([(name, value, True) for name, value in request_headers(ECHO)])
        )
    return raw_frame(HEADERS, END_HEADERS, stream_id, _BLOCK[0])


# --- over TLS: the same bounds, and the handshake bounded too ------------------------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The server's TLS context (sidecar.rls.tls) and a client's that trusts it."""
    authority = Authority()
    cert, key = authority.issue(tmp_path, "server")
    client = ssl.create_default_context(cafile=authority.write(tmp_path / "ca.crt"))
    client.set_alpn_protocols(["h2"])
    return ServerTls(TlsFiles(cert, key)).listening, client


async def test_a_tls_handshake_that_never_completes_is_closed_after_the_handshake_timeout(
    tls_files: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """A TCP connection that sends nothing, or half a ClientHello, to a TLS port is closed once
    `handshake_timeout` has passed; it never counted as a connection, and a client that does
    finish its handshake is answered meanwhile."""
    server_tls, client_tls = tls_files
    async with server_with(tls=server_tls, handshake_timeout=0.3) as (server, port, _):
        silent = await asyncio.open_connection("127.0.0.1", port)
        half = await asyncio.open_connection("127.0.0.1", port)
        half[1].write(bytes.fromhex("160301020001") + bytes(40))  # a ClientHello, cut short
        legitimate = await Peer.connect(port, track=False, tls=client_tls)
        legitimate.start()
        legitimate.send(call(legitimate, 1, ECHO, b"over tls"))
        assert await answered(legitimate, 1) == {b"grpc-status": b"0"}
        assert len(server.protocols) == 1
        for reader, writer in (silent, half):
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed by the server
            writer.close()
        await legitimate.close()


async def test_over_tls_a_ping_flood_and_a_connection_stuck_mid_frame_are_ended(
    tls_files: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """TLS changes nothing of the HTTP/2 bounds: a PING flood gets ENHANCE_YOUR_CALM, and a
    connection stuck in the middle of a frame is closed after `frame_timeout`."""
    server_tls, client_tls = tls_files
    async with server_with(tls=server_tls, sweep_interval=0.1, frame_timeout=0.3) as (
        server,
        port,
        _,
    ):
        flood = await Peer.connect(port, track=False, tls=client_tls)
        flood.start()
        flood.send(raw_frame(PING, 0, 0, bytes(8)) * (CONTROL_BUDGET + 10))
        await connection_error(flood, ENHANCE_YOUR_CALM)
        stuck = await Peer.connect(port, track=False, tls=client_tls)
        stuck.start()
        stuck.send(raw_frame(PING, 0, 0, bytes(8))[:12])
        await stuck.closed(5)
        for peer in (flood, stuck):
            await peer.close()
        await until(lambda: not server.protocols)
