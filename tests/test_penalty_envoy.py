"""Penalties through the real Envoy 1.40 (`penalty:`, `sidecar.algorithms.penalty`): a client
that trips its limit gets a 429 whose Retry-After is the time left in its block, all through
the block and not only until its window ends, and is admitted once the block is over; the
next trip doubles it.

The sidecar runs in this process on a clock the test sets (memory and Redis backends), so the
waits are exact and the test takes no time; Envoy, in front of it, is the real binary.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from test_retry_after_envoy import gateway

from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: gateway
descriptors:
  - key: app
    value: shop
    descriptors:
      - key: remote_address
        rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2}
        penalty: {block: 10m, escalate: 2, max: 1h, forget_after: 1d}
"""
#: A whole number of 10 s from the epoch, far from the real clock (see test_retry_after_envoy).
START = 1_782_489_600.0


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest) -> Backend:
    """The sidecar's backend (the app closes it when it stops)."""
    if request.param == "memory":
        return MemoryBackend()
    return open_backend(request.getfixturevalue("redis_url"), timeout_ms=1_000)


async def test_a_blocked_client_gets_429_with_the_time_left_in_its_block(
    envoy_binary: str, tmp_path: Path, backend: Backend
) -> None:
    """2 per 10 s with a 10-minute penalty: the third request is a 429 with Retry-After 600;
    five minutes on (its window long over) still a 429, Retry-After 300; a second before the
    block's end a 429 with Retry-After 1, at its end a 200; tripped again, Retry-After 1200."""
    async with gateway(envoy_binary, tmp_path, backend, RULES, START) as through:
        clock = through.clock
        number = uuid.uuid4().int  # a client of its own: Redis keeps earlier runs' state
        address = f"127.{number % 254 + 1}.{number // 254 % 254 + 1}.{number // 64516 % 254 + 1}"
        for retry_after in (600, 1200):
            assert [(await through.call("shop", address)).status for _ in range(2)] == [200, 200]
            refused = await through.call("shop", address)
            assert refused.status == 429
            assert int(refused.headers["retry-after"]) == retry_after
            tripped_at = clock.now
            clock.now = tripped_at + 300
            refused = await through.call("shop", address)
            assert (refused.status, int(refused.headers["retry-after"])) == (
                429,
                retry_after - 300,
            )
            clock.now = tripped_at + retry_after - 1
            refused = await through.call("shop", address)
            assert (refused.status, int(refused.headers["retry-after"])) == (429, 1)
            clock.now = tripped_at + retry_after
            assert (await through.call("shop", address)).status == 200
            clock.now += 10  # a fresh window for the next trip
