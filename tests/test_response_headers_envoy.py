"""The reference's response headers reach the client through the real Envoy: with
`--response-headers` Envoy adds RateLimit-Limit, RateLimit-Remaining and RateLimit-Reset to
every response, 200s included; with `--response-limit-name` too, the 429 also has
RateLimit-Policy; and with `--response-dynamic-metadata` Envoy's access log reads the
reference's fields (`domain`, `metadata`) under its rate limit filter's name."""

from __future__ import annotations

from pathlib import Path

from test_limit_name_envoy import three_calls_through_envoy

RULES = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 2, name: per-client-hourly}
        metadata: {backend: {name: primary}}
"""
#: Per request: status, then the domain, the merged rules' metadata and the limit's name.
LOG_FORMAT = (
    "%RESPONSE_CODE% domain=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:domain)% "
    "backend=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:metadata:backend:name)% "
    "name=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_name)%\n"
)


def test_the_reference_headers_and_metadata_reach_the_client_and_the_access_log(
    envoy_binary: str, tmp_path: Path
) -> None:
    """Two requests of one client pass with RateLimit-Remaining 1 then 0; the third gets 429
    with Remaining 0 and RateLimit-Policy; Reset counts the seconds to the hour's end. The access
    log shows the domain on every request, the passing rule's metadata on the 200s only, and
    the limit's name on the 429 only."""
    flags = ["--response-headers", "--response-dynamic-metadata", "--response-limit-name"]
    responses, lines, ended = three_calls_through_envoy(
        envoy_binary, tmp_path, RULES, flags, LOG_FORMAT
    )
    assert [r.status for r in responses] == [200, 200, 429]
    assert [r.headers["ratelimit-limit"] for r in responses] == ["2", "2", "2"]
    assert [r.headers["ratelimit-remaining"] for r in responses] == ["1", "0", "0"]
    for response in responses:
        reset = int(response.headers["ratelimit-reset"])
        assert 0 < reset <= 3600 and abs(reset - (3600 - ended % 3600)) < 5
    assert "ratelimit-policy" not in responses[0].headers
    assert responses[2].headers["ratelimit-policy"] == '"per-client-hourly";q=2;w=3600'
    assert lines == [
        "200 domain=gateway backend=primary name=-",
        "200 domain=gateway backend=primary name=-",
        "429 domain=gateway backend=- name=per-client-hourly",
    ]


#: Two descriptors per request on /api/orders: the client's, 2 an hour, and the user's on the
#: orders interface, 100 a day.
TWO_UNITS = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 2}
      - key: user
        descriptors:
          - key: interface
            value: orders
            rate_limit: {unit: day, requests_per_unit: 100}
"""


def test_every_descriptors_limit_and_remaining_reach_the_client(
    envoy_binary: str, tmp_path: Path
) -> None:
    """With `--response-headers-all-descriptors` (the reference's
    LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED) each response carries ratelimit-limit-hours and
    ratelimit-remaining-hours of the hourly descriptor and ratelimit-limit-days and
    ratelimit-remaining-days of the daily one, the 429 too, and none of the closest
    descriptor's three headers."""
    responses, _, _ = three_calls_through_envoy(
        envoy_binary,
        tmp_path,
        TWO_UNITS,
        ["--response-headers-all-descriptors"],
        request_headers={"x-user-id": "alice"},
    )
    assert [r.status for r in responses] == [200, 200, 429]
    names = ("ratelimit-limit-hours", "ratelimit-remaining-hours")
    assert [tuple(r.headers[name] for name in names) for r in responses] == [
        ("2", "1"),
        ("2", "0"),
        ("2", "0"),
    ]
    names = ("ratelimit-limit-days", "ratelimit-remaining-days")
    assert [tuple(r.headers[name] for name in names) for r in responses] == [
        ("100", "99"),
        ("100", "98"),
        ("100", "97"),
    ]
    for response in responses:
        assert "ratelimit-limit" not in response.headers
        assert "ratelimit-reset" not in response.headers
