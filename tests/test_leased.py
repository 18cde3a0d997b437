"""Leased windows on a real Redis (`sidecar.storage.leases`): hits judged on leases with no
store call until a lease runs low, renewals in one call, blocks given back when idle and on
stop, failures decided from what a lease holds then by the failure mode, a Redis restart, and
three sidecars under load admitting exactly each window's limit."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import generate_latest
from support.callbacks import apply, should_rate_limit
from support.sidecars import client, request, write_rules

from sidecar import cli
from sidecar.core import config
from sidecar.core.counters import window_hit
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.model import (
    Algorithm,
    Code,
    Decision,
    Descriptor,
    Entry,
    Hit,
    Request,
    Role,
    Unit,
    Window,
)
from sidecar.runner.app import App, InvalidOption, Options
from sidecar.storage.backends import open_backend
from sidecar.storage.leases import Leased, RedisLeases, store_for

TIMEOUT_MS = 200
LEASE_MS = 1_000
LEASED = Window(10, Unit.MINUTE, leased=True)
EXACT = Window(10, Unit.MINUTE)


class Clock:
    """Time the test sets, 5 s into the next real minute: a window that starts after the
    session's Redis did (`lua/lease.lua` lends nothing of one that started before)."""

    def __init__(self) -> None:
        self.now = math.floor(time.time() / 60) * 60 + 65.0

    def __call__(self) -> float:
        return self.now

    @property
    def ms(self) -> int:
        return int(self.now * 1000)


def hit(window: Window, now_ms: int, cost: int = 1, prefix: str = "api_client_a") -> Hit:
    return window_hit(prefix, window, cost, 0, Role.BLOCKING, now_ms)


def stored(url: str, key: bytes) -> int:
    with redis.Redis.from_url(url) as connection:
        value = connection.get(key)
    return 0 if value is None else int(value)


def commands(url: str) -> int:
    """The commands sidecars sent the server so far (INFO commandstats): script calls, the only
    commands of the decision path (the commands a script runs inside count apart)."""
    with redis.Redis.from_url(url) as connection:
        stats = connection.info("commandstats")
    return sum(
        int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval")
    )


def leased(url: str, clock: Clock, lease_ms: int = LEASE_MS) -> Leased:
    backend = open_backend(url, timeout_ms=TIMEOUT_MS)
    return Leased(backend, store_for(backend, TIMEOUT_MS, lease_ms), lease_ms, clock=clock)


async def test_leased_hits_are_judged_on_the_lease_with_no_store_call_until_it_runs_low(
    redis_url: str,
) -> None:
    """600 a minute, hit 100 times a second for 7 s: the first hit waits for a block (the rule's
    pace over lease_ms: 10), the next ones are judged in memory while the lease is renewed in
    the background, sized by the demand measured; the window admits exactly its limit, then
    refuses without asking the store. A few dozen store calls for 700 hits; Redis holds what
    was handed out, never more than the limit."""
    clock = Clock()
    a = leased(redis_url, clock)
    window = Window(600, Unit.MINUTE, leased=True)
    try:
        first = clock.ms
        key = hit(window, first).key
        before = commands(redis_url)
        outcomes = []
        for _ in range(700):
            (outcome,) = await apply(a, [hit(window, clock.ms)], False, clock.ms)
            outcomes.append(outcome)
            await asyncio.sleep(0)  # the event loop's turn: renewals go out
            clock.now += 0.01
        assert [o.over for o in outcomes] == [False] * 600 + [True] * 100
        assert stored(redis_url, key) == 600
        assert isinstance(a.leases, RedisLeases)
        calls = a.leases.calls
        assert calls <= 20, calls
        # Every call Redis saw is one of these (and an EVAL if it did not have the script).
        assert calls <= commands(redis_url) - before <= calls + 1
        assert a.waited_hits <= calls and a.local_hits + a.waited_hits == 700
        (after,) = await apply(a, [hit(window, clock.ms)], False, clock.ms)
        assert after.over and a.leases.calls == calls
    finally:
        await a.close()


def evals(url: str) -> int:
    """The EVAL commands (a script sent by its text) the server ran so far."""
    with redis.Redis.from_url(url) as connection:
        return int(connection.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))


async def test_a_server_that_lost_the_lease_script_runs_it_again_from_its_text(
    redis_url: str,
) -> None:
    """After SCRIPT FLUSH (what a restart or a failover leaves: an empty script cache), a lease
    is still taken: the NOSCRIPT reply is answered by sending lease.lua's text once (EVAL, which
    caches it again), and the next renewals call it by its hash."""
    clock = Clock()
    a = leased(redis_url, clock)
    try:
        with redis.Redis.from_url(redis_url) as connection:
            connection.script_flush()
        before = evals(redis_url)
        first = hit(LEASED, clock.ms, prefix="api_client_flushed")
        (outcome,) = await apply(a, [first], False, clock.ms)
        assert not outcome.over
        assert evals(redis_url) == before + 1
        assert stored(redis_url, first.key) >= 1  # the block lent, counted in Redis
        assert isinstance(a.leases, RedisLeases)
        calls = a.leases.calls
        clock.now += 10.0  # past a quarter of lease_ms: the next hit renews
        for _ in range(3):
            (outcome,) = await apply(
                a, [hit(LEASED, clock.ms, prefix="api_client_flushed")], False, clock.ms
            )
            await asyncio.sleep(0)
        assert a.leases.calls > calls
        assert evals(redis_url) == before + 1
    finally:
        await a.close()


async def test_a_request_with_exact_and_leased_windows_gets_its_outcomes_in_order(
    redis_url: str,
) -> None:
    """The leased hit is judged on the lease, the exact one by Redis, each in its place."""
    clock = Clock()
    a = leased(redis_url, clock)
    try:
        now = clock.ms
        exact = window_hit("api_ip_b", EXACT, 1, 1, Role.BLOCKING, now)
        for n in range(1, 4):
            first, second = await apply(a, [exact, hit(LEASED, now)], False, now)
            assert first.remaining == 10 - n and not second.over
        assert stored(redis_url, exact.key) == 3
    finally:
        await a.close()


async def test_a_descriptor_refused_by_one_leased_window_spends_nothing_of_the_others(
    redis_url: str,
) -> None:
    """A descriptor with two leased windows (3 a second, 10 a minute): once the second's window
    refuses, the minute's units are not spent (a leased window counts no refused hit)."""
    clock = Clock()
    a = leased(redis_url, clock)
    second = Window(3, Unit.SECOND, leased=True)
    try:
        now = clock.ms
        for _ in range(5):
            await apply(a, [hit(second, now), hit(LEASED, now)], False, now)
        await a.close()
        assert stored(redis_url, hit(LEASED, now).key) == 3  # what was spent, the rest given back
    finally:
        await a.close()


async def test_idle_leases_and_a_stopping_sidecar_give_their_blocks_back(redis_url: str) -> None:
    """A counter with no hit for lease_ms gives its block back at the next tick; close (SIGTERM)
    gives back every block at once: Redis is left with what was spent."""
    clock = Clock()
    a = leased(redis_url, clock)
    busy = Window(1_000, Unit.MINUTE, leased=True)
    idle = Window(600, Unit.MINUTE, leased=True)
    now = clock.ms
    try:
        await apply(a, [hit(busy, now)], False, now)
        await apply(a, [hit(idle, now, prefix="api_client_idle")], False, now)
        # Each took the rule's pace over 1 s: 1000/60 and 600/60.
        assert stored(redis_url, hit(busy, now).key) == 17
        assert stored(redis_url, hit(idle, now, prefix="api_client_idle").key) == 10
        clock.now += LEASE_MS / 1000
        await apply(a, [hit(busy, clock.ms)], False, clock.ms)
        a.tick(clock.ms)  # idle had no hit for lease_ms: given back; busy had one just now
        for _ in range(100):
            if stored(redis_url, hit(idle, now, prefix="api_client_idle").key) == 1:
                break
            await asyncio.sleep(0.01)
        assert stored(redis_url, hit(idle, now, prefix="api_client_idle").key) == 1
        assert stored(redis_url, hit(busy, now).key) == 17
    finally:
        await a.close()
    assert stored(redis_url, hit(busy, now).key) == 2
    assert a.returned_units == 9 + 15


async def test_a_failing_store_leaves_what_the_lease_holds_then_the_failure_mode_answers(
    restartable_redis: Any,
) -> None:
    """With Redis down, hits are still admitted from what the lease holds; once it is spent the
    hit waits for a block that fails (StorageError), which the limiter's failure mode answers
    (deny here). Nothing is ever admitted past what was leased."""
    server = restartable_redis
    clock = Clock()
    a = leased(server.url, clock, lease_ms=30_000)  # the first block: 5 of the minute's 10
    rules = Rules({"api": config.parse(RULES, "api.yaml")})
    limiter = Limiter(rules, a, settings=Settings(failure_mode="deny"), clock=clock)
    asked = Request("api", (Descriptor((Entry("client", "c1"),)),))
    try:
        first = await should_rate_limit(limiter, asked)
        assert first.overall_code is Code.OK
        held = next(iter(a._counts.values())).held
        assert held > 0
        server.stop()
        answers = [await should_rate_limit(limiter, asked) for _ in range(held + 2)]
        assert [d.overall_code for d in answers] == [Code.OK] * held + [Code.OVER_LIMIT] * 2
        assert a.failed_renewals >= 1
    finally:
        server.start()
        await a.close()


async def test_a_return_whose_answer_was_lost_is_not_sent_again(restartable_redis: Any) -> None:
    """A block given back in a call that times out (Redis frozen) may still be taken back when
    Redis wakes: it is not sent again, so it is never taken back twice (which would lend it
    twice); Redis holds exactly what the sidecar spent and holds."""
    server = restartable_redis
    clock = Clock()
    a = leased(server.url, clock)
    window = Window(600, Unit.MINUTE, leased=True)
    key = hit(window, clock.ms).key
    try:
        await apply(a, [hit(window, clock.ms)], False, clock.ms)  # a block of 10: 9 held
        clock.now += LEASE_MS / 1000
        server.pause()
        try:
            a.tick(clock.ms)  # idle: the 9 go back, in a call that times out
            for _ in range(100):
                if a.failed_renewals:
                    break
                await asyncio.sleep(0.02)
            assert a.lost_units == 9
        finally:
            server.resume()
        for _ in range(100):  # Redis runs the late call: the 9 are back
            if stored(server.url, key) == 1:
                break
            await asyncio.sleep(0.02)
        assert stored(server.url, key) == 1
        (outcome,) = await apply(a, [hit(window, clock.ms)], False, clock.ms)
        assert not outcome.over
        (count,) = a._counts.values()
        assert stored(server.url, key) == count.spent + count.held == 2 + count.held
    finally:
        await a.close()


async def test_a_lease_is_never_used_past_its_window(redis_url: str) -> None:
    """What a lease holds at the end of its window is not spent in the next: the next window's
    first hit waits for a block of its own; the next tick forgets the old lease and counts what
    it held as expired."""
    clock = Clock()
    a = leased(redis_url, clock, lease_ms=30_000)  # the first block: 5 of the minute's 10
    try:
        now = clock.ms
        await apply(a, [hit(LEASED, now)], False, now)
        clock.now += 60
        later = clock.ms
        (outcome,) = await apply(a, [hit(LEASED, later)], False, later)
        assert not outcome.over and a.waited_hits == 2
        a.tick(later)  # the ended window's lease is forgotten, what it held counted as expired
        assert a.expired_units == 4 and len(a) == 1
        assert stored(redis_url, hit(LEASED, later).key) == 5
    finally:
        await a.close()


async def test_a_hit_costing_more_than_the_lease_holds_asks_for_its_cost(redis_url: str) -> None:
    """A hit of 20 (hits_addend) on a lease holding 9 waits for a block of at least its cost,
    and is admitted from it."""
    clock = Clock()
    a = leased(redis_url, clock)
    window = Window(600, Unit.MINUTE, leased=True)
    try:
        now = clock.ms
        await apply(a, [hit(window, now)], False, now)  # a block of 10: 9 held
        (outcome,) = await asyncio.wait_for(apply(a, [hit(window, now, cost=20)], False, now), 5)
        assert not outcome.over
        assert stored(redis_url, hit(window, now).key) == 30
    finally:
        await a.close()


async def test_a_hit_waiting_when_its_window_ends_still_gets_its_answer(redis_url: str) -> None:
    """A hit that came within its window and waits for a block gets the block's answer even when
    the renewal goes out after the window ended (it is not left waiting)."""
    clock = Clock()
    a = leased(redis_url, clock)
    try:
        now = clock.ms
        waiting = asyncio.ensure_future(apply(a, [hit(LEASED, now)], False, now))
        clock.now += 60  # the window ends before the event loop sends the renewal
        (outcome,) = await asyncio.wait_for(waiting, 5)
        assert not outcome.over
    finally:
        await a.close()


async def test_a_leased_token_bucket_admits_its_tokens_and_no_more(redis_url: str) -> None:
    """A leased token bucket of 10 a second: a burst at one instant admits its 10 tokens, and
    half a second later the 5 refilled, as the bucket does exactly; Redis keeps the bucket in
    decide.lua's format, so exact sidecars share it."""
    clock = Clock()
    a = leased(redis_url, clock)
    bucket = Window(10, Unit.SECOND, algorithm=Algorithm.TOKEN_BUCKET, leased=True)
    try:
        now = clock.ms
        burst = [(await apply(a, [hit(bucket, now)], False, now))[0].over for _ in range(15)]
        assert burst == [False] * 10 + [True] * 5
        clock.now += 0.5
        later = clock.ms
        refilled = [(await apply(a, [hit(bucket, later)], False, later))[0].over for _ in range(8)]
        assert refilled == [False] * 5 + [True] * 3
        with redis.Redis.from_url(redis_url) as connection:
            stored_bucket = connection.get(hit(bucket, now).key) or b""
        tokens, stamp, _ = stored_bucket.split()
        assert (float(tokens), int(float(stamp))) == (0.0, later)
    finally:
        await a.close()


async def test_a_bucket_lease_is_spent_within_its_term_then_given_back(redis_url: str) -> None:
    """Tokens a sidecar took are spent within lease_ms of its ask: what it holds then goes back
    to the bucket with its next call, and the hit waits for a block of the new term."""
    clock = Clock()
    a = leased(redis_url, clock)
    bucket = Window(10, Unit.SECOND, algorithm=Algorithm.TOKEN_BUCKET, leased=True)
    try:
        now = clock.ms
        await apply(a, [hit(bucket, now)], False, now)  # a block of 7 (two thirds of 10): 6 held
        clock.now += LEASE_MS / 1000
        (outcome,) = await apply(a, [hit(bucket, clock.ms)], False, clock.ms)
        assert not outcome.over
        assert a.returned_units == 6 and a.waited_hits == 2
    finally:
        await a.close()


async def test_a_restarted_redis_lends_nothing_more_of_the_window_it_forgot(
    restartable_redis: Any,
) -> None:
    """Redis restarts mid-window and forgets what it lent: the sidecar keeps spending what it
    holds, a new sidecar gets nothing more of that window (no over-admission), and a window
    that starts after the restart lends as usual. The cost: the rest of that window's budget."""
    server = restartable_redis
    clock = Clock()
    # A second that starts after the server did, and the clock margin after it.
    clock.now = math.ceil(time.time()) + 2.1
    a = leased(server.url, clock)
    second = Window(100, Unit.SECOND, leased=True)
    try:
        now = clock.ms
        (first,) = await apply(a, [hit(second, now)], False, now)  # holds 49 of a block of 50
        assert not first.over
        while time.time() * 1000 < now:  # restart once the window has begun, on Redis' clock
            await asyncio.sleep(0.05)
        server.restart()
        b = leased(server.url, clock)
        try:
            (fresh,) = await apply(b, [hit(second, now)], False, now)
            assert fresh.over
            (kept,) = await apply(a, [hit(second, now)], False, now)
            assert not kept.over
            clock.now += 3  # past the restart and the clock margin
            (next_window,) = await apply(b, [hit(second, clock.ms)], False, clock.ms)
            assert not next_window.over
        finally:
            await b.close()
    finally:
        await a.close()


RULES = """\
domain: api
descriptors:
  - key: client
    leased: true
    rate_limit: {unit: minute, requests_per_unit: 10}
"""

LOAD_RULES = """\
domain: load
descriptors:
  - key: client
    leased: true
    rate_limit: {unit: second, requests_per_unit: 300}
"""
SIDECARS = 3
LIMIT = 300


async def test_three_sidecars_under_load_admit_exactly_each_windows_limit(redis_url: str) -> None:
    """Three sidecars (limiters on their own connections, leases of 200 ms of demand) share one
    Redis and one leased 300/s counter, with demand several times the limit, for a few
    seconds: every whole window admits exactly its limit (0 over; under-admission 0 here,
    within the stated bound), at about ten Redis calls a window whatever the demand (printed
    per 1,000 requests: 8.3 at four times the limit on a quiet machine)."""
    rules = Rules({"load": config.parse(LOAD_RULES, "load.yaml")})
    asked = Request("load", (Descriptor((Entry("client", "c1"),)),))
    backends = [leased(redis_url, time.time, lease_ms=200) for _ in range(SIDECARS)]  # type: ignore[arg-type]
    instant = [time.time()]  # the limiters' clock: each request's window is the one it counts in
    limiters = [Limiter(rules, backend, clock=lambda: instant[0]) for backend in backends]
    for backend in backends:
        backend.start()
    admitted: Counter[int] = Counter()
    demand: Counter[int] = Counter()
    before = commands(redis_url)
    stop_at = math.floor(time.time()) + 4.0

    async def drive(limiter: Limiter) -> None:
        plan = limiter.prepare(asked)
        while (now := time.time()) < stop_at:
            instant[0] = now
            window = int(now)
            for _ in range(2):
                demand[window] += 1

                def done(decision: Decision | Exception, window: int = window) -> None:
                    assert isinstance(decision, Decision), decision
                    if decision.overall_code is Code.OK:
                        admitted[window] += 1

                limiter.decide(plan, lambda d: d, done)
            await asyncio.sleep(0.004)  # about 400 requests a second each: 4 x the limit in all

    try:
        await asyncio.gather(*(drive(limiter) for limiter in limiters))
        await asyncio.sleep(0.2)
    finally:
        for backend in backends:
            await backend.close()
    used = commands(redis_url) - before
    requests = sum(demand.values())
    print(
        f"\nleased, 3 sidecars: {used} Redis commands for {requests} requests: "
        f"{1000 * used / requests:.1f} per 1,000; admitted per window {dict(admitted)}"
    )
    windows = sorted(demand)[1:-1]  # whole seconds only
    assert len(windows) >= 2, demand
    for window in windows:
        assert demand[window] > LIMIT, demand  # four times it on a quiet machine
        assert admitted[window] == LIMIT, (window, admitted, demand)
    # A first block, a few shrinking ones and an answer that the window is spent, per sidecar
    # and window (lease.py): about 10 for 3 sidecars and 300, whatever the demand; 15 at most.
    assert used <= 15 * (len(demand) + 1), (used, demand)


APP_RULES = """\
domain: app
descriptors:
  - key: client
    leased: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 3}
"""


@asynccontextmanager
async def leasing_app(tmp_path: Path, backend: str, **options: Any) -> AsyncIterator[App]:
    app = App(
        Options(
            config=[write_rules(tmp_path, APP_RULES)],
            backend=backend,
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            **options,
        ),
        clock=Clock(),
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace=1.0)


async def test_serve_with_leases_decides_leased_rules_on_leases_and_gives_back_on_stop(
    tmp_path: Path, redis_url: str
) -> None:
    """`serve --lease-ms`: a leased rule is answered from its lease, an exact rule by Redis on
    every call; /metrics counts the leases' work; the block goes back when the sidecar stops."""
    async with (
        leasing_app(tmp_path, redis_url, lease_ms=60_000) as app,
        client(app.grpc_port) as rls,
    ):
        mixed = request("app", [("client", "a")], [("ip", "b")])
        answers = [await rls.should_rate_limit(mixed) for _ in range(5)]
        text = generate_latest(app.registry).decode()
        with redis.Redis.from_url(redis_url, decode_responses=True) as connection:
            counts = {
                key.split("|")[1]: int(connection.get(key) or 0) for key in connection.keys("*")
            }
    assert [[s.code for s in a.statuses] for a in answers] == [
        [Code.OK, Code.OK],
        [Code.OK, Code.OK],
        [Code.OK, Code.OK],
        [Code.OVER_LIMIT, Code.OVER_LIMIT],
        [Code.OVER_LIMIT, Code.OVER_LIMIT],
    ]
    assert counts == {"client": 3, "ip": 5}  # a leased window counts no refused hit
    assert "ratelimit_sidecar_lease_local_hits_total" in text


async def test_leases_refuse_all_or_nothing_and_the_flag_reads_its_variable(
    tmp_path: Path, redis_url: str
) -> None:
    """`--lease-ms N` (or RLS_LEASE_MS), at least 4; not with --rejected-hits skip."""
    with pytest.raises(InvalidOption, match="--rejected-hits skip"):
        async with leasing_app(tmp_path, redis_url, lease_ms=100, rejected_hits="skip"):
            pass
    assert cli.parse_args(["serve", "--config", "x"], {}).lease_ms is None
    assert cli.parse_args(["serve", "--config", "x", "--lease-ms", "250"], {}).lease_ms == 250
    assert cli.parse_args(["serve", "--config", "x"], {"RLS_LEASE_MS": "80"}).lease_ms == 80
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--config", "x", "--lease-ms", "3"], {})


async def test_a_cluster_renews_in_one_call_per_hash_slot(cluster_url: str) -> None:
    """On a Redis Cluster, a request whose three leased counters sit in three hash slots waits
    for one renewal: one `lease.lua` call per slot, each counter lent its block."""
    clock = Clock()
    a = leased(cluster_url, clock)
    try:
        now = clock.ms
        hits = [
            window_hit(f"api_client_{name}", LEASED, 1, group, Role.BLOCKING, now)
            for group, name in enumerate("abc")
        ]
        outcomes = await apply(a, hits, False, now)
        assert not any(o.over for o in outcomes)
        assert a.renewals == 1
        assert isinstance(a.leases, RedisLeases) and a.leases.calls == 3
    finally:
        await a.close()
