"""HTTP/2 conformance of the fast transport's server, stream by stream: resets from either side,
stream limits, request header rules, gRPC framing, and the graceful shutdown.

The client is tests/support/h2peer.py (h2's state machine, or raw frames); see
test_h2_conformance.py for the connection-level rules.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from pathlib import Path

import grpc
import hpack
import pytest
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, PingFrame, RstStreamFrame, SettingsFrame
from support.h2peer import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Headers,
    Peer,
    answered,
    call,
    grpc_message,
    headers_frame,
    raw_frame,
    request_headers,
    split_frames,
    stream_error,
)
from support.h2served import ECHO, MAX_STREAMS, WAIT, Served, serve_h2

from sidecar.rls.h2.connection import DEFAULT_LIMITS, Connection, Limits

CANCEL = 8


async def waiting(served: Served, calls: int) -> None:
    """Until `calls` calls wait at the gate."""
    async with asyncio.timeout(10):
        while served.methods.waiting < calls:
            await asyncio.sleep(0.005)


# --- resets, GOAWAY from the peer, stream limits -----------------------------------------------


async def test_a_call_reset_by_the_peer_is_dropped_and_its_late_answer_discarded(
    peer: Peer, served: Served
) -> None:
    """A call the peer resets gets nothing more on its stream, even when its answer comes later;
    the connection's next call is answered."""
    peer.start()
    reset = peer.call(WAIT, b"never")
    await waiting(served, 1)
    peer.h2.reset_stream(reset, CANCEL)
    peer.flush()
    await peer.quiet(0.1)
    served.methods.gate.set()
    after = peer.call(ECHO, b"next")
    await answered(peer, after)
    await peer.quiet()

    assert peer.on(reset) == []
    assert peer.data[after] == grpc_message(b"next")


async def test_calls_in_flight_are_answered_after_the_peer_sent_goaway(
    raw: Peer, served: Served
) -> None:
    """GOAWAY from the client: what it already asked for is answered, then the server closes."""
    raw.send(call(raw, 1, WAIT))
    await waiting(served, 1)
    raw.send(raw_frame(GOAWAY, 0, 0, struct.pack(">LL", 0, NO_ERROR)))
    await raw.quiet(0.1)
    served.methods.gate.set()
    await raw.closed()

    assert raw.trailers(1) == {b"grpc-status": b"0"}


async def test_a_stream_over_max_concurrent_streams_is_refused(raw: Peer, served: Served) -> None:
    """REFUSED_STREAM for the stream beyond the limit; the others are answered."""
    ids = [1 + 2 * n for n in range(MAX_STREAMS + 1)]
    raw.send(*(call(raw, stream_id, WAIT) for stream_id in ids))
    await stream_error(raw, ids[-1], REFUSED_STREAM)
    await waiting(served, MAX_STREAMS)
    served.methods.gate.set()
    for stream_id in ids[:-1]:
        assert await answered(raw, stream_id) == {b"grpc-status": b"0"}


async def test_reset_calls_count_against_the_limit_until_they_return(
    raw: Peer, served: Served
) -> None:
    """Opening and resetting streams cannot pile up calls (the "rapid reset" attack): a call
    still working on a reset stream holds its slot until it returns."""
    ids = [1 + 2 * n for n in range(MAX_STREAMS)]
    raw.send(*(call(raw, stream_id, WAIT) for stream_id in ids))
    await waiting(served, MAX_STREAMS)
    raw.send(*(raw_frame(RST_STREAM, 0, stream_id, struct.pack(">L", CANCEL)) for stream_id in ids))
    raw.send(call(raw, 11, ECHO))
    await stream_error(raw, 11, REFUSED_STREAM)

    served.methods.gate.set()
    await raw.quiet(0.2)
    raw.send(call(raw, 13, ECHO))
    assert await answered(raw, 13) == {b"grpc-status": b"0"}
    assert [f.stream_id for f in raw.frames if f.stream_id in ids] == []


# --- what counts toward MAX_CONCURRENT_STREAMS (RFC 9113 §5.1.2) ---------------------------------
#
# Open and half-closed streams count. Here a stream is half-closed (remote) while its call is out
# or its answer waits for window; none stays half-closed (local): a stream answered before its
# request ends is reset with NO_ERROR (§8.1), which closes it.

#: h2spec's request: `spec.CommonHeaders`, a GET of `/`, encoded once and sent on every stream.
_H2SPEC_GET = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":path", b"/"),
    (b":authority", b"127.0.0.1:8081"),
]
_ZERO_WINDOW = raw_frame(SETTINGS, 0, 0, struct.pack(">HL", INITIAL_WINDOW_SIZE, 0))
_DEFAULT_WINDOW = raw_frame(SETTINGS, 0, 0, struct.pack(">HL", INITIAL_WINDOW_SIZE, 65_535))


def _h2spec_5_1_2(advertised: int, opening: Callable[[int], bytes]) -> tuple[list[int], bytes]:
    """h2spec's frames once its handshake is done: SETTINGS_INITIAL_WINDOW_SIZE 0 ("to prevent
    the peer from closing the stream"), then `opening` on one stream more than `advertised`."""
    ids = [1 + 2 * n for n in range(advertised + 1)]
    return ids, _ZERO_WINDOW + b"".join(opening(stream_id) for stream_id in ids)


async def _advertised(raw: Peer) -> int:
    """The server's SETTINGS_MAX_CONCURRENT_STREAMS, read as h2spec reads it; ACKed as it does."""
    await raw.until(lambda p: bool(p.of(SettingsFrame)))
    raw.send(raw_frame(SETTINGS, ACK, 0))
    advertised: int = raw.of(SettingsFrame)[0].settings[MAX_CONCURRENT_STREAMS]
    return advertised


def _get(stream_id: int, block: bytes) -> bytes:
    """h2spec's HEADERS: the whole request, ending the stream."""
    return raw_frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block)


def _sans_io(answer_at_once: bool) -> Connection:
    """A Connection with the default limits, past the client's preface and SETTINGS; with
    `answer_at_once`, each call is answered as soon as it is made (Echo)."""

    def on_call(stream_id: int, path: str, message: bytes) -> None:
        if answer_at_once:
            conn.respond(stream_id, message)

    conn = Connection(on_call)
    conn.initiate()
    conn.receive(PREFACE + raw_frame(SETTINGS, 0, 0))
    conn.data_to_send()
    return conn


def _fed(conn: Connection, data: bytes) -> list[Frame]:
    """Feed `data` in one read, resuming until all of it is read; the frames written back."""
    conn.receive(data)
    while conn.backlog:
        conn.resume()
    written, rest = split_frames(conn.data_to_send())
    assert rest == b""
    return written


async def test_h2spec_5_1_2_the_get_past_the_limit_is_refused(raw: Peer) -> None:
    """h2spec's case "http2/5.1.2: Sends HEADERS frames that causes their advertised concurrent
    stream limit to be exceeded", frame for frame through the server: a window of 0, then one
    GET more than the advertised limit, each HEADERS ending its stream. Each GET is answered as
    plain HTTP, a 405 whose body the window of 0 holds after its HEADERS, so every stream stays
    half-closed (remote) and counts, and the GET past the limit gets RST_STREAM REFUSED_STREAM,
    which h2spec waits for. Once the window opens each body ends its stream."""
    advertised = await _advertised(raw)
    block = raw.block(_H2SPEC_GET)  # sent on every stream, as h2spec sends it
    ids, frames = _h2spec_5_1_2(advertised, lambda stream_id: _get(stream_id, block))
    raw.send(frames)
    await stream_error(raw, ids[-1], REFUSED_STREAM)
    await raw.until(lambda p: all(p.on(stream_id) for stream_id in ids[:-1]))
    assert [raw.kinds(stream_id) for stream_id in ids[:-1]] == [["HeadersFrame"]] * advertised
    assert {raw.trailers(stream_id)[b":status"] for stream_id in ids[:-1]} == {b"405"}

    raw.send(_DEFAULT_WINDOW)
    await raw.until(lambda p: all(p.ended(stream_id) for stream_id in ids[:-1]))
    bodies = {b"".join(f.data for f in raw.of(DataFrame) if f.stream_id == s) for s in ids[:-1]}
    assert bodies == {b"gRPC calls are POST, not GET\n"}
    assert [f.stream_id for f in raw.of(RstStreamFrame)] == [ids[-1]]


def test_h2spec_5_1_2_at_the_default_limit_on_the_state_machine() -> None:
    """h2spec's 5.1.2 case against the sans-IO Connection at its default limit of 1,024: the
    first 1,024 GETs are answered with a 405's HEADERS, their bodies held by the window of 0,
    and the 1,025th is refused; a SETTINGS that opens the window sends each body, ending its
    stream, and no stream is left open."""
    conn, decoder = _sans_io(answer_at_once=False), hpack.Decoder()
    block = hpack.Encoder().encode(_H2SPEC_GET)
    ids, frames = _h2spec_5_1_2(
        DEFAULT_LIMITS.max_concurrent_streams, lambda stream_id: _get(stream_id, block)
    )
    written = _fed(conn, frames)

    kinds = ["SettingsFrame"] + ["HeadersFrame"] * (len(ids) - 1) + ["RstStreamFrame"]
    assert [type(f).__name__ for f in written] == kinds
    assert [f.stream_id for f in written[1:]] == ids
    assert (written[-1].error_code, len(conn.streams)) == (REFUSED_STREAM, len(ids) - 1)
    assert {dict(decoder.decode(f.data, raw=True))[b":status"] for f in written[1:-1]} == {b"405"}

    written = _fed(conn, _DEFAULT_WINDOW)
    assert [type(f).__name__ for f in written] == ["SettingsFrame"] + ["DataFrame"] * (len(ids) - 1)
    assert [f.stream_id for f in written[1:]] == ids[:-1]
    assert all("END_STREAM" in f.flags for f in written[1:])
    assert conn.streams == {} and not conn.closed


async def test_answers_held_by_a_zero_window_count_and_the_stream_past_them_is_refused(
    raw: Peer,
) -> None:
    """What h2spec's 5.1.2 case means to test, with gRPC calls as Envoy sends them (HEADERS,
    then DATA with END_STREAM): under a window of 0 each answer's DATA waits after its HEADERS,
    so its stream stays half-closed (remote) and counts; the stream past the limit gets
    RST_STREAM REFUSED_STREAM. Once the window opens the answers end, and room comes back."""
    advertised = await _advertised(raw)
    ids, frames = _h2spec_5_1_2(advertised, lambda stream_id: call(raw, stream_id, ECHO))
    raw.send(frames)
    await stream_error(raw, ids[-1], REFUSED_STREAM)
    await raw.until(lambda p: all(p.on(stream_id) for stream_id in ids[:-1]))
    assert [raw.kinds(stream_id) for stream_id in ids[:-1]] == [["HeadersFrame"]] * advertised

    raw.send(_DEFAULT_WINDOW)
    for stream_id in ids[:-1]:
        assert await answered(raw, stream_id) == {b"grpc-status": b"0"}
    after = ids[-1] + 2
    raw.send(call(raw, after, ECHO))
    assert await answered(raw, after) == {b"grpc-status": b"0"}


def test_answers_held_by_a_zero_window_at_the_default_limit_on_the_state_machine() -> None:
    """The same on the sans-IO Connection at its default limit: 1,024 calls answered at once,
    their DATA held by the window of 0, and the 1,025th stream refused; a SETTINGS that opens
    the window sends every answer's DATA and trailers, and no stream is left."""
    conn = _sans_io(answer_at_once=True)
    block = hpack.Encoder().encode([(n, v, True) for n, v in request_headers(ECHO)])
    ids, frames = _h2spec_5_1_2(
        DEFAULT_LIMITS.max_concurrent_streams,
        lambda s: (
            raw_frame(HEADERS, END_HEADERS, s, block)
            + raw_frame(DATA, END_STREAM, s, grpc_message(b"x"))
        ),
    )
    written = _fed(conn, frames)
    resets = [(f.stream_id, f.error_code) for f in written if isinstance(f, RstStreamFrame)]
    assert resets == [(ids[-1], REFUSED_STREAM)]
    assert len(conn.streams) == DEFAULT_LIMITS.max_concurrent_streams

    written = _fed(conn, _DEFAULT_WINDOW)
    assert len([f for f in written if isinstance(f, DataFrame)]) == len(ids) - 1
    assert conn.streams == {}


async def test_a_request_still_being_sent_holds_its_stream_until_it_ends_or_is_reset(
    raw: Peer,
) -> None:
    """Streams opened by HEADERS without END_STREAM are open and count: the one past the limit
    is refused. One the peer ends (and that is answered) and one it resets give back two
    streams, exactly: two more open, and the next is refused again."""
    ids = [1 + 2 * n for n in range(MAX_STREAMS)]
    raw.send(*(headers_frame(raw, stream_id, ECHO) for stream_id in ids))
    beyond = ids[-1] + 2
    raw.send(headers_frame(raw, beyond, ECHO))
    await stream_error(raw, beyond, REFUSED_STREAM)

    raw.send(
        raw_frame(DATA, END_STREAM, ids[0], grpc_message(b"done")),
        raw_frame(RST_STREAM, 0, ids[1], struct.pack(">L", CANCEL)),
    )
    assert await answered(raw, ids[0]) == {b"grpc-status": b"0"}
    more = [beyond + 2, beyond + 4]
    raw.send(*(headers_frame(raw, stream_id, ECHO) for stream_id in [*more, beyond + 6]))
    await raw.until(lambda p: len(p.of(RstStreamFrame)) == 2)

    resets = [(f.stream_id, f.error_code) for f in raw.of(RstStreamFrame)]
    assert resets == [(beyond, REFUSED_STREAM), (beyond + 6, REFUSED_STREAM)]
    assert [raw.on(stream_id) for stream_id in [*ids[1:], *more]] == [[]] * (len(ids) + 1)


def test_a_stream_answered_before_its_request_ends_is_reset_and_frees_its_slot() -> None:
    """An answer sent before the peer's END_STREAM (here a body over the connection's buffer
    bound: RESOURCE_EXHAUSTED) comes with RST_STREAM NO_ERROR, which closes the stream (§8.1):
    at a limit of one stream the next is taken, and the DATA the peer had already sent on the
    answered stream is ignored."""
    called: list[int] = []
    conn = Connection(
        lambda stream_id, path, message: called.append(stream_id),
        Limits(max_concurrent_streams=1, max_buffered_bytes=1_024),
    )
    block = hpack.Encoder().encode([(n, v, True) for n, v in request_headers(ECHO)])
    opened = raw_frame(HEADERS, END_HEADERS, 1, block) + raw_frame(DATA, 0, 1, bytes(2_048))
    written = _fed(conn, PREFACE + raw_frame(SETTINGS, 0, 0) + opened)
    assert [type(f).__name__ for f in written] == [
        "SettingsFrame",
        "HeadersFrame",
        "RstStreamFrame",
    ]
    answer = dict(hpack.Decoder().decode(written[1].data, raw=True))
    assert answer[b"grpc-status"] == b"8" and "END_STREAM" in written[1].flags
    assert written[2].error_code == NO_ERROR and conn.streams == {}

    late = raw_frame(DATA, END_STREAM, 1, bytes(16))
    then = raw_frame(HEADERS, END_HEADERS, 3, block) + raw_frame(
        DATA, END_STREAM, 3, grpc_message(b"x")
    )
    assert _fed(conn, late + then) == []
    assert called == [3] and not conn.closed


# --- request headers (RFC 9113 §8.2, §8.3) -----------------------------------------------------


def _with(headers: Headers, **changes: bytes) -> Headers:
    """`headers` with some values replaced, or added at the end."""
    new = {k.replace("_", "-").encode(): v for k, v in changes.items()}
    replaced = [(n, new.pop(n, v)) for n, v in headers]
    return replaced + list(new.items())


_BASE = request_headers(ECHO)


@pytest.mark.parametrize(
    "headers",
    [
        [*_BASE, (b"X-Upper", b"1")],
        [h for h in _BASE if h[0] != b":path"],
        [h for h in _BASE if h[0] != b":method"],
        [*_BASE, (b"connection", b"keep-alive")],
        [*_BASE, (b"te", b"gzip")],
        [*_BASE, (b":authority", b"again")],
        [(b"content-type", b"application/grpc"), *[h for h in _BASE if h[0] != b"content-type"]],
        [(b":status", b"200"), *_BASE],
        [*_BASE, (b"x-bad", b"a\nb")],
        [*_BASE, (b"x-space", b" padded")],
        [*_BASE, (b"content-length", b"abc")],
    ],
    ids=[
        "uppercase-name",
        "no-path",
        "no-method",
        "connection-header",
        "te-not-trailers",
        "pseudo-header-after-regular",
        "regular-before-pseudo",
        "response-pseudo-header",
        "newline-in-value",
        "leading-space-in-value",
        "bad-content-length",
    ],
)
async def test_a_malformed_request_resets_its_stream_and_the_connection_goes_on(
    raw: Peer, headers: Headers
) -> None:
    """A request with malformed headers (RFC 9113 §8.2 and §8.3) resets its stream with
    PROTOCOL_ERROR; the next call on the connection is answered."""
    raw.send(raw_frame(HEADERS, END_HEADERS | END_STREAM, 1, raw.block(headers)))
    await stream_error(raw, 1, PROTOCOL_ERROR)
    raw.send(call(raw, 3, ECHO))
    assert await answered(raw, 3) == {b"grpc-status": b"0"}


async def test_a_body_that_contradicts_content_length_resets_the_stream(raw: Peer) -> None:
    """A body shorter than its content-length resets the stream with PROTOCOL_ERROR."""
    block = raw.block(request_headers(ECHO, content_length="100"))
    raw.send(
        raw_frame(HEADERS, END_HEADERS, 1, block),
        raw_frame(DATA, END_STREAM, 1, grpc_message(b"short")),
    )
    await stream_error(raw, 1, PROTOCOL_ERROR)


async def test_request_trailers_end_the_request(raw: Peer) -> None:
    """Trailers (HEADERS with END_STREAM after the body) end the request, which is then answered."""
    raw.send(
        headers_frame(raw, 1, ECHO),
        raw_frame(DATA, 0, 1, grpc_message(b"t")),
        raw_frame(HEADERS, END_HEADERS | END_STREAM, 1, raw.block([(b"x-trailer", b"1")])),
    )
    assert await answered(raw, 1) == {b"grpc-status": b"0"}


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (
            lambda p: raw_frame(HEADERS, END_HEADERS, 1, p.block([(b"x-trailer", b"1")])),
            PROTOCOL_ERROR,
        ),
        (lambda p: raw_frame(DATA, END_STREAM, 1, grpc_message(b"x")), STREAM_CLOSED),
        (lambda p: raw_frame(WINDOW_UPDATE, 0, 1, bytes(4)), PROTOCOL_ERROR),
    ],
    ids=["trailers-without-end-stream", "data-after-end-stream", "window-update-of-0"],
)
async def test_a_broken_stream_rule_resets_the_stream(
    raw: Peer, served: Served, frames: object, code: int
) -> None:
    """Frames that break a stream's rules while its request is open or being answered."""
    if code == STREAM_CLOSED:
        raw.send(call(raw, 1, WAIT))
        await waiting(served, 1)
    else:
        raw.send(headers_frame(raw, 1, ECHO))
    raw.send(frames(raw))  # type: ignore[operator]
    await stream_error(raw, 1, code)


async def test_data_on_a_stream_the_server_reset_is_ignored(raw: Peer) -> None:
    """Frames the peer sent before it saw our RST_STREAM are not errors (§5.1, closed)."""
    raw.send(raw_frame(HEADERS, END_HEADERS, 1, raw.block([(b"X-Upper", b"1")])))
    await stream_error(raw, 1, PROTOCOL_ERROR)
    raw.send(raw_frame(DATA, END_STREAM, 1, b"late"), call(raw, 3, ECHO))
    assert await answered(raw, 3) == {b"grpc-status": b"0"}
    assert len(raw.of(RstStreamFrame)) == 1


# --- what a gRPC server answers itself ---------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "status", "grpc_status"),
    [
        (_with(_BASE, grpc_encoding=b"gzip"), grpc_message(b"x"), b"200", b"12"),
        (_BASE, b"\x00\x00", b"200", b"13"),
        (_BASE, grpc_message(b"x", flag=1), b"200", b"13"),
        (_BASE, grpc_message(b"x") + b"extra", b"200", b"13"),
        (_BASE, grpc_message(b"xyz")[:-1], b"200", b"13"),
        (_BASE, struct.pack(">BL", 0, 5 << 20), b"200", b"8"),
    ],
    ids=[
        "unsupported-grpc-encoding",
        "no-message-prefix",
        "compressed-flag",
        "two-messages",
        "truncated-message",
        "message-over-4-MiB",
    ],
)
async def test_a_request_the_server_cannot_call_is_answered_with_a_status(
    raw: Peer, headers: Headers, body: bytes, status: bytes, grpc_status: bytes
) -> None:
    """A gRPC request the server cannot call (an unsupported encoding, a body that is not
    exactly one uncompressed message, a message over 4 MiB) is answered with the HTTP and gRPC
    statuses gRPC names for it, and a message."""
    raw.send(
        raw_frame(HEADERS, END_HEADERS, 1, raw.block(headers)),
        raw_frame(DATA, END_STREAM, 1, body),
    )
    trailers = await answered(raw, 1)

    assert (trailers[b":status"], trailers[b"grpc-status"]) == (status, grpc_status)
    assert trailers[b"grpc-message"]


@pytest.mark.parametrize(
    ("request_", "status", "allow", "body"),
    [
        (_H2SPEC_GET, b"405", b"POST", b"gRPC calls are POST, not GET\n"),
        (
            _with(_BASE, content_type=b"text/plain"),
            b"415",
            None,
            b"content-type must be application/grpc, not text/plain\n",
        ),
    ],
    ids=["get", "not-grpc-content-type"],
)
async def test_a_request_that_is_not_grpc_gets_a_plain_http_answer(
    raw: Peer, request_: Headers, status: bytes, allow: bytes | None, body: bytes
) -> None:
    """A request that is not gRPC (a GET, a POST of another content type) is answered as HTTP:
    HEADERS with the status gRPC names for it (405 with `allow: POST`, 415), a text/plain
    content type and no gRPC status, then the reason as a body in DATA that ends the stream."""
    raw.send(_get(1, raw.block(request_)))
    head = await answered(raw, 1)

    assert raw.kinds(1) == ["HeadersFrame", "DataFrame"]
    (data,) = raw.of(DataFrame)
    assert "END_STREAM" in data.flags and data.data == body
    assert (head[b":status"], head[b"content-type"]) == (status, b"text/plain; charset=utf-8")
    assert head.get(b"allow") == allow
    assert b"grpc-status" not in head
    assert raw.of(RstStreamFrame) == []


async def test_a_body_larger_than_a_message_may_be_is_answered_before_it_ends(
    peer: Peer,
) -> None:
    """RESOURCE_EXHAUSTED as soon as the body passes 4 MiB, then RST_STREAM NO_ERROR: the
    server reads no more of it."""
    peer.start()
    stream_id = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(stream_id, request_headers(ECHO))
    peer.flush()
    async with asyncio.timeout(20):
        while not peer.ended(stream_id):
            window = min(peer.h2.local_flow_control_window(stream_id), 16_384)
            if window:
                peer.h2.send_data(stream_id, bytes(window))
                peer.flush()
            else:
                await peer.read()
    await peer.until(lambda p: p.ended(stream_id))

    assert peer.trailers(stream_id)[b"grpc-status"] == b"8"
    assert [(f.stream_id, f.error_code) for f in peer.of(RstStreamFrame)] == [(stream_id, NO_ERROR)]


# --- graceful shutdown, back-pressure, Unix sockets --------------------------------------------


async def test_shutdown_is_goaway_ping_goaway_then_calls_in_flight_are_answered(
    raw: Peer, served: Served
) -> None:
    """GOAWAY(2^31-1) and a PING; streams opened before the PING ACK are still taken; after
    the final GOAWAY(last stream) a new stream is ignored; the connection closes once every
    call taken is answered."""
    raw.send(call(raw, 1, WAIT))
    await waiting(served, 1)
    stopping = asyncio.create_task(served.server.stop(grace=10.0))
    await raw.until(lambda p: bool(p.of(PingFrame)))
    first = raw.of(GoAwayFrame)[0]
    assert (first.last_stream_id, first.error_code) == (2**31 - 1, NO_ERROR)

    raw.send(call(raw, 3, ECHO))
    await answered(raw, 3)
    raw.send(raw_frame(PING, ACK, 0, raw.of(PingFrame)[0].opaque_data))
    await raw.until(lambda p: len(p.of(GoAwayFrame)) == 2)
    final = raw.of(GoAwayFrame)[1]
    assert (final.last_stream_id, final.error_code) == (3, NO_ERROR)

    raw.send(call(raw, 5, ECHO))
    await raw.quiet(0.2)
    assert not stopping.done()
    served.methods.gate.set()
    await raw.closed()
    await stopping

    assert raw.trailers(1) == {b"grpc-status": b"0"}
    assert raw.on(5) == []


async def test_a_peer_that_does_not_read_stops_the_server_reading(
    peer: Peer, served: Served
) -> None:
    """Write back-pressure: while the transport's buffer is full, the connection reads nothing."""
    peer.start()
    await peer.until(lambda p: bool(p.frames))
    (protocol,) = served.server.protocols
    assert protocol.transport is not None
    protocol.pause_writing()
    assert not protocol.transport.is_reading()
    protocol.resume_writing()
    assert protocol.transport.is_reading()


async def test_the_server_listens_on_a_unix_socket(tmp_path: Path) -> None:
    """A grpc.aio channel to `unix:PATH`; the socket file is removed on stop."""
    path = tmp_path / "rls.sock"
    async with serve_h2(f"unix:{path}") as served:
        assert served.port == 0
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            answer = await channel.unary_unary(ECHO)(b"over a pipe", timeout=10)
    assert answer == b"over a pipe"
    assert not path.exists()


async def test_a_connection_that_never_sends_its_preface_is_closed(served: Served) -> None:
    """A socket that never speaks HTTP/2 does not hold a connection open."""
    served.server.handshake_timeout = 0.1
    silent = await Peer.connect(served.port, track=False)
    await silent.closed()
    await silent.close()

    assert silent.goaways() == []


def test_closed_streams_are_remembered_in_bulk_without_growing() -> None:
    """However many streams close, the most recent CLOSED_STREAMS_REMEMBERED are remembered with
    how they closed, and the record stays under twice that size."""
    from sidecar.rls.h2.streams import CLOSED_STREAMS_REMEMBERED, Streams

    streams = Streams()
    last = 10 * CLOSED_STREAMS_REMEMBERED
    for stream_id in range(1, last + 1, 2):
        streams.remember(stream_id, stream_id % 3 == 0)
    remembered = streams.closed_streams
    assert CLOSED_STREAMS_REMEMBERED <= len(remembered) <= 2 * CLOSED_STREAMS_REMEMBERED
    recent = range(last - 2 * CLOSED_STREAMS_REMEMBERED + 1, last + 1, 2)
    assert all(remembered[stream_id] is (stream_id % 3 == 0) for stream_id in recent)
    assert 1 not in remembered
