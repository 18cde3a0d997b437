"""Per-second limits on a store of their own, as the reference's `REDIS_PERSECOND` does.

Per-second counters are the busiest and the shortest-lived: the reference lets them live on a
second Redis so they do not load the one holding minute, hour and day counters. `PerSecond` is
a backend made of two: the counters of each descriptor whose windows are all in seconds go to
`per_second`, every other counter to `main` (a descriptor's windows stay together, since it is
admitted only when all of them admit). A request with counters on both is decided on both at
once, each store atomically for its own counters, and the outcomes are put back in order.

Two stores cannot decide one request atomically, so `--rejected-hits skip` (all or nothing) is
refused with a per-second store (`App` checks it), as it would let one store count what the
other refused. Frequency caps (`record`, `read`) and the count of sidecars use `main`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sidecar.algorithms.decide import Address, State
from sidecar.model import Dedupe, Hit, Outcome, Unit, Window
from sidecar.storage.base import Applied, Backend, ReportsFaults
from sidecar.storage.peers import CountsPeers


class PerSecond:
    """`main` and `per_second` as one backend; both must be shared stores (Redis)."""

    def __init__(self, main: Backend, per_second: Backend) -> None:
        if not isinstance(main, CountsPeers) or not isinstance(per_second, CountsPeers):
            raise ValueError(
                "a per-second backend needs shared stores for both (redis:// or "
                "redis+cluster://), not memory://"
            )
        self.main = main
        self.per_second = per_second
        self._main_peers: CountsPeers = main
        self.name = f"{main.name}, per second {per_second.name}"

    def split(self, hits: Sequence[Hit]) -> list[bool]:
        """For each hit, whether it goes to `per_second`: every window of its descriptor (its
        group) is in seconds."""
        minutes_or_more = {hit.group for hit in hits if hit.window.unit is not Unit.SECOND}
        return [hit.group not in minutes_or_more for hit in hits]

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """Each store's share of `hits` through its own `apply`; `done` once, when both
        answered (with the first failure if either failed)."""
        routes = self.split(hits)
        if all(routes):
            self.per_second.apply(hits, all_or_nothing, now_ms, done)
            return
        if not any(routes):
            self.main.apply(hits, all_or_nothing, now_ms, done)
            return
        seconds = [hit for hit, fast in zip(hits, routes, strict=True) if fast]
        others = [hit for hit, fast in zip(hits, routes, strict=True) if not fast]
        answers: dict[bool, list[Outcome] | Exception] = {}

        def joined(route: bool) -> Applied:
            def one(got: list[Outcome] | Exception) -> None:
                answers[route] = got
                if len(answers) < 2:
                    return
                failure = next((a for a in answers.values() if isinstance(a, Exception)), None)
                if failure is not None:
                    done(failure)
                    return
                got_fast, got_slow = answers[True], answers[False]
                assert not isinstance(got_fast, Exception) and not isinstance(got_slow, Exception)
                fast, slow = iter(got_fast), iter(got_slow)
                done([next(fast) if route else next(slow) for route in routes])

            return one

        self.per_second.apply(seconds, all_or_nothing, now_ms, joined(True))
        self.main.apply(others, all_or_nothing, now_ms, joined(False))

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        return await self.main.record(batches, now_ms)

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        return await self.main.read(addresses, now_ms)

    async def reset(self, addresses: Sequence[Address]) -> int:
        """Deleted on both stores at once: an address lives on the one its descriptor's windows
        chose (`split`), and deleting it where it is not changes nothing."""
        main, per_second = await asyncio.gather(
            self.main.reset(addresses), self.per_second.reset(addresses)
        )
        return main + per_second

    def store_for(self, windows: Sequence[Window]) -> Backend:
        """The store that decides a descriptor with these windows (as `split` routes its hits)."""
        if all(window.unit is Unit.SECOND for window in windows):
            return self.per_second
        return self.main

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Usage lives on `main` (its hits are of a day, never per second)."""
        return await self.main.usage_hashes(pattern)  # type: ignore[attr-defined, no-any-return]

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        return await self.main.usage_unique(groups)  # type: ignore[attr-defined, no-any-return]

    async def ping(self) -> bool:
        main, per_second = await asyncio.gather(self.main.ping(), self.per_second.ping())
        return main and per_second

    def fault(self) -> str | None:
        """The first of the two stores' faults (`ReportsFaults`)."""
        faults = (s.fault() for s in (self.main, self.per_second) if isinstance(s, ReportsFaults))
        return next((found for found in faults if found), None)

    async def peers(self, name: bytes) -> int:
        return await self._main_peers.peers(name)

    async def leave(self, name: bytes) -> None:
        await self._main_peers.leave(name)

    async def close(self) -> None:
        await asyncio.gather(self.main.close(), self.per_second.close())
