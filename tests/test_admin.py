"""The HTTP endpoints, over a real socket: /json, /healthcheck, /rlconfig and /metrics."""

from __future__ import annotations

import asyncio
import gc
import io
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.sidecars import client, request, running_app, write_rules

from sidecar.core import config
from sidecar.http import bodies as http_bodies
from sidecar.runner.app import App
from sidecar.storage.memory import MemoryBackend


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    return write_rules(tmp_path)


@pytest.fixture
async def app(rules: Path) -> AsyncIterator[App]:
    async with running_app(rules) as running:
        yield running


@pytest.fixture
async def http(app: App) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as session:
        yield session


def rate_limit_request(domain: str, *descriptors: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {
        "domain": domain,
        "descriptors": [
            {"entries": [{"key": key, "value": value} for key, value in entries]}
            for entries in descriptors
        ],
    }


USER = [("user", "alice")]


async def test_json_answers_200_then_429_with_the_reference_json(
    http: aiohttp.ClientSession,
) -> None:
    """/json speaks proto3 JSON in camelCase: 200 while OK, 429 once OVER_LIMIT."""
    answers = []
    for _ in range(4):
        async with http.post("/json", json=rate_limit_request("test", USER)) as response:
            answers.append((response.status, await response.json()))

    assert [status for status, _ in answers] == [200, 200, 200, 429]
    assert answers[0][1] == {
        "overallCode": "OK",
        "statuses": [
            {
                "code": "OK",
                "currentLimit": {"name": "per-user", "requestsPerUnit": 3, "unit": "MINUTE"},
                "limitRemaining": 2,
                "durationUntilReset": "30s",
            }
        ],
    }
    assert answers[3][1] == {
        "overallCode": "OVER_LIMIT",
        "statuses": [
            {
                "code": "OVER_LIMIT",
                "currentLimit": {"name": "per-user", "requestsPerUnit": 3, "unit": "MINUTE"},
                "durationUntilReset": "30s",
            }
        ],
    }


async def test_json_reads_hits_addend_and_overrides(http: aiohttp.ClientSession) -> None:
    """Per-descriptor `hitsAddend` (a UInt64Value, so a string or a number) and `limit` work."""
    body = rate_limit_request("test", USER)
    body["descriptors"][0]["hitsAddend"] = "3"
    body["descriptors"][0]["limit"] = {"requestsPerUnit": 5, "unit": "HOUR"}
    async with http.post("/json", json=body) as response:
        answer = await response.json()

    assert response.status == 200
    assert answer["statuses"][0]["currentLimit"] == {"requestsPerUnit": 5, "unit": "HOUR"}
    assert answer["statuses"][0]["limitRemaining"] == 2


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "malformed RateLimitRequest JSON"),
        (b'{"domain": "test", "nope": 1}', "malformed RateLimitRequest JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (json.dumps(rate_limit_request("", USER)).encode(), "rate limit domain must not be empty"),
        (
            json.dumps(rate_limit_request("test")).encode(),
            "rate limit descriptor list must not be empty",
        ),
        (
            json.dumps(
                {
                    "domain": "test",
                    "descriptors": [
                        {
                            "entries": [{"key": "user", "value": "a"}],
                            "limit": {"requestsPerUnit": 1},
                        }
                    ],
                }
            ).encode(),
            "limit.unit must be one of",
        ),
    ],
    ids=["bad-json", "unknown-field", "not-utf8", "empty-domain", "no-descriptors", "unit-unknown"],
)
async def test_json_answers_400_with_the_reason(
    http: aiohttp.ClientSession, body: bytes, reason: str
) -> None:
    """Anything that is not a valid request is a 400 whose body says why; the server goes on."""
    async with http.post("/json", data=body) as response:
        text = await response.text()
    async with http.post("/json", json=rate_limit_request("test", USER)) as after:
        pass

    assert response.status == 400
    assert text.startswith("Bad Request: ")
    assert reason in text
    assert after.status == 200


async def test_json_refuses_a_body_over_one_mebibyte(http: aiohttp.ClientSession) -> None:
    """A body over 1 MiB is a 413 before it is parsed."""
    async with http.post("/json", data=io.BytesIO(b" " * (2 << 20))) as response:
        assert response.status == 413


@pytest.mark.parametrize(
    ("path", "answer"),
    [
        ("/json", b"Request Timeout: the body took longer than 0.3 s"),
        ("/v1/caps/check", b'{"error":"the body took longer than 0.3 s"}'),
    ],
)
async def test_a_body_that_trickles_in_is_a_408_and_the_connection_closes(
    app: App, path: str, answer: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends its headers and part of its body, then nothing, is answered 408
    once the body deadline passes (`BODY_TIMEOUT`, 10 s; 0.3 here), and its connection is
    closed: it cannot hold a handler and a buffer as long as it likes."""
    monkeypatch.setattr(http_bodies, "BODY_TIMEOUT", 0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
    try:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        writer.write(head.encode() + b'{"domain": ')
        async with asyncio.timeout(5):
            status = await reader.readline()
            rest = await reader.read()  # to the end: the server closes the connection
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 408")
    assert answer in rest


async def test_healthcheck_is_ok_until_draining(app: App, http: aiohttp.ClientSession) -> None:
    """200 `OK` while serving; 500 once shutdown started."""
    async with http.get("/healthcheck") as healthy:
        healthy_body = await healthy.text()
    await app.health.drain()
    async with http.get("/healthcheck") as draining:
        draining_body = await draining.text()

    assert (healthy.status, healthy_body) == (200, "OK")
    assert draining.status == 500
    assert "shutting down" in draining_body


class _Unreachable(MemoryBackend):
    """A backend whose ping fails while `down` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def ping(self) -> bool:
        return not self.down


async def test_healthcheck_fails_while_the_backend_does_not_answer_under_deny(rules: Path) -> None:
    """Under failure mode deny, /healthcheck follows the backend: 500 while its ping fails,
    200 again once it answers."""
    backend = _Unreachable()
    async with (
        running_app(rules, backend=backend, failure_mode="deny") as app,
        aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as http,
    ):
        backend.down = True
        async with http.get("/healthcheck") as down:
            down_body = await down.text()
        backend.down = False
        async with http.get("/healthcheck") as up:
            pass

    assert down.status == 500
    assert "backend unavailable" in down_body
    assert up.status == 200


async def test_healthcheck_stays_ok_without_backend_under_allow(rules: Path) -> None:
    """Under failure mode allow (the default) the sidecar answers without its backend, by
    failing open, so it stays healthy: a Redis outage must not pull gateway pods out of
    service."""
    backend = _Unreachable()
    async with (
        running_app(rules, backend=backend) as app,
        aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as http,
    ):
        backend.down = True
        await app.health.check()
        async with http.get("/healthcheck") as down:
            body = await down.text()
        assert app.health.backend_ok is False

    assert (down.status, body) == (200, "OK")


async def test_rlconfig_lists_one_line_per_rule(rules: Path, http: aiohttp.ClientSession) -> None:
    """/rlconfig prints the loaded rules as the reference's config dump does."""
    async with http.get("/rlconfig") as response:
        text = await response.text()

    assert response.status == 200
    assert text.splitlines() == config.load([rules]).dump()
    assert len(text.splitlines()) == 4
    assert text.splitlines()[0].startswith("test.user: ")


async def test_rlconfig_shows_calendar_months_when_the_app_counts_them(tmp_path: Path) -> None:
    """Options.calendar_months (--calendar-months, USE_CALENDAR_MONTH_RATE_LIMIT) reaches the
    rules the app loads, at start and on reload: a month rule is a UTC calendar window."""
    rules = write_rules(
        tmp_path,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: month, requests_per_unit: 5}\n",
    )
    for calendar_months, shown in ((True, " calendar timezone=UTC"), (False, "")):
        async with (
            running_app(rules, calendar_months=calendar_months) as app,
            aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as session,
        ):
            assert app.reload()
            async with session.get("/rlconfig") as response:
                text = await response.text()
        assert text == (
            f"d.k: unit=MONTH requests_per_unit=5{shown}, shadow_mode: false, quota_mode: false\n"
        )


async def test_metrics_count_per_rule_with_the_reference_names_and_labels(
    app: App, http: aiohttp.ClientSession
) -> None:
    """After three hits within a limit of 3 and one over it, the rule's series read 4 hits, 3
    within, 1 near and 1 over; nested rules get key2, unknown domains their own counter."""
    for _ in range(4):
        async with http.post("/json", json=rate_limit_request("test", USER)):
            pass
    async with http.post("/json", json=rate_limit_request("test", [("app", "a"), ("path", "/")])):
        pass
    async with http.post("/json", json=rate_limit_request("elsewhere", USER, USER)):
        pass
    async with client(app.grpc_port) as rls:
        await rls.should_rate_limit(request("test", [("quiet", "x")]))
        await rls.should_rate_limit(request("test", [("quiet", "x")]))
    async with http.get("/metrics") as response:
        text = await response.text()

    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    # The official parser reads the format (and renames counter samples `<family>_total`).
    samples = {
        (
            family.name if family.type == "counter" else sample.name,
            tuple(sorted(sample.labels.items())),
        ): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    user = (("domain", "test"), ("key1", "user"))
    assert samples[("ratelimit_service_rate_limit_total_hits", user)] == 4
    assert samples[("ratelimit_service_rate_limit_within_limit", user)] == 3
    assert samples[("ratelimit_service_rate_limit_near_limit", user)] == 1
    assert samples[("ratelimit_service_rate_limit_over_limit", user)] == 1
    assert samples[("ratelimit_service_rate_limit_shadow_mode", user)] == 0
    nested = (("domain", "test"), ("key1", "app"), ("key2", "path"))
    assert samples[("ratelimit_service_rate_limit_total_hits", nested)] == 1
    quiet = (("domain", "test"), ("key1", "quiet"))
    assert samples[("ratelimit_service_rate_limit_shadow_mode", quiet)] == 1
    not_found = (("domain", "elsewhere"),)
    assert samples[("ratelimit_service_rate_limit_domain_not_found", not_found)] == 2
    method = (("grpc_method", "ShouldRateLimit"),)
    assert samples[("ratelimit_service_total_requests", method)] == 8
    assert samples[("ratelimit_service_response_time_seconds_count", method)] == 2
    assert samples[("ratelimit_service_config_load_success", ())] == 1
    assert (
        samples[("ratelimit_service_should_rate_limit_error", (("err_type", "redis_error"),))] == 0
    )
    # Named exactly as the reference's exporter names them: no `_total` suffix added.
    assert "# TYPE ratelimit_service_rate_limit_total_hits counter" in text
    assert "ratelimit_service_rate_limit_total_hits_total" not in text


LIMITS = """\
domain: shop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: app
    descriptors:
      - key: path
        rate_limits:
          - {unit: second, requests_per_unit: 10}
          - {unit: minute, unit_multiplier: 5, requests_per_unit: 100, algorithm: sliding_window}
  - key: org
    descriptors:
      - key: team
        descriptors:
          - key: a
            rate_limit: {unit: hour, requests_per_unit: 50}
          - key: b
            rate_limit: {unit: hour, requests_per_unit: 20}
  - key: free
    rate_limit: {unlimited: true}
"""


def limit_samples(text: str) -> dict[tuple[tuple[str, str], ...], float]:
    """`ratelimit_sidecar_rate_limit_requests_per_unit`'s samples in `text`, by their labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "ratelimit_sidecar_rate_limit_requests_per_unit"
        for sample in family.samples
    }


async def test_metrics_show_each_rules_configured_limit_from_the_rules_served(
    tmp_path: Path,
) -> None:
    """A gauge per rule window holds its requests_per_unit, labelled as the rule's counters are
    and with its unit (its multiplier, and its place in rate_limits, where they apply); rules
    folded into one series by depth show the smallest limit; an unlimited rule has none; after
    a reload the gauge shows the new rules, before any call."""
    rules = write_rules(tmp_path, LIMITS)
    async with (
        running_app(rules) as app,
        aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as session,
    ):
        async with session.get("/metrics") as response:
            text = await response.text()
        assert "# TYPE ratelimit_sidecar_rate_limit_requests_per_unit gauge" in text
        shop = (("domain", "shop"),)
        assert limit_samples(text) == {
            (*shop, ("key1", "user"), ("unit", "minute")): 3,
            (*shop, ("key1", "app"), ("key2", "path"), ("unit", "second"), ("window", "0")): 10,
            (
                *shop, ("key1", "app"), ("key2", "path"), ("unit", "minute"),
                ("unit_multiplier", "5"), ("window", "1"),
            ): 100,
            (*shop, ("key1", "org"), ("key2", "team"), ("unit", "hour")): 20,
        }  # fmt: skip

        rules.write_text(LIMITS.replace("requests_per_unit: 3}", "requests_per_unit: 7}"))
        assert app.reload()
        async with session.get("/metrics") as response:
            text = await response.text()
        assert limit_samples(text)[(*shop, ("key1", "user"), ("unit", "minute"))] == 7


async def test_metrics_show_the_memory_backends_counters_and_evictions(
    rules: Path, tmp_path: Path
) -> None:
    """On the memory backend, /metrics shows how many values it holds and how many it evicted
    to stay within its max_counters."""
    async with (
        running_app(rules, backend=MemoryBackend(max_counters=1)) as app,
        client(app.grpc_port) as rls,
        aiohttp.ClientSession(f"http://127.0.0.1:{app.http_port}") as session,
    ):
        for user in ("a", "b", "c"):
            await rls.should_rate_limit(request("test", [("user", user)]))
        async with session.get("/metrics") as response:
            text = await response.text()
    assert "\nratelimit_sidecar_memory_counters 1\n" in text
    assert "\nratelimit_sidecar_memory_evictions 2\n" in text


def gc_pauses(text: str) -> tuple[dict[str, float], float]:
    """The full collections' count in `text` (/metrics) by generation, and the longest pause."""
    counts = {}
    longest = -1.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ratelimit_sidecar_gc_pause_seconds_count":
                counts[sample.labels["generation"]] = sample.value
            elif sample.name == "ratelimit_sidecar_gc_pause_max_seconds":
                longest = sample.value
    return counts, longest


async def test_metrics_time_every_pause_of_the_cycle_collector(
    app: App, http: aiohttp.ClientSession
) -> None:
    """While the app serves, each collection is timed by generation: a full collection adds
    one to `ratelimit_sidecar_gc_pause_seconds{generation="2"}`, and
    `ratelimit_sidecar_gc_pause_max_seconds` holds the longest pause so far."""
    async with http.get("/metrics") as response:
        before, _ = gc_pauses(await response.text())
    gc.collect()
    async with http.get("/metrics") as response:
        text = await response.text()
    after, longest = gc_pauses(text)

    assert sorted(after) == ["0", "1", "2"]
    assert after["2"] == before["2"] + 1
    assert longest > 0
    assert "# TYPE ratelimit_sidecar_gc_pause_seconds histogram" in text
    assert "# TYPE ratelimit_sidecar_gc_pause_max_seconds gauge" in text


async def test_a_stopped_app_times_no_more_pauses(rules: Path) -> None:
    """The app's timing of the collector ends with the app: it leaves nothing in
    `gc.callbacks`."""
    async with running_app(rules) as app:
        assert app.gc_pauses in gc.callbacks
    assert app.gc_pauses not in gc.callbacks
