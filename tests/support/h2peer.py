"""An HTTP/2 client for the conformance tests, independent of the server's code.

`Peer` drives the connection with the `h2` library's client state machine over a raw loopback
socket; for what h2 refuses to send (broken frames, forbidden headers) a test writes raw bytes.
Every frame the server sends is kept in order, parsed by hyperframe, and the header blocks are
decoded by the peer's own HPACK decoder, so a test can assert the exact frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import Any

import h2.config
import h2.connection
import h2.events
import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types, flags, settings and error codes, as RFC 9113 numbers them.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 1, 2, 3, 4
MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 5, 6
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0, 1, 3, 5, 6
REFUSED_STREAM, COMPRESSION_ERROR = 7, 9

TIMEOUT = 10.0

Headers = list[tuple[bytes, bytes]]


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """Any frame, valid or not: 24-bit length, type, flags, 32-bit stream id, payload."""
    size = len(payload)
    return struct.pack(">BHBBL", size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def grpc_message(message: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BL", flag, len(message)) + message


def request_headers(path: str, **extra: str) -> Headers:
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    return headers + [(k.replace("_", "-").encode(), v.encode()) for k, v in extra.items()]


class Peer:
    """One client connection. With `track`, h2 sees every byte both ways (and answers SETTINGS
    and PING itself); without, the test writes every frame, preface included."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, track: bool
    ) -> None:
        self.reader, self.writer = reader, writer
        self.track = track
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.encoder = hpack.Encoder()  # for raw header blocks (only on untracked peers)
        self.decoder = hpack.Decoder()
        self.frames: list[Frame] = []
        self.events: list[h2.events.Event] = []
        self.blocks: dict[int, list[Headers]] = {}
        self.data: dict[int, bytes] = {}
        self.eof = False
        self._buffer = b""
        self._fragments: list[bytes] = []

    @classmethod
    async def connect(
        cls, port: int, *, track: bool = True, tls: ssl.SSLContext | None = None
    ) -> Peer:
        """With `tls`, over TLS (the server's name taken to be localhost)."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname=None if tls is None else "localhost"
        )
        return cls(reader, writer, track)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    # --- sending -------------------------------------------------------------------------------

    def start(self, settings: dict[int, int] | None = None) -> None:
        if self.track:
            self.h2.initiate_connection()
            if settings:
                self.h2.update_settings(settings)
            self.flush()
        else:
            payload = b"".join(struct.pack(">HL", k, v) for k, v in (settings or {}).items())
            self.send(PREFACE + raw_frame(0x4, 0, 0, payload))

    def call(self, path: str, message: bytes, **extra: str) -> int:
        """Start a call whose message fits the windows and one frame; returns its stream."""
        stream_id: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, request_headers(path, **extra))
        self.h2.send_data(stream_id, grpc_message(message), end_stream=True)
        self.flush()
        return stream_id

    async def call_large(self, path: str, message: bytes) -> int:
        """A call of any size: DATA in frames that fit, waiting for WINDOW_UPDATEs as needed."""
        stream_id: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, request_headers(path))
        body = grpc_message(message)
        while body:
            size = min(
                len(body),
                self.h2.local_flow_control_window(stream_id),
                self.h2.max_outbound_frame_size,
            )
            if not size:
                self.flush()
                await self.read()
                continue
            chunk, body = body[:size], body[size:]
            self.h2.send_data(stream_id, chunk, end_stream=not body)
        self.flush()
        return stream_id

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    def send(self, *chunks: bytes) -> None:
        self.writer.write(b"".join(chunks))

    def block(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """A header block from this peer's own encoder (untracked peers only)."""
        encoded: bytes = self.encoder.encode(list(headers))
        return encoded

    # --- receiving -----------------------------------------------------------------------------

    async def until(self, done: Callable[[Peer], bool], timeout: float = TIMEOUT) -> None:
        """Read until `done(self)` holds; fails if the connection ends or time runs out first."""
        async with asyncio.timeout(timeout):
            while not done(self):
                if self.eof:
                    raise AssertionError(f"connection closed; frames: {self.frames}")
                await self.read()

    async def closed(self, timeout: float = TIMEOUT) -> None:
        """Read until the server closes the connection."""
        async with asyncio.timeout(timeout):
            while not self.eof:
                await self.read()

    async def quiet(self, seconds: float = 0.3) -> None:
        """Read whatever comes for `seconds` (to show that nothing does)."""
        try:
            async with asyncio.timeout(seconds):
                while not self.eof:
                    await self.read()
        except TimeoutError:
            pass

    async def read(self) -> None:
        """Read once from the socket and take in every complete frame."""
        try:
            chunk = await self.reader.read(65_536)
        except ConnectionError:
            chunk = b""
        if not chunk:
            self.eof = True
            return
        if self.track:
            events = self.h2.receive_data(chunk)
            self.events += events
            for event in events:
                if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self.flush()
        whole, self._buffer = split_frames(self._buffer + chunk)
        for frame in whole:
            self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)
        if isinstance(frame, (HeadersFrame, ContinuationFrame)):
            self._fragments.append(frame.data)
            if "END_HEADERS" in frame.flags:
                block = b"".join(self._fragments)
                self._fragments = []
                decoded = self.decoder.decode(block, raw=True)
                self.blocks.setdefault(frame.stream_id, []).append([tuple(h) for h in decoded])
        elif isinstance(frame, DataFrame):
            self.data[frame.stream_id] = self.data.get(frame.stream_id, b"") + frame.data

    # --- reading what came ---------------------------------------------------------------------

    def on(self, stream_id: int) -> list[Frame]:
        return [f for f in self.frames if f.stream_id == stream_id]

    def kinds(self, stream_id: int) -> list[str]:
        return [type(f).__name__ for f in self.on(stream_id)]

    def ended(self, stream_id: int) -> bool:
        """The server ended the stream: END_STREAM or RST_STREAM."""
        return any(
            isinstance(f, RstStreamFrame) or "END_STREAM" in f.flags for f in self.on(stream_id)
        )

    def goaways(self) -> list[GoAwayFrame]:
        return [f for f in self.frames if isinstance(f, GoAwayFrame)]

    def of(self, kind: type[Any]) -> list[Any]:
        return [f for f in self.frames if isinstance(f, kind)]

    def trailers(self, stream_id: int) -> dict[bytes, bytes]:
        """The last header block of the stream as a dict."""
        return dict(self.blocks[stream_id][-1])


# --- helpers for tests ---------------------------------------------------------------------


def split_frames(data: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the start of `data`, parsed, and the bytes after them."""
    found, at = [], 0
    while len(data) - at >= 9:
        frame, size = Frame.parse_frame_header(memoryview(data[at : at + 9]))
        if len(data) - at < 9 + size:
            break
        frame.parse_body(memoryview(data[at + 9 : at + 9 + size]))
        found.append(frame)
        at += 9 + size
    return found, data[at:]


def headers_frame(peer: Peer, stream_id: int, path: str, flags: int = END_HEADERS) -> bytes:
    return raw_frame(HEADERS, flags, stream_id, peer.block(request_headers(path)))


def call(peer: Peer, stream_id: int, path: str, message: bytes = b"hi") -> bytes:
    """A whole unary call as raw frames (DATA in frames of the default maximum size)."""
    body = grpc_message(message)
    chunks = [body[at : at + 16_384] for at in range(0, len(body), 16_384)]
    data = [raw_frame(DATA, 0, stream_id, chunk) for chunk in chunks[:-1]]
    data.append(raw_frame(DATA, END_STREAM, stream_id, chunks[-1]))
    return headers_frame(peer, stream_id, path) + b"".join(data)


async def answered(peer: Peer, stream_id: int) -> dict[bytes, bytes]:
    """Wait for the stream to end; returns its trailers."""
    await peer.until(lambda p: p.ended(stream_id))
    return peer.trailers(stream_id)


async def connection_error(peer: Peer, code: int) -> GoAwayFrame:
    """The server ends the connection with GOAWAY `code`, its last frame."""
    await peer.closed()
    assert isinstance(peer.frames[-1], GoAwayFrame), peer.frames
    assert peer.frames[-1].error_code == code, peer.frames[-1]
    return peer.frames[-1]


async def stream_error(peer: Peer, stream_id: int, code: int) -> None:
    await peer.until(lambda p: bool(p.of(RstStreamFrame)))
    (reset,) = peer.of(RstStreamFrame)
    assert (reset.stream_id, reset.error_code) == (stream_id, code)
