"""The over-limit cache: a plain window known to be over is refused without waiting for Redis,
with the same answer Redis would give, until its window ends; the hits it refuses are still
counted afterwards, so every answer is the one the reference gives with its cache off (its
default), which is what this sidecar answers with the cache off too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import redis
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.model import Code, Decision, Descriptor, Entry, Override, Request, Unit
from sidecar.operator import counter_admin
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

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


def counter(url: str, prefix: str) -> int:
    """The value of the one counter whose key starts with `prefix`."""
    with redis.Redis.from_url(url) as client:
        (key,) = client.keys(prefix + "*")
        return int(client.get(key) or 0)


async def turn() -> None:
    """Let the event loop finish its turn (the refused hits are counted at its end)."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_an_over_window_is_refused_without_redis_until_it_ends(
    backend: Backend, redis_url: str
) -> None:
    """Once over, the same answer comes from the cache without a script call before it,
    counted in the rule's over_limit_with_local_cache; the refused hit is added to the counter
    after the answer (a check adds nothing); the next window goes to Redis again."""
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
    await turn()
    assert counter(redis_url, "rl{c|k|v}") == 4
    assert script_calls(redis_url) == calls + 1
    clock.now += 60
    fresh = await should_rate_limit(limiter, one("k", "v"))
    assert fresh.overall_code is Code.OK
    assert script_calls(redis_url) == calls + 2


async def test_a_flood_of_refused_hits_is_counted_in_one_call(
    backend: Backend, redis_url: str
) -> None:
    """Refused requests answered in one turn of the event loop are added to their counter in
    one script call, all of them."""
    limiter = Limiter(RULES, backend, clock=Clock(), over_limit_cache=1000)
    for _ in range(3):
        await should_rate_limit(limiter, one("k", "v"))
    calls = script_calls(redis_url)
    answers = await asyncio.gather(*(should_rate_limit(limiter, one("k", "v")) for _ in range(50)))
    assert {a.overall_code for a in answers} == {Code.OVER_LIMIT}
    await turn()
    assert script_calls(redis_url) == calls + 1
    assert counter(redis_url, "rl{c|k|v}") == 53


SHARED = """
domain: c
descriptors:
  - key: k
    rate_limit: {{unit: minute, requests_per_unit: {limit}}}
"""


def shared_rules(limit: int) -> Rules:
    return Rules({"c": config.parse(SHARED.format(limit=limit), "c.yaml")})


def override(limit: int) -> Request:
    return Request("c", (Descriptor((Entry("k", "v"),), None, Override(limit, Unit.MINUTE)),))


async def decide_directly(limiter: Limiter, request: Request) -> Decision:
    """The decision as the fast transport gets it: `decide` called directly, its answer
    taken by a future of this test rather than by `sidecar.loop.callbacks.awaited`."""
    answered: asyncio.Future[Decision | Exception] = asyncio.get_running_loop().create_future()
    limiter.decide(limiter.prepare(request), lambda d: d, answered.set_result)
    answer = await answered
    assert isinstance(answer, Decision), answer
    return answer


async def play(
    url: str, steps: Sequence[Request | Rules], cache: int, directly: bool = False
) -> list[tuple[Code, int]]:
    """The (code, limit_remaining) of each request of `steps` on a fresh Redis database, with an
    over-limit cache of `cache` entries, through `decide` called directly when `directly`; a
    Rules step reloads (as `serve` does on a change)."""
    with redis.Redis.from_url(url) as client:
        client.flushall()
    store = open_backend(url, timeout_ms=1000)
    limiter = Limiter(shared_rules(2), store, clock=Clock(), over_limit_cache=cache)
    answers = []
    try:
        for step in steps:
            if isinstance(step, Rules):
                limiter.rules = step
                if limiter.over_limit_cache is not None:
                    limiter.over_limit_cache.clear()
                continue
            decision = await (
                decide_directly(limiter, step) if directly else should_rate_limit(limiter, step)
            )
            answers += [(s.code, s.limit_remaining) for s in decision.statuses]
        # The last refused hits are sent at the end of this turn; a call sent after them comes
        # back after them.
        await turn()
        await should_rate_limit(limiter, Request("c", (Descriptor((Entry("k", "last"),)),)))
    finally:
        await store.close()
    return answers


async def test_an_override_sharing_a_counter_sees_every_refused_hit(redis_url: str) -> None:
    """A `limit` override and a rule name the same counter (the same entries and unit); hits
    the cache refused at one limit still count for the other, so the answers are the ones the
    sidecar gives without the cache, which are the reference's. (The cache used to skip them:
    the override of 10 answered OK with 6 remaining, where the reference has 3.)"""
    steps = [override(2)] * 4 + [one("k", "v")] * 2 + [override(10)] * 5 + [one("k", "v")]
    with_cache = await play(redis_url, steps, cache=1000)
    assert with_cache == await play(redis_url, steps, cache=0)
    assert with_cache == await play(redis_url, steps, cache=1000, directly=True)
    over = (Code.OVER_LIMIT, 0)
    assert with_cache[6:] == [(Code.OK, 3), (Code.OK, 2), (Code.OK, 1), (Code.OK, 0), over, over]


async def test_a_reload_raising_a_limit_mid_window_sees_every_refused_hit(redis_url: str) -> None:
    """A limit raised mid-window (2 to 5, after 6 hits) keeps refusing, as the reference does
    with 6 hits counted; the cache used to have counted 3, and admitted 2 more."""
    steps: list[Request | Rules] = [one("k", "v")] * 6 + [shared_rules(5)] + [one("k", "v")]
    with_cache = await play(redis_url, steps, cache=1000)
    assert with_cache == await play(redis_url, steps, cache=0)
    assert with_cache == await play(redis_url, steps, cache=1000, directly=True)
    assert with_cache[-1] == (Code.OVER_LIMIT, 0)


async def test_a_reload_forgets_the_counters_known_over(tmp_path: Path, redis_url: str) -> None:
    """`serve` clears the over-limit cache when it loads new rules."""
    from support.sidecars import running_app

    from sidecar.runner.app import App

    rules = tmp_path / "c.yaml"
    rules.write_text(SHARED.format(limit=1))
    store = open_backend(redis_url, timeout_ms=1000)
    try:
        async with running_app(rules, backend=store) as app:
            app_limiter = app.assembly.limiter
            assert isinstance(app, App) and app_limiter is not None
            for _ in range(2):
                await should_rate_limit(app_limiter, one("k", "v"))
            assert (
                app_limiter.over_limit_cache is not None and len(app_limiter.over_limit_cache) == 1
            )
            rules.write_text(SHARED.format(limit=3))
            assert app.reload()
            assert len(app_limiter.over_limit_cache) == 0
    finally:
        await store.close()


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


async def test_a_reset_through_another_sidecar_is_learned_from_the_reply_to_refused_hits(
    redis_url: str,
) -> None:
    """Two sidecars sharing Redis both know (k, v) over; an operator resets it through a third.
    The next call the second answers from its cache is still refused (it cannot know yet), but
    the reply to adding that hit shows the counter was under its limit before it: the cache
    forgets the counter, and the call after is asked of Redis and admitted (2 of 2). The
    first sidecar's next refusal from its cache finds the counter over again, and keeps it."""
    clock = Clock()
    stores = [open_backend(redis_url, timeout_ms=1000) for _ in range(3)]
    first, second = (Limiter(RULES, s, clock=clock, over_limit_cache=1000) for s in stores[:2])
    try:
        for limiter, calls in ((first, 3), (second, 1)):
            for _ in range(calls):
                last = await should_rate_limit(limiter, one("k", "v"))
            assert last.overall_code is Code.OVER_LIMIT
            assert limiter.over_limit_cache is not None and len(limiter.over_limit_cache) == 1
        located = counter_admin.locate(RULES, "c", [Entry("k", "v")], int(clock() * 1000))
        assert await counter_admin.reset(stores[2], located) == 1

        async def refused_from_cache(limiter: Limiter) -> int:
            """One call refused from the cache, then the entries it keeps once the reply to
            adding its hit is in (a call sent after it comes back after it)."""
            assert (await should_rate_limit(limiter, one("k", "v"))).overall_code is Code.OVER_LIMIT
            await turn()
            await should_rate_limit(limiter, one("k", "other"))
            assert limiter.over_limit_cache is not None
            return len(limiter.over_limit_cache)

        assert await refused_from_cache(second) == 0
        assert (await should_rate_limit(second, one("k", "v"))).overall_code is Code.OK
        assert await refused_from_cache(first) == 1
    finally:
        for store in stores:
            await store.close()
