"""Counters in this process's memory: the embedded default, for one sidecar with no Redis.

Decisions are atomic because `apply` never awaits between reading and writing.
A counter is evicted once its ttl has passed, so memory stays bounded by the counters of live
windows even under millions of distinct descriptor values. Counters are lost on restart.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from sidecar.algorithms import fixed_window
from sidecar.model import Count, Hit


class MemoryBackend:
    name = "memory"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.time
        # key -> [value, expires_at]
        self._counters: dict[bytes, list[int]] = {}
        # (expires_at, key) for every counter created; stale entries are skipped on pop.
        self._expiries: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._counters)

    async def apply(self, hits: Sequence[Hit], all_or_nothing: bool) -> list[Count]:
        now = int(self._clock())
        self._evict(now)
        counters = self._counters
        stored = []
        for hit in hits:
            entry = counters.get(hit.key)
            stored.append(entry[0] if entry is not None else 0)
        counts = fixed_window.step(stored, hits, all_or_nothing)
        for hit, count in zip(hits, counts, strict=True):
            if count.applied and hit.hits > 0:
                entry = counters.get(hit.key)
                if entry is None:
                    expires_at = now + hit.ttl
                    counters[hit.key] = [hit.hits, expires_at]
                    heapq.heappush(self._expiries, (expires_at, hit.key))
                else:
                    entry[0] += hit.hits
        return counts

    def _evict(self, now: int) -> None:
        expiries = self._expiries
        counters = self._counters
        while expiries and expiries[0][0] <= now:
            _, key = heapq.heappop(expiries)
            entry = counters.get(key)
            if entry is not None and entry[1] <= now:
                del counters[key]

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._counters.clear()
        self._expiries.clear()
