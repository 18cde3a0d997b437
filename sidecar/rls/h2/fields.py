"""Header fields: request blocks decoded (HPACK, RFC 7541) and checked (RFC 9113 §8), response
blocks encoded.

Every request block goes through one `hpack.Decoder`, in the order the blocks arrived, because
the blocks share its dynamic table. Decoding costs more than the rest of a call, and a client
sends the very same block bytes again and again once its headers sit in the table, so what a
block means is kept by its bytes; that is only sound while the table stays as it was, so any
block that changes the table empties the cache and is not kept itself.

Responses use the static table and literals without indexing only: the encoder keeps no state,
so every response block is a constant or a concatenation of constants.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Final

import hpack

from sidecar.rls.h2.frames import ErrorCode, H2ConnectionError

#: Blocks up to this size are cached, up to this many; the cache is emptied when full.
CACHED_BLOCK_MAX_BYTES: Final = 1_024
CACHE_SIZE: Final = 256
#: The longest grpc-message sent, in characters; longer messages are cut.
GRPC_MESSAGE_MAX_CHARS: Final = 1_024

_NAME: Final = re.compile(rb"[^\x00-\x20:A-Z\x7f-\xff]+")
_BAD_VALUE: Final = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")
_CONNECTION_SPECIFIC: Final = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO: Final = frozenset((b":method", b":scheme", b":path", b":authority"))


@dataclass(frozen=True, slots=True)
class Rejection:
    """A well-formed request the server answers itself, without calling a method: with
    `http_status` 200, a gRPC request it cannot serve, answered with `grpc_status` (gRPC's
    Trailers-Only); otherwise a request that is not gRPC (not a POST, or not application/grpc),
    answered in plain HTTP with that status and `message` as a text body (`plain_response`)."""

    http_status: int
    grpc_status: int
    message: str


@dataclass(frozen=True, slots=True)
class Head:
    """What one decoded header block means, as a request's headers and as trailers.

    `malformed` (as a request) and `malformed_trailers` (as trailers) name the broken rule;
    either ends the stream with PROTOCOL_ERROR (§8.1.1).
    """

    path: str = ""
    content_length: int | None = None
    rejection: Rejection | None = None
    malformed: str | None = None
    malformed_trailers: str | None = None
    #: The request's fields among those the decoder was asked to keep (`RequestDecoder`), as
    #: they came: the trace context Envoy sends, when tracing is on.
    kept: tuple[tuple[bytes, bytes], ...] = ()


class RequestDecoder:
    """The connection's HPACK decoder, with the cache of decoded blocks; `kept` names the
    fields (lower case) each Head keeps the values of (none: the usual case)."""

    def __init__(self, max_header_list_size: int, kept: frozenset[bytes] = frozenset()) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._max_header_list_size = max_header_list_size
        self._cache: dict[bytes, Head] = {}
        self._kept = kept

    def decode(self, block: bytes) -> Head:
        """The meaning of one complete block; raises H2ConnectionError when it cannot be decoded."""
        head = self._cache.get(block)
        if head is not None:
            return head
        table = self._decoder.header_table
        # Any: the compiled build (sidecar.build) would unbox a typed tuple[bytes, bytes] and box
        # it anew, so the identity test below would never hold.
        entries: Any = table.dynamic_entries
        count, newest, maxsize = len(entries), entries[0] if entries else None, table.maxsize
        try:
            fields = self._decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError as exc:
            raise H2ConnectionError(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"header list larger than {self._max_header_list_size} bytes",
            ) from exc
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise H2ConnectionError(
                ErrorCode.COMPRESSION_ERROR, f"bad header block: {exc}"
            ) from exc
        head = interpret(fields)
        if self._kept:
            kept = self._kept
            head = replace(head, kept=tuple((n, v) for n, v in fields if n in kept))
        # A new entry is a new tuple at the front; an eviction or resize changes count or size.
        unchanged = (
            len(entries) == count
            and table.maxsize == maxsize
            and (entries[0] if entries else None) is newest
        )
        if not unchanged:
            self._cache.clear()
        elif len(block) <= CACHED_BLOCK_MAX_BYTES:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[block] = head
        return head


def interpret(fields: Iterable[tuple[bytes, bytes]]) -> Head:
    """Check a decoded block against RFC 9113 §8.2 and §8.3 and read what a gRPC server needs."""
    pseudo: dict[bytes, bytes] = {}
    regular_seen = False
    content_lengths: set[bytes] = set()
    content_type = b""
    encoding = b""
    problem = None
    for name, value in fields:
        problem = _field_problem(name, value)
        if problem:
            break
        if name[:1] == b":":
            if regular_seen:
                problem = f"pseudo-header {name.decode()} after a regular field"
            elif name not in _REQUEST_PSEUDO:
                problem = f"pseudo-header {name.decode()} is not a request pseudo-header"
            elif name in pseudo:
                problem = f"pseudo-header {name.decode()} repeated"
            if problem:
                break
            pseudo[name] = value
            continue
        regular_seen = True
        if name == b"content-length":
            content_lengths.add(value)
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
    if problem:
        return Head(malformed=problem, malformed_trailers=problem)
    trailers_problem = "pseudo-header in trailers" if pseudo else None
    problem = _request_problem(pseudo, content_lengths)
    if problem:
        return Head(malformed=problem, malformed_trailers=trailers_problem)
    content_length = int(next(iter(content_lengths))) if content_lengths else None
    path = pseudo.get(b":path", b"").decode("latin-1")
    return Head(
        path=path,
        content_length=content_length,
        rejection=_rejection(pseudo[b":method"], content_type, encoding),
        malformed_trailers=trailers_problem,
    )


def _field_problem(name: bytes, value: bytes) -> str | None:
    bare = name[1:] if name[:1] == b":" else name
    if not _NAME.fullmatch(bare):
        return f"invalid field name {name!r}"
    if _BAD_VALUE.search(value):
        return f"invalid value for {name.decode()}"
    if name in _CONNECTION_SPECIFIC:
        return f"connection-specific field {name.decode()}"
    if name == b"te" and value != b"trailers":
        return "te other than 'trailers'"
    return None


def _request_problem(pseudo: dict[bytes, bytes], content_lengths: set[bytes]) -> str | None:
    method = pseudo.get(b":method")
    if method is None:
        return "no :method"
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
            return "CONNECT needs :authority and neither :scheme nor :path"
    else:
        for required in (b":scheme", b":path"):
            if not pseudo.get(required):
                return f"no {required.decode()}"
    if len(content_lengths) > 1 or any(not v.isdigit() for v in content_lengths):
        return "invalid content-length"
    return None


def _rejection(method: bytes, content_type: bytes, encoding: bytes) -> Rejection | None:
    if method != b"POST":
        return Rejection(405, 12, f"gRPC calls are POST, not {method.decode('latin-1')}")
    kind = content_type.split(b";", 1)[0].strip()
    if kind != b"application/grpc" and not kind.startswith(b"application/grpc+"):
        shown = content_type.decode("latin-1") or "none"
        return Rejection(415, 3, f"content-type must be application/grpc, not {shown}")
    if encoding not in (b"", b"identity"):
        return Rejection(
            200, 12, f"grpc-encoding {encoding.decode('latin-1')} is not supported (identity only)"
        )
    return None


# --- responses: static table and literals without indexing only (RFC 7541 §6.1, §6.2.2) -----


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal without indexing, with a literal name."""
    return b"\x00" + _string(name) + _string(value)


def _status(code: int) -> bytes:
    if code == 200:
        return b"\x88"  # static entry 8, ":status: 200"
    return _integer(8, 4, 0) + _string(str(code).encode())  # name from static entry 8


#: `content-type: application/grpc`; its name is static entry 31.
_CONTENT_TYPE: Final = _integer(31, 4, 0) + _string(b"application/grpc")
RESPONSE_HEADERS: Final = _status(200) + _CONTENT_TYPE
TRAILERS_OK: Final = _literal(b"grpc-status", b"0")


def table_size_update(size: int) -> bytes:
    """A dynamic table size update, for the start of the next block after the peer shrank it."""
    return _integer(size, 5, 0x20)


def trailers(grpc_status: int, message: str = "") -> bytes:
    block = _literal(b"grpc-status", str(grpc_status).encode())
    if message:
        block += _literal(b"grpc-message", percent_encode(message))
    return block


def trailers_only(grpc_status: int, message: str, http_status: int = 200) -> bytes:
    """A whole response in one block: an error with no message (gRPC's Trailers-Only)."""
    return _status(http_status) + _CONTENT_TYPE + trailers(grpc_status, message)


#: `content-type: text/plain; charset=utf-8`, for the body of a plain HTTP answer.
_TEXT_PLAIN = _integer(31, 4, 0) + _string(b"text/plain; charset=utf-8")
#: `allow: POST`: what a 405 must name (RFC 9110 §15.5.6); its name is static entry 22.
_ALLOW_POST = _integer(22, 4, 0) + _string(b"POST")


def plain_response(http_status: int) -> bytes:
    """The header block of a plain HTTP answer to a request that is not gRPC: `http_status`, a
    text body to follow in DATA, and for 405 the one method there is."""
    block = _status(http_status) + _TEXT_PLAIN
    return block + _ALLOW_POST if http_status == 405 else block


def percent_encode(message: str) -> bytes:
    """grpc-message as the gRPC spec encodes it: printable ASCII but '%' as is, the rest %XX."""
    raw = message[:GRPC_MESSAGE_MAX_CHARS].encode("utf-8", "replace")
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)
