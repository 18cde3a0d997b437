"""HTTP/2 frames (RFC 9113 §4 and §6) as bytes: constants, the frame header, payload readers and
the serializers of the frames a server sends.

Pure: no sockets and no connection state. A frame that breaks a rule a frame can break on its
own (padding longer than the payload, a SETTINGS payload that is not a multiple of six) raises
`H2ConnectionError` with the error code RFC 9113 names for it.
"""

from __future__ import annotations

import enum
import struct
from typing import Final

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (§6).
DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

# Flags; one bit means different things on different frame types.
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# Settings (§6.5.2).
HEADER_TABLE_SIZE: Final = 0x1
ENABLE_PUSH: Final = 0x2
MAX_CONCURRENT_STREAMS: Final = 0x3
INITIAL_WINDOW_SIZE: Final = 0x4
MAX_FRAME_SIZE: Final = 0x5
MAX_HEADER_LIST_SIZE: Final = 0x6

DEFAULT_WINDOW: Final = 65_535
MAX_WINDOW: Final = 2**31 - 1
DEFAULT_MAX_FRAME_SIZE: Final = 16_384
LARGEST_MAX_FRAME_SIZE: Final = 2**24 - 1
DEFAULT_HEADER_TABLE_SIZE: Final = 4_096
MAX_STREAM_ID: Final = 2**31 - 1

#: The frame header: length (24 bits, as a byte and a short), type, flags, stream id (31 bits).
HEADER: Final = struct.Struct(">BHBBL")
HEADER_SIZE: Final = HEADER.size
_SETTING: Final = struct.Struct(">HL")
_GOAWAY: Final = struct.Struct(">LL")
_U32: Final = struct.Struct(">L")


class ErrorCode(enum.IntEnum):
    """RFC 9113 §7."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class H2ConnectionError(Exception):
    """The peer broke a rule that ends the connection: answer GOAWAY with `code`, then close."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason


class H2StreamError(Exception):
    """The peer broke a rule that ends one stream: answer RST_STREAM with `code`."""

    def __init__(self, stream_id: int, code: ErrorCode, reason: str) -> None:
        super().__init__(f"stream {stream_id}: {code.name}: {reason}")
        self.stream_id = stream_id
        self.code = code
        self.reason = reason


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame; `payload` must fit the peer's MAX_FRAME_SIZE (the caller splits)."""
    size = len(payload)
    return HEADER.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


SETTINGS_ACK: Final = frame(SETTINGS, ACK, 0)


def ping(opaque: bytes, ack: bool = False) -> bytes:
    return frame(PING, ACK if ack else 0, 0, opaque)


def goaway(last_stream_id: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def unpad(payload: bytes, flags: int) -> bytes:
    """The payload of a DATA or HEADERS frame without its padding (§6.1, §6.2)."""
    if not flags & PADDED:
        return payload
    if not payload:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PADDED frame with an empty payload")
    pad = payload[0]
    if pad >= len(payload):
        raise H2ConnectionError(
            ErrorCode.PROTOCOL_ERROR, f"padding of {pad} bytes in a {len(payload)}-byte payload"
        )
    return payload[1 : len(payload) - pad]


def header_block(payload: bytes, flags: int) -> tuple[bytes, int | None]:
    """A HEADERS payload as its field block fragment and, with PRIORITY, the stream it depends on.

    The priority itself is read and ignored, as RFC 9113 §5.3.2 allows; only a stream that
    depends on itself matters (a stream error).
    """
    payload = unpad(payload, flags)
    if not flags & PRIORITY_FLAG:
        return payload, None
    if len(payload) < 5:
        raise H2ConnectionError(
            ErrorCode.FRAME_SIZE_ERROR, "HEADERS with PRIORITY too short for its priority fields"
        )
    return payload[5:], _U32.unpack_from(payload)[0] & MAX_STREAM_ID


def settings_values(payload: bytes) -> list[tuple[int, int]]:
    """The (identifier, value) pairs of a SETTINGS payload, in order."""
    if len(payload) % 6:
        raise H2ConnectionError(
            ErrorCode.FRAME_SIZE_ERROR, f"SETTINGS payload of {len(payload)} bytes"
        )
    return [_SETTING.unpack_from(payload, at) for at in range(0, len(payload), 6)]


def u32(payload: bytes, at: int = 0) -> int:
    """The 32-bit big-endian number at `at`."""
    value: int = _U32.unpack_from(payload, at)[0]
    return value
