"""What a running sidecar is made of: a list of parts, each started in order and stopped in
reverse, and each that reads the rules told of every new set.

A `Part` is three optional hooks: `start`, `stop(grace)` and `rules_changed(rules)`. The
composition root (`sidecar.runner.app`) owns the list (built by `sidecar.runner.assembly`), so adding a
listener, a background task or a consumer of rules is one entry where the list is built; the
order of the list is the start order, and its reverse the stop order (what started last, the
health report, stops first: unhealthy everywhere before anything closes).

Every `stop` is safe whether or not its `start` ran: a failed start stops every part built so
far, as the reference's runner stops what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sidecar.core.rules import Rules


async def _idle() -> None:
    return None


async def _idle_stop(grace: float) -> None:
    return None


@dataclass(frozen=True)
class Part:
    """One piece of the sidecar: what starts it, what stops it (calls in flight get `grace`
    seconds), and, for a part that reads the rules, what gives it a new set (None: it does not)."""

    name: str
    start: Callable[[], Awaitable[object]] = _idle
    stop: Callable[[float], Awaitable[object]] = _idle_stop
    rules_changed: Callable[[Rules], object] | None = None


def closing(name: str, close: Callable[[], Awaitable[object]]) -> Part:
    """A part opened when built, closed at stop (a backend, the statsd reporter)."""

    async def stop(grace: float) -> None:
        await close()

    return Part(name, stop=stop)


def reading_rules(name: str, rules_changed: Callable[[Rules], object]) -> Part:
    """A part that only takes each new set of rules (a limiter, the frequency caps)."""
    return Part(name, rules_changed=rules_changed)


class _Background:
    """A coroutine run as a task from start to stop."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._make = make
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._make())

    async def stop(self, grace: float) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def background(name: str, make: Callable[[], Coroutine[Any, Any, None]]) -> Part:
    """A part that runs `make()` as a task from its start (a watch, a poll) and cancels it."""
    task = _Background(make)
    return Part(name, task.start, task.stop)


@dataclass(frozen=True)
class Listener:
    """A server on a port: `start` returns the port bound, `stop(grace)` lets calls finish."""

    name: str
    start: Callable[[], Awaitable[int]]
    stop: Callable[[float], Awaitable[object]]


@dataclass
class Listeners:
    """The servers, one part: started in order (each bound port kept by name), stopped together,
    so that the calls in flight on each get the same grace rather than one after another."""

    listeners: list[Listener] = field(default_factory=list)
    #: The port each listener bound, by name (absent until it started).
    ports: dict[str, int] = field(default_factory=dict)

    async def start(self) -> None:
        for listener in self.listeners:
            self.ports[listener.name] = await listener.start()

    async def stop(self, grace: float) -> None:
        await asyncio.gather(*(listener.stop(grace) for listener in self.listeners))

    def part(self) -> Part:
        return Part("listeners", self.start, self.stop)
