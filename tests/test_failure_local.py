"""`--failure-mode local`: while the backend fails, each sidecar limits on its own counters at
its share of every limit (limit / N), and goes back to the shared counters when the backend
answers again. Against a real redis-server, stopped and started on the same port, through both
ways a caller gets a decision (awaited through `sidecar.loop.callbacks.awaited`, and the callbacks
of `decide`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitResponse  # type: ignore[import-untyped]
from support.callbacks import decide
from support.clock import Clock
from support.servers import RedisServer
from support.sidecars import running_app, write_rules

from sidecar.cli import build_parser
from sidecar.cli.serve import worker_flags
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings, local_share
from sidecar.model import Code, Descriptor, Entry, Request
from sidecar.rls import convert
from sidecar.storage.backends import open_backend
from sidecar.storage.peers import PEERS_INTERVAL, PEERS_KEY, CountsPeers

RULES = """
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tiny
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: blocked
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: bucket
    rate_limit: {algorithm: token_bucket, unit: minute, requests_per_unit: 9}
  - key: both
    rate_limits:
      - {unit: minute, requests_per_unit: 6}
      - {unit: hour, requests_per_unit: 60}
"""

#: (code, limit_remaining, current_limit's requests_per_unit) of one descriptor's answer.
Answer = tuple[int, int, int]


def test_a_share_is_the_limit_divided_rounded_down_but_never_zero_of_a_limit() -> None:
    """Each of N sidecars enforces limit // N, so that together they admit no more than the
    limit; a limit that is not 0 keeps at least 1, and a limit of 0 stays 0."""
    assert [local_share(limit, 3) for limit in (10, 9, 3, 2, 1, 0)] == [3, 3, 1, 1, 1, 0]
    assert local_share(1000, 1) == 1000
    with pytest.raises(ValueError, match="at least 1"):
        Settings(failure_mode="local", local_divisor=0)


@pytest.fixture(params=["awaited", "callbacks"])
async def ask(
    request: pytest.FixtureRequest, restartable_redis: RedisServer, clock: Clock
) -> AsyncIterator[tuple[Limiter, Callable[[str], asyncio.Future[Answer]]]]:
    """A limiter under `--failure-mode local --local-divisor 3` on the test's own Redis, and
    `ask(key)`: one call for the descriptor (key, "a"), answered through `request.param`."""
    rules = Rules({"d": config.parse(RULES, "rules.yaml")})
    backend = open_backend(f"redis://127.0.0.1:{restartable_redis.port}", timeout_ms=200)
    limiter = Limiter(
        rules,
        backend,
        settings=Settings(failure_mode="local", local_divisor=3),
        clock=clock,
    )

    def ask(key: str) -> asyncio.Future[Answer]:
        plan = limiter.prepare(Request("d", (Descriptor((Entry(key, "a"),)),), 0))
        if request.param == "awaited":
            return asyncio.ensure_future(_read(decide(limiter, plan)))
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

        def done(answer: bytes | Exception) -> None:
            assert isinstance(answer, bytes), answer
            status = RateLimitResponse.FromString(answer).statuses[0]
            answered.set_result(
                (status.code, status.limit_remaining, status.current_limit.requests_per_unit)
            )

        limiter.decide(plan, convert.response_bytes, done)
        return answered

    yield limiter, ask
    await backend.close()


async def _read(decision: object) -> Answer:
    got = await decision  # type: ignore[misc]
    status = got.statuses[0]
    return (int(status.code), status.limit_remaining, status.window.requests_per_unit)


OK, OVER = int(Code.OK), int(Code.OVER_LIMIT)


@pytest.mark.redis
async def test_a_failed_backend_is_replaced_by_local_shares_until_it_answers_again(
    ask: tuple[Limiter, Callable[[str], asyncio.Future[Answer]]], restartable_redis: RedisServer
) -> None:
    """With Redis up, calls count on the shared counter (10 a minute). With Redis paused (no
    answer within the 200 ms deadline), each call is decided on this sidecar's counters at a third of the limit (3 a minute, reported as
    the current limit), counted as a backend error and a local decision, never answered by
    failing open or closed. Once Redis is back, calls count on the shared counter again. (The
    paused Redis still runs the four calls that had reached it when it resumes, as a Redis that
    is late does: a call that timed out may still be counted, never the other way round.)"""
    limiter, call = ask
    shared = [await call("user") for _ in range(2)]
    assert shared == [(OK, 9, 10), (OK, 8, 10)]

    restartable_redis.pause()
    try:
        local = [await call("user") for _ in range(4)]
    finally:
        restartable_redis.resume()
    assert local == [(OK, 2, 3), (OK, 1, 3), (OK, 0, 3), (OVER, 0, 3)]
    assert limiter.stats.backend_error == 4
    assert limiter.stats.local_decisions == 4

    for _ in range(50):  # the client may reconnect, after its back-off
        answer = await call("user")
        if answer[2] == 10:
            break
        await asyncio.sleep(0.05)
    assert answer == (OK, 10 - 2 - 4 - 1, 10)
    assert limiter.stats.local_decisions == limiter.stats.backend_error


@pytest.mark.redis
async def test_local_shares_keep_small_and_zero_limits_and_every_algorithm(
    ask: tuple[Limiter, Callable[[str], asyncio.Future[Answer]]], restartable_redis: RedisServer
) -> None:
    """At a third: a limit of 1 keeps 1 (not 0, which would block), a limit of 0 still admits
    nothing, a token bucket of 9 admits 3, and a descriptor with two windows (6 a minute, 60 an
    hour) admits the smaller share, 2."""
    _, call = ask
    restartable_redis.stop()
    assert [await call("tiny") for _ in range(2)] == [(OK, 0, 1), (OVER, 0, 1)]
    assert await call("blocked") == (OVER, 0, 0)
    bucket = [await call("bucket") for _ in range(4)]
    assert [code for code, _, _ in bucket] == [OK, OK, OK, OVER]
    both = [await call("both") for _ in range(3)]
    assert [(code, limit) for code, _, limit in both] == [(OK, 2), (OK, 2), (OVER, 2)]


def test_workers_split_the_local_share_again() -> None:
    """`serve --workers 2 --failure-mode local --local-divisor 3`: each worker keeps its own
    local counters, so each is started with a divisor of 6."""
    parser, env_flags = build_parser()
    argv = "serve --config r.yaml --workers 2 --failure-mode local --local-divisor 3"
    args = parser.parse_args(argv.split())
    env_flags["serve"].resolve(args, {})
    flags = worker_flags(args)
    assert flags[flags.index("--local-divisor") + 1] == "6"
    assert flags[flags.index("--failure-mode") + 1] == "local"


@pytest.mark.redis
async def test_auto_divisor_counts_the_sidecars_sharing_the_backend(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """Under `--local-divisor auto` each sidecar registers on the backend when it starts and
    every PEERS_INTERVAL after, and divides local limits by how many are registered: a second
    sidecar sees two at once. A sidecar that stops cleanly takes its name out, and the other
    one counts itself alone at its next registration."""
    rules = write_rules(tmp_path)
    local = {"failure_mode": "local", "local_divisor": None}
    async with running_app(rules, backend=open_backend(redis_url), **local) as first:
        second_context = running_app(rules, backend=open_backend(redis_url), **local)
        second = await second_context.__aenter__()
        try:
            assert second.assembly.limiter is not None and first.assembly.limiter is not None
            assert second.assembly.limiter.local_divisor == 2
            with redis_server.client() as inspect:
                assert inspect.zcard(PEERS_KEY) == 2
        finally:
            await second_context.__aexit__(None, None, None)
        with redis_server.client() as inspect:
            assert inspect.zcard(PEERS_KEY) == 1
        for _ in range(int(PEERS_INTERVAL * 2 / 0.1)):
            if first.assembly.limiter.local_divisor == 1:
                break
            await asyncio.sleep(0.1)
        assert first.assembly.limiter.local_divisor == 1


@pytest.mark.redis
async def test_a_fixed_divisor_or_another_failure_mode_registers_nothing(
    tmp_path: Path, redis_url: str, redis_server: RedisServer
) -> None:
    """Only `--failure-mode local` with `--local-divisor auto` registers on the backend."""
    rules = write_rules(tmp_path)
    for options in ({"failure_mode": "local", "local_divisor": 3}, {"failure_mode": "allow"}):
        async with running_app(rules, backend=open_backend(redis_url), **options) as app:
            assert app.assembly.limiter is not None
            assert app.assembly.limiter.local_divisor == options.get("local_divisor", 1)
            with redis_server.client() as inspect:
                assert inspect.zcard(PEERS_KEY) == 0


@pytest.mark.parametrize(
    "backend_url",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
    indirect=True,
)
async def test_shared_backends_count_registered_sidecars(backend_url: str) -> None:
    """A Redis and a Redis Cluster count the names registered within the time to live; a name
    that leaves is no longer counted."""
    backend = open_backend(backend_url, timeout_ms=1000)
    try:
        assert isinstance(backend, CountsPeers)
        counts = [await backend.peers(b"a"), await backend.peers(b"b"), await backend.peers(b"a")]
        await backend.leave(b"a")
        counts.append(await backend.peers(b"b"))
    finally:
        await backend.close()
    assert counts == [1, 2, 2, 1]
