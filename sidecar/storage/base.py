"""The one interface every counter store implements, and the URL that picks one.

Backend URLs: ``memory://`` (the default; ``memory://?max_counters=N`` caps its counters), ``redis://[user:password@]host:port[/db]``,
``rediss://...`` (TLS), ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``
for TLS) and ``redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]``
(``rediss+sentinel://`` for TLS; ``?sentinel_username=&sentinel_password=`` for the Sentinels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit

from sidecar.algorithms.decide import Address, State
from sidecar.model import Dedupe, Hit, Outcome

#: What `apply_then` hands its callback: the outcomes, or the exception the call ended with
#: (StorageError when the store failed, Overloaded when it refused the call; anything else is a
#: bug).
Applied = Callable[[list[Outcome] | Exception], None]


class Backend(Protocol):
    """Decides and applies the hits of one request, atomically for each hash slot.

    `apply_then` hands `done` one Outcome per hit, in order, as `sidecar.algorithms.decide`
    defines them: each window counts as its algorithm says, and with ``all_or_nothing`` a
    request that is OVER_LIMIT applies nothing. `now_ms` is the sidecar's clock, so every
    backend (and every sidecar sharing a Redis) places hits in the same windows. The call ends
    with StorageError on failure or when the deadline passes on a silent store, and with
    Overloaded when the store is answering but not this call in time: refused with nothing
    applied when it already has as many calls in flight as it answers in time, or past its
    deadline behind calls the store is still answering (it may count it later). Never anything
    else.

    It answers through a callback, the one form (see `sidecar.callbacks`; `awaited` is the
    coroutine form): `done` is called exactly once, at once when the answer is known at once
    (memory), else from the event loop when the store answers (Redis: from the connection's
    `data_received`). No coroutine, task or future is made for it in the usual call (a cluster
    runs a coroutine for the rest: several slots, redirections).
    """

    name: str

    def apply_then(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied
    ) -> None: ...

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        """Count impressions exactly once: for each batch (the impressions of one user, whose
        hits and id hashes share a hash slot), atomically, skip the impressions whose id is in
        either id hash, add the others' ids and apply all their hits whatever the limits say.
        Returns, per batch, one flag per id: True when it was seen before (nothing changed)."""
        ...

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        """The values at `addresses` at `now_ms`, in order, writing nothing: counters as ints,
        token buckets as Buckets, None where nothing is stored. One round trip per hash slot;
        each grouped hash, and each slot's string keys, are read at one instant. A frequency-cap
        check judges these in Python (`decide`, read only), which answers as the script would."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers now (for health checks)."""
        ...

    async def close(self) -> None: ...


def open_backend(url: str, timeout_ms: int = 50) -> Backend:
    """The backend a URL names; raises ValueError with the reason for a URL it cannot use."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from sidecar.storage.memory import MemoryBackend

        return MemoryBackend(**_memory_options(url))
    if scheme in ("redis", "rediss"):
        from sidecar.storage.redis import RedisBackend

        return RedisBackend.from_url(url, timeout_ms=timeout_ms)
    if scheme in ("redis+cluster", "rediss+cluster"):
        from sidecar.storage.cluster import RedisClusterBackend

        return RedisClusterBackend.from_url(url, timeout_ms=timeout_ms)
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        from sidecar.storage import sentinel

        return sentinel.from_url(url, timeout_ms=timeout_ms)
    raise ValueError(
        f"unsupported backend URL {url!r}: use memory://, redis://host:port, rediss://host:port, "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS) "
        "or redis+sentinel://host:port[,host:port...]/master-name (rediss+sentinel:// for TLS)"
    )


def _memory_options(url: str) -> dict[str, int]:
    """`memory://` takes one query parameter, `max_counters` (a whole number, at least 1)."""
    parts = urlsplit(url)
    if parts.netloc or parts.path or parts.fragment:
        raise ValueError(f"{url!r}: memory:// takes no host or path, only ?max_counters=N")
    options = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name != "max_counters":
            raise ValueError(f"{url!r}: unknown query parameter {name!r} (allowed: max_counters)")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{url!r}: max_counters must be a whole number of at least 1")
        options[name] = int(value)
    return options
