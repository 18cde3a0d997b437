"""The streams of one HTTP/2 connection and everything the server sends on them.

`Streams` keeps the open streams, the calls in flight, the send windows and the queue of
answers waiting for window; `Connection` (the receive side) builds on it. An answer is
HEADERS, DATA and trailers (a gRPC answer), or HEADERS and DATA that ends the stream (the
plain HTTP answer to a request that is not gRPC). When the windows allow, the frames go out at
once; otherwise DATA leaves in pieces as WINDOW_UPDATEs arrive, and the trailers follow the
last piece (or the last piece ends the stream).

A call whose stream the peer reset stays counted against MAX_CONCURRENT_STREAMS until its
answer comes back (and is dropped): opening and resetting streams cannot pile up work.
"""

from __future__ import annotations

import struct
from typing import Final

from sidecar.rls.h2 import fields, frames
from sidecar.rls.h2.fields import Head
from sidecar.rls.h2.frames import ErrorCode, H2ConnectionError, H2StreamError
from sidecar.rls.h2.unary import PREFIX_SIZE, Status, message_frame

#: Streams remembered after they close (at least; up to twice as many), to tell a late frame
#: (ignored) from a broken rule.
CLOSED_STREAMS_REMEMBERED: Final = 1_024
#: The opaque data of the PING sent between the two GOAWAY frames of a graceful shutdown.
SHUTDOWN_PING: Final = b"drain\x00\x00\x00"

#: Packs a frame header. Header blocks are sent in one frame, with 0 as the length's high byte:
#: they stay far below 16 KiB, the smallest MAX_FRAME_SIZE, as grpc-message is cut short.
_FRAME: Final = frames.HEADER.pack
_HEADERS: Final = frames.HEADERS
_DATA: Final = frames.DATA
_END_HEADERS: Final = frames.END_HEADERS
_END_STREAM: Final = frames.END_STREAM
_END_ALL: Final = frames.END_HEADERS | frames.END_STREAM
_RESPONSE_HEADERS: Final = fields.RESPONSE_HEADERS
_TRAILERS_OK: Final = fields.TRAILERS_OK
#: The usual answer up to its message, in one pack: HEADERS (response headers), the DATA frame's
#: header and the message's prefix. Then the message, and the trailers' frame.
#: (Each frame header is `frames.HEADER`'s >BHBBL.)
_ANSWER_HEAD: Final = struct.Struct(f">BHBBL{len(_RESPONSE_HEADERS)}sBHBBLBL").pack
_TRAILERS_OK_FRAME: Final = struct.Struct(f">BHBBL{len(_TRAILERS_OK)}s").pack


class Stream:
    """One request and its answer."""

    __slots__ = (
        "body",
        "head",
        "id",
        "pending",
        "received",
        "receiving",
        "recv_window",
        "send_window",
        "size",
        "trailers",
    )

    def __init__(self, stream_id: int, head: Head, recv_window: int, send_window: int) -> None:
        self.id = stream_id
        self.head = head
        self.receiving = True  # until the peer's END_STREAM
        self.received = 0  # DATA bytes without padding, buffered or not
        self.recv_window = recv_window
        self.send_window = send_window
        self.body: bytes | bytearray = b""
        self.size = 0  # bytes buffered in `body`
        self.pending = b""  # answer DATA waiting for window
        self.trailers = b""  # sent after `pending`; none: its last DATA ends the stream

    def add(self, data: bytes) -> None:
        body = self.body
        if not body:
            self.body = data
        elif isinstance(body, bytearray):
            body += data
        else:
            self.body = bytearray(body) + data
        self.size += len(data)

    def take_body(self) -> bytes:
        body = bytes(self.body)
        self.body, self.size = b"", 0
        return body


class BufferBudget:
    """Request bytes buffered by all connections together, and their bound: what a server's
    connections hold between a request's first DATA frame and its last is at most `limit`.
    A connection gives back what it holds when its streams end, and when it closes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class Streams:
    """Open streams, calls in flight and the send side of one connection."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.streams: dict[int, Stream] = {}
        self.calls: set[int] = set()  # streams whose call is out, reset or not
        self.orphaned = 0  # calls out on streams that were reset
        self.buffered = 0  # request bytes held in stream bodies
        #: Bytes buffered by all the server's connections (Connection sets the shared one).
        self.budget = BufferBudget(0)
        self.closed = False  # a connection error was sent; nothing more is read
        self.last_stream_id = 0  # the highest stream processed, for GOAWAY
        self.goaway_last: int | None = None  # set by our final GOAWAY
        self.draining = False
        self.peer_window = frames.DEFAULT_WINDOW  # the peer's INITIAL_WINDOW_SIZE
        self.peer_max_frame = frames.DEFAULT_MAX_FRAME_SIZE
        self.send_window = frames.DEFAULT_WINDOW
        self.closed_streams: dict[int, bool] = {}  # id: closed by our RST_STREAM
        self._blocked: dict[int, Stream] = {}
        self._table_size = frames.DEFAULT_HEADER_TABLE_SIZE
        self._size_update = b""

    def data_to_send(self) -> bytes:
        """Everything queued since the last call, as one chunk to write."""
        out = self.out
        if not out:
            return b""
        data = b"".join(out) if len(out) > 1 else out[0]
        out.clear()
        return data

    # --- answers -------------------------------------------------------------------------------

    def respond(self, stream_id: int, message: bytes) -> None:
        """Answer a call with OK and `message` (dropped if the stream is gone)."""
        stream = self._take_call(stream_id)
        if stream is None:
            return
        size = len(message) + PREFIX_SIZE
        if (
            size <= stream.send_window
            and size <= self.send_window
            and size <= self.peer_max_frame
            and not self._size_update
            and not stream.receiving
        ):
            # The usual answer: it fits the windows and ends a request already complete, so
            # its three frames leave together and the stream closes. `answer` does the rest. This
            # mirrors its path for an answer that fits, inline: the calls it saves are a twentieth
            # of the state machine's instructions per call.
            self.send_window -= size
            stream.send_window -= size
            stream_id = stream.id
            self.out.append(
                _ANSWER_HEAD(
                    0,
                    len(_RESPONSE_HEADERS),
                    _HEADERS,
                    _END_HEADERS,
                    stream_id,
                    _RESPONSE_HEADERS,
                    size >> 16,
                    size & 0xFFFF,
                    _DATA,
                    0,
                    stream_id,
                    0,  # the message's prefix: not compressed, and its length
                    size - PREFIX_SIZE,
                )
                + message
                + _TRAILERS_OK_FRAME(
                    0, len(_TRAILERS_OK), _HEADERS, _END_ALL, stream_id, _TRAILERS_OK
                )
            )
            del self.streams[stream_id]
            self.remember(stream_id, False)
            return
        self.answer(stream, _RESPONSE_HEADERS, message_frame(message), _TRAILERS_OK)

    def respond_error(self, stream_id: int, status: Status, message: str) -> None:
        """Answer a call with a gRPC status other than OK."""
        stream = self._take_call(stream_id)
        if stream is not None:
            self.answer(stream, fields.trailers_only(status, message))

    def _take_call(self, stream_id: int) -> Stream | None:
        if stream_id not in self.calls:
            raise ValueError(f"stream {stream_id} has no call to answer")
        self.calls.remove(stream_id)
        stream = self.streams.get(stream_id)
        if stream is None and not self.closed:
            self.orphaned -= 1
        return None if self.closed else stream

    def answer(
        self, stream: Stream, block: bytes, data: bytes = b"", trailers: bytes = b""
    ) -> None:
        """Send `block` and, unless it ends the stream itself, `data` and then `trailers`; without
        `trailers`, `data` ends the stream."""
        stream_id = stream.id
        if self._size_update:
            block = self._size_update + block
            self._size_update = b""
        if not data:
            self.out.append(_FRAME(0, len(block), _HEADERS, _END_ALL, stream_id) + block)
            self.closed_stream(stream)
            return
        size = len(data)
        if size <= stream.send_window and size <= self.send_window and size <= self.peer_max_frame:
            self.send_window -= size
            stream.send_window -= size
            # Without trailers (`data` ends the stream) the DATA frame carries END_STREAM.
            self.out.append(
                b"".join(
                    (
                        _FRAME(0, len(block), _HEADERS, _END_HEADERS, stream_id),
                        block,
                        _FRAME(
                            size >> 16,
                            size & 0xFFFF,
                            _DATA,
                            0 if trailers else _END_STREAM,
                            stream_id,
                        ),
                        data,
                        _FRAME(0, len(trailers), _HEADERS, _END_ALL, stream_id)
                        if trailers
                        else b"",
                        trailers,
                    )
                )
            )
            self.closed_stream(stream)
            return
        self.out.append(_FRAME(0, len(block), _HEADERS, _END_HEADERS, stream_id) + block)
        stream.pending, stream.trailers = data, trailers
        self._blocked[stream_id] = stream
        self._send_pending(stream)

    def _send_pending(self, stream: Stream) -> None:
        pending, trailers = stream.pending, stream.trailers
        while pending:
            size = min(len(pending), stream.send_window, self.send_window, self.peer_max_frame)
            if size <= 0:
                stream.pending = pending
                return
            last = size == len(pending) and not trailers
            self.out.append(
                frames.frame(_DATA, _END_STREAM if last else 0, stream.id, pending[:size])
            )
            pending = pending[size:]
            stream.send_window -= size
            self.send_window -= size
        stream.pending = b""
        del self._blocked[stream.id]
        if trailers:
            self.out.append(frames.frame(_HEADERS, _END_ALL, stream.id, trailers))
        self.closed_stream(stream)

    def send_blocked(self) -> None:
        """Send what the windows now allow of the answers waiting for window, oldest first."""
        for stream in list(self._blocked.values()):
            if self.send_window <= 0:
                return
            self._send_pending(stream)

    # --- windows and settings ------------------------------------------------------------------

    def grow_window(self, increment: int) -> None:
        self.send_window += increment
        if self.send_window > frames.MAX_WINDOW:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow")
        self.send_blocked()

    def grow_stream_window(self, stream: Stream, increment: int) -> None:
        stream.send_window += increment
        if stream.send_window > frames.MAX_WINDOW:
            raise H2StreamError(stream.id, ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
        if stream.id in self._blocked:
            self._send_pending(stream)

    def set_peer_window(self, value: int) -> None:
        """A new SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves by the change."""
        if value > frames.MAX_WINDOW:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value}")
        delta, self.peer_window = value - self.peer_window, value
        for stream in self.streams.values():
            stream.send_window += delta
            if stream.send_window > frames.MAX_WINDOW:
                raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")

    def limit_table_size(self, value: int) -> None:
        """The peer's HEADER_TABLE_SIZE: below ours, the next block must say we shrank (RFC 7541
        §4.2). The table stays empty either way, since nothing is ever indexed."""
        if value < self._table_size:
            self._table_size = value
            self._size_update = fields.table_size_update(value)

    # --- closing -------------------------------------------------------------------------------

    def drop(self, stream: Stream) -> None:
        """Forget a stream; a call out on it becomes an orphan, its answer to be dropped."""
        del self.streams[stream.id]
        self._blocked.pop(stream.id, None)
        self.buffered -= stream.size
        self.budget.used -= stream.size
        if stream.id in self.calls:
            self.orphaned += 1

    def reset(self, stream_id: int, code: ErrorCode) -> None:
        """Send RST_STREAM and forget the stream."""
        self.out.append(frames.rst_stream(stream_id, code))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.drop(stream)
        self.remember(stream_id, True)

    def closed_stream(self, stream: Stream) -> None:
        """We sent END_STREAM. Before the peer's, the request is cut short: RST_STREAM NO_ERROR."""
        if stream.receiving:
            self.reset(stream.id, ErrorCode.NO_ERROR)
            return
        del self.streams[stream.id]
        self.remember(stream.id, False)

    def remember(self, stream_id: int, closed_by_us: bool) -> None:
        """Keep how `stream_id` closed: the last CLOSED_STREAMS_REMEMBERED streams at least."""
        remembered = self.closed_streams
        remembered[stream_id] = closed_by_us
        if len(remembered) > 2 * CLOSED_STREAMS_REMEMBERED:
            # Forgotten in bulk: dropping the oldest one at a time from a dict costs a walk
            # over the holes earlier deletions left at its front.
            kept = list(remembered.items())[-CLOSED_STREAMS_REMEMBERED:]
            self.closed_streams = dict(kept)

    def fail(self, code: ErrorCode, reason: str) -> None:
        """A connection error: GOAWAY with `code`, then nothing more is read or answered."""
        if self.closed:
            return
        debug = reason.encode("utf-8", "replace")[:256]
        self.out.append(frames.goaway(self.last_stream_id, code, debug))
        self.closed = True
        for stream in list(self.streams.values()):
            self.drop(stream)

    def release(self) -> None:
        """The connection is gone: drop its streams, giving back what their bodies held."""
        self.closed = True
        for stream in list(self.streams.values()):
            self.drop(stream)

    def start_shutdown(self) -> None:
        """Graceful shutdown, step one: GOAWAY with the largest id, so calls already on their
        way are still taken, and a PING whose ACK says the peer saw it."""
        if self.closed or self.draining:
            return
        self.draining = True
        self.out.append(frames.goaway(frames.MAX_STREAM_ID, ErrorCode.NO_ERROR))
        self.out.append(frames.ping(SHUTDOWN_PING))

    def finish_shutdown(self) -> None:
        """Step two (the PING came back, or waiting for it took too long): the final GOAWAY.
        Streams above its last id are ignored; the connection ends when the rest are answered."""
        if self.closed or self.goaway_last is not None:
            return
        self.draining = True
        self.goaway_last = self.last_stream_id
        self.out.append(frames.goaway(self.last_stream_id, ErrorCode.NO_ERROR))
