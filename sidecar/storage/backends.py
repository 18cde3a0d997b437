"""The backend a URL names: the one module that imports every backend, and that none imports.

The URL forms are `sidecar.storage.urls`'s; each backend module opens its own kind.
"""

from __future__ import annotations

from sidecar.storage import sentinel, urls
from sidecar.storage.base import Backend
from sidecar.storage.cluster import RedisClusterBackend
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.redis import RedisBackend


def open_backend(url: str, timeout_ms: int = 50) -> Backend:
    """The backend a URL names; raises ValueError with the reason for a URL it cannot use.
    Nothing connects yet."""
    location = urls.parse(url)
    if isinstance(location, urls.MemoryURL):
        if location.max_counters is None:
            return MemoryBackend()
        return MemoryBackend(max_counters=location.max_counters)
    if isinstance(location, urls.RedisURL):
        return RedisBackend.from_url(url, timeout_ms=timeout_ms)
    if isinstance(location, urls.ClusterURL):
        return RedisClusterBackend.from_url(url, timeout_ms=timeout_ms)
    return sentinel.from_url(url, timeout_ms=timeout_ms)
