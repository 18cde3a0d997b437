"""A second Redis for per-second limits (the reference's REDIS_PERSECOND, `--backend-per-second`):
each descriptor's counters live on the store its windows pick, one request may use both, and
the answers are those of one store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from support.servers import RedisServer
from support.sidecars import NOW, Clock, client, request, write_rules

from sidecar import cli
from sidecar.model import Code, Hit, Unit, Window
from sidecar.runner.app import App, InvalidOption, Options
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.per_second import PerSecond

pytestmark = pytest.mark.redis

RULES = """\
domain: split
descriptors:
  - key: per_second
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: per_minute
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: both
    rate_limits:
      - {unit: second, requests_per_unit: 5}
      - {unit: hour, requests_per_unit: 100}
"""


@asynccontextmanager
async def split_app(
    tmp_path: Path, main: str, per_second: str, **options: Any
) -> AsyncIterator[App]:
    app = App(
        Options(
            config=[write_rules(tmp_path, RULES)],
            backend=main,
            backend_per_second=per_second,
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            **options,
        ),
        clock=Clock(NOW),
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace=1.0)


def keys(url: str) -> list[str]:
    with redis.Redis.from_url(url, decode_responses=True) as connection:
        return sorted(connection.keys("*"))


async def test_per_second_counters_live_on_their_own_store(
    tmp_path: Path, redis_url: str, restartable_redis: RedisServer
) -> None:
    """In one request, the per-second descriptor counts on the per-second Redis, the others
    (a minute, and seconds beside an hour) on the main one; each answers as one store would."""
    second_url = restartable_redis.url
    async with split_app(tmp_path, redis_url, second_url) as app, client(app.grpc_port) as rls:
        mixed = request("split", [("per_second", "a")], [("per_minute", "b")], [("both", "c")])
        answers = [await rls.should_rate_limit(mixed) for _ in range(3)]
        alone = await rls.should_rate_limit(request("split", [("per_second", "z")]))

    assert [[s.code for s in a.statuses] for a in answers] == [
        [Code.OK, Code.OK, Code.OK],
        [Code.OK, Code.OK, Code.OK],
        [Code.OVER_LIMIT, Code.OK, Code.OK],
    ]
    assert [a.statuses[1].limit_remaining for a in answers] == [2, 1, 0]
    assert alone.overall_code == Code.OK
    on_second, on_main = keys(second_url), keys(redis_url)
    assert len(on_second) == 2 and all("per_second" in key for key in on_second)
    assert len(on_main) == 3
    assert not any("per_second" in key for key in on_main)
    assert sum("both" in key for key in on_main) == 2
    assert app.health.backend_ok


async def test_a_failing_per_second_store_fails_its_calls_and_health(
    tmp_path: Path, redis_url: str, restartable_redis: RedisServer
) -> None:
    """A call that needs the stopped store is answered by the failure mode (deny here) and
    counted as a Redis error; health needs both stores to answer."""
    async with (
        split_app(tmp_path, redis_url, restartable_redis.url, failure_mode="deny") as app,
        client(app.grpc_port) as rls,
    ):
        restartable_redis.stop()
        mixed = request("split", [("per_second", "a")], [("per_minute", "b")])
        answer = await rls.should_rate_limit(mixed)
        assert answer.overall_code == Code.OVER_LIMIT
        assert app.stats.backend_error == 1
        assert await app.health.check() is False


async def test_per_second_with_all_or_nothing_or_memory_is_refused(
    tmp_path: Path, redis_url: str
) -> None:
    """Two stores cannot decide a request all or nothing, and memory is no shared store."""
    with pytest.raises(InvalidOption, match="--rejected-hits skip"):
        async with split_app(tmp_path, redis_url, redis_url, rejected_hits="skip"):
            pass
    with pytest.raises(InvalidOption, match="not memory://"):
        async with split_app(tmp_path, "memory://", redis_url):
            pass


def test_a_descriptor_goes_to_the_per_second_store_only_with_all_its_windows() -> None:
    """Routing is by descriptor (its `group`): every window in seconds, or the main store."""
    second, minute = Window(1, Unit.SECOND), Window(1, Unit.MINUTE)
    hits = [
        Hit(b"a", 1, second, group=0),
        Hit(b"b", 1, minute, group=1),
        Hit(b"c", 1, second, group=2),
        Hit(b"d", 1, minute, group=2),
    ]
    from sidecar.storage.redis import RedisBackend

    backend = PerSecond(
        RedisBackend.from_url("redis://127.0.0.1:1"), RedisBackend.from_url("redis://127.0.0.1:2")
    )
    assert backend.split(hits) == [True, False, False, False]
    with pytest.raises(ValueError, match="not memory://"):
        PerSecond(MemoryBackend(), MemoryBackend())


def test_redis_persecond_variables_make_the_per_second_backend() -> None:
    """REDIS_PERSECOND=true with REDIS_PERSECOND_* builds --backend-per-second (TLS files are
    REDIS_TLS_*'s); without its URL the start stops naming what to set."""
    env = {
        "REDIS_URL": "main:6379",
        "REDIS_PERSECOND": "true",
        "REDIS_PERSECOND_SOCKET_TYPE": "tcp",
        "REDIS_PERSECOND_URL": "fast:6379",
        "REDIS_PERSECOND_AUTH": "secret",
    }
    args = cli.parse_args(["serve", "--config", "x", "--reference-env"], env)
    assert (args.backend, args.backend_per_second) == (
        "redis://main:6379",
        "redis://:secret@fast:6379",
    )
    with pytest.raises(SystemExit):
        cli.parse_args(
            ["serve", "--config", "x", "--reference-env"],
            {"REDIS_URL": "main:6379", "REDIS_PERSECOND": "1"},
        )
