"""The frequency-cap API end to end, over real sockets: JSON on the HTTP port (exact shapes and
errors) and `ratelimit_sidecar.frequency.v1.FrequencyCaps` on the gRPC port, on both gRPC
transports, beside Envoy's ShouldRateLimit and sharing its counters."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitResponse
from support.sidecars import Clock, client, request, running_app, write_rules

from sidecar.algorithms.decide import Address, State
from sidecar.errors import StorageError
from sidecar.frequency.service import CHECK_ADS, RECORD_IMPRESSIONS
from sidecar.model import Dedupe, Hit
from sidecar.proto.ratelimit_sidecar.frequency.v1 import frequency_pb2 as pb
from sidecar.runner.app import TRANSPORTS, App
from sidecar.storage.base import Applied
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 5}
      - key: ad
        value: a2
        rate_limit: {unit: minute, unit_multiplier: 2, requests_per_unit: 1}
      - key: campaign
        rate_limit: {unit: day, requests_per_unit: 10}
"""

PLAIN = """\
domain: plain
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
"""

#: 5,120 s before the end of a UTC day, 40 s into an even minute.
NOW = 19_675 * 86_400 + 81_280.0

#: Caps as ad servers run them: per device with a cooldown, a click cap, a lifetime cap to a
#: flight's end and a window from the first event; and per person, across identifiers.
PEOPLE = f"""\
domain: people
descriptors:
  - key: device
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {{unit: day, requests_per_unit: 4}}
          - {{algorithm: cooldown, unit: minute, unit_multiplier: 10}}
        descriptors:
          - key: event
            value: click
            rate_limit: {{unit: day, requests_per_unit: 1}}
      - key: ad
        value: onboarding
        rate_limit: {{algorithm: lifetime, requests_per_unit: 2, ends: {int(NOW) + 864_000}}}
      - key: ad
        value: trial
        rate_limit: {{algorithm: first_event, unit: hour, unit_multiplier: 24, requests_per_unit: 1}}
  - key: person
    identifiers: [user, device, cookie]
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {{unit: day, requests_per_unit: 3}}
"""
#: One person: a login, a phone, a cookie.
PERSON = {"user": "u1", "device": "d1", "cookie": "c1"}


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    write_rules(tmp_path, RULES, "ads.yaml")
    write_rules(tmp_path, PLAIN, "plain.yaml")
    write_rules(tmp_path, PEOPLE, "people.yaml")
    return tmp_path


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def app(rules: Path, transport: str) -> AsyncIterator[App]:
    async with running_app(rules, clock=Clock(NOW), transport=transport) as running:
        yield running


@pytest.fixture
async def http(rules: Path) -> AsyncIterator[aiohttp.ClientSession]:
    async with (
        running_app(rules, clock=Clock(NOW)) as running,
        aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session,
    ):
        yield session


async def post(http: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    # A stream, as aiohttp wants for large bodies.
    async with http.post(path, data=io.BytesIO(data)) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


CHECK = {"domain": "ads", "user": "u1", "ads": [{"ad": "a1", "campaign": "c1"}, {"ad": "a2"}]}


async def test_http_check_and_record_answer_the_documented_json(
    http: aiohttp.ClientSession,
) -> None:
    """Record answers one result per impression, a repeat as a duplicate; check answers one verdict
    per ad in request order, remaining and reset from the most restrictive window."""
    status, recorded = await post(
        http,
        "/v1/caps/record",
        {
            "domain": "ads",
            "impressions": [
                {"id": "imp-1", "user": "u1", "ad": "a1", "campaign": "c1"},
                {"id": "imp-2", "user": "u1", "ad": "a2"},
            ],
        },
    )
    assert (status, recorded) == (
        200,
        {"results": [{"id": "imp-1", "counted": True}, {"id": "imp-2", "counted": True}]},
    )
    again = {"domain": "ads", "impressions": [{"id": "imp-1", "user": "u1", "ad": "a1"}]}
    assert await post(http, "/v1/caps/record", again) == (
        200,
        {"results": [{"id": "imp-1", "counted": False, "duplicate": True}]},
    )
    assert await post(http, "/v1/caps/check", CHECK) == (
        200,
        {
            "ads": [
                {"ad": "a1", "allowed": True, "remaining": 4, "reset_seconds": 5120},
                {"ad": "a2", "allowed": False, "remaining": 0, "reset_seconds": 80},
            ]
        },
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            b"{",
            "body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (b"\xff", "body is not UTF-8 (invalid start byte)"),
        ([], "body must be a JSON object"),
        ({"domain": "ads", "ads": []}, "user is missing"),
        ({"domain": "ads", "user": 7, "ads": []}, "user must be a string, got 7"),
        ({"domain": "ads", "user": "u1"}, "ads must be a list"),
        ({"domain": "ads", "user": "u1", "ads": ["a1"]}, "ads[0] must be a JSON object"),
        (
            {"domain": "ads", "user": "u1", "ads": [{"ad": "a1", "campain": "c1"}]},
            "ads[0]: unknown field 'campain' (did you mean 'campaign'?)",
        ),
        (
            {"domain": "ads", "user": "u1", "ads": [{"ad": "a1", "campaign": ""}]},
            "ads[0].campaign must not be empty (leave it out for none)",
        ),
        ({"domain": "ads", "user": "", "ads": []}, "user must be a non-empty string"),
        (
            {"domain": "ads", "user": "u1", "ads": [{"ad": f"a{i}"} for i in range(101)]},
            "too many ads: 101 (at most 100 per check)",
        ),
    ],
)
async def test_http_check_refuses_bad_bodies_with_400_and_the_reason(
    http: aiohttp.ClientSession, body: Any, reason: str
) -> None:
    """A body that is not the documented object answers 400 with {"error": reason}."""
    assert await post(http, "/v1/caps/check", body) == (400, {"error": reason})


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 50_000 + b"]" * 50_000, "body is not JSON this service reads: nested too deeply"),
        (
            b'{"domain": "ads", "user": ' + b"9" * 5_000 + b"}",
            "body is not JSON this service reads: Exceeds the limit (4300 digits) for integer "
            "string conversion: value has 5000 digits; use sys.set_int_max_str_digits() to "
            "increase the limit",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/caps/check", "/v1/caps/record"])
async def test_json_nested_too_deep_or_with_a_huge_integer_is_a_400(
    http: aiohttp.ClientSession, path: str, body: bytes, reason: str
) -> None:
    """JSON nested 50,000 deep, or with a 5,000-digit integer, answers 400 with the reason
    (it used to be a 500 from the parser's RecursionError or ValueError)."""
    assert await post(http, path, body) == (400, {"error": reason})


@pytest.mark.parametrize(
    ("impression", "reason"),
    [
        ({"user": "u1", "ad": "a1"}, "impressions[0].id is missing"),
        ({"id": "", "user": "u1", "ad": "a1"}, "impressions[0].id must be a non-empty string"),
        (
            {"id": "x" * 129, "user": "u1", "ad": "a1"},
            "impressions[0].id is too long (at most 128 bytes)",
        ),
        (
            {"id": "a\u0000b", "user": "u1", "ad": "a1"},
            "impressions[0].id must be printable text (no control characters)",
        ),
        ({"id": "i", "user": "u1"}, "impressions[0].ad is missing"),
    ],
)
async def test_http_record_refuses_bad_impressions_with_400(
    http: aiohttp.ClientSession, impression: dict[str, Any], reason: str
) -> None:
    """A bad impression refuses the batch with 400 and the reason."""
    body = {"domain": "ads", "impressions": [impression]}
    assert await post(http, "/v1/caps/record", body) == (400, {"error": reason})


async def test_http_identities_events_cooldowns_and_anchored_windows(
    http: aiohttp.ClientSession,
) -> None:
    """In JSON: impressions named by a cookie or a phone count on the person's cap for a check
    naming all three identifiers; a click counts on the click cap only; the phone's cooldown
    answers the seconds until allowed; the lifetime cap resets at the flight's end and the
    window from the first event 24 hours after it."""
    impressions = [
        {"id": "i1", "ad": "a1", "identities": {"cookie": "c1"}},
        {"id": "k1", "ad": "a1", "event": "click", "identities": {"device": "d1"}},
        {"id": "o1", "ad": "onboarding", "identities": {"device": "d1"}},
        {"id": "t1", "ad": "trial", "identities": {"device": "d1"}},
    ]
    status, recorded = await post(
        http, "/v1/caps/record", {"domain": "people", "impressions": impressions}
    )
    assert (status, [r["counted"] for r in recorded["results"]]) == (200, [True] * 4)
    check = {
        "domain": "people",
        "identities": PERSON,
        "ads": [{"ad": "a1"}, {"ad": "onboarding"}, {"ad": "trial"}],
    }
    assert await post(http, "/v1/caps/check", check) == (
        200,
        {
            "ads": [
                # The phone's cooldown admits one (its 600 s would start), the person has 2.
                {"ad": "a1", "allowed": True, "remaining": 1, "reset_seconds": 600},
                {"ad": "onboarding", "allowed": True, "remaining": 1, "reset_seconds": 864_000},
                {"ad": "trial", "allowed": False, "remaining": 0, "reset_seconds": 86_400},
            ]
        },
    )
    clicks = {**check, "event": "click", "ads": [{"ad": "a1"}]}
    assert await post(http, "/v1/caps/check", clicks) == (
        200,
        {"ads": [{"ad": "a1", "allowed": False, "remaining": 0, "reset_seconds": 5_120}]},
    )
    again = {"domain": "people", "impressions": [{"id": "i2", "ad": "a1", "user": "u1"}]}
    again["impressions"][0]["identities"] = {"device": "d1"}
    assert (await post(http, "/v1/caps/record", again))[0] == 200
    assert await post(http, "/v1/caps/check", {**check, "ads": [{"ad": "a1"}]}) == (
        200,
        {"ads": [{"ad": "a1", "allowed": False, "remaining": 0, "reset_seconds": 600}]},
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            {"domain": "people", "identities": {"email": "x@y"}, "ads": []},
            "identities.email: unknown identifier kind 'email' (the rules declare: cookie, "
            "device, user)",
        ),
        (
            {"domain": "people", "identities": {"device": 7}, "ads": []},
            "identities.device must be a string, got 7",
        ),
        (
            {"domain": "people", "identities": ["device"], "ads": []},
            "identities must be a JSON object of identifier kind to value",
        ),
        (
            {"domain": "people", "identities": {f"k{n}": "v" for n in range(9)}, "ads": []},
            "identities: too many identifiers: 9 (at most 8)",
        ),
        (
            {"domain": "people", "identities": PERSON, "ads": [], "event": "like"},
            "event: event 'like' is not declared by the rules of domain 'people' (declare it "
            "with 'key: event' below 'key: ad', or send 'impression')",
        ),
        ({"domain": "people", "ads": []}, "user is missing"),
    ],
)
async def test_http_check_refuses_bad_identities_and_events_with_400(
    http: aiohttp.ClientSession, body: Any, reason: str
) -> None:
    """An unknown identifier kind, a value that is not a string, too many identifiers, an
    event the rules do not declare, or no identifier at all: 400 naming the field."""
    assert await post(http, "/v1/caps/check", body) == (400, {"error": reason})


@pytest.mark.parametrize(
    ("impression", "reason"),
    [
        (
            {"id": "i", "ad": "a1", "identities": {"email": "x@y"}},
            "impressions[1].identities.email: unknown identifier kind 'email' (the rules "
            "declare: cookie, device, user)",
        ),
        (
            {"id": "i", "ad": "a1", "event": "like", "identities": {"device": "d1"}},
            "impressions[1].event: event 'like' is not declared by the rules of domain "
            "'people' (declare it with 'key: event' below 'key: ad', or send 'impression')",
        ),
        (
            {"id": "x" * 129, "ad": "a1", "identities": {"device": "d1"}},
            "impressions[1].id is too long (at most 128 bytes)",
        ),
    ],
)
async def test_http_record_refuses_bad_identities_and_counts_nothing(
    http: aiohttp.ClientSession, impression: dict[str, Any], reason: str
) -> None:
    """A bad impression beside a good one: 400 naming the field, and neither is counted."""
    good = {"id": "good", "ad": "a1", "identities": {"device": "d1"}}
    body = {"domain": "people", "impressions": [good, impression]}
    assert await post(http, "/v1/caps/record", body) == (400, {"error": reason})
    check = {"domain": "people", "identities": {"device": "d1"}, "ads": [{"ad": "a1"}]}
    assert (await post(http, "/v1/caps/check", check))[1]["ads"][0]["remaining"] == 1
    assert (await post(http, "/v1/caps/record", {"domain": "people", "impressions": [good]}))[
        1
    ] == {"results": [{"id": "good", "counted": True}]}


async def test_http_unknown_domains_answer_404(http: aiohttp.ClientSession) -> None:
    """An unknown domain, or a domain without user → ad rules, answers 404 with the reason."""
    assert await post(http, "/v1/caps/check", {**CHECK, "domain": "nope"}) == (
        404,
        {"error": "unknown domain 'nope'"},
    )
    assert await post(http, "/v1/caps/record", {"domain": "plain", "impressions": []}) == (
        404,
        {"error": "domain 'plain' has no frequency caps (add 'key: user' with 'key: ad' below it)"},
    )


async def test_http_body_over_1_mib_answers_413(http: aiohttp.ClientSession) -> None:
    """A body over 1 MiB is refused before it is parsed."""
    status, answer = await post(http, "/v1/caps/record", b" " * (1 << 20 | 1))
    assert (status, answer) == (413, {"error": "body too large: at most 1048576 bytes"})


class _Unavailable(MemoryBackend):
    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        done(StorageError("redis: no answer within 50 ms"))

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        raise StorageError("redis: no answer within 50 ms")

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        raise StorageError("redis: no answer within 50 ms")


async def test_http_a_failing_backend_answers_503(rules: Path) -> None:
    """When the counters cannot be reached the ad server gets 503 and decides for itself."""
    async with (
        running_app(rules, backend=_Unavailable(), clock=Clock(NOW)) as running,
        aiohttp.ClientSession(f"http://127.0.0.1:{running.http_port}") as session,
    ):
        assert await post(session, "/v1/caps/check", CHECK) == (
            503,
            {"error": "counters unavailable: redis: no answer within 50 ms"},
        )


class Caps:
    """CheckAds and RecordImpressions over one real channel, with the generated messages."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.check_ads = channel.unary_unary(
            CHECK_ADS,
            request_serializer=pb.CheckAdsRequest.SerializeToString,
            response_deserializer=pb.CheckAdsResponse.FromString,
        )
        self.record_impressions = channel.unary_unary(
            RECORD_IMPRESSIONS,
            request_serializer=pb.RecordImpressionsRequest.SerializeToString,
            response_deserializer=pb.RecordImpressionsResponse.FromString,
        )


def check_request(*ads: tuple[str, str]) -> pb.CheckAdsRequest:
    return pb.CheckAdsRequest(
        domain="ads", user="u1", ads=[pb.AdCandidate(ad=ad, campaign=c) for ad, c in ads]
    )


async def test_grpc_check_and_record_beside_envoys_service(app: App) -> None:
    """On the gRPC port: RecordImpressions counts once, CheckAds answers per ad, and Envoy's
    ShouldRateLimit on the same descriptor moves the same counter."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        caps = Caps(channel)
        impression = pb.Impression(id="imp-1", user="u1", ad="a1", campaign="c1")
        batch = pb.RecordImpressionsRequest(domain="ads", impressions=[impression, impression])
        recorded = await caps.record_impressions(batch, timeout=10)
        assert [(r.id, r.counted, r.duplicate) for r in recorded.results] == [
            ("imp-1", True, False),
            ("imp-1", False, True),
        ]
        checked = await caps.check_ads(check_request(("a1", "c1"), ("a2", "")), timeout=10)
        assert list(checked.ads) == [
            pb.AdVerdict(ad="a1", allowed=True, remaining=4, reset_seconds=5120),
            pb.AdVerdict(ad="a2", allowed=True, remaining=1, reset_seconds=80),
        ]

    async with client(app.grpc_port) as rls:
        envoy = await rls.should_rate_limit(request("ads", [("user", "u1"), ("ad", "a1")]))
    assert envoy.overall_code == RateLimitResponse.OK
    assert envoy.statuses[0].limit_remaining == 3

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        after = await Caps(channel).check_ads(check_request(("a1", "")), timeout=10)
    assert after.ads[0].remaining == 3


async def test_grpc_identities_events_cooldowns_and_anchored_windows(app: App) -> None:
    """On the gRPC port, the same as in JSON: identities summed for a person, a click cap,
    the cooldown's seconds until allowed, a lifetime and a first-event window."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        caps = Caps(channel)
        impressions = [
            pb.Impression(id="i1", ad="a1", identities={"cookie": "c1"}),
            pb.Impression(id="k1", ad="a1", event="click", identities={"device": "d1"}),
            pb.Impression(id="o1", ad="onboarding", identities={"device": "d1"}),
            pb.Impression(id="t1", ad="trial", identities={"device": "d1"}),
            pb.Impression(id="t1", ad="trial", identities={"device": "d1"}),
        ]
        recorded = await caps.record_impressions(
            pb.RecordImpressionsRequest(domain="people", impressions=impressions), timeout=10
        )
        assert [(r.counted, r.duplicate) for r in recorded.results] == [(True, False)] * 4 + [
            (False, True)
        ]
        ads = [pb.AdCandidate(ad=ad) for ad in ("a1", "onboarding", "trial")]
        checked = await caps.check_ads(
            pb.CheckAdsRequest(domain="people", identities=PERSON, ads=ads), timeout=10
        )
        assert list(checked.ads) == [
            pb.AdVerdict(ad="a1", allowed=True, remaining=1, reset_seconds=600),
            pb.AdVerdict(ad="onboarding", allowed=True, remaining=1, reset_seconds=864_000),
            pb.AdVerdict(ad="trial", allowed=False, remaining=0, reset_seconds=86_400),
        ]
        clicks = await caps.check_ads(
            pb.CheckAdsRequest(domain="people", identities=PERSON, ads=ads[:1], event="click"),
            timeout=10,
        )
        assert list(clicks.ads) == [
            pb.AdVerdict(ad="a1", allowed=False, remaining=0, reset_seconds=5_120)
        ]
        await caps.record_impressions(
            pb.RecordImpressionsRequest(
                domain="people",
                impressions=[pb.Impression(id="i2", ad="a1", identities={"device": "d1"})],
            ),
            timeout=10,
        )
        cooling = await caps.check_ads(
            pb.CheckAdsRequest(domain="people", identities={"device": "d1"}, ads=ads[:1]),
            timeout=10,
        )
        assert list(cooling.ads) == [
            pb.AdVerdict(ad="a1", allowed=False, remaining=0, reset_seconds=600)
        ]


@pytest.mark.parametrize(
    ("message", "details"),
    [
        (
            pb.RecordImpressionsRequest(
                domain="people",
                impressions=[
                    pb.Impression(id="i1", ad="a1", identities={"device": "d1"}),
                    pb.Impression(id="i2", ad="a1", identities={"email": "x@y"}),
                ],
            ),
            "impressions[1].identities.email: unknown identifier kind 'email' (the rules "
            "declare: cookie, device, user)",
        ),
        (
            pb.RecordImpressionsRequest(
                domain="people",
                impressions=[
                    pb.Impression(id="i1", ad="a1", identities={"device": "d1"}),
                    pb.Impression(id="i2", ad="a1", event="like", identities={"device": "d1"}),
                ],
            ),
            "impressions[1].event: event 'like' is not declared by the rules of domain "
            "'people' (declare it with 'key: event' below 'key: ad', or send 'impression')",
        ),
        (
            pb.RecordImpressionsRequest(
                domain="people",
                impressions=[
                    pb.Impression(id="i1", ad="a1", identities={"device": "d1"}),
                    pb.Impression(id="i2", ad="a1", identities={f"k{n}": "v" for n in range(9)}),
                ],
            ),
            "impressions[1].identities: too many identifiers: 9 (at most 8)",
        ),
    ],
)
async def test_grpc_bad_identities_and_events_are_invalid_argument_and_count_nothing(
    app: App, message: pb.RecordImpressionsRequest, details: str
) -> None:
    """A record with an unknown identifier kind, an undeclared event or too many identifiers
    is INVALID_ARGUMENT naming the field, and counts none of its impressions."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        caps = Caps(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await caps.record_impressions(message, timeout=10)
        check = pb.CheckAdsRequest(
            domain="people", identities={"device": "d1"}, ads=[pb.AdCandidate(ad="a1")]
        )
        after = await caps.check_ads(check, timeout=10)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        details,
    )
    assert after.ads[0].remaining == 1  # the cooldown's one: nothing was recorded


@pytest.mark.parametrize(
    ("message", "code", "details"),
    [
        (
            pb.CheckAdsRequest(domain="people", identities={"email": "x@y"}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "identities.email: unknown identifier kind 'email' (the rules declare: cookie, "
            "device, user)",
        ),
        (
            pb.CheckAdsRequest(domain="people", identities=PERSON, event="like"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "event: event 'like' is not declared by the rules of domain 'people' (declare it "
            "with 'key: event' below 'key: ad', or send 'impression')",
        ),
        (
            pb.CheckAdsRequest(domain="nope", user="u1"),
            grpc.StatusCode.NOT_FOUND,
            "unknown domain 'nope'",
        ),
        (
            pb.CheckAdsRequest(domain="ads", user=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "user must be a non-empty string",
        ),
    ],
)
async def test_grpc_errors_carry_their_status_and_reason(
    app: App, message: pb.CheckAdsRequest, code: grpc.StatusCode, details: str
) -> None:
    """An unknown domain is NOT_FOUND, a bad request INVALID_ARGUMENT, each with its reason."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await Caps(channel).check_ads(message, timeout=10)
    assert (info.value.code(), info.value.details()) == (code, details)


async def test_grpc_malformed_bytes_and_a_failing_backend(rules: Path, transport: str) -> None:
    """Bytes that are no message are INVALID_ARGUMENT; a failing backend is UNAVAILABLE."""
    async with (
        running_app(rules, backend=_Unavailable(), transport=transport) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel,
    ):
        raw = channel.unary_unary(RECORD_IMPRESSIONS)
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await raw(b"\xff\xff", timeout=10)
        impression = pb.Impression(id="i", user="u1", ad="a1")
        with pytest.raises(grpc.aio.AioRpcError) as unavailable:
            await Caps(channel).record_impressions(
                pb.RecordImpressionsRequest(domain="ads", impressions=[impression]), timeout=10
            )
    assert malformed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert malformed.value.details().startswith("malformed RecordImpressionsRequest")
    assert unavailable.value.code() is grpc.StatusCode.UNAVAILABLE
