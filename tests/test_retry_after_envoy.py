"""Retry-After through the real Envoy 1.40 (issue 31, item 4): with the rate limit filter's
`enable_retry_after_header`, Envoy answers a 429 with the largest `duration_until_reset` of the
OVER_LIMIT descriptors, in whole seconds rounded down; the sidecar rounds the wait up, so for
every algorithm a client that waits exactly `Retry-After` seconds is admitted, and one that
waits a second less is not.

The sidecar runs in this process on a clock the test sets (memory and Redis backends), so the
waits are exact and the test takes no time; Envoy, in front of it, is the real binary.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.clock import Clock
from support.envoys import Envoy, Response, Upstream, free_port, get
from support.sidecars import running_app
from test_gateway_e2e import bootstrap

from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

#: One rule per algorithm, chosen by the client's app id (the gateway's first descriptor is
#: the app and the client's address, so every test's client counts on its own).
RULES = """\
domain: gateway
descriptors:
  - key: app
    value: bucket
    descriptors:
      - key: remote_address
        rate_limit: {algorithm: token_bucket, unit: second, unit_multiplier: 10,
                     requests_per_unit: 1, burst: 2}
  - key: app
    value: lender
    descriptors:
      - key: remote_address
        rate_limit: {algorithm: token_bucket, unit: second, unit_multiplier: 10,
                     requests_per_unit: 1, burst: 2, borrow: 1}
  - key: app
    value: sliding
    descriptors:
      - key: remote_address
        rate_limit: {algorithm: sliding_window, unit: second, unit_multiplier: 10,
                     requests_per_unit: 2}
  - key: app
    value: plain
    descriptors:
      - key: remote_address
        rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2}
  - key: app
    value: borrowing
    descriptors:
      - key: remote_address
        rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2, borrow: 2}
  - key: app
    value: calendar
    descriptors:
      - key: remote_address
        rate_limit: {unit: day, requests_per_unit: 2, calendar: true, timezone: Asia/Shanghai}
  - key: app
    value: several
    descriptors:
      - key: remote_address
        rate_limits:
          - {unit: second, unit_multiplier: 10, requests_per_unit: 1}
          - {algorithm: token_bucket, unit: second, unit_multiplier: 30, requests_per_unit: 1,
             burst: 1}
"""

#: Midnight in Shanghai (16:00 UTC), a whole number of 30 s from the epoch: every window here
#: starts on it. Far from the real clock, which only Redis's expiries follow (see test_parity).
MIDNIGHT = 1_782_489_600.0


@dataclass
class Gateway:
    port: int
    clock: Clock

    async def call(self, app: str, address: str) -> Response:
        """One request of the client at `address` to the app (its rule)."""
        headers = {"x-app-id": app}
        return await asyncio.to_thread(get, self.port, "/api/orders/x", headers, source=address)


def with_retry_after(config_text: str) -> str:
    """The gateway's bootstrap with the rate limit filter's `enable_retry_after_header` on, and
    failing closed: a 200 is the sidecar's admission, never Envoy giving up on a late answer."""
    config: dict[str, Any] = yaml.safe_load(config_text)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (limit,) = [
        f for f in manager["typed_config"]["http_filters"]
        if f["name"] == "envoy.filters.http.ratelimit"
    ]  # fmt: skip
    limit["typed_config"]["enable_retry_after_header"] = True
    limit["typed_config"]["failure_mode_deny"] = True
    return yaml.safe_dump(config)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest) -> Backend:
    """The sidecar's backend (the app closes it when it stops)."""
    if request.param == "memory":
        return MemoryBackend()
    return open_backend(request.getfixturevalue("redis_url"), timeout_ms=1_000)


@asynccontextmanager
async def gateway(
    envoy_binary: str,
    tmp_path: Path,
    backend: Backend,
    rules_text: str = RULES,
    start: float = MIDNIGHT,
) -> AsyncIterator[Gateway]:
    """The sidecar on `rules_text` and a clock set to `start`, and Envoy (Retry-After on) in
    front of it."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(rules_text)
    clock = Clock(start)
    upstream = Upstream()
    upstream.start()
    try:
        async with running_app(rules, backend=backend, clock=clock) as app:
            port, admin_port = free_port(), free_port()
            config = tmp_path / "envoy.yaml"
            # A generous timeout: this shared machine can be slow, and a late answer is a 500.
            text = bootstrap(rules, app.grpc_port, port, admin_port, upstream.port, timeout=10.0)
            config.write_text(with_retry_after(text))
            envoy = Envoy(envoy_binary, config, admin_port, tmp_path / "envoy.log")
            await asyncio.to_thread(envoy.start)
            try:
                yield Gateway(port, clock)
            finally:
                await asyncio.to_thread(envoy.stop)
    finally:
        upstream.stop()


#: (app, seconds into the window of the first request, requests admitted, Retry-After of the
#: next): the issue's cases and one of each other kind.
CASES = [
    # 1 token per 10 s, burst 2: emptied, one token in 10 s (not 20, the time until full).
    pytest.param("bucket", 0.25, 2, 10, id="token_bucket"),
    # The same with borrow 1: three pass, a debt of 1; repaid and one token refilled: 20 s.
    pytest.param("lender", 0.25, 3, 20, id="token_bucket_borrowing"),
    # 2 per 10 s, sliding, from 8.25 s in: to the window's end (1.75 s), then until half of
    # the two hits has slid out (5 s): 6.75 s, 7 (the window's end, 2, used to be answered).
    pytest.param("sliding", 8.25, 2, 7, id="sliding_window"),
    # 2 per 10 s: the window's end, 6.5 s.
    pytest.param("plain", 3.5, 2, 7, id="fixed_window"),
    # 2 per 10 s, borrow 2: four pass, the next window admits nothing (in debt by two): the
    # end of the next window, 16.5 s.
    pytest.param("borrowing", 3.5, 4, 17, id="borrowing_window"),
    # 2 a day, Shanghai: 10.5 s before local midnight, its end.
    pytest.param("calendar", 86_389.5, 2, 11, id="calendar_day"),
    # 1 per 10 s and a bucket of 1 per 30 s: both refuse the second hit, the bucket's wait
    # (30 s) is the longer one (the first over, the 10 s window, used to be answered).
    pytest.param("several", 0.0, 1, 30, id="several_windows"),
]


@pytest.mark.parametrize(("app", "into", "admitted", "retry_after"), CASES)
async def test_a_client_waiting_retry_after_is_admitted_and_one_waiting_less_is_not(
    envoy_binary: str,
    tmp_path: Path,
    backend: Backend,
    app: str,
    into: float,
    admitted: int,
    retry_after: int,
) -> None:
    """Through Envoy with `enable_retry_after_header`: a client's first `admitted` requests
    pass, the next is 429 with the expected Retry-After; the same client back a second before
    Retry-After is refused again, and back after exactly Retry-After is admitted."""
    async with gateway(envoy_binary, tmp_path, backend) as through:
        clock = through.clock
        # A client of its own (Redis keeps the counters of earlier runs at these times).
        number = uuid.uuid4().int
        address = f"127.{number % 254 + 1}.{number // 254 % 254 + 1}.{number // 64516 % 254 + 1}"
        clock.now = MIDNIGHT - 86_400 + into if app == "calendar" else MIDNIGHT + into
        passed = [await through.call(app, address) for _ in range(admitted)]
        assert [r.status for r in passed] == [200] * admitted
        refused = await through.call(app, address)
        assert refused.status == 429
        assert int(refused.headers["retry-after"]) == retry_after
        refused_at = clock.now
        clock.now = refused_at + retry_after - 1
        assert (await through.call(app, address)).status == 429
        clock.now = refused_at + retry_after
        assert (await through.call(app, address)).status == 200
