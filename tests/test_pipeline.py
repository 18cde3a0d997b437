"""The pipelined Redis client of the hot path, against real redis-server processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_binary
from servers import RedisServer, ServerError, start_server

from sidecar.storage.pipeline import ConnectionLost, PipelinedRedis, RedisReplyError
from sidecar.storage.redis import RedisBackend

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[PipelinedRedis]:
    redis_server.start()
    pipelined = PipelinedRedis("127.0.0.1", redis_server.port, connect_timeout=1.0)
    yield pipelined
    await pipelined.close()


async def test_calls_of_one_tick_leave_in_one_write(client: PipelinedRedis) -> None:
    """100 calls issued together share one write, and each gets its own reply, in order."""
    await client.execute("PING")  # connected
    protocol: Any = client._protocol
    writes: list[bytes] = []
    write = protocol.transport.write

    def counting(data: bytes) -> None:
        writes.append(data)
        write(data)

    protocol.transport.write = counting
    replies = await asyncio.gather(*(client.execute("ECHO", str(i)) for i in range(100)))
    assert replies == [str(i).encode() for i in range(100)]
    assert len(writes) == 1


async def test_an_error_reply_raises_and_leaves_the_others_in_step(client: PipelinedRedis) -> None:
    """An error reply fails its own call only; the calls around it get their own replies."""
    results = await asyncio.gather(
        client.execute("ECHO", "a"),
        client.execute("NOSUCHCOMMAND"),
        client.execute("ECHO", "b"),
        return_exceptions=True,
    )
    assert results[0] == b"a" and results[2] == b"b"
    assert isinstance(results[1], RedisReplyError)
    assert "unknown command" in str(results[1])


async def test_a_call_that_gives_up_does_not_shift_later_replies(client: PipelinedRedis) -> None:
    """A cancelled call's reply is dropped when it arrives; the next call gets its own."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await client.execute("BLPOP", "nothing-here", "0.2")
    assert await client.execute("ECHO", "next") == b"next"


@pytest.fixture
def protected(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own that wants a password."""
    require_binary("redis-server")
    try:
        server = start_server(tmp_path)
    except ServerError as exc:
        pytest.fail(str(exc))
    with server.client() as sync:
        sync.config_set("requirepass", "s3cret")
    yield server
    server.stop()


async def test_auth_and_database_are_sent_on_connect(protected: RedisServer) -> None:
    """A password and a database from the URL are used on every new connection."""
    backend_url = f"redis://:s3cret@127.0.0.1:{protected.port}/3"
    backend = RedisBackend.from_url(backend_url, timeout_ms=1000)
    try:
        assert await backend.ping()
        client: Any = backend._client
        await client.execute("SET", "k", "v")
    finally:
        await backend.close()
    with protected.client() as sync:
        sync.execute_command("AUTH", "s3cret")
        sync.execute_command("SELECT", "3")
        assert sync.get("k") == b"v"
    wrong = RedisBackend.from_url(f"redis://:wrong@127.0.0.1:{protected.port}", timeout_ms=1000)
    try:
        assert not await wrong.ping()
    finally:
        await wrong.close()


async def test_a_dead_server_fails_fast_and_a_restarted_one_serves_again(
    restartable_redis: RedisServer,
) -> None:
    """Calls to a stopped server fail at once (no waiting out the deadline), and the same client
    reconnects when the server is back."""
    client = PipelinedRedis("127.0.0.1", restartable_redis.port, connect_timeout=1.0)
    try:
        assert await client.execute("PING") == b"PONG"
        restartable_redis.stop()
        with pytest.raises(ConnectionLost):
            await client.execute("PING")
        started = time.monotonic()
        with pytest.raises(ConnectionLost):
            await client.execute("PING")
        assert time.monotonic() - started < 0.5
        restartable_redis.start()
        await asyncio.sleep(0.15)  # past the reconnect back-off
        assert await client.execute("PING") == b"PONG"
    finally:
        await client.close()


async def test_a_hung_server_drops_the_connection_and_recovers(
    restartable_redis: RedisServer,
) -> None:
    """A server that stops answering fails calls by their deadline; once it answers again, a new
    connection serves."""
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{restartable_redis.port}", timeout_ms=200)
    try:
        assert await backend.ping()
        restartable_redis.pause()
        await asyncio.sleep(0.25)
        client: Any = backend._client
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.execute("PING")
        assert client._protocol.lost is not None  # dropped: nothing heard for a whole deadline
        assert not await backend.ping()
        restartable_redis.resume()
        for _ in range(20):
            if await backend.ping():
                break
            await asyncio.sleep(0.1)
        assert await backend.ping()
    finally:
        restartable_redis.resume()
        await backend.close()
