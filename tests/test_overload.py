"""A flood at several times what the sidecar and Redis can decide in time, with Redis healthy:
every limit admits exactly its limit. The calls that cannot be decided in time are answered
UNAVAILABLE (counted `overloaded`), never OK by the failure mode (here `allow`, the one that
would admit). h2load, 1,000 connections of 8 streams, straight at a sidecar process on a real
redis-server; a few seconds per flood."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import require_binary
from support.loads import H2load
from support.sidecars import request, serve_process

pytestmark = pytest.mark.redis

RULES = """
domain: flood
descriptors:
  - key: zero
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: thousand
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""

#: The flood: as many calls in flight as 1,000 Envoy connections with 8 streams each.
CLIENTS, STREAMS, REQUESTS = 1_000, 8, 60_000


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if match := re.fullmatch(r"([^#\s][^\s]*) (\S+)", line):
            samples[match.group(1)] = float(match.group(2))
    return samples


@pytest.mark.parametrize(("key", "limit"), [("zero", 0), ("thousand", 1000)])
async def test_a_flood_with_redis_healthy_admits_exactly_the_limit(
    key: str, limit: int, redis_url: str, tmp_path: Path
) -> None:
    """1,000 connections flood one descriptor. Exactly `limit` calls are admitted (within_limit),
    none is answered by the failure mode (redis_error 0), and every call is either decided or
    refused as overloaded: the sidecar sheds what it cannot decide in time instead of letting
    the deadline of Redis expire in its own queue and failing open."""
    require_binary("h2load")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    left = 3600 - time.time() % 3600  # one hour's window for the whole flood
    if left < 60:
        await asyncio.sleep(left + 0.05)
    args = [
        "--config", str(rules), "--backend", redis_url, "--redis-timeout-ms", "50",
        "--failure-mode", "allow", "--over-limit-cache", "0",
        "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
    ]  # fmt: skip
    async with serve_process(args) as sidecar:
        flood = H2load(
            f"127.0.0.1:{sidecar.grpc_port}",
            request("flood", [(key, "x")]),
            tmp_path,
            requests=REQUESTS,
            clients=CLIENTS,
            rate=None,
            streams=STREAMS,
        )
        report = await asyncio.to_thread(flood.report)
        assert report.succeeded == REQUESTS, report.output
        samples = metrics(sidecar.http_port)
    rule = f'{{domain="flood",key1="{key}"}}'
    errors = "ratelimit_service_should_rate_limit_error"
    within = samples[f"ratelimit_service_rate_limit_within_limit{rule}"]
    decided = samples[f"ratelimit_service_rate_limit_total_hits{rule}"]
    assert samples[f'{errors}{{err_type="redis_error"}}'] == 0
    assert within == limit
    assert decided + samples[f'{errors}{{err_type="overloaded"}}'] == REQUESTS
