"""The over-limit cache: a plain window known to be over is refused without a Redis call, with
the same answer Redis would give, until its window ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis
from callbacks import should_rate_limit
from clock import Clock

from sidecar import config
from sidecar.limiter import Limiter, Settings
from sidecar.model import Code, Descriptor, Entry, Request
from sidecar.rules import Rules
from sidecar.storage import Backend, open_backend

pytestmark = pytest.mark.redis

RULES = Rules(
    {
        "c": config.parse(
            """
domain: c
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: s
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: b
    rate_limit: {algorithm: token_bucket, unit: minute, requests_per_unit: 1}
""",
            "c.yaml",
        )
    }
)


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[Backend]:
    store = open_backend(redis_url, timeout_ms=1000)
    yield store
    await store.close()


def script_calls(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def one(key: str, value: str, hits: int | None = None) -> Request:
    return Request("c", (Descriptor((Entry(key, value),), hits),))


async def test_an_over_window_is_refused_without_redis_until_it_ends(
    backend: Backend, redis_url: str
) -> None:
    """Once over, the same answer comes from the cache (no script call), counted in the rule's
    over_limit_with_local_cache; the next window goes to Redis again."""
    clock = Clock()
    limiter = Limiter(RULES, backend, clock=clock, over_limit_cache=1000)
    for _ in range(3):
        last = await should_rate_limit(limiter, one("k", "v"))
    assert last.overall_code is Code.OVER_LIMIT
    calls = script_calls(redis_url)
    cached = await should_rate_limit(limiter, one("k", "v"))
    checked = await should_rate_limit(limiter, one("k", "v", hits=0))
    assert script_calls(redis_url) == calls
    assert cached.statuses == last.statuses
    assert checked.overall_code is Code.OVER_LIMIT
    assert limiter.stats.rules["c.k"].over_limit_with_local_cache == 1
    clock.now += 60
    fresh = await should_rate_limit(limiter, one("k", "v"))
    assert fresh.overall_code is Code.OK
    assert script_calls(redis_url) == calls + 1


async def test_the_cache_respects_shadow_mode_and_skips_other_algorithms(
    backend: Backend, redis_url: str
) -> None:
    """A cached shadow rule still answers OK; a token bucket is never cached (it refills)."""
    limiter = Limiter(RULES, backend, clock=Clock(), over_limit_cache=1000)
    for _ in range(3):
        shadow = await should_rate_limit(limiter, one("s", "v"))
        bucket = await should_rate_limit(limiter, one("b", "v"))
    assert shadow.overall_code is Code.OK
    assert bucket.overall_code is Code.OVER_LIMIT
    assert limiter.stats.rules["c.s"].over_limit_with_local_cache == 1
    calls = script_calls(redis_url)
    await should_rate_limit(limiter, one("b", "v"))
    assert script_calls(redis_url) == calls + 1


async def test_the_cache_is_off_with_rejected_hits_skip(backend: Backend, redis_url: str) -> None:
    """With skip a refused request is judged as a whole, so every call goes to Redis."""
    settings = Settings(rejected_hits="skip")
    limiter = Limiter(RULES, backend, settings=settings, clock=Clock(), over_limit_cache=1000)
    for _ in range(3):
        await should_rate_limit(limiter, one("k", "v"))
    calls = script_calls(redis_url)
    await should_rate_limit(limiter, one("k", "v"))
    assert script_calls(redis_url) == calls + 1


async def test_the_cache_keeps_its_answer_when_redis_fails(redis_url: str) -> None:
    """A descriptor known to be over stays refused while the backend fails (failure mode allow
    answers only for what the cache does not know)."""
    backend = open_backend(redis_url, timeout_ms=200)
    limiter = Limiter(RULES, backend, clock=Clock(), over_limit_cache=1000)
    try:
        for _ in range(3):
            await should_rate_limit(limiter, one("k", "v"))
        await backend.close()
        dead = open_backend("redis://127.0.0.1:1", timeout_ms=200)
        limiter.backend = dead
        decision = await should_rate_limit(
            limiter,
            Request("c", (Descriptor((Entry("k", "v"),)), Descriptor((Entry("k", "other"),)))),
        )
        assert decision.overall_code is Code.OVER_LIMIT
        assert [s.code for s in decision.statuses] == [Code.OVER_LIMIT, Code.OK]
        await dead.close()
    finally:
        await backend.close()
