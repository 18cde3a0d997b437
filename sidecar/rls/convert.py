"""Convert between RLS v3 protobuf and `sidecar.model`, once, at the edge.

`request` turns a parsed `RateLimitRequest` into a `model.Request`, refusing what the model
cannot carry (an override with an unknown unit) with InvalidRequest.
`request_bytes` reads the model straight from the wire bytes of the usual request, as Envoy
encodes it, without building the protobuf message first; for anything else it answers None, and
the caller parses with protobuf, which gives every encoding its exact meaning or error.
`response_bytes` writes a `model.Decision` straight to the wire bytes of a `RateLimitResponse`:
it is the hot path, and encoding the few fields by hand, with each limit's `current_limit`
encoded once and reused, costs a fraction of building the protobuf message field by field.
`response` parses those bytes back for callers that need a message.
What `serve` may add beside the statuses (the limit's name, the reference's headers and
dynamic metadata) `sidecar.rls.extras` writes.
"""

from __future__ import annotations

from typing import Final

from envoy.type.v3.ratelimit_unit_pb2 import RateLimitUnit  # type: ignore[import-untyped]

from sidecar.errors import InvalidRequest
from sidecar.model import (
    Code,
    Decision,
    Descriptor,
    Entry,
    Override,
    Request,
    Unit,
    Window,
)
from sidecar.rls.messages import RateLimitDescriptor, RateLimitRequest, RateLimitResponse

#: `RateLimitOverride.unit` (envoy.type.v3.RateLimitUnit, SECOND to YEAR numbered 1 to 6 as the
#: model numbers them) as a unit. The reference reads the number as a
#: `RateLimitResponse.RateLimit.Unit`, so 7 is a week there, though Envoy's enum has no 7 yet:
#: so it is here. UNKNOWN (0) and any other number are refused (the reference panics on them).
_OVERRIDE_UNITS: Final[dict[int, Unit]] = {
    **{number: Unit[name] for name, number in RateLimitUnit.items() if name != "UNKNOWN"},
    Unit.WEEK.value: Unit.WEEK,
}
_OVERRIDE_UNIT_NAMES: Final = ", ".join(
    f"{unit.name} ({unit.value})" for unit in _OVERRIDE_UNITS.values()
)


def request(message: RateLimitRequest) -> Request:
    """The model of a parsed request; raises InvalidRequest for an override it cannot honour.

    A per-descriptor `hits_addend` keeps its presence: absent is None, an explicit 0 stays 0.
    """
    descriptors = []
    for index, descriptor in enumerate(message.descriptors):
        entries = tuple([Entry(entry.key, entry.value) for entry in descriptor.entries])
        hits_addend = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else None
        override = _override(descriptor.limit, index) if descriptor.HasField("limit") else None
        descriptors.append(Descriptor(entries, hits_addend, override, descriptor.is_negative_hits))
    return Request(message.domain, tuple(descriptors), message.hits_addend)


# Wire format of the fields read below (field number << 3 | wire type 0 varint, 2 length):
#   RateLimitRequest: 1 domain (string), 2 descriptors (message, repeated), 3 hits_addend (uint32)
#   RateLimitDescriptor: 1 entries (message, repeated), 2 limit (RateLimitOverride),
#                        3 hits_addend (google.protobuf.UInt64Value: 1 value, read up to
#                        uint32 here), 4 is_negative_hits (bool, Envoy 1.38+)
#   Entry: 1 key (string), 2 value (string)
#   RateLimitOverride: 1 requests_per_unit (uint32), 2 unit (enum)
_DOMAIN: Final = 0x0A
_DESCRIPTOR: Final = 0x12
_REQUEST_HITS: Final = 0x18
_ENTRY: Final = 0x0A
_LIMIT: Final = 0x12
_DESCRIPTOR_HITS: Final = 0x1A
_NEGATIVE_HITS: Final = 0x20
_KEY: Final = 0x0A
_VALUE: Final = 0x12
_WRAPPED_VALUE: Final = 0x08
_REQUESTS_PER_UNIT: Final = 0x08
_UNIT: Final = 0x10
_UINT32: Final = 0xFFFFFFFF


def request_bytes(body: bytes) -> Request | None:
    """The model of the serialized `RateLimitRequest` `body`, read from its bytes, or None.

    A new body costs this instead of a protobuf parse followed by `request`, whose reads of
    the parsed message's fields cost several times the parse (most of a gateway's bodies are
    new: they name client addresses and users). It reads the fields Envoy sends, in any order,
    a repeated string or number keeping its last value as protobuf does. Whatever it does not
    read the usual way is left to protobuf (None): an unknown field (a newer Envoy's), a known
    one of an unexpected wire type, a message field sent twice (protobuf merges the two), a
    string that is not UTF-8, a number wider than its uint32 field (protobuf keeps the low bits
    of some and not of others), an override whose unit the model lacks, a truncated or
    malformed message. So the two readings never differ; a test holds them to that on random messages.
    """
    reader = _Reader(body)
    end = len(body)
    domain = ""
    descriptors: list[Descriptor] = []
    hits_addend = 0
    while reader.pos < end:
        tag = reader.varint(end)
        if tag == _DESCRIPTOR:
            stop = reader.length(end)
            if stop < 0:
                return None
            descriptor = _descriptor(reader, stop)
            if descriptor is None:
                return None
            descriptors.append(descriptor)
        elif tag == _DOMAIN:
            text = reader.text(end)
            if text is None:
                return None
            domain = text
        elif tag == _REQUEST_HITS:
            number = reader.varint(end)
            if not 0 <= number <= _UINT32:
                return None
            hits_addend = number
        else:
            return None
    return Request(domain, tuple(descriptors), hits_addend)


def _descriptor(reader: _Reader, end: int) -> Descriptor | None:
    """The descriptor whose fields run from the reader's position to `end`, or None."""
    entries: list[Entry] = []
    hits_addend: int | None = None
    override: Override | None = None
    negative = False
    while reader.pos < end:
        tag = reader.varint(end)
        if tag == _ENTRY:
            stop = reader.length(end)
            if stop < 0:
                return None
            key = value = ""
            while reader.pos < stop:
                field = reader.varint(stop)
                text = reader.text(stop) if field in (_KEY, _VALUE) else None
                if text is None:
                    return None
                if field == _KEY:
                    key = text
                else:
                    value = text
            entries.append(Entry(key, value))
        elif tag == _DESCRIPTOR_HITS and hits_addend is None:
            stop = reader.length(end)
            if stop < 0:
                return None
            hits_addend = 0
            while reader.pos < stop:
                field = reader.varint(stop)
                number = reader.varint(stop) if field == _WRAPPED_VALUE else -1
                if not 0 <= number <= _UINT32:
                    return None
                hits_addend = number
        elif tag == _LIMIT and override is None:
            override = _limit(reader, end)
            if override is None:
                return None
        elif tag == _NEGATIVE_HITS:
            # A bool is any varint, true when not 0 (its 64 bits, as protobuf reads it); the
            # last one sent counts.
            number = reader.varint(end)
            if number < 0:
                return None
            negative = number != 0
        else:
            return None
    return Descriptor(tuple(entries), hits_addend, override, negative)


def _limit(reader: _Reader, end: int) -> Override | None:
    """The override whose length-prefixed fields start at the reader's position, or None (its
    unit unknown to the model too: `_override` words that refusal)."""
    stop = reader.length(end)
    if stop < 0:
        return None
    requests_per_unit = unit = 0
    while reader.pos < stop:
        field = reader.varint(stop)
        number = reader.varint(stop) if field in (_REQUESTS_PER_UNIT, _UNIT) else -1
        if not 0 <= number <= _UINT32:
            return None
        if field == _REQUESTS_PER_UNIT:
            requests_per_unit = number
        else:
            unit = number
    known = _OVERRIDE_UNITS.get(unit)
    return None if known is None else Override(requests_per_unit, known)


class _Reader:
    """A position in a message's bytes. Each read returns -1 (or None) for bytes that do not
    hold what it reads within `end`, and then the position means nothing."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def varint(self, end: int) -> int:
        """The varint at the position (at most ten bytes, as protobuf allows), or -1."""
        data = self.data
        pos = self.pos
        if pos < end:
            byte = data[pos]
            if byte < 0x80:  # one byte: every tag, most lengths and counts
                self.pos = pos + 1
                return byte
        result = 0
        shift = 0
        while pos < end and shift < 70:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.pos = pos
                # Nine bytes or fewer hold at most 63 bits: only a tenth can pass 64, and the
                # mask is arithmetic on a long integer, dearer than on a small one.
                return result if shift < 63 else result & 0xFFFFFFFFFFFFFFFF
            shift += 7
        return -1

    def length(self, end: int) -> int:
        """Where the length-delimited field at the position ends (its bytes then start at the
        position), or -1 when it would end past `end`."""
        size = self.varint(end)
        if size < 0 or size > end - self.pos:
            return -1
        return self.pos + size

    def text(self, end: int) -> str | None:
        """The UTF-8 string field at the position, or None."""
        stop = self.length(end)
        if stop < 0:
            return None
        start = self.pos
        self.pos = stop
        try:
            return self.data[start:stop].decode()
        except UnicodeDecodeError:
            return None


def _override(limit: RateLimitDescriptor.RateLimitOverride, index: int) -> Override:
    unit = _OVERRIDE_UNITS.get(limit.unit)
    if unit is None:
        got = "UNKNOWN (0)" if limit.unit == 0 else str(limit.unit)
        raise InvalidRequest(
            f"descriptors[{index}].limit.unit must be one of {_OVERRIDE_UNIT_NAMES}, got {got}"
        )
    return Override(limit.requests_per_unit, unit)


def response(decision: Decision) -> RateLimitResponse:
    """The decision as a protobuf message (parsed from `response_bytes`, so both always agree)."""
    return RateLimitResponse.FromString(response_bytes(decision))


# Wire format of the fields written below (field number << 3 | wire type):
#   RateLimitResponse: 1 overall_code (varint), 2 statuses (length-delimited, repeated)
#   DescriptorStatus: 1 code (varint), 2 current_limit (message), 3 limit_remaining (varint),
#                     4 duration_until_reset (google.protobuf.Duration: 1 seconds, varint)
#   RateLimit: 1 requests_per_unit (varint), 2 unit (varint), 3 name (string)
# proto3 leaves fields at their default (0, "") off the wire, and so do we.
_SMALL_VARINTS: Final = tuple(bytes((n,)) for n in range(0x80))
#: The `code` field by Code number (UNKNOWN, 0, stays off the wire).
_CODE_FIELD: Final = tuple(
    b"\x08" + _SMALL_VARINTS[code] if code else b"" for code in range(max(Code) + 1)
)
#: A whole status holding only its code, by Code number.
_BARE_STATUS: Final = tuple(b"\x12" + _SMALL_VARINTS[len(body)] + body for body in _CODE_FIELD)

#: A `duration_until_reset` of 1 to 127 seconds, the usual reset: a Duration of one small field.
_SMALL_DURATIONS: Final = (b"", *(b"\x22\x02\x08" + _SMALL_VARINTS[s] for s in range(1, 0x80)))

#: A status's `code` and `current_limit` fields, by Code number, for each Window by its
#: identity, which the entry keeps alive so the id cannot be reused. Rules give a handful of
#: limits; overrides give one per request, so the cache is emptied whenever it grows past this
#: size.
_CURRENT_LIMIT_CACHE_SIZE: Final = 4_096
_current_limits: Final[dict[int, tuple[Window, tuple[bytes, ...]]]] = {}


def response_bytes(decision: Decision) -> bytes:
    """The wire bytes of the `RateLimitResponse` for `decision`."""
    overall, statuses = decision
    parts = [_CODE_FIELD[overall]]
    # Unpacked in one step: a status's fields read by name cost a lookup each.
    for code, limit, remaining, seconds, window in statuses:
        if limit is None and not remaining and seconds is None:
            parts.append(_BARE_STATUS[code])
            continue
        if limit is not None and not limit.unlimited:
            if window is None:
                window = limit.windows[0]
            cached = _current_limits.get(id(window))
            body = (cached[1] if cached is not None else _current_limit(window))[code]
        else:
            body = _CODE_FIELD[code]
        if remaining:
            body += b"\x18" + varint(remaining)
        if seconds is not None:
            if 0 < seconds < 0x80:
                body += _SMALL_DURATIONS[seconds]
            elif seconds:
                duration = b"\x08" + varint(seconds)
                body += b"\x22" + _SMALL_VARINTS[len(duration)] + duration
            else:
                body += b"\x22\x00"
        size = len(body)
        parts.append(
            (b"\x12" + _SMALL_VARINTS[size] if size < 0x80 else b"\x12" + varint(size)) + body
        )
    return b"".join(parts)


def _current_limit(window: Window) -> tuple[bytes, ...]:
    """Encode a window's `current_limit` field after each `code` field, and remember them."""
    body = b""
    if window.requests_per_unit:
        body += b"\x08" + varint(window.requests_per_unit)
    body += b"\x10" + varint(window.unit)
    if window.name:
        name = window.name.encode()
        body += b"\x1a" + varint(len(name)) + name
    encoded = b"\x12" + varint(len(body)) + body
    if len(_current_limits) >= _CURRENT_LIMIT_CACHE_SIZE:
        _current_limits.clear()
    by_code = tuple(code + encoded for code in _CODE_FIELD)
    _current_limits[id(window)] = (window, by_code)
    return by_code


def varint(value: int) -> bytes:
    # Unrolled by length up to five bytes (every uint32: a limit, what remains of it, a reset in
    # seconds): a loop costs several times as much, and large limits are common.
    if value < 0x80:
        return _SMALL_VARINTS[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    if value < 0x10000000:
        return bytes(
            (value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80, value >> 21)
        )
    if value < 0x800000000:
        return bytes(
            (
                value & 0x7F | 0x80,
                value >> 7 & 0x7F | 0x80,
                value >> 14 & 0x7F | 0x80,
                value >> 21 & 0x7F | 0x80,
                value >> 28,
            )
        )
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
