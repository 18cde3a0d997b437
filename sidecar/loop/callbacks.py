"""Where the decision path's callback form meets coroutines: the one adapter between them.

Every layer of the decision path answers through a callback, once: the backend
(`Backend.apply`), the limiter (`Limiter.decide`) and the service
(`RateLimitService.should_rate_limit`). `done` gets the result, or the exception the call
ended with; what goes wrong before the store is asked is raised by the call itself. That form is
the hot path's (no coroutine, task or future per call, which is most of what a call costs in
Python once the store's own work is small), so it is the one implementation. A caller that
wants a coroutine (grpc.aio, the `/json` endpoint, tests) awaits it through `awaited`, here and
nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: What a call in the callback form hands its answer to: the result, or the exception it ended
#: with.
Done = Callable[[T | Exception], None]


async def awaited(start: Callable[[Done[T]], None]) -> T:
    """Run `start(done)` and wait for its answer: return the result `done` gets, raise the
    exception it gets, or what `start` raises before it answers. An answer that comes after the
    caller gave up (cancelled, or its own timeout) is dropped, as is a second one."""
    answer: asyncio.Future[T | Exception] = asyncio.get_running_loop().create_future()

    def done(result: T | Exception) -> None:
        if not answer.done():
            answer.set_result(result)

    start(done)
    result = await answer
    if isinstance(result, Exception):
        raise result
    return result
