"""Counters in this process's memory: the embedded default, for one sidecar with no Redis.

Decisions are atomic because `apply` never awaits between reading and writing.
Every stored value expires (a window counter after its ttl, a token bucket once it would be full
again), and expired values are evicted, so memory stays bounded by the live windows even under
millions of distinct descriptor values. Counters are lost on restart.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from sidecar.algorithms.decide import State, decide
from sidecar.model import Hit, Outcome


class MemoryBackend:
    name = "memory"

    def __init__(self) -> None:
        # key -> [value, expires_at_ms]
        self._values: dict[bytes, list[object]] = {}
        # (expires_at_ms, key), one entry per stored key; an entry found stale when it comes up
        # (its key was written again with a later expiry) is pushed back with the new time.
        self._expiries: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._values)

    def __bool__(self) -> bool:
        # An empty store is still a store: never let `backend or default` replace it.
        return True

    async def apply(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, read_only: bool = False
    ) -> list[Outcome]:
        self._evict(now_ms)
        values = self._values

        def read(key: bytes) -> State | None:
            entry = values.get(key)
            return None if entry is None else entry[0]  # type: ignore[return-value]

        outcomes, writes = decide(read, hits, now_ms, all_or_nothing, read_only)
        for write in writes:
            entry = values.get(write.key)
            if write.state is not None:
                expires_at = now_ms + write.ttl_ms
                if entry is None:
                    values[write.key] = [write.state, expires_at]
                    heapq.heappush(self._expiries, (expires_at, write.key))
                else:
                    entry[0], entry[1] = write.state, expires_at
            elif entry is None:
                expires_at = now_ms + write.ttl_ms
                values[write.key] = [write.amount, expires_at]
                heapq.heappush(self._expiries, (expires_at, write.key))
            else:
                entry[0] += write.amount  # type: ignore[operator]
        return outcomes

    def _evict(self, now_ms: int) -> None:
        expiries = self._expiries
        values = self._values
        while expiries and expiries[0][0] <= now_ms:
            _, key = heapq.heappop(expiries)
            entry = values.get(key)
            if entry is None:
                continue
            expires_at: int = entry[1]  # type: ignore[assignment]
            if expires_at <= now_ms:
                del values[key]
            else:
                heapq.heappush(expiries, (expires_at, key))

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._values.clear()
        self._expiries.clear()
