"""The server side of one HTTP/2 connection carrying unary gRPC calls, as a state machine.

Sans-IO: `receive` takes the bytes the socket read, `data_to_send` hands back the frames to
write, and each complete call goes up as `on_call(stream_id, path, message)`. Its answer comes
back through `respond` or `respond_error`, whenever it is ready; an answer for a stream the peer
reset meanwhile is dropped. Nothing here reads a clock or touches a socket, so tests and the
fuzzer drive it with plain bytes.

A rule broken on one stream resets that stream (RST_STREAM); a rule broken on the connection
ends it (GOAWAY with the code RFC 9113 names, then `closed`). Requests are read completely
before they are called; a body over the gRPC message limit is answered RESOURCE_EXHAUSTED
without reading the rest.

A hostile peer is bounded on every axis (CVE-2023-44487 rapid reset, CVE-2024-27316 and the
other CONTINUATION floods; Envoy's `http2_protocol_options` name the same protections). Each
limit below is a connection error, GOAWAY ENHANCE_YOUR_CALM, unless said otherwise:

- a header block: its size kept as a running total (at most twice the header list limit) and
  at most MAX_CONTINUATIONS frames;
- frames with nothing in them (DATA without END_STREAM, HEADERS or CONTINUATION that do not end
  the block): at most MAX_EMPTY_FRAMES in a row;
- control frames (SETTINGS, PING, RST_STREAM, PRIORITY, WINDOW_UPDATE): a budget of
  CONTROL_BUDGET that each request refills by CONTROL_PER_REQUEST; a SETTINGS that changes the
  initial window costs one more per WINDOW_WALK_COST open streams it moves;
- request bodies buffered: `Limits.max_buffered_bytes` per connection and, through a shared
  `BufferBudget`, across all connections (the stream is answered RESOURCE_EXHAUSTED);
- calls started per `receive`: `Limits.max_calls_per_read`; the rest of the bytes wait for
  `resume` (`backlog` says so), so one connection's read cannot hold the loop for thousands
  of calls while others wait.

One module past the usual size because it is one state machine: every frame type's handler
reads and moves the same connection state (streams, windows, the budgets above), and a rule of
RFC 9113 changes them together; what stands apart already lives apart (frames.py, fields.py,
streams.py, unary.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sidecar.rls.h2 import fields, frames
from sidecar.rls.h2.fields import Head, RequestDecoder
from sidecar.rls.h2.frames import ErrorCode, H2ConnectionError, H2StreamError
from sidecar.rls.h2.streams import SHUTDOWN_PING, BufferBudget, Stream, Streams
from sidecar.rls.h2.unary import MAX_MESSAGE_BYTES, PREFIX_SIZE, CallError, Status, read_message

OnCall = Callable[[int, str, bytes], None]

_PADDED_OR_PRIORITY: Final = frames.PADDED | frames.PRIORITY_FLAG

#: CONTINUATION frames one header block may take: a header list of at most 16 KiB needs two at
#: the smallest frame size a client may use (16 KiB); a few more for clients that split finer.
MAX_CONTINUATIONS: Final = 16
#: Frames in a row that carry nothing (Envoy's max_consecutive_inbound_frames_with_empty_payload
#: defaults to 1; a few more for clients that flush early).
MAX_EMPTY_FRAMES: Final = 16
#: Control frames a connection may send before its first request, and the most it can save up.
CONTROL_BUDGET: Final = 1_024
#: What each request adds back: a client's PING, WINDOW_UPDATE, RST_STREAM and PRIORITY frames
#: come with its requests, a few per request at most.
CONTROL_PER_REQUEST: Final = 8
#: A SETTINGS frame that changes the initial window walks the open streams: one more unit of
#: the budget per this many streams (1,024 streams: 16 units).
WINDOW_WALK_COST: Final = 64


@dataclass(frozen=True)
class Limits:
    """What the server announces and enforces; the defaults suit a sidecar next to Envoy.

    The windows are at least HTTP/2's default 65,535 bytes: a peer may use that much before it
    reads our SETTINGS.
    """

    #: Streams open or half-closed (RFC 9113 §5.1.2): a stream counts while its request comes,
    #: its call runs or its answer waits for window, and a call on a stream the peer reset
    #: counts until it returns. None stays half-closed (local): an answer sent before the
    #: request ends comes with RST_STREAM NO_ERROR (§8.1), which closes the stream.
    max_concurrent_streams: int = 1_024
    #: Stream receive window: larger than any RateLimitRequest, so a call needs no WINDOW_UPDATE.
    initial_window_size: int = 1 << 20
    connection_window_size: int = 1 << 24
    max_header_list_size: int = 16_384
    #: Request bytes buffered on one connection, all streams together: two messages of the
    #: largest size (4 MiB).
    max_buffered_bytes: int = 8 << 20
    #: Request bytes buffered by all the connections of one server together (BufferBudget).
    max_buffered_bytes_all: int = 32 << 20
    #: Calls one `receive` starts at most; the rest of the bytes wait for `resume`.
    max_calls_per_read: int = 64


DEFAULT_LIMITS: Final = Limits()


def _no_call(stream_id: int, path: str, message: bytes) -> None:
    """A released connection's `on_call`: it reads nothing more, so it starts no call."""


class Connection(Streams):
    """One connection, from the client preface to GOAWAY."""

    def __init__(
        self,
        on_call: OnCall,
        limits: Limits = DEFAULT_LIMITS,
        budget: BufferBudget | None = None,
        kept: frozenset[bytes] = frozenset(),
    ) -> None:
        """`kept`: request fields whose values each stream's `head.kept` holds (tracing)."""
        super().__init__()
        self.on_call = on_call
        self.limits = limits
        if budget is not None:  # shared with the server's other connections
            self.budget = budget
        else:
            self.budget = BufferBudget(limits.max_buffered_bytes_all)
        self.peer_goaway = False
        self._decoder = RequestDecoder(limits.max_header_list_size, kept)
        self._buffer = b""
        self._preface = True
        self.settings_received = False  # the peer's preface is complete
        self._highest_id = 0  # the highest client stream id seen, processed or ignored
        self._recv_window = limits.connection_window_size
        self._unacked = 0  # connection window bytes consumed but not yet given back
        self._block_stream = 0  # nonzero while a header block continues in CONTINUATION
        self._block: list[bytes] = []
        self._block_flags = 0
        self._block_self_dependent = False
        self._block_size = 0
        self._empty_frames = 0  # frames in a row with nothing in them
        self._control = CONTROL_BUDGET  # control frames still allowed (see the module's notes)
        self._started = 0  # calls started by the current `receive`
        self.backlog = False  # bytes wait because a read started max_calls_per_read calls
        self._stashed = 0  # bytes of `_buffer` put aside unread (`stash`), in the budget
        self._handlers: dict[int, Callable[[int, int, bytes], None]] = {
            frames.PRIORITY: self._on_priority,
            frames.RST_STREAM: self._on_rst_stream,
            frames.SETTINGS: self._on_settings,
            frames.PUSH_PROMISE: self._on_push_promise,
            frames.PING: self._on_ping,
            frames.GOAWAY: self._on_goaway,
            frames.WINDOW_UPDATE: self._on_window_update,
            frames.CONTINUATION: self._on_continuation,
        }

    def initiate(self) -> None:
        """Queue the server's preface: SETTINGS, and the connection window raised."""
        limits = self.limits
        self.out.append(
            frames.settings(
                {
                    frames.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                    frames.INITIAL_WINDOW_SIZE: limits.initial_window_size,
                    frames.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
                }
            )
        )
        raise_by = limits.connection_window_size - frames.DEFAULT_WINDOW
        if raise_by > 0:
            self.out.append(frames.window_update(0, raise_by))

    @property
    def done(self) -> bool:
        """Nothing left to do: closed on an error, or after a GOAWAY with no call left open."""
        if self.closed:
            return True
        ending = self.goaway_last is not None or self.peer_goaway
        return ending and not self.streams and not self.calls

    # --- input ---------------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Process what the peer sent; answers and errors queue up for `data_to_send`."""
        if self.closed:
            return
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
            if self._stashed:
                self.budget.used -= self._stashed
                self._stashed = 0
        self._started = 0
        self.backlog = False
        try:
            if self._preface:
                data = self._read_preface(data)
            used = self._read_frames(data)
        except H2ConnectionError as exc:
            self.fail(exc.code, exc.reason)
            return
        if used < len(data) and not self.closed:
            self._buffer = data[used:]
            # Complete frames left unread: the read started as many calls as it may.
            self.backlog = self._started >= self.limits.max_calls_per_read

    @property
    def unread(self) -> bool:
        """Bytes wait to be read: put aside (`stash`) or left by a read's bound (`backlog`)."""
        return bool(self._stashed) or self.backlog

    @property
    def unfinished(self) -> bool:
        """Something the peer started is not finished: part of a frame (or of the preface), a
        header block waiting for its CONTINUATION, or a request whose body has not ended."""
        if (self._buffer and not self.backlog) or self._block_stream:
            return True
        return any(stream.receiving for stream in self.streams.values())

    def stash(self, data: bytes) -> bool:
        """Keep `data` unread for the next `receive`, counted in the budget of buffered bytes;
        False (nothing kept) when the budget has no room for it."""
        budget = self.budget
        if budget.used + len(data) > budget.limit:
            return False
        self._buffer += data
        self._stashed += len(data)
        budget.used += len(data)
        return True

    def release(self) -> None:
        """The connection is gone: give back what its streams and its unread bytes held."""
        super().release()
        self.budget.used -= self._stashed
        self._stashed = 0
        self._buffer = b""
        # What refers back to this connection and its owner (the frame handlers, bound to it;
        # `on_call`, bound to the server's protocol) goes too: a closed connection is then
        # freed by its reference count, not left as a cycle of some thirty objects for the
        # collector to find, or never, if it was frozen (`gc.freeze`, see sidecar.telemetry.garbage).
        self._handlers = {}
        self.on_call = _no_call

    def resume(self) -> None:
        """Go on with the bytes a read left for later (`backlog`)."""
        self.receive(b"")

    def _read_preface(self, data: bytes) -> bytes:
        size = len(frames.PREFACE)
        if not frames.PREFACE.startswith(data[:size]):
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "invalid connection preface")
        if len(data) < size:
            self._buffer = data
            return b""
        self._preface = False
        return data[size:]

    def _read_frames(self, data: bytes) -> int:
        """Handle every complete frame in `data`; returns how many bytes were used."""
        pos, end = 0, len(data)
        unpack = frames.HEADER.unpack_from
        max_size = frames.DEFAULT_MAX_FRAME_SIZE
        most_calls = self.limits.max_calls_per_read
        # Typed, so that the compiled build works on them as small integers rather than through
        # the generic number protocol (unpack gives objects of unknown type).
        high: int
        low: int
        kind: int
        flags: int
        stream_id: int
        while end - pos >= frames.HEADER_SIZE and self._started < most_calls:
            high, low, kind, flags, stream_id = unpack(data, pos)
            size = high << 16 | low
            if size > max_size:
                raise H2ConnectionError(
                    ErrorCode.FRAME_SIZE_ERROR, f"frame of {size} bytes over MAX_FRAME_SIZE"
                )
            stop = pos + frames.HEADER_SIZE + size
            if stop > end:
                break
            payload = data[pos + frames.HEADER_SIZE : stop]
            pos = stop
            stream_id &= frames.MAX_STREAM_ID
            if not self.settings_received and (kind != frames.SETTINGS or flags & frames.ACK):
                raise H2ConnectionError(
                    ErrorCode.PROTOCOL_ERROR, "the first frame must be SETTINGS"
                )
            if self._block_stream and kind != frames.CONTINUATION:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "header block not continued")
            try:
                if kind == frames.HEADERS:
                    self._on_headers(flags, stream_id, payload)
                elif kind == frames.DATA:
                    self._on_data(flags, stream_id, payload)
                else:
                    handler = self._handlers.get(kind)
                    if handler is not None:  # unknown frame types are ignored (§5.5)
                        handler(flags, stream_id, payload)
            except H2StreamError as exc:
                self.reset(exc.stream_id, exc.code)
            if self.closed:
                break
        return pos

    # --- requests ------------------------------------------------------------------------------

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & _PADDED_OR_PRIORITY:
            block, dependency = frames.header_block(payload, flags)
            self_dependent = dependency == stream_id
        else:
            block, self_dependent = payload, False
        if flags & frames.END_HEADERS:
            self._empty_frames = 0
            self._on_header_block(stream_id, block, flags, self_dependent)
            return
        self._count_empty(block)
        self._block_stream, self._block = stream_id, [block]
        self._block_flags, self._block_self_dependent = flags, self_dependent
        self._block_size = len(block)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not self._block_stream or stream_id != self._block_stream:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        self._block.append(payload)
        self._block_size += len(payload)
        if self._block_size > 2 * self.limits.max_header_list_size:
            raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if len(self._block) > MAX_CONTINUATIONS + 1:
            raise H2ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM, f"header block in over {MAX_CONTINUATIONS} frames"
            )
        if flags & frames.END_HEADERS:
            self._empty_frames = 0
            block = b"".join(self._block)
            self._block_stream, self._block = 0, []
            self._on_header_block(stream_id, block, self._block_flags, self._block_self_dependent)
        else:
            self._count_empty(payload)

    def _on_header_block(self, stream_id: int, block: bytes, flags: int, self_dep: bool) -> None:
        head = self._decoder.decode(block)  # always, in order: the blocks share one HPACK table
        end_stream = flags & frames.END_STREAM
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._on_trailers(stream, head, end_stream)
            return
        if stream_id <= self._highest_id:
            closed_by_us = self.closed_streams.get(stream_id)
            if closed_by_us:
                return
            if closed_by_us is None:
                raise H2ConnectionError(
                    ErrorCode.PROTOCOL_ERROR,
                    f"stream {stream_id} is not above the last one ({self._highest_id})",
                )
            raise H2ConnectionError(ErrorCode.STREAM_CLOSED, f"HEADERS on closed {stream_id}")
        if not stream_id & 1:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "even stream id from a client")
        self._highest_id = stream_id
        if self.goaway_last is not None and stream_id > self.goaway_last:
            self.remember(stream_id, True)  # after our GOAWAY: ignored, as §6.8 says
            return
        self.last_stream_id = stream_id
        if self_dep:
            raise H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "stream depends on itself")
        if head.malformed:
            raise H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, head.malformed)
        if len(self.streams) + self.orphaned >= self.limits.max_concurrent_streams:
            self._spend(1, "HEADERS past MAX_CONCURRENT_STREAMS")
            raise H2StreamError(stream_id, ErrorCode.REFUSED_STREAM, "too many streams")
        stream = Stream(stream_id, head, self.limits.initial_window_size, self.peer_window)
        self.streams[stream_id] = stream
        if end_stream:
            self._end_request(stream)

    def _on_trailers(self, stream: Stream, head: Head, end_stream: int) -> None:
        if not stream.receiving:
            raise H2StreamError(stream.id, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
        if not end_stream:
            raise H2StreamError(stream.id, ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
        if head.malformed_trailers:
            raise H2StreamError(stream.id, ErrorCode.PROTOCOL_ERROR, head.malformed_trailers)
        self._end_request(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # padding included: all of it counts against the windows
        if size:
            self._empty_frames = 0
        elif not flags & frames.END_STREAM:
            self._count_empty(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window exceeded")
        self._unacked += size
        if self._unacked >= self.limits.connection_window_size >> 1:
            self.out.append(frames.window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None or not stream.receiving:
            self._on_late_data(stream_id, stream)
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            raise H2StreamError(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "stream window exceeded")
        data = frames.unpad(payload, flags) if flags & frames.PADDED else payload
        stream.received += len(data)
        head = stream.head
        length = head.content_length
        if length is not None and stream.received > length:
            raise H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "body over content-length")
        if head.rejection is None:
            if stream.received > PREFIX_SIZE + MAX_MESSAGE_BYTES:
                self._answer_early(stream, "request message larger than the limit")
                return
            if flags & frames.END_STREAM and not stream.size:
                # The usual request: its whole body in one frame, used as it is.
                self._end_request(stream, data)
                return
            if self.buffered + len(data) > self.limits.max_buffered_bytes:
                self._answer_early(stream, "too many request bytes buffered on this connection")
                return
            budget = self.budget
            if budget.used + len(data) > budget.limit:
                self._answer_early(stream, "too many request bytes buffered by this server")
                return
            stream.add(data)
            self.buffered += len(data)
            budget.used += len(data)
        if flags & frames.END_STREAM:
            self._end_request(stream)
        elif stream.recv_window <= self.limits.initial_window_size >> 1:
            increment = self.limits.initial_window_size - stream.recv_window
            self.out.append(frames.window_update(stream_id, increment))
            stream.recv_window += increment

    def _on_late_data(self, stream_id: int, stream: Stream | None) -> None:
        if stream is not None:
            raise H2StreamError(stream_id, ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
        if stream_id > self._highest_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
        if not self.closed_streams.get(stream_id):
            raise H2StreamError(stream_id, ErrorCode.STREAM_CLOSED, "DATA on a closed stream")

    def _answer_early(self, stream: Stream, reason: str) -> None:
        self.answer(stream, fields.trailers_only(Status.RESOURCE_EXHAUSTED, reason))

    def _end_request(self, stream: Stream, body: bytes | None = None) -> None:
        """The request is complete: answer its rejection or framing error, or call it. `body`
        is its whole body when it came in one frame, else the stream's buffer holds it."""
        stream.receiving = False
        self._started += 1
        control = self._control + CONTROL_PER_REQUEST
        self._control = control if control < CONTROL_BUDGET else CONTROL_BUDGET
        head = stream.head
        if head.content_length is not None and stream.received != head.content_length:
            raise H2StreamError(stream.id, ErrorCode.PROTOCOL_ERROR, "body under content-length")
        rejection = head.rejection
        if rejection is not None:
            if rejection.http_status == 200:
                self.answer(stream, fields.trailers_only(rejection.grpc_status, rejection.message))
            else:
                # Not gRPC (a GET, another content type): a plain HTTP answer with a body, as
                # HTTP clients and h2spec expect; its DATA waits for window like any answer's.
                body = rejection.message.encode("utf-8", "replace") + b"\n"
                self.answer(stream, fields.plain_response(rejection.http_status), body)
            return
        if body is None:
            body = stream.take_body()
            self.buffered -= len(body)
            self.budget.used -= len(body)
        # One uncompressed message, exactly as long as its prefix says: the usual case, read
        # here; anything else goes to read_message for the error it deserves.
        if body[:1] == b"\0" and int.from_bytes(body[1:PREFIX_SIZE]) == len(body) - PREFIX_SIZE:
            message = body[PREFIX_SIZE:]
        else:
            try:
                message = read_message(body)
            except CallError as exc:
                self.answer(stream, fields.trailers_only(exc.status, exc.message))
                return
        self.calls.add(stream.id)
        self.on_call(stream.id, head.path, message)

    # --- control -------------------------------------------------------------------------------

    def _count_empty(self, payload: bytes) -> None:
        """A frame that does not end what it belongs to: at most MAX_EMPTY_FRAMES empty ones
        in a row."""
        if payload:
            self._empty_frames = 0
            return
        self._empty_frames += 1
        if self._empty_frames > MAX_EMPTY_FRAMES:
            raise H2ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM, f"over {MAX_EMPTY_FRAMES} empty frames in a row"
            )

    def _spend(self, cost: int, kind: str) -> None:
        """A control frame: out of the budget its requests refill (see the module's notes)."""
        self._control -= cost
        if self._control < 0:
            raise H2ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM, f"too many control frames ({kind}) for its requests"
            )

    def _on_priority(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._spend(1, "PRIORITY")
        if not stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise H2StreamError(stream_id, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY is 5 bytes")
        if frames.u32(payload) & frames.MAX_STREAM_ID == stream_id:
            raise H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "stream depends on itself")

    def _on_rst_stream(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._spend(1, "RST_STREAM")
        if len(payload) != 4:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM is 4 bytes")
        if not stream_id or stream_id > self._highest_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle {stream_id}")
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.drop(stream)
            self.remember(stream_id, False)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._spend(1, "SETTINGS")
        if stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & frames.ACK:
            if payload:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        self.settings_received = True
        for setting, value in frames.settings_values(payload):
            if setting == frames.INITIAL_WINDOW_SIZE:
                if value != self.peer_window:  # every open stream's window moves
                    self._spend(len(self.streams) // WINDOW_WALK_COST, "SETTINGS")
                self.set_peer_window(value)
            elif setting == frames.MAX_FRAME_SIZE:
                if not frames.DEFAULT_MAX_FRAME_SIZE <= value <= frames.LARGEST_MAX_FRAME_SIZE:
                    raise H2ConnectionError(
                        ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range"
                    )
                self.peer_max_frame = value
            elif setting == frames.HEADER_TABLE_SIZE:
                self.limit_table_size(value)
            elif setting == frames.ENABLE_PUSH and value > 1:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
        self.out.append(frames.SETTINGS_ACK)
        self.send_blocked()

    def _on_push_promise(self, flags: int, stream_id: int, payload: bytes) -> None:
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._spend(1, "PING")
        if stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING is 8 bytes")
        if not flags & frames.ACK:
            self.out.append(frames.ping(payload, ack=True))
        elif payload == SHUTDOWN_PING:
            self.finish_shutdown()

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY is at least 8 bytes")
        self.peer_goaway = True

    def _on_window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._spend(1, "WINDOW_UPDATE")
        if len(payload) != 4:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE is 4 bytes")
        increment = frames.u32(payload) & frames.MAX_WINDOW
        if not stream_id:
            if not increment:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.grow_window(increment)
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._highest_id:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on idle stream")
            return  # a closed stream: the update crossed our END_STREAM
        if not increment:
            raise H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        self.grow_stream_window(stream, increment)
