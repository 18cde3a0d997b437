"""The backend a URL names: the one module that imports every backend, and that none imports.

The URL forms are `sidecar.storage.urls`'s; each backend module opens its own kind. A backend's
module is imported when a URL names it, so a sidecar on memory:// loads no Redis client (nor
keeps its objects, which every full collection of the garbage collector would walk).
"""

from __future__ import annotations

from sidecar.storage import urls
from sidecar.storage.base import Backend


def open_backend(url: str, timeout_ms: int = 50) -> Backend:
    """The backend a URL names; raises ValueError with the reason for a URL it cannot use.
    Nothing connects yet."""
    location = urls.parse(url)
    if isinstance(location, urls.MemoryURL):
        from sidecar.storage.memory import MemoryBackend

        if location.max_counters is None:
            return MemoryBackend()
        return MemoryBackend(max_counters=location.max_counters)
    if isinstance(location, urls.RedisURL):
        from sidecar.storage.redis import RedisBackend

        return RedisBackend.from_url(url, timeout_ms=timeout_ms)
    if isinstance(location, urls.ClusterURL):
        from sidecar.storage.cluster import RedisClusterBackend

        return RedisClusterBackend.from_url(url, timeout_ms=timeout_ms)
    from sidecar.storage import sentinel

    return sentinel.from_url(url, timeout_ms=timeout_ms)
