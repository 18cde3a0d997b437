"""Where the quota service keeps a bucket's reported usage and every Envoy's assignment, so that
every sidecar sharing a backend decides from the same numbers.

Per bucket (`buckets.state_key`, the whole bucket id in the Redis Cluster hash tag, so its keys
share a slot) the store holds:

- ``<key>|used|<window start>``: what the reports allowed in that window, living two windows;
- ``<key>|holders``: a hash, one field per Envoy (its `Holder`, packed by `pack`), and
  ``%version``, raised by every assignment written. It lives as long as its newest holder.

`report` adds one report's allowed requests and reads the window's total, every holder and the
version in one script call; `assign` writes an Envoy's new holder only if the version is still
the one `report` read, and drops the holders whose assignments ended before the window began.
Two sidecars that allocate the same bucket at once cannot both promise the same budget: the
second write finds the version moved, and its caller reads again and allocates again.

On the memory backend the same is kept in this process (`MemoryStore`), at most `MAX_BUCKETS`
buckets (the least recently reported one goes first).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar.errors import Overloaded, StorageError
from sidecar.quota.allocator import Holder
from sidecar.storage.base import RunsCommands
from sidecar.storage.per_second import PerSecond

#: The holders hash's field that counts assignments written (no Envoy id starts with '%').
VERSION = b"%version"
#: Buckets the memory store keeps.
MAX_BUCKETS = 100_000

#: KEYS[1] the window's used counter, KEYS[2] the holders hash; ARGV[1] the requests a report
#: allowed, ARGV[2] how long the counter lives (ms). Returns {used, {field, value, ...}}.
_REPORT = b"""
local used = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {used, redis.call('HGETALL', KEYS[2])}
"""

#: KEYS[1] the holders hash; ARGV[1] the version read, ARGV[2] the Envoy, ARGV[3] its packed
#: holder, ARGV[4] how long the hash lives (ms), ARGV[5...] Envoys to drop. Returns 1 when
#: written, 0 when the version moved since it was read (nothing written).
_ASSIGN = b"""
local version = redis.call('HGET', KEYS[1], '%version') or '0'
if version ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], '%version', 1)
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
for i = 5, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class Reported:
    """What `report` read: the window's allowed requests, every holder, and the version."""

    used: int
    holders: dict[str, Holder]
    version: int


class QuotaStore(Protocol):
    """A bucket's usage and holders; every method raises StorageError or Overloaded."""

    async def report(self, key: bytes, window_start: int, window_ms: int, allowed: int) -> Reported:
        """Add `allowed` to the window's used and read it, with every holder and the version."""
        ...

    async def assign(
        self, key: bytes, holder: Holder, version: int, drop: list[str], keep_ms: int
    ) -> bool:
        """Write `holder` (and drop the holders named) if the version is still `version`;
        False when it moved. The holders are kept at least `keep_ms`."""
        ...


def open_store(backend: object, timeout_ms: int) -> QuotaStore:
    """The store beside a counters backend: on its Redis (or Redis Cluster) server, or in this
    process for the memory backend."""
    if isinstance(backend, PerSecond):
        backend = backend.main  # the quota's own keys live with the counters of longer windows
    if not isinstance(backend, RunsCommands):
        return MemoryStore()
    return RedisStore(backend, timeout_ms, str(getattr(backend, "name", "redis")))


def pack(holder: Holder) -> bytes:
    """A holder as the store keeps it: its numbers joined by '|'."""
    demand = "" if holder.demand is None else repr(holder.demand)
    return "|".join(
        (
            demand,
            str(holder.reported_ms),
            str(holder.assigned_ms),
            repr(holder.rate),
            str(holder.burst),
            str(holder.expires_ms),
            repr(holder.owed),
        )
    ).encode()


def unpack(envoy: str, packed: bytes) -> Holder | None:
    """A stored holder, or None for a value this version cannot read (skipped, not fatal)."""
    try:
        demand, reported, assigned, rate, burst, expires, owed = packed.decode().split("|")
        return Holder(
            envoy,
            float(demand) if demand else None,
            int(reported),
            int(assigned),
            float(rate),
            int(burst),
            int(expires),
            float(owed),
        )
    except (ValueError, UnicodeDecodeError):
        return None


class RedisStore:
    """The store on a Redis or a Redis Cluster, through the backend's `execute`."""

    def __init__(self, client: RunsCommands, timeout_ms: int, name: str = "redis") -> None:
        self._client = client
        self._timeout = timeout_ms / 1000
        self._name = name

    async def report(self, key: bytes, window_start: int, window_ms: int, allowed: int) -> Reported:
        used_key = key + b"|used|" + str(window_start).encode()
        reply = await self._run(
            b"EVAL", _REPORT, 2, used_key, key + b"|holders", allowed, 2 * window_ms
        )
        used, flat = reply
        holders: dict[str, Holder] = {}
        version = 0
        for name, value in zip(flat[::2], flat[1::2], strict=True):
            if name == VERSION:
                version = int(value)
                continue
            envoy = name.decode(errors="replace")
            holder = unpack(envoy, value)
            if holder is not None:
                holders[envoy] = holder
        return Reported(int(used), holders, version)

    async def assign(
        self, key: bytes, holder: Holder, version: int, drop: list[str], keep_ms: int
    ) -> bool:
        args = [key + b"|holders", version, holder.envoy, pack(holder), keep_ms, *drop]
        return bool(await self._run(b"EVAL", _ASSIGN, 1, *args))

    async def _run(self, *args: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                return await self._client.execute(*args)
        except Overloaded:
            raise
        except Exception as exc:  # every failure of the client is the store's StorageError
            raise StorageError(f"{self._name}: quota store: {type(exc).__name__}: {exc}") from exc


@dataclass
class _State:
    used: dict[int, int] = field(default_factory=dict)
    holders: dict[str, Holder] = field(default_factory=dict)
    version: int = 0


class MemoryStore:
    """The store in this process (the memory backend: one sidecar, nobody to agree with)."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self._buckets: OrderedDict[bytes, _State] = OrderedDict()
        self._max_buckets = max_buckets

    def __len__(self) -> int:
        return len(self._buckets)

    async def report(self, key: bytes, window_start: int, window_ms: int, allowed: int) -> Reported:
        state = self._buckets.get(key)
        if state is None:
            state = self._buckets[key] = _State()
            while len(self._buckets) > self._max_buckets:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(key)
        # Only this window and the one before are ever read.
        for start in [s for s in state.used if s < window_start - window_ms]:
            del state.used[start]
        used = state.used[window_start] = state.used.get(window_start, 0) + allowed
        return Reported(used, dict(state.holders), state.version)

    async def assign(
        self, key: bytes, holder: Holder, version: int, drop: list[str], keep_ms: int
    ) -> bool:
        state = self._buckets.get(key)
        if state is None or state.version != version:
            return False
        state.version += 1
        state.holders[holder.envoy] = holder
        for envoy in drop:
            state.holders.pop(envoy, None)
        return True
