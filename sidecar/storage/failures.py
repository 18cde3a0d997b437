"""What a failed Redis call becomes: the StorageError or Overloaded the Backend contract allows,
for the Redis backends (`redis.py`, `cluster.py`) and the script contract (`scripts.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

from redis.exceptions import RedisError

from sidecar.errors import Overloaded, StorageError


def failure(backend: str, timeout_ms: int, exc: Exception) -> StorageError | Overloaded:
    """The StorageError for whatever a call raised, or Overloaded for a call the client refused
    because its server already had as many calls in flight as it answers in time.

    Mostly the pipelined clients' RedisReplyError and ConnectionLost, or the cluster client's
    ClusterError, and `asyncio.timeout` raises TimeoutError. The Backend contract promises
    StorageError only, so that the service answers with its failure mode rather than an
    internal error: callers catch every Exception and the original type stays in the message
    for the logs. Overloaded is kept apart: Redis is answering, so the failure mode (which
    would admit) must not.
    """
    if isinstance(exc, Overloaded):
        return Overloaded(f"{backend}: {exc}")
    if isinstance(exc, TimeoutError) and not isinstance(exc, RedisError):
        return StorageError(f"{backend}: no answer within {timeout_ms} ms")
    return StorageError(f"{backend}: {type(exc).__name__}: {exc}")


async def gather_all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await every call, then raise the first failure.

    Waiting for all before raising leaves no call running unobserved after the caller returns;
    the caller's deadline still bounds the wait.
    """
    replies = await asyncio.gather(*calls, return_exceptions=True)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies
