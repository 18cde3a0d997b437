"""The one interface every counter store implements, and the URL that picks one.

Backend URLs: ``memory://`` (the default), ``redis://[user:password@]host:port[/db]``,
``rediss://...`` (TLS) and ``redis+cluster://host:port[,host:port...]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

from sidecar.model import Count, Hit


class Backend(Protocol):
    """Applies the hits of one request to their counters, atomically for each hash slot.

    `apply` returns one Count per hit, in order. With ``all_or_nothing`` the backend decides the
    request's outcome from every hit (see `fixed_window.request_is_over`) and adds nothing when
    it is OVER_LIMIT; otherwise it adds every hit. It raises StorageError on failure or when the
    deadline passes, never anything else.
    """

    name: str

    async def apply(self, hits: Sequence[Hit], all_or_nothing: bool) -> list[Count]: ...

    async def ping(self) -> bool:
        """Whether the store answers now (for health checks)."""
        ...

    async def close(self) -> None: ...


def open_backend(
    url: str, timeout_ms: int = 50, clock: Callable[[], float] | None = None
) -> Backend:
    """The backend a URL names; raises ValueError with the reason for a URL it cannot use."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from sidecar.storage.memory import MemoryBackend

        return MemoryBackend(clock=clock)
    if scheme in ("redis", "rediss"):
        from sidecar.storage.redis import RedisBackend

        return RedisBackend.from_url(url, timeout_ms=timeout_ms)
    if scheme == "redis+cluster":
        from sidecar.storage.redis import RedisClusterBackend

        return RedisClusterBackend.from_url(url, timeout_ms=timeout_ms)
    raise ValueError(
        f"unsupported backend URL {url!r}: use memory://, redis://host:port, rediss://host:port "
        "or redis+cluster://host:port[,host:port...]"
    )
