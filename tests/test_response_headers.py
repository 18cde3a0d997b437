"""The reference's response headers and dynamic metadata (`serve --response-headers`,
`--response-dynamic-metadata`; LIMIT_RESPONSE_HEADERS_ENABLED and RESPONSE_DYNAMIC_METADATA), as
REFERENCE.md 2.11 and 2.12 describe them: which status the headers report, on OK answers too;
the metadata's fields and how the rules' `metadata` maps merge; and how both sit beside
`--response-limit-name` in one answer. Through the real limiter on the memory backend, with the
test clock, and on hand-made decisions for the selection rule.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from envoy.service.ratelimit.v3.rls_pb2 import (  # type: ignore[import-untyped]
    RateLimitRequest,
    RateLimitResponse,
)
from google.protobuf import json_format  # type: ignore[import-untyped]
from support.clock import Clock

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
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
from sidecar.rls.extras import (
    Extras,
    HeaderNames,
    header_status,
    merge_metadata,
    rate_limit_headers,
)
from sidecar.rls.service import service
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: web
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10, name: per-user}
    metadata: {service: {name: users, tier: gold}, owner: team-a}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 2}
    metadata: {service: {name: paths, region: eu}, owner: team-b, flags: [1, true, null]}
  - key: free
    rate_limit: {unlimited: true}
    metadata: {owner: never-returned}
  - key: quota
    quota_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
"""

HEADERS = HeaderNames()


def headers_of(message: RateLimitResponse) -> list[tuple[str, str]]:
    return [(h.key, h.value) for h in message.response_headers_to_add]


def metadata_of(message: RateLimitResponse) -> dict[str, Any]:
    found: dict[str, Any] = json_format.MessageToDict(message.dynamic_metadata)
    return found


class Served:
    """A RateLimitService on RULES (memory backend, the test clock) with `extras`."""

    def __init__(self, extras: Extras, clock: Clock) -> None:
        domain = config.parse(RULES, "rules.yaml")
        self.backend = MemoryBackend()
        limiter = Limiter(Rules({domain.name: domain}), self.backend, clock=clock)
        self.service = service(limiter, extras)

    async def call(self, *descriptors: list[tuple[str, str]], hits_addend: int = 0) -> Any:
        message = RateLimitRequest(domain="web", hits_addend=hits_addend)
        for entries in descriptors:
            added = message.descriptors.add()
            for key, value in entries:
                added.entries.add(key=key, value=value)
        answered: asyncio.Future[bytes | Exception] = asyncio.get_running_loop().create_future()
        self.service.should_rate_limit(message.SerializeToString(), answered.set_result)
        answer = await answered
        assert isinstance(answer, bytes), answer
        return RateLimitResponse.FromString(answer)


@pytest.fixture
def serve() -> Callable[..., Served]:
    def make(clock: Clock | None = None, **extras: Any) -> Served:
        return Served(Extras(**extras), clock or Clock())

    return make


# --- Headers ----------------------------------------------------------------------------------


async def test_the_reference_example_a_10_per_minute_descriptor_over_limit(
    serve: Callable[..., Served],
) -> None:
    """A 10/min descriptor over its limit at now % 60 = 2 gives RateLimit-Limit: 10,
    RateLimit-Remaining: 0, RateLimit-Reset: 58 (the reference's own test)."""
    clock = Clock()
    clock.now = clock.now - clock.now % 60 + 2
    served = serve(clock, headers=HEADERS)
    answers = [await served.call([("user", "alice")]) for _ in range(11)]
    assert answers[-1].overall_code == RateLimitResponse.OVER_LIMIT
    assert headers_of(answers[-1]) == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", "58"),
    ]


async def test_an_ok_answer_carries_the_headers_too(serve: Callable[..., Served]) -> None:
    """The headers come with every answer that has a limit, OK ones included: the first call
    of a 10/min window 5 s into it leaves 9, and the window resets in 55 s."""
    clock = Clock()  # 5 s into the minute
    served = serve(clock, headers=HEADERS)
    answer = await served.call([("user", "bob")])
    assert answer.overall_code == RateLimitResponse.OK
    assert headers_of(answer) == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "9"),
        ("RateLimit-Reset", "55"),
    ]


async def test_no_descriptor_with_a_current_limit_gives_no_headers(
    serve: Callable[..., Served],
) -> None:
    """A descriptor no rule matches and an unlimited one report no `current_limit`: the answer
    has no headers at all."""
    served = serve(headers=HEADERS)
    answer = await served.call([("nobody", "x")], [("free", "y")])
    assert answer.overall_code == RateLimitResponse.OK
    assert headers_of(answer) == []


async def test_the_header_names_are_the_configured_ones(serve: Callable[..., Served]) -> None:
    """LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER and LIMIT_RESET_HEADER rename the headers."""
    served = serve(headers=HeaderNames("X-Limit", "X-Left", "X-Reset"))
    answer = await served.call([("user", "carol")])
    assert [key for key, _ in headers_of(answer)] == ["X-Limit", "X-Left", "X-Reset"]


MINUTE = single(10, Unit.MINUTE, rule_key="d.m")
HOUR = single(100, Unit.HOUR, rule_key="d.h")
QUOTA = single(1, Unit.SECOND, quota_mode=True, rule_key="d.q")
SHADOW = single(5, Unit.DAY, shadow_mode=True, rule_key="d.s")
FREE = single(0, Unit.SECOND, unlimited=True, rule_key="d.f")


def status(limit: Any, code: Code, remaining: int, reset: int = 7) -> DescriptorStatus:
    return DescriptorStatus(
        code, limit, remaining, reset, None if limit is None else limit.windows[0]
    )


def test_the_least_remaining_wins_and_a_tie_keeps_the_first() -> None:
    """Among the statuses with a `current_limit`, the one with strictly the least
    `limit_remaining` is chosen; an equal one later does not replace it."""
    first = status(HOUR, Code.OK, 3)
    statuses = [
        status(None, Code.OK, 0),
        status(MINUTE, Code.OK, 8),
        first,
        status(MINUTE, Code.OK, 3),
    ]
    assert header_status(statuses) is first


def test_a_blocking_over_limit_descriptor_wins_and_the_last_such_one() -> None:
    """A non-quota OVER_LIMIT status replaces the choice whatever its remaining, and a later one
    replaces it again; a status after it with 0 remaining does not."""
    last = status(HOUR, Code.OVER_LIMIT, 0)
    statuses = [
        status(MINUTE, Code.OVER_LIMIT, 0),
        last,
        status(MINUTE, Code.OK, 0),
    ]
    assert header_status(statuses) is last


def test_a_quota_descriptor_over_limit_is_chosen_only_by_its_remaining() -> None:
    """An OVER_LIMIT quota descriptor does not take the choice as a blocking one does: it is
    chosen when it has the least remaining, and a blocking OVER_LIMIT after it still wins."""
    quota = status(QUOTA, Code.OVER_LIMIT, 0)
    assert header_status([status(MINUTE, Code.OK, 4), quota]) is quota
    over = status(MINUTE, Code.OVER_LIMIT, 0)
    assert header_status([quota, over]) is over
    # A shadowed descriptor over its limit answers OK with 0 left: chosen by its remaining only.
    shadow = status(SHADOW, Code.OK, 0)
    assert header_status([shadow, status(HOUR, Code.OK, 0)]) is shadow


def test_unlimited_and_ruleless_statuses_are_never_chosen() -> None:
    """No rule, or an unlimited one (whose remaining is MaxUint32), never gives the headers."""
    statuses = [status(None, Code.OK, 0), status(FREE, Code.OK, UNLIMITED_REMAINING)]
    assert header_status(statuses) is None
    assert rate_limit_headers(Decision(Code.OK, tuple(statuses)), HEADERS) == b""


# --- Dynamic metadata -------------------------------------------------------------------------


async def test_dynamic_metadata_carries_the_request_and_the_passed_rules_metadata(
    serve: Callable[..., Served],
) -> None:
    """`domain`, every descriptor's entries as "key=value", the request's `hitsAddend` (not 0),
    and the `metadata` of the rules whose descriptors were not OVER_LIMIT, merged in request
    order: the first value of a key wins, and maps merge key by key."""
    served = serve(dynamic_metadata=True)
    answer = await served.call([("user", "dave")], [("path", "/a")], hits_addend=1)
    assert metadata_of(answer) == {
        "domain": "web",
        "descriptors": [{"entries": ["user=dave"]}, {"entries": ["path=/a"]}],
        "hitsAddend": 1.0,
        "metadata": {
            "service": {"name": "users", "tier": "gold", "region": "eu"},
            "owner": "team-a",
            "flags": [1.0, True, None],
        },
    }


async def test_an_over_limit_descriptor_adds_no_metadata(serve: Callable[..., Served]) -> None:
    """Once `path` is over its limit, only `user`'s metadata is merged; the request's own
    `hitsAddend` is left out when 0, and a rule without `metadata` adds nothing."""
    served = serve(dynamic_metadata=True)
    for _ in range(2):
        await served.call([("path", "/b")])
    answer = await served.call([("path", "/b")], [("user", "erin")], [("quota", "q")])
    assert answer.statuses[0].code == RateLimitResponse.OVER_LIMIT
    fields = metadata_of(answer)
    assert "hitsAddend" not in fields
    assert fields["metadata"] == {"service": {"name": "users", "tier": "gold"}, "owner": "team-a"}


async def test_no_passed_metadata_leaves_the_field_out(serve: Callable[..., Served]) -> None:
    """Without a rule's metadata to merge (no rule; unlimited rules report none), `metadata` is
    absent while `domain` and `descriptors` are still there."""
    served = serve(dynamic_metadata=True)
    answer = await served.call([("free", "z")], [("nobody", "n")])
    assert metadata_of(answer) == {
        "domain": "web",
        "descriptors": [{"entries": ["free=z"]}, {"entries": ["nobody=n"]}],
    }


def test_a_descriptors_override_and_own_hits_addend_are_reported() -> None:
    """A descriptor's `limit` override is its text form and its own `hits_addend` is reported
    when Envoy set it, 0 included."""
    request = Request(
        "d",
        (
            Descriptor((Entry("a", "1"), Entry("b", "")), 0, Override(42, Unit.HOUR)),
            Descriptor((Entry("c", "2"),), None, Override(3, Unit.WEEK)),
        ),
    )
    body = Extras(dynamic_metadata=True).encode(request, Decision(Code.OK, ()))
    fields = metadata_of(RateLimitResponse.FromString(body))
    assert fields["descriptors"] == [
        {"entries": ["a=1", "b="], "limit": "requests_per_unit:42 unit:HOUR", "hitsAddend": 0.0},
        {"entries": ["c=2"], "limit": "requests_per_unit:3 unit:7"},
    ]


def test_merging_keeps_the_first_value_and_never_changes_the_rules_maps() -> None:
    """A key already present keeps its value (a map under it merges with a later map); the
    rules' own maps are left as they were."""
    first = {"a": 1, "m": {"x": 1}}
    second = {"a": 2, "b": 3, "m": {"x": 2, "y": 2}}
    merged: dict[str, object] = {}
    merge_metadata(merged, first)
    merge_metadata(merged, second)
    assert merged == {"a": 1, "b": 3, "m": {"x": 1, "y": 2}}
    assert first == {"a": 1, "m": {"x": 1}}


# --- Beside --response-limit-name, and the JSON endpoint --------------------------------------


def _top_level_fields(body: bytes) -> list[int]:
    """The field numbers of a message's top-level fields, in wire order."""
    numbers, at = [], 0
    while at < len(body):
        key, at = _read_varint(body, at)
        numbers.append(key >> 3)
        kind = key & 7
        if kind == 0:
            _, at = _read_varint(body, at)
        elif kind == 2:
            size, at = _read_varint(body, at)
            at += size
        else:
            raise AssertionError(f"unexpected wire type {kind}")
    return numbers


def _read_varint(body: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


async def test_with_the_limit_name_every_header_and_one_struct(
    serve: Callable[..., Served],
) -> None:
    """With `--response-limit-name` too, an OVER_LIMIT answer has the three headers then
    `RateLimit-Policy`, and one `dynamic_metadata` Struct holding the reference's fields and
    `limit_name`, `limit_quota`, `limit_window`; an OK answer has the three headers and the
    reference's fields only."""
    clock = Clock()
    served = serve(clock, headers=HEADERS, dynamic_metadata=True, limit_name=True)
    ok = await served.call([("path", "/c")])
    assert [key for key, _ in headers_of(ok)] == [
        "RateLimit-Limit",
        "RateLimit-Remaining",
        "RateLimit-Reset",
    ]
    assert set(metadata_of(ok)) == {"domain", "descriptors", "metadata"}
    await served.call([("path", "/c")])
    request = RateLimitRequest(domain="web")
    request.descriptors.add().entries.add(key="path", value="/c")
    answered: asyncio.Future[bytes | Exception] = asyncio.get_running_loop().create_future()
    served.service.should_rate_limit(request.SerializeToString(), answered.set_result)
    body = await answered
    assert isinstance(body, bytes)
    assert _top_level_fields(body).count(6) == 1
    over = RateLimitResponse.FromString(body)
    assert over.overall_code == RateLimitResponse.OVER_LIMIT
    assert headers_of(over) == [
        ("RateLimit-Limit", "2"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", str(3600 - int(clock.now) % 3600)),
        ("RateLimit-Policy", '"web.path";q=2;w=3600'),
    ]
    assert metadata_of(over) == {
        "domain": "web",
        "descriptors": [{"entries": ["path=/c"]}],
        "limit_name": "web.path",
        "limit_quota": 2.0,
        "limit_window": 3600.0,
    }


async def test_the_json_endpoint_answers_with_the_same_fields(
    serve: Callable[..., Served],
) -> None:
    """`/json` (`should_rate_limit_json`) carries the headers and the metadata as gRPC does, in
    proto3 JSON."""
    served = serve(headers=HEADERS, dynamic_metadata=True)
    body = json.dumps(
        {"domain": "web", "descriptors": [{"entries": [{"key": "user", "value": "f"}]}]}
    )
    code, text = await served.service.should_rate_limit_json(body.encode())
    answer = json.loads(text)
    assert code == Code.OK
    assert answer["responseHeadersToAdd"] == [
        {"key": "RateLimit-Limit", "value": "10"},
        {"key": "RateLimit-Remaining", "value": "9"},
        {"key": "RateLimit-Reset", "value": "55"},
    ]
    assert answer["dynamicMetadata"]["domain"] == "web"
    assert answer["dynamicMetadata"]["metadata"]["owner"] == "team-a"


async def test_without_extras_the_answer_is_the_plain_one(serve: Callable[..., Served]) -> None:
    """With every option off, the answer is `response_bytes` of the decision: no header, no
    metadata."""
    served = serve()
    answer = await served.call([("user", "gina")])
    assert headers_of(answer) == [] and not answer.HasField("dynamic_metadata")
