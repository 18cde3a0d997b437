"""What a failed Redis call becomes: the StorageError or Overloaded the Backend contract allows,
for the Redis backends (`redis.py`, `cluster.py`) and the script contract (`scripts.py`); and
which failures are the sidecar's configuration rather than an outage (`fault`)."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Iterable
from typing import Any, Final

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


#: Error replies that refuse the credentials sent, or ask for some (Redis 6 and later, and 5).
_REFUSED: Final = re.compile(r"WRONGPASS|NOAUTH|invalid password|invalid username", re.IGNORECASE)


def fault(exc: BaseException | None, server: str) -> str | None:
    """Why `server` cannot be used, when waiting will not cure it: it refuses our credentials
    (or wants some), or a host name does not resolve. None for anything else (an outage:
    refused or lost connections, no answer), which a restarted server or network ends. `exc`
    is what a connection attempt or a call raised; its causes are looked at too, and the words
    of those that carry another's as text (the cluster's slot map, the Sentinels')."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 5:  # a few wrappers deep
        chain.append(exc)
        exc = exc.__cause__
    for error in chain:
        if isinstance(error, socket.gaierror):
            return f"{server}: the host name does not resolve ({error.strerror or error})"
        if not isinstance(error, OSError) and _REFUSED.search(str(error)):
            return _refused(server, str(error))
    for error in chain:
        text = str(error)
        if "gaierror" in text:
            return f"{server}: a host name does not resolve ({text})"
        if _REFUSED.search(text):
            return _refused(server, text)
    return None


def _refused(server: str, reply: str) -> str:
    if "NOAUTH" in reply:
        return f"{server} wants a password, and none is given (REDIS_AUTH, or the URL's): {reply}"
    return f"{server} refuses the credentials given (REDIS_AUTH, or the URL's): {reply}"


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
