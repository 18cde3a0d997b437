"""The reference's response headers and dynamic metadata over real gRPC, on both transports (the
sidecar's own HTTP/2 server and grpc.aio), with `--response-limit-name` beside them: the app as
`serve` builds it from its options, a grpc.aio client over a loopback socket."""

from __future__ import annotations

from pathlib import Path

from envoy.service.ratelimit.v3.rls_pb2 import RateLimitResponse
from google.protobuf import json_format
from support.sidecars import client, request, running_app, write_rules

RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2, name: per-user}
    metadata: {backend: {name: users}}
  - key: app
    rate_limit: {unit: hour, requests_per_unit: 100}
    metadata: {backend: {name: apps, pool: b}}
"""


async def test_both_transports_answer_with_headers_metadata_and_the_limit_name(
    tmp_path: Path, transport: str
) -> None:
    """OK answers carry RateLimit-Limit/Remaining/Reset of the descriptor with the least left
    and the reference's dynamic metadata; the OVER_LIMIT answer reports the refusing limit in
    the three headers, adds RateLimit-Policy, and has one Struct with both sets of fields. The
    test clock is 30 s into a minute, so the minute window resets in 30 s."""
    rules = write_rules(tmp_path, RULES)
    options = {
        "response_headers": True,
        "response_dynamic_metadata": True,
        "response_limit_name": True,
    }
    call = request("test", [("user", "u")], [("app", "a")])
    async with (
        running_app(rules, transport=transport, **options) as app,
        client(app.grpc_port) as rls,
    ):
        answers = [await rls.should_rate_limit(call) for _ in range(3)]

    codes = [a.overall_code for a in answers]
    assert codes == [RateLimitResponse.OK, RateLimitResponse.OK, RateLimitResponse.OVER_LIMIT]
    headers = [[(h.key, h.value) for h in a.response_headers_to_add] for a in answers]
    assert headers == [
        [("RateLimit-Limit", "2"), ("RateLimit-Remaining", "1"), ("RateLimit-Reset", "30")],
        [("RateLimit-Limit", "2"), ("RateLimit-Remaining", "0"), ("RateLimit-Reset", "30")],
        [
            ("RateLimit-Limit", "2"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "30"),
            ("RateLimit-Policy", '"per-user";q=2;w=60'),
        ],
    ]
    metadata = [json_format.MessageToDict(a.dynamic_metadata) for a in answers]
    descriptors = [{"entries": ["user=u"]}, {"entries": ["app=a"]}]
    assert metadata[0] == {
        "domain": "test",
        "descriptors": descriptors,
        "metadata": {"backend": {"name": "users", "pool": "b"}},
    }
    assert metadata[2] == {
        "domain": "test",
        "descriptors": descriptors,
        "metadata": {"backend": {"name": "apps", "pool": "b"}},
        "limit_name": "per-user",
        "limit_quota": 2.0,
        "limit_window": 60.0,
    }


async def test_both_transports_answer_plainly_with_the_options_off(
    tmp_path: Path, transport: str
) -> None:
    """Without the options an answer has neither headers nor dynamic metadata."""
    rules = write_rules(tmp_path, RULES)
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        answer = await rls.should_rate_limit(request("test", [("user", "v")]))
    assert list(answer.response_headers_to_add) == []
    assert not answer.HasField("dynamic_metadata")


ALL_UNITS = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: app
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: region
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: internal
    rate_limit: {unlimited: true}
"""


async def test_both_transports_answer_with_every_descriptors_limit_and_remaining(
    tmp_path: Path, transport: str
) -> None:
    """With `response_headers_all_descriptors` (the reference's
    LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED, PR #1190) every answer, OVER_LIMIT too, carries
    ratelimit-limit-<unit>s and ratelimit-remaining-<unit>s of each descriptor with a limit, in
    request order (two of one unit give the names twice), and nothing for a descriptor with no
    rule or an unlimited one. It replaces the closest descriptor's three headers, which
    `response_headers` also asks for, as the reference's setting does."""
    rules = write_rules(tmp_path, ALL_UNITS)
    call = request(
        "test", [("user", "u")], [("nothing", "x")], [("app", "a")], [("internal", "i")],
        [("region", "r")],
    )  # fmt: skip
    options = {"response_headers_all_descriptors": True, "response_headers": True}
    async with (
        running_app(rules, transport=transport, **options) as app,
        client(app.grpc_port) as rls,
    ):
        answers = [await rls.should_rate_limit(call) for _ in range(3)]

    codes = [a.overall_code for a in answers]
    assert codes == [RateLimitResponse.OK, RateLimitResponse.OK, RateLimitResponse.OVER_LIMIT]
    headers = [[(h.key, h.value) for h in a.response_headers_to_add] for a in answers]
    assert headers == [
        [
            ("ratelimit-limit-minutes", "2"),
            ("ratelimit-remaining-minutes", str(max(0, 2 - n))),
            ("ratelimit-limit-hours", "100"),
            ("ratelimit-remaining-hours", str(100 - n)),
            ("ratelimit-limit-minutes", "10"),
            ("ratelimit-remaining-minutes", str(10 - n)),
        ]
        for n in (1, 2, 3)
    ]
