"""The Envoy edge's conversions: requests to the model, decisions to the exact protobuf bytes."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.errors import InvalidRequest
from sidecar.model import (
    UNLIMITED_REMAINING,
    Code,
    Decision,
    Descriptor,
    DescriptorStatus,
    Entry,
    Override,
    Request,
    Unit,
    single,
)
from sidecar.rls import convert
from sidecar.rls.extras import Extras, policy
from sidecar.rls.messages import RateLimitRequest, RateLimitResponse


def _protobuf(decision: Decision) -> bytes:
    """The same response built field by field with the protobuf API, as a reference encoding."""
    response = RateLimitResponse(overall_code=decision.overall_code)
    for status in decision.statuses:
        built = response.statuses.add(code=status.code, limit_remaining=status.limit_remaining)
        limit = status.limit
        if limit is not None and not limit.unlimited:
            built.current_limit.requests_per_unit = limit.requests_per_unit
            built.current_limit.unit = limit.unit
            built.current_limit.name = limit.name
        if status.duration_until_reset is not None:
            built.duration_until_reset.SetInParent()
            built.duration_until_reset.seconds = status.duration_until_reset
    encoded: bytes = response.SerializeToString()
    return encoded


MINUTE = single(3, Unit.MINUTE, name="per-user", rule_key="d.user")
#: What the answers below answer (only the dynamic metadata of `Extras` reads it).
REQUEST = Request("d", ())
BIG = single(4_294_967_295, Unit.YEAR, name="n" * 300, rule_key="d.big")
ZERO = single(0, Unit.SECOND, rule_key="d.blocked")
WEEK = single(7, Unit.WEEK, rule_key="d.week")
UNLIMITED = single(0, Unit.SECOND, unlimited=True, rule_key="d.free")

DECISIONS = {
    "bare-ok": Decision(Code.OK, (DescriptorStatus(Code.OK),)),
    "no-statuses": Decision(Code.OK, ()),
    "unknown-overall": Decision(Code.UNKNOWN, (DescriptorStatus(Code.UNKNOWN),)),
    "within": Decision(Code.OK, (DescriptorStatus(Code.OK, MINUTE, 2, 30),)),
    "over": Decision(Code.OVER_LIMIT, (DescriptorStatus(Code.OVER_LIMIT, MINUTE, 0, 30),)),
    "large-numbers": Decision(
        Code.OK, (DescriptorStatus(Code.OK, BIG, 4_294_967_295, 31_536_000),)
    ),
    "zero-limit-and-reset": Decision(
        Code.OVER_LIMIT, (DescriptorStatus(Code.OVER_LIMIT, ZERO, 0, 0),)
    ),
    "week": Decision(Code.OK, (DescriptorStatus(Code.OK, WEEK, 6, 604_800),)),
    "unlimited": Decision(Code.OK, (DescriptorStatus(Code.OK, UNLIMITED, UNLIMITED_REMAINING),)),
    "mixed": Decision(
        Code.OVER_LIMIT,
        (
            DescriptorStatus(Code.OK),
            DescriptorStatus(Code.OVER_LIMIT, MINUTE, 0, 1),
            DescriptorStatus(Code.OK, None, UNLIMITED_REMAINING),
            DescriptorStatus(Code.OK, BIG, 128, 127),
        ),
    ),
}


@pytest.mark.parametrize("decision", DECISIONS.values(), ids=DECISIONS.keys())
def test_response_bytes_equal_the_protobuf_encoding(decision: Decision) -> None:
    """The hand-written wire bytes are byte for byte what protobuf itself would send."""
    assert convert.response_bytes(decision) == _protobuf(decision)
    # Twice: the second time the cached current_limit is used.
    assert convert.response_bytes(decision) == _protobuf(decision)


def test_request_keeps_entries_hits_addend_presence_and_overrides() -> None:
    """An absent per-descriptor hits_addend is None, an explicit 0 stays 0; overrides convert."""
    message = RateLimitRequest(domain="d", hits_addend=2)
    plain = message.descriptors.add()
    plain.entries.add(key="k", value="v")
    checked = message.descriptors.add()
    checked.entries.add(key="k", value="w")
    checked.hits_addend.value = 0
    overridden = message.descriptors.add()
    overridden.entries.add(key="k", value="x")
    overridden.hits_addend.value = 5
    overridden.limit.requests_per_unit = 9
    overridden.limit.unit = 6  # YEAR

    request = convert.request(message)

    assert request.domain == "d"
    assert request.hits_addend == 2
    first, second, third = request.descriptors
    assert first.entries == (Entry("k", "v"),)
    assert (first.hits_addend, first.override) == (None, None)
    assert second.hits_addend == 0
    assert third.hits_addend == 5
    assert third.override == Override(9, Unit.YEAR)


def test_an_override_unit_7_is_a_week_as_in_the_reference() -> None:
    """The reference reads an override's unit number as a RateLimit.Unit, where 7 is WEEK
    (Envoy's RateLimitUnit has no 7 yet): a week here too."""
    message = RateLimitRequest(domain="d")
    descriptor = message.descriptors.add()
    descriptor.entries.add(key="k", value="v")
    descriptor.limit.requests_per_unit = 3
    descriptor.limit.unit = 7
    assert convert.request(message).descriptors[0].override == Override(3, Unit.WEEK)


@pytest.mark.parametrize("unit", [0, 8, 99])
def test_an_override_unit_outside_rate_limit_unit_is_invalid(unit: int) -> None:
    """UNKNOWN and numbers no unit has are refused (the reference panics on them)."""
    message = RateLimitRequest(domain="d")
    descriptor = message.descriptors.add()
    descriptor.entries.add(key="k", value="v")
    descriptor.limit.requests_per_unit = 1
    descriptor.limit.unit = unit

    with pytest.raises(InvalidRequest, match=r"descriptors\[0\]\.limit\.unit must be one of"):
        convert.request(message)


def test_a_limit_object_is_never_confused_with_another() -> None:
    """The current_limit cache is keyed by identity and keeps its limits alive, so a new limit
    with other values is never answered with a stale encoding."""
    for requests in range(1, 50):
        limit = single(requests, Unit.HOUR)
        decision = Decision(Code.OK, (DescriptorStatus(Code.OK, limit, 0, 1),))
        assert convert.response_bytes(decision) == _protobuf(decision)


#: Each side of every varint length: 1 to 5 bytes (all of uint32), and longer int64 resets.
_VARINT_EDGES = sorted(
    {0, 1}
    | {(1 << bits) + delta for bits in (7, 14, 21, 28, 35, 42, 56) for delta in (-1, 0)}
    | {4_294_967_295, (1 << 63) - 1}
)


@pytest.mark.parametrize("value", _VARINT_EDGES)
def test_numbers_at_every_varint_length_encode_as_protobuf_does(value: int) -> None:
    """Remaining counts (uint32) and resets (int64 seconds) on each side of every varint length
    boundary are the bytes protobuf writes."""
    limit = single(max(1, min(value, 4_294_967_295)), Unit.SECOND, rule_key="d.edge")
    decision = Decision(
        Code.OK, (DescriptorStatus(Code.OK, limit, min(value, 4_294_967_295), value),)
    )
    assert convert.response_bytes(decision) == _protobuf(decision)


def test_an_over_limit_answer_names_every_refusing_limit_in_a_ratelimit_policy_header() -> None:
    """With the limit's name (`--response-limit-name`), an OVER_LIMIT answer carries one
    `RateLimit-Policy` header listing each refusing limit once, in request order, as a quoted
    name with its quota and window in seconds; the rule's name, else its descriptor path. The
    first refusing limit's name, quota and window are the dynamic metadata."""
    unnamed = single(5, Unit.HOUR, rule_key="d.app_x.interface")
    statuses = (
        DescriptorStatus(Code.OK, BIG, 7, 1, BIG.windows[0]),
        DescriptorStatus(Code.OVER_LIMIT, MINUTE, 0, 30, MINUTE.windows[0]),
        DescriptorStatus(Code.OVER_LIMIT, unnamed, 0, 30, unnamed.windows[0]),
        DescriptorStatus(Code.OVER_LIMIT, MINUTE, 0, 30, MINUTE.windows[0]),
    )
    decision = Decision(Code.OVER_LIMIT, statuses)
    message = RateLimitResponse.FromString(Extras(limit_name=True).encode(REQUEST, decision))
    assert [(h.key, h.value) for h in message.response_headers_to_add] == [
        ("RateLimit-Policy", '"per-user";q=3;w=60, "d.app_x.interface";q=5;w=3600')
    ]
    metadata = dict(message.dynamic_metadata.fields)
    assert metadata["limit_name"].string_value == "per-user"
    assert metadata["limit_quota"].number_value == 3
    assert metadata["limit_window"].number_value == 60
    # The statuses are the same bytes as without the name.
    assert message.statuses == convert.response(Decision(Code.OVER_LIMIT, statuses)).statuses


def test_an_ok_answer_carries_no_limit_name() -> None:
    """An OK answer is encoded as without `--response-limit-name`: nothing refused it."""
    decision = Decision(Code.OK, (DescriptorStatus(Code.OK, MINUTE, 2, 30, MINUTE.windows[0]),))
    assert Extras(limit_name=True).encode(REQUEST, decision) == convert.response_bytes(decision)


def test_a_limit_name_is_a_valid_structured_field_string() -> None:
    """Quotes and backslashes are escaped, and what is not printable ASCII (and `%`) is
    percent-encoded from its UTF-8 bytes, so the header is always a valid sf-string."""
    odd = single(1, Unit.SECOND, name='a"b\\c%d é\n')
    status = DescriptorStatus(Code.OVER_LIMIT, odd, 0, 1, odd.windows[0])
    assert policy(status) == '"a\\"b\\\\c%25d %C3%A9%0A";q=1;w=1'


_TEXT = st.text(max_size=12) | st.sampled_from(["", "user", "10.0.0.1", "é", "a|b{c}"])
_UINT32_VALUES = st.integers(0, 4_294_967_295) | st.sampled_from(
    [v for v in _VARINT_EDGES if v <= 4_294_967_295]
)


@st.composite
def _requests(draw: st.DrawFn) -> RateLimitRequest:
    """Random requests with every field the model reads, each present or not."""
    message = RateLimitRequest(domain=draw(_TEXT))
    if draw(st.booleans()):
        message.hits_addend = draw(_UINT32_VALUES)
    for _ in range(draw(st.integers(0, 3))):
        descriptor = message.descriptors.add()
        for _ in range(draw(st.integers(0, 3))):
            descriptor.entries.add(key=draw(_TEXT), value=draw(_TEXT))
        if draw(st.booleans()):
            descriptor.hits_addend.value = draw(_UINT32_VALUES)
        if draw(st.booleans()):
            descriptor.limit.requests_per_unit = draw(_UINT32_VALUES)
            descriptor.limit.unit = draw(st.integers(-2, 9))
        descriptor.is_negative_hits = draw(st.booleans())
    return message


def _by_protobuf(body: bytes) -> Request | None:
    """What the service reads from `body` through protobuf: the model, or None when protobuf
    refuses the bytes or `request` refuses the message."""
    try:
        return convert.request(RateLimitRequest.FromString(body))
    except (DecodeError, InvalidRequest):
        return None


@settings(max_examples=400, deadline=None)
@given(_requests())
def test_a_request_read_from_its_bytes_is_the_one_protobuf_reads(message: RateLimitRequest) -> None:
    """Every request Envoy can send, every field present or absent, is read from its bytes as
    protobuf and `request` read it; only an override whose unit the model lacks is left to
    them (None), so that they word the refusal."""
    body = message.SerializeToString()
    read = convert.request_bytes(body)
    units_known = all(
        not d.HasField("limit") or 1 <= d.limit.unit <= 7 for d in message.descriptors
    )
    assert (read is not None) == units_known
    if read is not None:
        assert read == convert.request(message)


@settings(max_examples=1_000, deadline=None)
@given(_requests(), st.data())
def test_altered_bytes_are_read_as_protobuf_reads_them_or_left_to_it(
    message: RateLimitRequest, data: st.DataObject
) -> None:
    """Bytes cut short, changed, or with fields added (unknown ones, repeated ones, other wire
    types) are either read exactly as protobuf reads them or left to protobuf (None); never read
    differently."""
    body = bytearray(message.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        edit = data.draw(st.sampled_from(["cut", "flip", "insert", "append"]))
        at = data.draw(st.integers(0, len(body)))
        if edit == "cut":
            del body[at:]
        elif edit == "flip" and at < len(body):
            body[at] = data.draw(st.integers(0, 255))
        elif edit == "insert":
            body[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            body += data.draw(
                st.sampled_from(
                    [
                        b"\x0a\x01x",
                        b"\x18\x05",
                        b"\x20\x01",
                        b"\x12\x02\x20\x01",
                        b"\x12\x02\x20\x00",
                        b"\x12\x0b\x20" + b"\x80" * 9 + b"\x02",
                        b"\x12\x04\x20\x01\x20\x00",
                    ]
                )
                | st.binary(max_size=6)
            )
    read = convert.request_bytes(bytes(body))
    if read is not None:
        assert read == _by_protobuf(bytes(body))


def test_the_usual_request_is_read_from_its_bytes() -> None:
    """What Envoy sends for a route's descriptors (entries only, a request hits_addend) is read
    without protobuf; a repeated domain keeps its last value, as protobuf does."""
    message = RateLimitRequest(domain="gateway", hits_addend=1)
    message.descriptors.add().entries.add(key="remote_address", value="10.0.0.1")
    descriptor = message.descriptors.add()
    descriptor.entries.add(key="app", value="shop")
    descriptor.entries.add(key="user", value="u-1")
    body = message.SerializeToString()
    expected = Request(
        "gateway",
        (
            Descriptor((Entry("remote_address", "10.0.0.1"),)),
            Descriptor((Entry("app", "shop"), Entry("user", "u-1"))),
        ),
        1,
    )
    assert convert.request_bytes(body) == expected
    assert convert.request_bytes(b"\x0a\x01x" + body) == expected


@pytest.mark.parametrize(
    ("field", "negative"),
    [
        pytest.param(b"\x20\x01", True, id="true"),
        pytest.param(b"\x20\x00", False, id="false"),
        pytest.param(b"\x20\x80\x80\x80\x80\x10", True, id="true-as-a-wide-varint"),
        pytest.param(b"\x20\x01\x20\x00", False, id="the-last-one-counts"),
    ],
)
def test_is_negative_hits_is_read_from_the_bytes_as_protobuf_reads_it(
    field: bytes, negative: bool
) -> None:
    """Field 4 of a descriptor, Envoy 1.38's `is_negative_hits` (a refund), is read without
    protobuf, any varint true when not 0 and the last one sent counting; protobuf, with the
    messages of `sidecar.rls.messages`, reads the same."""
    entry = b"\x0a\x06\x0a\x01k\x12\x01v"
    hits = b"\x1a\x02\x08\x03"
    descriptor = entry + hits + field
    body = b"\x0a\x01d\x12" + bytes((len(descriptor),)) + descriptor
    expected = Request("d", (Descriptor((Entry("k", "v"),), 3, None, negative),))
    assert convert.request_bytes(body) == expected
    assert convert.request(RateLimitRequest.FromString(body)) == expected


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\x0a\x02d", id="string-past-the-end"),
        pytest.param(b"\x0a\x02\xff\xfe", id="domain-not-utf8"),
        pytest.param(b"\x12\x03\x0a\x01\x0a", id="entry-past-its-descriptor"),
        pytest.param(b"\x18" + b"\xff" * 10 + b"\x01", id="varint-over-ten-bytes"),
        pytest.param(b"\x22\x00", id="unknown-field"),
        pytest.param(b"\x12\x04\x1a\x00\x1a\x00", id="hits_addend-twice"),
        pytest.param(b"\x12\x04\x12\x02\x10\x08", id="override-unit-unknown"),
        pytest.param(b"\x08\x01", id="domain-as-varint"),
    ],
)
def test_what_is_not_the_usual_encoding_is_left_to_protobuf(body: bytes) -> None:
    """Malformed bytes, unknown fields, a message field sent twice and an override the model
    lacks are not read here (None)."""
    assert convert.request_bytes(body) is None


@pytest.mark.parametrize("wide", [(1 << 32) + 5, (1 << 64) - 1])
def test_a_number_wider_than_its_field_is_left_to_protobuf(wide: int) -> None:
    """A uint32 field sent as a wider varint (the request's or a descriptor's hits_addend) is
    left to protobuf, which keeps the low 32 bits of one and not of the other."""
    number = convert.varint(wide)
    wrapped = b"\x08" + number
    descriptor = b"\x12" + bytes((len(wrapped) + 2,)) + b"\x1a" + bytes((len(wrapped),)) + wrapped
    assert convert.request_bytes(b"\x0a\x01d\x18" + number) is None
    assert convert.request_bytes(b"\x0a\x01d" + descriptor) is None
    assert convert.request_bytes(b"\x0a\x01d\x18\x05" + descriptor) is None
