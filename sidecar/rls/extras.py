"""What an answer may carry beside its statuses, each asked for by a `serve` flag and off by
default: the name of the limit that refused it (`--response-limit-name`), and the reference's
response headers (`--response-headers`, or one pair per descriptor with
`--response-headers-all-descriptors`) and dynamic metadata (`--response-dynamic-metadata`), as
envoyproxy/ratelimit writes them (REFERENCE.md 2.11, 2.12; its PR #1190).

`Extras.encode` writes them after `convert.response_bytes`' statuses, straight to the wire
format as that does: `RateLimitResponse` field 3 `response_headers_to_add` (HeaderValue: 1 key,
2 value) and field 6 `dynamic_metadata` (google.protobuf.Struct: 1 fields, a map entry of
1 key and 2 Value; Value: 1 null_value, 2 number_value (double), 3 string_value, 4 bool_value,
5 struct_value, 6 list_value (ListValue: 1 values)). Envoy adds the headers to the response the
client gets (the 429, and with the reference's headers a 200 too), and keeps the Struct in the
request's dynamic metadata under its filter's name (`envoy.filters.http.ratelimit`), where
routes and the access log read it.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sidecar.model import (
    UNLIMITED_REMAINING,
    Code,
    Decision,
    Descriptor,
    DescriptorStatus,
    Override,
    Request,
    Role,
    Unit,
)
from sidecar.rls.convert import response_bytes, varint


@dataclass(frozen=True, slots=True)
class Extras:
    """What `serve` puts in an answer beside its statuses, each off by default: the limit's
    name on OVER_LIMIT (`limit_name`), the reference's three headers (`headers`, their names)
    or its limit and remaining headers of every descriptor (`all_descriptors_headers`, which
    then replace the three, as the reference's LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED does), and
    its dynamic metadata (`dynamic_metadata`).

    Their headers come in that order: the reference's, then `RateLimit-Policy`. Their dynamic
    metadata is one Struct holding the fields of both.
    """

    limit_name: bool = False
    headers: HeaderNames | None = None
    dynamic_metadata: bool = False
    all_descriptors_headers: bool = False

    @property
    def any(self) -> bool:
        return (
            self.limit_name
            or self.headers is not None
            or self.dynamic_metadata
            or self.all_descriptors_headers
        )

    def encode(self, request: Request, decision: Decision) -> bytes:
        """The wire bytes of the `RateLimitResponse` for `decision`, an answer to `request`."""
        if self.all_descriptors_headers:
            headers = all_descriptors_headers(decision)
        elif self.headers is not None:
            headers = rate_limit_headers(decision, self.headers)
        else:
            headers = b""
        fields = reference_metadata(request, decision) if self.dynamic_metadata else b""
        if self.limit_name:
            policy_header, name_fields = limit_name_fields(decision)
            headers += policy_header
            fields += name_fields
        encoded = response_bytes(decision) + headers
        if fields or self.dynamic_metadata:
            encoded += _message(6, fields)
        return encoded


# --- The limit that decided an OVER_LIMIT answer (`--response-limit-name`) -------------------
#
# The access log reads it as `%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_name)%`.

#: The header, per the IETF RateLimit header fields draft (draft-ietf-httpapi-ratelimit-headers):
#: a list of policies, each a quoted name with its quota `q` and window `w` in seconds.
POLICY_HEADER: Final = "RateLimit-Policy"
#: The keys of `dynamic_metadata`.
METADATA_NAME: Final = "limit_name"
METADATA_QUOTA: Final = "limit_quota"
METADATA_WINDOW: Final = "limit_window"


def limit_name(status: DescriptorStatus) -> str:
    """The name of the limit behind `status`: the rule's `name` (its window's, for a window of
    `rate_limits` that has one), else its descriptor path (`domain.key_value...`)."""
    limit, window = status.limit, status.window
    if window is not None and window.name:
        return window.name
    if limit is None:
        return ""
    return limit.name or limit.rule_key


def policy(status: DescriptorStatus) -> str:
    """One policy of the `RateLimit-Policy` header for `status`: `"name";q=100;w=60`."""
    window = status.window or (status.limit.windows[0] if status.limit else None)
    text = f'"{_sf_string(limit_name(status))}"'
    if window is not None:
        text += f";q={window.requests_per_unit};w={window.seconds}"
    return text


def _sf_string(text: str) -> str:
    """`text` as the inside of a structured-field string (RFC 8941): printable ASCII, with `"`
    and `\\` escaped; any other character percent-encoded from its UTF-8 bytes (`%` too)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif " " <= char <= "~" and char != "%":
            out.append(char)
        else:
            out.append("".join(f"%{byte:02X}" for byte in char.encode()))
    return "".join(out)


def limit_name_fields(decision: Decision) -> tuple[bytes, bytes]:
    """What an OVER_LIMIT answer adds to name the limits that refused it (nothing for another
    answer): the `RateLimit-Policy` header listing every refusing limit in request order, and
    the first one's name, quota and window as fields of the dynamic metadata's Struct."""
    if decision.overall_code != Code.OVER_LIMIT:
        return b"", b""
    refusing = [s for s in decision.statuses if s.code == Code.OVER_LIMIT and s.limit is not None]
    if not refusing:
        return b"", b""
    policies = list(dict.fromkeys(policy(status) for status in refusing))
    header = _header(POLICY_HEADER, ", ".join(policies))
    first = refusing[0]
    window = first.window or first.limit.windows[0]  # type: ignore[union-attr]
    fields = (
        _struct_entry(METADATA_NAME, _string(3, limit_name(first)))
        + _struct_entry(METADATA_QUOTA, _double(2, window.requests_per_unit))
        + _struct_entry(METADATA_WINDOW, _double(2, window.seconds))
    )
    return header, fields


# --- The reference's response headers and dynamic metadata (`--response-headers`,
# `--response-dynamic-metadata`) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeaderNames:
    """The names of the three headers `--response-headers` adds (the reference's
    LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER and LIMIT_RESET_HEADER)."""

    limit: str = "RateLimit-Limit"
    remaining: str = "RateLimit-Remaining"
    reset: str = "RateLimit-Reset"

    def __post_init__(self) -> None:
        for name in (self.limit, self.remaining, self.reset):
            check_header_name(name)


#: An HTTP field name: an RFC 9110 token.
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def check_header_name(name: str) -> str:
    """`name` if it can name an HTTP header; else ValueError saying what can."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(
            f"{name!r} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"
        )
    return name


def header_status(statuses: Sequence[DescriptorStatus]) -> DescriptorStatus | None:
    """The status the headers report, chosen as the reference chooses it: the first of those
    with a `current_limit` that has the least `limit_remaining`, unless a descriptor that is not
    a quota descriptor is OVER_LIMIT, in which case the last such; None when no status has a
    `current_limit` (no rule, a replaced one, `unlimited`)."""
    chosen = None
    least = UNLIMITED_REMAINING  # the reference starts from MaxUint32, and only less replaces it
    for status in statuses:
        limit = status.limit
        if limit is None or limit.unlimited:
            continue
        if status.limit_remaining < least:
            chosen, least = status, status.limit_remaining
        if status.code == Code.OVER_LIMIT and limit.role is not Role.QUOTA:
            chosen, least = status, 0
    return chosen


def rate_limit_headers(decision: Decision, names: HeaderNames) -> bytes:
    """The reference's three headers, for an OK answer as for an OVER_LIMIT one, from the
    status `header_status` chooses: its limit's `requests_per_unit`, its `limit_remaining`, and
    the seconds until its window resets (its `duration_until_reset`: for the reference's fixed
    windows, the unit's length less the time since the window began, as the reference works it
    out). Nothing when no status has a `current_limit`."""
    status = header_status(decision.statuses)
    if status is None:
        return b""
    limit = status.limit
    window = status.window or limit.windows[0]  # type: ignore[union-attr]
    reset = status.duration_until_reset
    if reset is None:  # never from the limiter; kept so a hand-made status still encodes
        reset = window.seconds
    return (
        _header(names.limit, str(window.requests_per_unit))
        + _header(names.remaining, str(status.limit_remaining))
        + _header(names.reset, str(reset))
    )


#: The plural, lower-case word of each unit in the names of `all_descriptors_headers`.
_UNIT_WORDS = {unit: unit.name.lower() + "s" for unit in Unit}


def all_descriptors_headers(decision: Decision) -> bytes:
    """The reference's headers of every descriptor (its LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED,
    PR #1190): for each status with a `current_limit`, in request order, `ratelimit-limit-<unit>`
    (its `requests_per_unit`) and `ratelimit-remaining-<unit>` (its `limit_remaining`), the unit
    its `current_limit` carries in the plural (`seconds`, `minutes`, ..., `years`; a window of
    `unit_multiplier` 5 minutes is `minutes`, as its `current_limit` says). No reset header; two
    descriptors of one unit give each name twice, as the reference's do. Nothing when no status
    has a `current_limit` (no rule, a replaced one, `unlimited`)."""
    headers = b""
    for status in decision.statuses:
        limit = status.limit
        if limit is None or limit.unlimited:
            continue
        window = status.window or limit.windows[0]
        word = _UNIT_WORDS[window.unit]
        headers += _header("ratelimit-limit-" + word, str(window.requests_per_unit))
        headers += _header("ratelimit-remaining-" + word, str(status.limit_remaining))
    return headers


def _header(key: str, value: str) -> bytes:
    return _message(3, _string(1, key) + _string(2, value))


def reference_metadata(request: Request, decision: Decision) -> bytes:
    """The fields of the reference's `dynamic_metadata` (its RESPONSE_DYNAMIC_METADATA), as the
    body of a Struct: `domain`; `descriptors`, each `{entries: ["key=value", ...]}` with its
    `limit` override as text and its own `hitsAddend` when Envoy set them; the request's
    `hitsAddend` when not 0; and `metadata`, the rules' `metadata` maps of the descriptors that
    were not OVER_LIMIT merged in request order, the first value of a key winning (maps merge
    key by key), left out when empty."""
    fields = _struct_entry("domain", _string(3, request.domain))
    descriptors = b"".join(_message(1, _message(5, _descriptor(d))) for d in request.descriptors)
    fields += _struct_entry("descriptors", _message(6, descriptors))
    if request.hits_addend:
        fields += _struct_entry("hitsAddend", _double(2, request.hits_addend))
    merged: dict[str, object] = {}
    for status in decision.statuses:
        limit = status.limit
        if status.code != Code.OVER_LIMIT and limit is not None and limit.metadata:
            merge_metadata(merged, limit.metadata)
    if merged:
        fields += _struct_entry("metadata", _message(5, _struct(merged)))
    return fields


def _descriptor(descriptor: Descriptor) -> bytes:
    entries = b"".join(
        _message(1, _string(3, f"{entry.key}={entry.value}")) for entry in descriptor.entries
    )
    body = _struct_entry("entries", _message(6, entries))
    override = descriptor.override
    if override is not None:
        body += _struct_entry("limit", _string(3, override_text(override)))
    if descriptor.hits_addend is not None:
        body += _struct_entry("hitsAddend", _double(2, descriptor.hits_addend))
    return body


def override_text(override: Override) -> str:
    """A `limit` override as the reference writes it (the protobuf text format of
    RateLimitOverride: `requests_per_unit:42 unit:HOUR`, a field at 0 left out)."""
    parts = []
    if override.requests_per_unit:
        parts.append(f"requests_per_unit:{override.requests_per_unit}")
    # WEEK (7) has no name in Envoy's RateLimitUnit: the text format then writes the number.
    parts.append(
        f"unit:{override.unit.value if override.unit is Unit.WEEK else override.unit.name}"
    )
    return " ".join(parts)


def merge_metadata(into: dict[str, object], source: Mapping[str, object]) -> None:
    """Merge `source` into `into` as the reference does: a key `into` lacks is added; where both
    hold a map, the maps merge the same way; otherwise the value already there stays."""
    for key, value in source.items():
        if key not in into:
            into[key] = value
            continue
        present = into[key]
        if isinstance(present, Mapping) and isinstance(value, Mapping):
            copy = dict(present)  # never change the rules' own maps
            merge_metadata(copy, value)
            into[key] = copy


def _struct(fields: Mapping[str, object]) -> bytes:
    return b"".join(_struct_entry(str(key), _value(value)) for key, value in fields.items())


def _value(value: object) -> bytes:
    """The body of a google.protobuf.Value for a value of a YAML (or xDS Struct) map."""
    if value is None:
        return b"\x08\x00"
    if isinstance(value, bool):
        return b"\x20\x01" if value else b"\x20\x00"
    if isinstance(value, (int, float)):
        return _double(2, float(value))
    if isinstance(value, str):
        return _string(3, value)
    if isinstance(value, Mapping):
        return _message(5, _struct(value))
    if isinstance(value, (list, tuple)):
        return _message(6, b"".join(_message(1, _value(item)) for item in value))
    return _string(3, str(value))  # a YAML date or time: as text


def _struct_entry(key: str, value: bytes) -> bytes:
    return _message(1, _string(1, key) + _message(2, value))


def _message(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


def _string(number: int, text: str) -> bytes:
    return _message(number, text.encode())


def _double(number: int, value: float) -> bytes:
    return varint(number << 3 | 1) + struct.pack("<d", value)
