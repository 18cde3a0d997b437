"""Local aggregation on a real Redis (`sidecar.storage.aggregation`): approximate windows judged
locally and synced every interval in one call, the rest decided by Redis, failures, restarts,
bounds, and several sidecars under load within the stated overshoot bound."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import generate_latest
from support.callbacks import should_rate_limit
from support.sidecars import client, request, write_rules

from sidecar import cli
from sidecar.core import config
from sidecar.core.counters import window_hit
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.errors import StorageError
from sidecar.loop.callbacks import awaited
from sidecar.model import (
    Code,
    Decision,
    Descriptor,
    Entry,
    Hit,
    Outcome,
    Request,
    Role,
    Unit,
    Window,
)
from sidecar.runner.app import App, InvalidOption, Options
from sidecar.storage.aggregation import Aggregated
from sidecar.storage.backends import open_backend
from sidecar.storage.base import Applied

INTERVAL_MS = 20
TIMEOUT_MS = 50
APPROXIMATE = Window(10, Unit.MINUTE, approximate=True)
EXACT = Window(10, Unit.MINUTE)


class Clock:
    """Time the test sets, 5 s into the current real minute (Redis expires keys by real time)."""

    def __init__(self) -> None:
        self.now = math.floor(time.time() / 60) * 60 + 5.0

    def __call__(self) -> float:
        return self.now

    @property
    def ms(self) -> int:
        return int(self.now * 1000)


def hit(window: Window, now_ms: int, cost: int = 1, prefix: str = "api_client_a") -> Hit:
    return window_hit(prefix, window, cost, 0, Role.BLOCKING, now_ms)


async def apply(backend: Aggregated, hits: Sequence[Hit], now_ms: int) -> list[Outcome]:
    def start(done: Applied) -> None:
        backend.apply(hits, False, now_ms, done)

    return await awaited(start)


def stored(url: str, key: bytes) -> int:
    with redis.Redis.from_url(url) as client:
        value = client.get(key)
    return 0 if value is None else int(value)


def evalsha_calls(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def aggregated(url: str, clock: Clock, **options: int) -> Aggregated:
    return Aggregated(
        open_backend(url, timeout_ms=TIMEOUT_MS), INTERVAL_MS, TIMEOUT_MS, clock=clock, **options
    )


async def test_approximate_hits_are_judged_locally_and_synced_in_one_call(redis_url: str) -> None:
    """A window's first hit goes to Redis and teaches the view the count; the next ones are
    judged locally and reach Redis at the sync, all in one script call, whose answer is the
    count with every sidecar's synced hits: the view learns the others' in the same round trip."""
    clock = Clock()
    a, b = aggregated(redis_url, clock), aggregated(redis_url, clock)
    try:
        now = clock.ms
        key = hit(APPROXIMATE, now).key
        await apply(a, [hit(APPROXIMATE, now)], now)
        assert stored(redis_url, key) == 1
        for _ in range(4):
            (outcome,) = await apply(a, [hit(APPROXIMATE, now)], now)
        assert outcome.remaining == 5 and not outcome.over
        assert stored(redis_url, key) == 1  # judged locally: Redis has not seen them
        await apply(b, [hit(APPROXIMATE, now)], now)
        await apply(b, [hit(APPROXIMATE, now, cost=2)], now)
        calls = evalsha_calls(redis_url)
        await a.sync()
        assert evalsha_calls(redis_url) == calls + 1
        assert stored(redis_url, key) == 6
        await b.sync()
        assert stored(redis_url, key) == 8
        # a has learned b's first hit (in Redis before a's sync); b has learned all of a's.
        (outcome,) = await apply(a, [hit(APPROXIMATE, now, cost=0)], now)
        assert outcome.remaining == 10 - 6
        (outcome,) = await apply(b, [hit(APPROXIMATE, now, cost=3)], now)
        assert outcome.over and outcome.remaining == 0 and outcome.left_before == 2
        assert a.local_hits == 5 and b.local_hits == 2
    finally:
        await a.close()
        await b.close()


async def test_a_refund_on_an_approximate_window_goes_to_the_store(redis_url: str) -> None:
    """A refund is never judged on the local view: Redis takes it at once and floors the
    counter at 0. The view, whose count only grows within a window, still counts the hit given
    back: it frees nothing locally before the window ends, and never admits past the limit."""
    clock = Clock()
    a = aggregated(redis_url, clock)
    try:
        now = clock.ms
        key = hit(APPROXIMATE, now).key
        for _ in range(4):
            await apply(a, [hit(APPROXIMATE, now)], now)
        assert stored(redis_url, key) == 1  # three judged locally, still pending
        (outcome,) = await apply(a, [hit(APPROXIMATE, now, cost=-2)], now)
        assert not outcome.over and stored(redis_url, key) == 0  # 1 - 2, floored at 0
        await a.sync()
        assert stored(redis_url, key) == 3
        (outcome,) = await apply(a, [hit(APPROXIMATE, now, cost=0)], now)
        assert outcome.remaining == 6  # 10 - 4: the view's, the refunded hit still in it
        assert a.local_hits == 4
    finally:
        await a.close()


async def test_a_request_with_exact_and_approximate_windows_gets_its_outcomes_in_order(
    redis_url: str,
) -> None:
    """Exact windows go to Redis at once, approximate ones are judged locally; the outcomes come
    back in the request's order. Without any approximate window, a request goes to Redis as is."""
    clock = Clock()
    a = aggregated(redis_url, clock)
    try:
        now = clock.ms
        await apply(a, [hit(APPROXIMATE, now, cost=3)], now)
        exact = hit(EXACT, now, cost=4, prefix="api_client_b")
        outcomes = await apply(a, [hit(APPROXIMATE, now), exact, hit(APPROXIMATE, now)], now)
        assert [o.remaining for o in outcomes] == [6, 6, 5]
        assert stored(redis_url, exact.key) == 4
        assert stored(redis_url, hit(APPROXIMATE, now).key) == 3
    finally:
        await a.close()


async def test_a_failed_sync_keeps_its_hits_and_the_failure_mode_answers_meanwhile(
    restartable_redis: Any,
) -> None:
    """While syncs fail no hit is judged locally: an approximate hit goes to the store and its
    failure (StorageError) is the limiter's failure mode to answer. The hits pending are sent
    again by the next sync that succeeds, once."""
    server = restartable_redis
    url = server.url
    clock = Clock()
    a = aggregated(url, clock)
    try:
        now = clock.ms
        await apply(a, [hit(APPROXIMATE, now)], now)
        for _ in range(3):
            await apply(a, [hit(APPROXIMATE, now)], now)
        server.stop()
        await a.sync()
        assert a.failing and a.failed_syncs == 1
        with pytest.raises(StorageError):
            await apply(a, [hit(APPROXIMATE, now)], now)
        server.start()
        for _ in range(100):  # the next intervals, until the client has reconnected
            await a.sync()
            if not a.failing:
                break
            await asyncio.sleep(0.02)
        assert not a.failing  # a new, empty Redis: it got the three hits once
        assert stored(url, hit(APPROXIMATE, now).key) == 3
        await a.sync()
        assert stored(url, hit(APPROXIMATE, now).key) == 3
    finally:
        await a.close()


async def test_close_syncs_what_is_pending_so_a_clean_restart_loses_no_count(
    redis_url: str,
) -> None:
    """A sidecar that stops cleanly sends its pending hits before closing the store; the next
    one starts from them."""
    clock = Clock()
    a = aggregated(redis_url, clock)
    now = clock.ms
    for _ in range(6):
        await apply(a, [hit(APPROXIMATE, now)], now)
    await a.close()
    assert stored(redis_url, hit(APPROXIMATE, now).key) == 6
    after = aggregated(redis_url, clock)
    try:
        (outcome,) = await apply(after, [hit(APPROXIMATE, now, cost=0)], now)
        assert outcome.remaining == 4
    finally:
        await after.close()


async def test_views_are_bounded_and_forgotten_when_stale_or_their_window_ended(
    redis_url: str,
) -> None:
    """Past `max_counts` a counter is decided by Redis, as without aggregation; a view not hit
    for longer than it stays fresh, or whose window ended, is dropped at the next sync; hits
    pending for a window that ended are sent once more, then dropped if that fails."""
    clock = Clock()
    a = aggregated(redis_url, clock, max_counts=1)
    try:
        now = clock.ms
        for _ in range(3):
            await apply(a, [hit(APPROXIMATE, now)], now)
            await apply(a, [hit(APPROXIMATE, now, prefix="api_client_z")], now)
        assert len(a) == 1
        assert stored(redis_url, hit(APPROXIMATE, now, prefix="api_client_z").key) == 3
        assert stored(redis_url, hit(APPROXIMATE, now).key) == 1
        await a.sync()
        assert len(a) == 1
        clock.now += (INTERVAL_MS + TIMEOUT_MS + 1) / 1000
        await a.sync()
        assert len(a) == 0
        now = clock.ms
        await apply(a, [hit(APPROXIMATE, now)], now)
        await apply(a, [hit(APPROXIMATE, now)], now)
        clock.now += 60  # the minute ended with a hit pending: sent once more, then forgotten
        await a.sync()
        assert len(a) == 0 and a.dropped_hits == 0
        assert stored(redis_url, hit(APPROXIMATE, now).key) == 3 + 2
    finally:
        await a.close()


RULES = """
domain: load
descriptors:
  - key: client
    approximate: true
    rate_limit: {unit: second, requests_per_unit: 300}
"""
LIMIT = 300
SIDECARS = 3


async def test_several_sidecars_under_load_admit_the_limit_within_the_stated_overshoot(
    redis_url: str,
) -> None:
    """Three sidecars (limiters on their own connections, syncing every 20 ms) share one Redis
    and one approximate 300/s counter, with demand several times the limit, for a few seconds:
    each whole window admits at least the limit (no undershoot with hits of 1) and at most
    limit + (S - 1) × r × 2 × (T + d) + S, r the busiest sidecar's demand in that window (README);
    Redis sees a small fraction of one script call per request."""
    rules = Rules({"load": config.parse(RULES, "load.yaml")})
    request = Request("load", (Descriptor((Entry("client", "c1"),)),))
    backends = [
        Aggregated(open_backend(redis_url, timeout_ms=TIMEOUT_MS), INTERVAL_MS, TIMEOUT_MS)
        for _ in range(SIDECARS)
    ]
    limiters = [Limiter(rules, backend) for backend in backends]
    for backend in backends:
        backend.start()
    admitted: Counter[int] = Counter()
    demand: Counter[tuple[int, int]] = Counter()
    calls_before = evalsha_calls(redis_url)
    stop_at = math.floor(time.time()) + 4.0

    async def drive(index: int, limiter: Limiter) -> None:
        plan = limiter.prepare(request)
        while (now := time.time()) < stop_at:
            window = int(now)
            for _ in range(5):
                demand[(index, window)] += 1

                def done(decision: Decision | Exception, window: int = window) -> None:
                    assert isinstance(decision, Decision), decision
                    if decision.overall_code is Code.OK:
                        admitted[window] += 1

                limiter.decide(plan, lambda d: d, done)
            await asyncio.sleep(0.0005)

    try:
        await asyncio.gather(*(drive(i, limiter) for i, limiter in enumerate(limiters)))
        await asyncio.sleep(0.2)
    finally:
        for backend in backends:
            await backend.close()
    calls = evalsha_calls(redis_url) - calls_before
    requests = sum(demand.values())
    windows = sorted(admitted)[1:-1]  # whole seconds only
    assert len(windows) >= 2, admitted
    for window in windows:
        busiest = max(demand[(i, window)] for i in range(SIDECARS))
        assert sum(demand[(i, window)] for i in range(SIDECARS)) > 2 * LIMIT
        bound = (SIDECARS - 1) * busiest * 2 * (INTERVAL_MS + TIMEOUT_MS) / 1000 + SIDECARS
        assert LIMIT <= admitted[window] <= LIMIT + bound, (window, admitted, demand)
    assert calls < requests / 5, (calls, requests)


APP_RULES = """\
domain: app
descriptors:
  - key: client
    approximate: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 3}
"""


@asynccontextmanager
async def aggregating_app(tmp_path: Path, backend: str, **options: Any) -> AsyncIterator[App]:
    app = App(
        Options(
            config=[write_rules(tmp_path, APP_RULES)],
            backend=backend,
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            **options,
        ),
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace=1.0)


def keys_and_counts(url: str) -> dict[str, int]:
    with redis.Redis.from_url(url, decode_responses=True) as connection:
        found = {key: int(connection.get(key) or 0) for key in connection.keys("*")}
    return {name: sum(n for key, n in found.items() if name in key) for name in ("client", "ip")}


async def test_serve_with_a_sync_interval_decides_approximate_rules_locally_and_syncs_on_stop(
    tmp_path: Path, redis_url: str
) -> None:
    """`serve --sync-interval-ms`: an approximate rule is answered from the local view (its
    first hit taught it the count; Redis sees the rest at the next sync, or when the sidecar
    stops), an exact rule by Redis on every call; /metrics counts the local hits."""
    async with (
        aggregating_app(tmp_path, redis_url, sync_interval_ms=60_000) as app,
        client(app.grpc_port) as rls,
    ):
        mixed = request("app", [("client", "a")], [("ip", "b")])
        answers = [await rls.should_rate_limit(mixed) for _ in range(5)]
        counts = keys_and_counts(redis_url)
        text = generate_latest(app.registry).decode()
    assert [[s.code for s in a.statuses] for a in answers] == [
        [Code.OK, Code.OK],
        [Code.OK, Code.OK],
        [Code.OK, Code.OK],
        [Code.OVER_LIMIT, Code.OVER_LIMIT],
        [Code.OVER_LIMIT, Code.OVER_LIMIT],
    ]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 1, 0, 0, 0]
    assert counts == {"client": 1, "ip": 5}
    assert "ratelimit_sidecar_aggregation_local_hits_total 4.0" in text
    assert keys_and_counts(redis_url) == {"client": 5, "ip": 5}  # synced when it stopped


async def test_a_sync_interval_needs_a_shared_store_and_counts_rejected_hits(
    tmp_path: Path, redis_url: str
) -> None:
    """memory:// is already local, and all or nothing cannot span a local view and a store."""
    with pytest.raises(InvalidOption, match="needs a shared store"):
        async with aggregating_app(tmp_path, "memory://", sync_interval_ms=50):
            pass
    with pytest.raises(InvalidOption, match="--rejected-hits skip"):
        async with aggregating_app(tmp_path, redis_url, sync_interval_ms=50, rejected_hits="skip"):
            pass


def test_sync_interval_flag_and_variable() -> None:
    """`--sync-interval-ms N` (or RLS_SYNC_INTERVAL_MS), a whole number of at least 1; unset
    by default (every hit decided by the store)."""
    assert cli.parse_args(["serve", "--config", "x"], {}).sync_interval_ms is None
    assert (
        cli.parse_args(["serve", "--config", "x", "--sync-interval-ms", "50"], {}).sync_interval_ms
        == 50
    )
    args = cli.parse_args(["serve", "--config", "x"], {"RLS_SYNC_INTERVAL_MS": "100"})
    assert args.sync_interval_ms == 100
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--config", "x", "--sync-interval-ms", "0"], {})


USAGE_RULES = """\
domain: open
usage:
  - by: [app]
  - by: [app]
    unique: user
descriptors:
  - key: app
    approximate: true
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: plan
    rate_limit: {unit: minute, requests_per_unit: 15}
"""


@pytest.mark.parametrize("with_exact", [False, True], ids=["approximate only", "with exact"])
async def test_usage_counts_a_locally_judged_request_by_its_answer(
    redis_url: str, with_exact: bool
) -> None:
    """With aggregation, a request judged on the local view still counts its usage in Redis as
    admitted or refused by its answer (a local refusal included, which Redis never saw), and
    /v1/usage's reads pass through the wrapper: the counts equal the answers given."""
    from sidecar.core import usage

    clock = Clock()
    domain = config.parse(USAGE_RULES, "rules.yaml")
    backend = aggregated(redis_url, clock)
    limiter = Limiter(Rules({domain.name: domain}), backend, clock=clock)
    answers: Counter[Code] = Counter()
    try:
        for n in range(30):
            entries = [
                Descriptor((Entry("app", "shop"),)),
                Descriptor((Entry("user", f"u{n % 7}"),)),
            ]
            if with_exact:
                entries.append(Descriptor((Entry("plan", "free"),)))
            decision = await should_rate_limit(limiter, Request("open", tuple(entries)))
            answers[decision.overall_code] += 1
        assert backend.local_hits > 0
        counted = domain.usage
        assert counted is not None
        report = await usage.report(
            backend, "open", counted, ("app",), [counted.today(clock.ms)], 10
        )  # type: ignore[arg-type]
        (row,) = report["days"][0]["top"]
        assert (row["admitted"], row["refused"]) == (answers[Code.OK], answers[Code.OVER_LIMIT])
        assert answers[Code.OVER_LIMIT] == (15 if with_exact else 10)
    finally:
        await backend.close()
