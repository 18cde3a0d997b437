"""The one interface every counter store implements (`Backend`), and what a shared one adds
(`RunsCommands`). `sidecar.storage.backends` opens one by URL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from sidecar.algorithms.decide import Address, State
from sidecar.model import Dedupe, Hit, Outcome

#: What `apply` hands its callback: the outcomes, or the exception the call ended with
#: (StorageError when the store failed, Overloaded when it refused the call; anything else is a
#: bug).
Applied = Callable[[list[Outcome] | Exception], None]


class Backend(Protocol):
    """Decides and applies the hits of one request, atomically for each hash slot.

    `apply` hands `done` one Outcome per hit, in order, as `sidecar.algorithms.decide`
    defines them: each window counts as its algorithm says, and with ``all_or_nothing`` a
    request that is OVER_LIMIT applies nothing. `now_ms` is the sidecar's clock, so every
    backend (and every sidecar sharing a Redis) places hits in the same windows. The call ends
    with StorageError on failure or when the deadline passes on a silent store, and with
    Overloaded when the store is answering but not this call in time: refused with nothing
    applied when it already has as many calls in flight as it answers in time, or past its
    deadline behind calls the store is still answering (it may count it later). Never anything
    else.

    It answers through a callback, the one form (see `sidecar.loop.callbacks`; `awaited` is the
    coroutine form): `done` is called exactly once, at once when the answer is known at once
    (memory), else from the event loop when the store answers (Redis: from the connection's
    `data_received`). No coroutine, task or future is made for it in the usual call (a cluster
    runs a coroutine for the rest: several slots, redirections).
    """

    name: str

    def apply(
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

    async def reset(self, addresses: Sequence[Address]) -> int:
        """Delete the values at `addresses` (an operator lifting a limit, `sidecar.operator.counter_admin`):
        counters and buckets under their own keys, or fields of a grouped hash, whose other
        fields stay. Returns how many existed. One round trip per hash slot; never on the
        decision path."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers now (for health checks)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class ReportsFaults(Protocol):
    """A backend that can say why it does not answer when the cause is its configuration, not an
    outage (a refused password, a host name that does not resolve); see `sidecar.http.health`."""

    def fault(self) -> str | None:
        """Why the last ping failed, if waiting will not cure it; else None."""
        ...


@runtime_checkable
class RunsCommands(Protocol):
    """A backend on a Redis server others share (standalone, Sentinel, Cluster), which runs a
    command there for a caller that keeps keys of its own beside the counters (the quota
    service's, `sidecar.quota.store`)."""

    async def execute(self, *args: Any) -> Any:
        """Run one command (on a cluster, on the master of its first key's slot) and return its
        reply; error replies raise. No deadline of its own: the caller keeps one."""
        ...
