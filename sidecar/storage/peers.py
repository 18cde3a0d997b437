"""How many sidecars share a backend's counters: what `--failure-mode local` divides each limit
by when `--local-divisor auto` leaves it to be learned.

While the backend answers, every sidecar (every worker process) writes its name into one sorted
set on it, scored by the server's own clock, every `PEERS_INTERVAL`, drops the names not seen
for `PEERS_TTL_MS`, and reads how many are left. When the backend fails, the last count read is
the divisor: the sidecars that were sharing the counters a few seconds before. A sidecar that
stops cleanly takes its name out at once; one that dies drops out after `PEERS_TTL_MS`.

The set holds one entry per live sidecar (at most a few hundred bytes each) and expires with
them; its key carries a hash tag, so on a Redis Cluster it lives in one slot.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

#: The sorted set of sidecar names (a hash tag: one slot on a cluster).
PEERS_KEY = b"{ratelimit-sidecar}:peers"
#: Seconds between two registrations of one sidecar.
PEERS_INTERVAL = 2.0
#: A sidecar not heard from for this long no longer counts (three missed registrations).
PEERS_TTL_MS = 6_000

#: KEYS[1] the set, ARGV[1] this sidecar's name, ARGV[2] the time to live in ms; returns how
#: many names are left. The server's clock scores the names, so the sidecars' clocks may differ.
_SCRIPT = b"""
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
"""


@runtime_checkable
class CountsPeers(Protocol):
    """A shared backend that can count the sidecars sharing it (memory cannot: it is one)."""

    async def peers(self, name: bytes) -> int:
        """Register `name` as live and return how many sidecars are; raises StorageError."""
        ...

    async def leave(self, name: bytes) -> None:
        """Take `name` out at once (a clean stop); never raises."""
        ...


def own_name() -> bytes:
    """This process's name in the set: host, process id and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}".encode()


async def register(execute: Callable[..., Awaitable[Any]], name: bytes) -> int:
    """Run the registration through `execute` (a client's `execute(*args)`)."""
    count = await execute(b"EVAL", _SCRIPT, 1, PEERS_KEY, name, PEERS_TTL_MS)
    return int(count)


async def unregister(execute: Callable[..., Awaitable[Any]], name: bytes) -> None:
    await execute(b"ZREM", PEERS_KEY, name)


async def count_within(
    execute: Callable[..., Awaitable[Any]],
    name: bytes,
    timeout: float,
    failure: Callable[[Exception], Exception],
) -> int:
    """`register` within `timeout`; whatever fails is raised as `failure` makes it (a
    backend's StorageError or Overloaded)."""
    try:
        async with asyncio.timeout(timeout):
            return await register(execute, name)
    except Exception as exc:
        raise failure(exc) from exc


async def leave_within(execute: Callable[..., Awaitable[Any]], name: bytes, timeout: float) -> None:
    """`unregister` within `timeout`, best effort: a name left behind drops out after its
    time to live anyway."""
    try:
        async with asyncio.timeout(timeout):
            await unregister(execute, name)
    except Exception:
        return
