"""Fuzzing the fast transport's protocol code (hypothesis): the frame parser and state machine
(`Connection`, fed bytes with no socket) and the gRPC message reader.

Whatever arrives, the connection ends in answers or in a connection error: nothing raises out
of it, what it writes is well-formed frames, a GOAWAY for an error is the last thing written,
and it never waits on itself (every stream left is waiting for the peer: for more request or
for window).
"""

from __future__ import annotations

import struct

import hpack
from hyperframe.frame import Frame, GoAwayFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.h2peer import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    grpc_message,
    raw_frame,
    request_headers,
    split_frames,
)

from sidecar.rls.h2.connection import Connection, Limits
from sidecar.rls.h2.unary import PREFIX_SIZE, CallError, Status, read_message

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _block(path: str) -> bytes:
    # A fresh encoder's block refers to no dynamic entry, so it decodes whatever the table holds.
    encoded: bytes = hpack.Encoder().encode(request_headers(path))
    return encoded


_BLOCKS = [
    _block("/t.T/Echo"),
    _block("/t.T/Nope"),
    _block("/x"),
    hpack.Encoder().encode([*request_headers("/t.T/Echo"), (b"content-length", b"10")]),
]
_STREAMS = st.sampled_from([0, 1, 2, 3, 5, 7, 9, 2**31 - 1])
_FLAGS = st.sampled_from(
    [0, END_STREAM, END_HEADERS, END_STREAM | END_HEADERS, 0x08, 0x20, 0x2D, 0xFF]
)
_PAYLOADS = st.one_of(
    st.binary(max_size=48),
    st.sampled_from(_BLOCKS),
    st.builds(grpc_message, st.binary(max_size=32)),
    st.builds(lambda k, v: struct.pack(">HL", k, v), st.integers(0, 8), st.integers(0, 2**32 - 1)),
)
_ANY_FRAME = st.builds(raw_frame, st.integers(0, 11), _FLAGS, _STREAMS, _PAYLOADS)
_OPEN_IDS = st.sampled_from([1, 3, 5, 7, 9, 11])
_U32 = st.builds(lambda n: struct.pack(">L", n), st.sampled_from([0, 1, 7, 100, 70_000, 2**31 - 1]))
_BODIES = st.one_of(st.builds(grpc_message, st.binary(max_size=120)), st.binary(max_size=40))

# Steps of a conversation that mostly keeps to the rules, so that it gets deep into the streams:
# "open" starts the next stream (ids go up), the other steps act on the newest stream.
_OPEN = st.tuples(st.just("open"), st.sampled_from(_BLOCKS), st.sampled_from([0, END_STREAM]))
_DATA = st.tuples(
    st.just("data"), _BODIES, st.sampled_from([0, END_STREAM]), st.sampled_from([0, 0, 3])
)
_STEPS = st.one_of(
    _OPEN,
    _DATA,
    _DATA,
    st.tuples(
        st.just("trailers"),
        st.sampled_from([b"", b"\x40\x01x\x01y", b"\x84"]),
        st.sampled_from([0, END_STREAM]),
    ),
    st.tuples(st.just("window"), st.booleans(), _U32),
    st.tuples(st.just("reset"), _U32),
    st.tuples(st.just("priority"), _U32),
    st.tuples(st.just("ping"), st.binary(min_size=8, max_size=8), st.sampled_from([0, ACK])),
    st.tuples(
        st.just("settings"),
        st.sampled_from([1, 3, 4, 6, 9]),
        st.sampled_from([0, 1, 5, 16_384, 65_535, 2**31 - 1]),
    ),
    st.tuples(st.just("settings"), st.just(5), st.sampled_from([16_384, 20_000])),
)


def _conversation(steps: list[tuple[object, ...]]) -> list[bytes]:
    frames, newest = [], 0
    for kind, *args in steps:
        sid = newest or 1
        if kind == "open":
            newest += 2 if newest else 1
            block, end = args
            frames.append(raw_frame(HEADERS, END_HEADERS | end, newest, block))  # type: ignore[operator]
        elif kind == "data":
            body, end, pad = args
            padded = bytes([pad]) + body + bytes(pad) if pad else body  # type: ignore[list-item, operator]
            frames.append(raw_frame(DATA, end | (0x8 if pad else 0), sid, padded))  # type: ignore[operator, arg-type]
        elif kind == "trailers":
            block, end = args
            frames.append(raw_frame(HEADERS, END_HEADERS | end, sid, block))  # type: ignore[operator, arg-type]
        elif kind == "window":
            on_stream, increment = args
            frames.append(raw_frame(WINDOW_UPDATE, 0, sid if on_stream else 0, increment))  # type: ignore[arg-type]
        elif kind == "reset":
            frames.append(raw_frame(RST_STREAM, 0, sid, args[0]))  # type: ignore[arg-type]
        elif kind == "priority":
            frames.append(raw_frame(PRIORITY, 0, sid, args[0] + b"\x10"))  # type: ignore[operator]
        elif kind == "ping":
            frames.append(raw_frame(PING, args[1], 0, args[0]))  # type: ignore[arg-type]
        else:
            frames.append(raw_frame(SETTINGS, 0, 0, struct.pack(">HL", *args)))
    return frames


_FRAMES = st.builds(
    lambda first, rest: _conversation([first, *rest]), _OPEN, st.lists(_STEPS, max_size=16)
)
# A whole call, its header block split over HEADERS and CONTINUATION.
_CALLS = st.builds(
    lambda sid, block, body, split: (
        raw_frame(HEADERS, 0, sid, block[:split])
        + raw_frame(CONTINUATION, END_HEADERS, sid, block[split:])
        + raw_frame(DATA, END_STREAM, sid, body)
    ),
    _OPEN_IDS,
    st.sampled_from(_BLOCKS),
    _BODIES,
    st.integers(0, 8),
)
_OPENING = st.one_of(
    st.just(PREFACE + raw_frame(SETTINGS, 0, 0)),
    st.builds(
        lambda k, v: PREFACE + raw_frame(SETTINGS, 0, 0, struct.pack(">HL", k, v)),
        st.integers(1, 6),
        st.sampled_from([0, 1, 3, 100, 16_384, 65_535, 2**31 - 1]),
    ),
)


class Driven:
    """A Connection whose calls are answered at once, from inside `on_call`."""

    def __init__(self) -> None:
        # Small windows and few streams: the limits are reached within a few frames.
        limits = Limits(max_concurrent_streams=3, initial_window_size=16)
        self.conn = Connection(self._on_call, limits)
        self.conn.initiate()
        self.out = bytearray(self.conn.data_to_send())
        self.outputs: list[bytes] = []

    def _on_call(self, stream_id: int, path: str, message: bytes) -> None:
        if path == "/t.T/Echo":
            self.conn.respond(stream_id, message)
        else:
            self.conn.respond_error(stream_id, Status.UNIMPLEMENTED, f"unknown method {path}")

    def feed(self, chunks: list[bytes]) -> Driven:
        for chunk in chunks:
            self.conn.receive(chunk)
            written = self.conn.data_to_send()
            self.outputs.append(written)
            self.out += written
        return self


def _frames(data: bytes) -> list[Frame]:
    """Parse everything the server wrote; it must be whole, well-formed frames."""
    found, rest = split_frames(data)
    assert rest == b""
    assert all(frame.body_len <= 16_384 for frame in found)
    return found


def _check(driven: Driven) -> None:
    conn = driven.conn
    written = _frames(bytes(driven.out))
    if conn.closed:
        goaways = [i for i, f in enumerate(written) if isinstance(f, GoAwayFrame)]
        assert goaways and goaways[-1] == len(written) - 1, written
        assert written[-1].error_code != 0
        return
    assert not conn.calls and conn.orphaned == 0
    assert conn.buffered == sum(s.size for s in conn.streams.values()) >= 0
    for stream in conn.streams.values():
        waiting_for_window = stream.pending and min(stream.send_window, conn.send_window) <= 0
        assert stream.receiving or waiting_for_window, (stream.id, stream.pending)


@FUZZ
@given(_OPENING, _FRAMES)
def test_any_conversation_ends_in_answers_or_a_connection_error(
    opening: bytes, frames: list[bytes]
) -> None:
    """A conversation that mostly keeps to the rules (streams opened, headers, bodies, resets,
    window updates, settings), after a preface with any one setting, never raises: the connection
    either ends with a GOAWAY carrying an error code as its last frame, or stays open with every
    complete call answered, its buffered bytes accounted exactly, and each open stream still
    receiving or waiting for flow-control window."""
    _check(Driven().feed([opening, *frames]))


@FUZZ
@given(_OPENING, st.lists(st.one_of(_ANY_FRAME, _CALLS), max_size=12))
def test_any_frames_end_in_answers_or_a_connection_error(
    opening: bytes, frames: list[bytes]
) -> None:
    """Any mix of arbitrary frames (any type, flags, stream and payload) and whole calls never
    raises, and leaves the connection as `_check` requires: ended by a GOAWAY with an error code,
    or open with every complete call answered and its buffers accounted exactly."""
    _check(Driven().feed([opening, *frames]))


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_after_the_preface_end_in_answers_or_a_connection_error(data: bytes) -> None:
    """Any bytes after a valid preface and SETTINGS never raise, and leave the connection as
    `_check` requires (ended by a GOAWAY with an error code, or open and consistent)."""
    _check(Driven().feed([PREFACE + raw_frame(SETTINGS, 0, 0), data]))


@FUZZ
@given(st.binary(max_size=60))
def test_any_bytes_instead_of_the_preface_are_refused_or_awaited(data: bytes) -> None:
    """Bytes that neither begin the client preface nor begin with it close the connection with a
    GOAWAY carrying an error code; nothing raises."""
    driven = Driven().feed([data])
    _check(driven)
    assert driven.conn.closed or PREFACE.startswith(data) or data.startswith(PREFACE)


@FUZZ
@given(
    _OPENING,
    _FRAMES,
    st.lists(st.integers(1, 64), max_size=20),
)
def test_how_the_bytes_are_split_does_not_change_the_answer(
    opening: bytes, frames: list[bytes], cuts: list[int]
) -> None:
    """TCP delivers bytes in any pieces: frames split anywhere are read the same."""
    data = opening + b"".join(frames)
    pieces, at = [], 0
    for cut in cuts:
        pieces.append(data[at : at + cut])
        at += cut
    pieces.append(data[at:])

    assert Driven().feed(pieces).out == Driven().feed([data]).out


@FUZZ
@given(st.binary(max_size=64))
def test_the_message_reader_returns_one_whole_message_or_a_status(body: bytes) -> None:
    """Any request body is read as exactly one whole uncompressed gRPC message (its prefix and
    length true), or refused with RESOURCE_EXHAUSTED or INTERNAL and a message saying why."""
    try:
        message = read_message(body)
    except CallError as exc:
        assert exc.status in (8, 13)
        assert exc.message
    else:
        assert len(body) == PREFIX_SIZE + len(message)
        assert body[0] == 0 and int.from_bytes(body[1:5], "big") == len(message)
