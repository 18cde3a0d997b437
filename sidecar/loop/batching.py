"""Writes caused by one read leave at the end of that read, without another turn of the loop.

The HTTP/2 server and the pipelined Redis client both queue what they have to send and write
it once per batch. Left to themselves they flush with `call_soon`, and each such flush costs
one more turn of the event loop (an `epoll_wait` and the loop's own bookkeeping). When calls
come one at a time (an Envoy with little traffic), those turns cost about as much as the calls:
a request read from Envoy queues a Redis command, and a reply read from Redis queues an answer.

While a protocol handles a read inside `begin()`/`end()`, `defer` holds such flushes instead,
and `end` runs them when the read is handled: the Redis commands a request caused, and the
answers a Redis reply completed, leave before the loop polls again. Outside a read (a task, a
timer, the grpcio transport) `defer` declines and the caller schedules its flush itself.

The state is per thread, since each event loop runs in one thread and a flush must run in its
own loop's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("sidecar.batching")


class _Held(threading.local):
    # The flushes held until the current read ends; None outside a read.
    flushes: list[tuple[Callable[..., None], tuple[Any, ...]]] | None = None


_held = _Held()


def begin() -> bool:
    """Hold flushes until `end`; True when this call started holding (and so must call `end`),
    False inside a read already being handled (a read handled within another's callbacks)."""
    if _held.flushes is not None:
        return False
    _held.flushes = []
    return True


def defer(flush: Callable[..., None], *args: Any) -> bool:
    """Run `flush(*args)` when the read being handled ends; False outside a read, where the
    caller must schedule it itself. A caller defers each batch once (it keeps its own flag)."""
    flushes = _held.flushes
    if flushes is None:
        return False
    flushes.append((flush, args))
    return True


def end() -> None:
    """Run the held flushes in the order they were deferred, and stop holding.

    A flush that raises is a bug; it is logged and the others still run, so one connection's
    failure never keeps another's bytes unsent.
    """
    flushes = _held.flushes
    _held.flushes = None
    if not flushes:
        return
    for flush, args in flushes:
        try:
            flush(*args)
        except Exception as exc:
            log.exception("flush_failed", error=repr(exc))
