"""HTTP/2 conformance of the fast transport's server (RFC 9113, RFC 7541), frame by frame.

An independent client (tests/support/h2peer.py: h2's state machine, or raw frames for what h2
will not send) talks to an `H2Server` on a loopback port, and each test asserts the frames the
RFC asks for: answers, RST_STREAM codes for stream errors, GOAWAY codes for connection errors.
"""

from __future__ import annotations

import asyncio
import struct

import pytest
from hyperframe.frame import (
    DataFrame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from support.h2peer import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Peer,
    answered,
    call,
    connection_error,
    grpc_message,
    raw_frame,
    request_headers,
    stream_error,
)
from support.h2served import BUG, ECHO, FAIL, MAX_STREAMS, THEN, Served

# --- connection setup and a call ---------------------------------------------------------------


async def test_the_server_announces_its_settings_and_acknowledges_the_clients(peer: Peer) -> None:
    """The server preface is SETTINGS, then a connection WINDOW_UPDATE; the client's SETTINGS
    get exactly one ACK."""
    peer.start()
    await peer.until(lambda p: any("ACK" in f.flags for f in p.of(SettingsFrame)))

    settings, window = peer.frames[:2]
    assert isinstance(settings, SettingsFrame) and not settings.flags
    assert settings.settings == {
        MAX_CONCURRENT_STREAMS: MAX_STREAMS,
        INITIAL_WINDOW_SIZE: 1 << 20,
        MAX_HEADER_LIST_SIZE: 16_384,
    }
    assert isinstance(window, WindowUpdateFrame)
    assert (window.stream_id, window.window_increment) == (0, (1 << 24) - 65_535)
    assert len([f for f in peer.of(SettingsFrame) if "ACK" in f.flags]) == 1


async def test_a_unary_call_is_headers_data_and_trailers(peer: Peer) -> None:
    """The answer: `:status 200` and the gRPC content-type, one message, `grpc-status 0`."""
    peer.start()
    stream_id = peer.call(ECHO, b"hello")
    trailers = await answered(peer, stream_id)

    assert peer.kinds(stream_id) == ["HeadersFrame", "DataFrame", "HeadersFrame"]
    assert peer.blocks[stream_id][0] == [
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
    ]
    assert peer.data[stream_id] == grpc_message(b"hello")
    assert trailers == {b"grpc-status": b"0"}


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/t.T/Nope", b"12", b"unknown method /t.T/Nope"),
        (FAIL, b"3", b"no: bad input %E2%9C%97"),
        (BUG, b"13", b"internal error: ZeroDivisionError: a bug"),
    ],
    ids=["unknown-method", "call-error", "bug"],
)
async def test_a_call_that_fails_is_trailers_only(
    peer: Peer, path: str, status: bytes, message: bytes
) -> None:
    """No message, one HEADERS frame ending the stream: status and percent-encoded message."""
    peer.start()
    stream_id = peer.call(path, b"x")
    trailers = await answered(peer, stream_id)

    assert peer.kinds(stream_id) == ["HeadersFrame"]
    assert trailers == {
        b":status": b"200",
        b"content-type": b"application/grpc",
        b"grpc-status": status,
        b"grpc-message": message,
    }


@pytest.mark.parametrize(
    ("message", "data", "trailers"),
    [
        (b"now", b"answered now", {b"grpc-status": b"0"}),
        (b"later", b"answered later", {b"grpc-status": b"0"}),
        (b"twice", b"first", {b"grpc-status": b"0"}),
        (b"raise", None, (b"9", b"mapped KeyError('raised')")),
        (b"error later", None, (b"9", b"mapped KeyError('answered')")),
        (b"call-error", None, (b"5", b"as it is")),
    ],
    ids=["now", "later", "twice", "raise", "error-later", "call-error"],
)
async def test_a_callback_method_answers_once_its_errors_mapped_and_its_duration_observed(
    peer: Peer,
    served: Served,
    message: bytes,
    data: bytes | None,
    trailers: dict[bytes, bytes] | tuple[bytes, bytes],
) -> None:
    """A CallbackMethod's first answer is the one sent, at once or later; an exception it
    raises or answers goes through its `errors` (a CallError does not), and `observe` gets one
    duration per call."""
    peer.start()
    stream_id = peer.call(THEN, message)
    got = await answered(peer, stream_id)

    if data is not None:
        assert peer.data[stream_id] == grpc_message(data)
        assert got == trailers
    else:
        assert isinstance(trailers, tuple)
        assert peer.kinds(stream_id) == ["HeadersFrame"]
        assert (got[b"grpc-status"], got[b"grpc-message"]) == trailers
    await asyncio.sleep(0.01)  # a second answer, if any, has come and gone
    assert len(served.methods.durations) == 1 and served.methods.durations[0] >= 0
    assert len(peer.kinds(stream_id)) == (3 if data is not None else 1)  # one answer only


# --- header blocks: CONTINUATION, padding, priority, HPACK -------------------------------------


async def test_a_header_block_split_over_continuation_frames_is_one_request(raw: Peer) -> None:
    """A header block split over HEADERS and two CONTINUATION frames is read as one request and
    answered once."""
    block = raw.block(request_headers(ECHO))
    first, second, third = block[:5], block[5:12], block[12:]
    raw.send(
        raw_frame(HEADERS, 0, 1, first),
        raw_frame(CONTINUATION, 0, 1, second),
        raw_frame(CONTINUATION, END_HEADERS, 1, third),
        raw_frame(DATA, END_STREAM, 1, grpc_message(b"split")),
    )
    assert await answered(raw, 1) == {b"grpc-status": b"0"}
    assert raw.data[1] == grpc_message(b"split")


async def test_padded_headers_and_data_are_read_without_their_padding(raw: Peer) -> None:
    """Padded HEADERS and DATA frames are read without their padding: the call gets exactly the
    message sent."""
    block = raw.block(request_headers(ECHO))
    body = grpc_message(b"padded")
    raw.send(
        raw_frame(HEADERS, END_HEADERS | PADDED, 1, bytes([10]) + block + bytes(10)),
        raw_frame(DATA, END_STREAM | PADDED, 1, bytes([200]) + body + bytes(200)),
    )
    await answered(raw, 1)
    assert raw.data[1] == body


async def test_priority_is_read_and_ignored(raw: Peer) -> None:
    """A HEADERS PRIORITY field and PRIORITY frames (even on idle streams) change nothing."""
    block = raw.block(request_headers(ECHO))
    priority = struct.pack(">LB", 0x8000_0000 | 0, 200)  # exclusive on stream 0, weight 201
    raw.send(
        raw_frame(PRIORITY, 0, 3, priority),
        raw_frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, priority + block),
        raw_frame(DATA, END_STREAM, 1, grpc_message(b"p")),
    )
    assert await answered(raw, 1) == {b"grpc-status": b"0"}
    assert raw.on(3) == []


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (raw_frame(PRIORITY, 0, 1, struct.pack(">LB", 1, 16)), PROTOCOL_ERROR),
        (raw_frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00"), FRAME_SIZE_ERROR),
    ],
    ids=["depends-on-itself", "four-bytes"],
)
async def test_a_broken_priority_frame_resets_its_stream(
    raw: Peer, frame: bytes, code: int
) -> None:
    """A PRIORITY frame that depends on its own stream, or is not five bytes long, resets that stream
    only: the next call on the connection is answered."""
    raw.send(frame)
    await stream_error(raw, 1, code)
    raw.send(call(raw, 3, ECHO))
    assert await answered(raw, 3) == {b"grpc-status": b"0"}


async def test_headers_that_depend_on_their_own_stream_reset_it(raw: Peer) -> None:
    """HEADERS whose priority makes the stream depend on itself reset the stream with
    PROTOCOL_ERROR."""
    block = raw.block(request_headers(ECHO))
    raw.send(
        raw_frame(
            HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, b"\x00\x00\x00\x01\x10" + block
        )
    )
    await stream_error(raw, 1, PROTOCOL_ERROR)


def _string(text: bytes) -> bytes:
    return bytes([len(text)]) + text


# POST and http (static entries 3 and 6); content-type and te as literals without indexing.
_METHOD_SCHEME = b"\x83\x86"
_REGULAR = (
    b"\x0f\x10" + _string(b"application/grpc") + b"\x00" + _string(b"te") + _string(b"trailers")
)


def _indexing_path(path: str) -> bytes:
    """`:path` as a literal with incremental indexing (name: static entry 4): a table entry."""
    return _METHOD_SCHEME + b"\x44" + _string(path.encode()) + _REGULAR


def _call_with(stream_id: int, block: bytes) -> bytes:
    return raw_frame(HEADERS, END_HEADERS, stream_id, block) + raw_frame(
        DATA, END_STREAM, stream_id, grpc_message(b"c")
    )


async def test_a_cached_block_is_decoded_anew_once_the_dynamic_table_changed(raw: Peer) -> None:
    """The same block bytes (`:path` = dynamic entry 62) name Echo, then Fail once another entry
    was inserted in front: the cache of decoded blocks must not answer for the old table."""
    by_index = _METHOD_SCHEME + b"\xbe" + _REGULAR  # indexed field 62: the newest entry
    blocks = [
        _indexing_path(ECHO),  # entry 62 = (:path, Echo)
        by_index,
        by_index,  # the same bytes again: from the cache
        _indexing_path(FAIL),  # entry 62 = (:path, Fail), Echo moves to 63
        by_index,
    ]
    statuses = []
    for stream_id, block in zip((1, 3, 5, 7, 9), blocks, strict=True):
        raw.send(_call_with(stream_id, block))
        statuses.append((await answered(raw, stream_id))[b"grpc-status"])

    assert statuses == [b"0", b"0", b"0", b"3", b"3"]


async def test_a_smaller_header_table_size_is_signalled_in_the_next_response_block(
    peer: Peer,
) -> None:
    """RFC 7541 §4.2: after the client lowers HEADER_TABLE_SIZE, the server's next block opens
    with a dynamic table size update; later blocks do not repeat it."""
    peer.start({HEADER_TABLE_SIZE: 0})
    await peer.until(lambda p: any("ACK" in f.flags for f in p.of(SettingsFrame)))
    first = peer.call(ECHO, b"a")
    await answered(peer, first)
    second = peer.call(ECHO, b"b")
    await answered(peer, second)

    first_block = peer.on(first)[0]
    second_block = peer.on(second)[0]
    assert isinstance(first_block, HeadersFrame) and isinstance(second_block, HeadersFrame)
    assert first_block.data[:1] == b"\x20"  # size update to 0
    assert second_block.data[:1] == b"\x88"  # :status 200 from the static table
    assert peer.blocks[first][0] == peer.blocks[second][0]


# --- flow control and settings -----------------------------------------------------------------

_SETTING = struct.Struct(">HL")


def _data_sizes(peer: Peer, stream_id: int) -> list[int]:
    return [len(f.data) for f in peer.on(stream_id) if isinstance(f, DataFrame)]


async def test_a_tiny_stream_window_sends_the_answer_piece_by_piece(raw: Peer) -> None:
    """INITIAL_WINDOW_SIZE 3: three bytes of DATA, then nothing until WINDOW_UPDATE; the trailers
    follow the last piece."""
    raw.send(raw_frame(SETTINGS, 0, 0, _SETTING.pack(INITIAL_WINDOW_SIZE, 3)))
    raw.send(call(raw, 1, ECHO, b"abcdef"))  # 11 bytes of DATA with the message prefix
    await raw.until(lambda p: _data_sizes(p, 1) == [3])
    await raw.quiet()
    assert raw.kinds(1) == ["HeadersFrame", "DataFrame"]

    raw.send(raw_frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 4)))
    await raw.until(lambda p: _data_sizes(p, 1) == [3, 4])
    raw.send(raw_frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 100)))
    await answered(raw, 1)

    assert _data_sizes(raw, 1) == [3, 4, 4]
    assert raw.kinds(1)[-1] == "HeadersFrame"
    assert raw.data[1] == grpc_message(b"abcdef")


async def test_the_connection_window_holds_back_an_answer_as_much_as_the_stream_window(
    raw: Peer,
) -> None:
    """An answer larger than the default 65,535-byte windows: the server stops at the smaller
    window, and a connection WINDOW_UPDATE alone does not release a stream with no window."""
    message = bytes(70_000)
    raw.send(call(raw, 1, ECHO, message))
    await raw.until(lambda p: sum(_data_sizes(p, 1)) == 65_535)
    assert max(_data_sizes(raw, 1)) == 16_384  # the default MAX_FRAME_SIZE

    raw.send(raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 10_000)))
    await raw.quiet()
    assert sum(_data_sizes(raw, 1)) == 65_535
    raw.send(raw_frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 10_000)))
    await answered(raw, 1)
    assert raw.data[1] == grpc_message(message)


async def test_a_larger_max_frame_size_is_used(peer: Peer) -> None:
    """When the client allows larger frames (SETTINGS_MAX_FRAME_SIZE), the answer's DATA frames are
    as large as it allows."""
    peer.start({MAX_FRAME_SIZE: 32_768, INITIAL_WINDOW_SIZE: 1 << 20})
    await peer.until(lambda p: any("ACK" in f.flags for f in p.of(SettingsFrame)))
    stream_id = await peer.call_large(ECHO, bytes(40_000))
    await answered(peer, stream_id)

    assert _data_sizes(peer, stream_id) == [32_768, 40_005 - 32_768]


async def test_a_request_larger_than_the_stream_window_gets_window_updates(peer: Peer) -> None:
    """A 3 MB request: the server gives the window back as the message arrives."""
    peer.start()
    stream_id = await peer.call_large(ECHO, bytes(3_000_000))
    await answered(peer, stream_id)

    assert peer.data[stream_id] == grpc_message(bytes(3_000_000))
    assert any(f.stream_id == stream_id for f in peer.of(WindowUpdateFrame))


async def test_a_ping_is_answered_with_its_payload(peer: Peer) -> None:
    """A PING is answered with a PING ACK carrying the same eight bytes."""
    peer.start()
    peer.h2.ping(b"12345678")
    peer.flush()
    await peer.until(lambda p: bool(p.of(PingFrame)))

    (pong,) = peer.of(PingFrame)
    assert ("ACK" in pong.flags, pong.opaque_data) == (True, b"12345678")


# --- connection errors -------------------------------------------------------------------------

_HPACK_BAD_INDEX = b"\xff\x7f"  # indexed field 127 + 127: no such entry
_HPACK_TABLE_TOO_BIG = b"\x3f\xe2\x1f"  # dynamic table size update to 4,097 > 4,096


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (raw_frame(DATA, 0, 1, bytes(16_385)), FRAME_SIZE_ERROR),
        (raw_frame(PING, 0, 0, bytes(7)), FRAME_SIZE_ERROR),
        (raw_frame(PING, 0, 1, bytes(8)), PROTOCOL_ERROR),
        (raw_frame(SETTINGS, 0, 0, bytes(5)), FRAME_SIZE_ERROR),
        (raw_frame(SETTINGS, ACK, 0, bytes(6)), FRAME_SIZE_ERROR),
        (raw_frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
        (raw_frame(SETTINGS, 0, 0, _SETTING.pack(INITIAL_WINDOW_SIZE, 2**31)), FLOW_CONTROL_ERROR),
        (raw_frame(SETTINGS, 0, 0, _SETTING.pack(MAX_FRAME_SIZE, 16_383)), PROTOCOL_ERROR),
        (raw_frame(SETTINGS, 0, 0, _SETTING.pack(ENABLE_PUSH, 2)), PROTOCOL_ERROR),
        (raw_frame(WINDOW_UPDATE, 0, 0, bytes(4)), PROTOCOL_ERROR),
        (raw_frame(WINDOW_UPDATE, 0, 0, bytes(3)), FRAME_SIZE_ERROR),
        (raw_frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1)), FLOW_CONTROL_ERROR),
        (raw_frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 1)), PROTOCOL_ERROR),
        (raw_frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        (raw_frame(DATA, 0, 1, b"x"), PROTOCOL_ERROR),
        (raw_frame(HEADERS, END_HEADERS, 0, b"\x83"), PROTOCOL_ERROR),
        (raw_frame(HEADERS, END_HEADERS, 2, b"\x83"), PROTOCOL_ERROR),
        (raw_frame(HEADERS, END_HEADERS | PADDED, 1, b"\x05\x83"), PROTOCOL_ERROR),
        (raw_frame(CONTINUATION, END_HEADERS, 1, b"\x83"), PROTOCOL_ERROR),
        (raw_frame(HEADERS, 0, 1, b"\x83") + raw_frame(PING, 0, 0, bytes(8)), PROTOCOL_ERROR),
        (raw_frame(HEADERS, 0, 1, b"\x83") + raw_frame(CONTINUATION, 4, 3, b""), PROTOCOL_ERROR),
        (raw_frame(RST_STREAM, 0, 1, bytes(4)), PROTOCOL_ERROR),
        (raw_frame(RST_STREAM, 0, 0, bytes(4)), PROTOCOL_ERROR),
        (raw_frame(RST_STREAM, 0, 1, bytes(3)), FRAME_SIZE_ERROR),
        (raw_frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR),
        (raw_frame(GOAWAY, 0, 0, bytes(7)), FRAME_SIZE_ERROR),
        (raw_frame(PUSH_PROMISE, END_HEADERS, 1, bytes(4)), PROTOCOL_ERROR),
        (raw_frame(HEADERS, END_HEADERS, 1, _HPACK_BAD_INDEX), COMPRESSION_ERROR),
        (raw_frame(HEADERS, END_HEADERS, 1, _HPACK_TABLE_TOO_BIG), COMPRESSION_ERROR),
        (raw_frame(HEADERS, END_HEADERS, 1, b"\x00\x7f"), COMPRESSION_ERROR),  # truncated
    ],
    ids=[
        "frame-over-max-frame-size",
        "ping-7-bytes",
        "ping-on-a-stream",
        "settings-5-bytes",
        "settings-ack-with-payload",
        "settings-on-a-stream",
        "initial-window-over-2^31-1",
        "max-frame-size-under-16384",
        "enable-push-2",
        "window-update-of-0",
        "window-update-3-bytes",
        "connection-window-overflow",
        "window-update-on-idle-stream",
        "data-on-stream-0",
        "data-on-idle-stream",
        "headers-on-stream-0",
        "headers-on-even-stream",
        "padding-longer-than-payload",
        "continuation-without-headers",
        "other-frame-inside-header-block",
        "continuation-on-other-stream",
        "rst-stream-on-idle-stream",
        "rst-stream-on-stream-0",
        "rst-stream-3-bytes",
        "goaway-on-a-stream",
        "goaway-7-bytes",
        "push-promise-from-client",
        "hpack-index-out-of-range",
        "hpack-table-size-over-setting",
        "hpack-truncated",
    ],
)
async def test_a_broken_connection_rule_is_goaway_with_its_error_code(
    raw: Peer, frames: bytes, code: int
) -> None:
    """A frame that breaks a rule of the connection (a bad size, a frame on the wrong stream, a bad
    setting, a header block interrupted, a bad HPACK block) ends it with GOAWAY and the error code
    RFC 9113 names for it."""
    raw.send(frames)
    await connection_error(raw, code)


async def test_a_lower_stream_id_after_a_higher_one_is_a_protocol_error(raw: Peer) -> None:
    """A new stream with a lower id than one already opened ends the connection with GOAWAY
    PROTOCOL_ERROR, naming the last stream taken."""
    raw.send(call(raw, 5, ECHO))
    await answered(raw, 5)
    raw.send(call(raw, 3, ECHO))
    goaway = await connection_error(raw, PROTOCOL_ERROR)
    assert goaway.last_stream_id == 5


@pytest.mark.parametrize(
    "opening",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PREFACE + raw_frame(PING, 0, 0, bytes(8))],
    ids=["http/1.1", "first-frame-not-settings"],
)
async def test_a_bad_opening_is_goaway_protocol_error(served: Served, opening: bytes) -> None:
    """A connection that opens with HTTP/1.1, or whose first frame is not SETTINGS, ends with GOAWAY
    PROTOCOL_ERROR."""
    peer = await Peer.connect(served.port, track=False)
    peer.send(opening)
    await connection_error(peer, PROTOCOL_ERROR)
    await peer.close()


async def test_after_a_connection_error_the_server_serves_other_connections(
    raw: Peer, served: Served
) -> None:
    """A connection error ends that connection only: a new connection's call is answered."""
    raw.send(raw_frame(HEADERS, END_HEADERS, 1, _HPACK_BAD_INDEX))
    await connection_error(raw, COMPRESSION_ERROR)

    other = await Peer.connect(served.port)
    other.start()
    stream_id = other.call(ECHO, b"still here")
    assert await answered(other, stream_id) == {b"grpc-status": b"0"}
    await other.close()
