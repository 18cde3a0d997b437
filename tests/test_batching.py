"""Flushes held while a read is handled run when it ends (sidecar.loop.batching), and the fast
transport's calls answered from Redis take no extra turn of the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from support.sidecars import client, request, running_app, write_rules

from sidecar.loop import batching
from sidecar.storage.redis import RedisBackend


@pytest.fixture(autouse=True)
def no_read_left_open() -> Iterator[None]:
    yield
    assert batching.begin(), "a test left a read open"
    batching.end()


def test_flushes_deferred_in_a_read_run_in_order_when_it_ends() -> None:
    """Inside a read, `defer` holds each flush with its arguments; `end` runs them in the order
    they came, once, and holds nothing more."""
    ran: list[Any] = []
    assert batching.begin()
    assert batching.defer(ran.append, "first")
    assert batching.defer(ran.append, "second")
    assert ran == []
    batching.end()
    assert ran == ["first", "second"]
    batching.end()
    assert ran == ["first", "second"]


def test_outside_a_read_defer_declines() -> None:
    """With no read being handled, `defer` holds nothing and says so: the caller schedules its
    flush itself."""
    ran: list[str] = []
    assert not batching.defer(ran.append, "x")
    assert ran == []


def test_a_read_handled_inside_another_joins_the_outer_one() -> None:
    """A second `begin` inside a read is not the owner: its flushes run when the outer read
    ends, not before."""
    ran: list[str] = []
    assert batching.begin()
    assert not batching.begin()
    batching.defer(ran.append, "inner")
    assert ran == []
    batching.end()
    assert ran == ["inner"]


def test_a_flush_that_raises_is_logged_and_the_others_still_run() -> None:
    """One connection's failing flush neither stops the rest nor escapes into the protocol."""
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    with structlog.testing.capture_logs() as logs:
        batching.begin()
        batching.defer(broken)
        batching.defer(ran.append, "after")
        batching.end()
    assert ran == ["after"]
    assert [entry["event"] for entry in logs] == ["flush_failed"]
    assert "boom" in logs[0]["error"]


def test_each_thread_holds_its_own_flushes() -> None:
    """A read handled in one thread holds nothing for another thread's event loop: a flush must
    run in the thread of the loop that owns its connection."""
    seen: list[bool] = []
    assert batching.begin()
    worker = threading.Thread(target=lambda: seen.append(batching.defer(print, "never")))
    worker.start()
    worker.join()
    batching.end()
    assert seen == [False]


RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000}
"""


class FlushesScheduled:
    """Records the sidecar's flushes that were left to a later turn of the loop (`call_soon`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.names: list[str] = []
        self._loop = loop
        self._call_soon = loop.call_soon

    def __enter__(self) -> FlushesScheduled:
        def call_soon(callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:
            owner = getattr(callback, "__self__", None)
            name = getattr(callback, "__name__", "")
            if name == "_flush" and type(owner).__module__.startswith("sidecar."):
                self.names.append(f"{type(owner).__module__}.{callback.__qualname__}")
            return self._call_soon(callback, *args, **kwargs)

        self._loop.call_soon = call_soon  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._loop.call_soon  # back to the class's own method


@pytest.mark.redis
async def test_a_call_answered_from_redis_leaves_no_flush_for_a_later_turn(
    tmp_path: Path, redis_url: str
) -> None:
    """On the fast transport, the Redis command a request causes leaves when the request's read
    is handled, and the answer leaves when Redis's reply is handled: behind Envoy, with a call
    or two per turn, neither waits for another turn of the event loop."""
    rules = write_rules(tmp_path, RULES)
    backend = RedisBackend.from_url(redis_url, timeout_ms=1000)
    async with running_app(rules, backend=backend) as app, client(app.grpc_port) as rls:
        message = request("test", [("user", "u1")])
        await rls.should_rate_limit(message)  # connections open, the script is loaded
        with FlushesScheduled(asyncio.get_running_loop()) as scheduled:
            for _ in range(10):
                response = await rls.should_rate_limit(message)
                assert response.overall_code == response.OK
        assert scheduled.names == []
        assert response.statuses[0].limit_remaining == 1000 - 11
