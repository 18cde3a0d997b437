"""Approximate fixed windows: the local view's logic (`sidecar.algorithms.approximate`), its
invariants under any interleaving of hits and syncs, and its overshoot bound over time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.algorithms.approximate import LocalCount, count_after
from sidecar.core.counters import window_hit
from sidecar.model import Hit, Outcome, Role, Unit, Window
from sidecar.storage.aggregation import Aggregated
from sidecar.storage.base import Applied
from sidecar.storage.memory import MemoryBackend

LIMIT = 20


def test_a_view_judges_as_a_plain_window_on_known_flying_and_pending() -> None:
    """A hit is over when known + flying + pending + cost passes the limit; it is counted either
    way; a check (cost 0) is over once the view reaches the limit and counts nothing."""
    count = LocalCount(known=7, learned_ms=0)
    assert count.judge(2, 10) == (False, 1, 3)
    count.send()
    assert count.judge(1, 10) == (False, 0, 1)
    assert count.judge(0, 10) == (True, 0, 0)
    assert count.judge(1, 10) == (True, 0, 0)
    assert (count.known, count.flying, count.pending) == (7, 2, 2)


def test_a_sync_that_fails_keeps_its_hits_and_one_that_lands_learns_the_count() -> None:
    """Failed: the hits sent are pending again. Landed: known is what the store answered."""
    count = LocalCount(known=3, learned_ms=0)
    count.judge(4, 100)
    sent = count.send()
    count.judge(1, 100)
    count.failed(sent)
    assert (count.known, count.flying, count.pending) == (3, 0, 5)
    sent = count.send()
    count.synced(sent, 30, asked_ms=500)
    assert (count.known, count.flying, count.pending, count.learned_ms) == (30, 0, 0, 500)


def test_count_after_reads_the_counter_back_from_an_outcome() -> None:
    """Exact below the limit and when the hit crossed it; the least it can be when the counter
    was already past it (which judges every later hit alike)."""
    assert count_after(False, 6, 9, 3, 10) == 4
    assert count_after(True, 0, 2, 5, 10) == 13
    assert count_after(True, 0, 0, 5, 10) == 15
    assert count_after(False, 10, 10, 0, 10) == 0


# An action: (sidecar, what): 0 a hit, 1 send a sync, 2 the oldest sync lands, 3 it fails,
# 4 a direct call (a hit sent to the store, which teaches the view the count).
actions = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), max_size=300)


@settings(max_examples=300, deadline=None)
@given(actions)
def test_views_never_count_a_hit_not_made_so_nothing_is_lost_or_refused_early(
    steps: list[tuple[int, int]],
) -> None:
    """Under any interleaving of hits, syncs that land or fail and direct calls, on four sidecars
    sharing one counter: every view is at most the hits made (no undershoot: with hits of 1 the
    window admits at least min(limit, hits made)); each sidecar admits at most the limit itself;
    once every sync has landed the store holds every hit exactly once."""
    store = 0
    counts = [LocalCount(0, 0) for _ in range(4)]
    flights: list[list[int]] = [[] for _ in range(4)]  # each sidecar's syncs in flight
    made = admitted = 0
    own = [0] * 4
    for sidecar, what in steps:
        count = counts[sidecar]
        if what == 0:
            over, _, _ = count.judge(1, LIMIT)
            made += 1
            if not over:
                admitted += 1
                own[sidecar] += 1
        elif what == 1:
            flights[sidecar].append(count.send())
        elif what in (2, 3) and flights[sidecar]:
            sent = flights[sidecar].pop(0)
            if what == 2:
                store += sent
                count.synced(sent, store, 0)
            else:
                count.failed(sent)
        elif what == 4:
            # A hit the store decides itself (the view is unknown or stale): exact.
            made += 1
            over = store + 1 > LIMIT
            store += 1
            count.learn(store, 0)
            if not over:
                admitted += 1
                own[sidecar] += 1
        for each in counts:
            assert each.view <= made
            assert each.known <= store
    assert admitted >= min(LIMIT, made)
    assert all(mine <= LIMIT for mine in own)
    for sidecar, count in enumerate(counts):
        for sent in flights[sidecar]:
            count.failed(sent)
        sent = count.send()
        store += sent
        count.synced(sent, store, 0)
    assert store == made


class Clock:
    """The simulation's time, in seconds, as the sidecar's clock gives it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Delayed:
    """The memory backend answering each call `latency_ms` after it was made, when the
    simulation's time reaches it (the store's round trip, during which the sidecar goes on)."""

    def __init__(self, latency_ms: int) -> None:
        self.store = MemoryBackend()
        self.name = "delayed memory"
        self.latency_ms = latency_ms
        self.calls: list[tuple[int, Sequence[Hit], int, Applied]] = []
        self.count = 0

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        assert not all_or_nothing
        self.count += 1
        self.calls.append((now_ms + self.latency_ms, hits, now_ms, done))

    def deliver(self, now_ms: int) -> None:
        due = [call for call in self.calls if call[0] <= now_ms]
        self.calls = [call for call in self.calls if call[0] > now_ms]
        for _, hits, made_ms, done in due:
            self.store.apply(hits, False, made_ms, done)

    async def close(self) -> None:
        await self.store.close()


async def simulate(
    sidecars: int, rate: int, interval_ms: int, latency_ms: int, phases: list[int]
) -> tuple[dict[int, int], int, int]:
    """`sidecars` sharing one Delayed store, each receiving `rate` hits per second (evenly
    spaced) of one counter limited to LIMIT_PER_SECOND, each syncing every `interval_ms` from its
    own phase, for three seconds of simulated time, 1 ms a step. Returns the hits admitted per
    window start, the store calls and the hits made."""
    clock = Clock(1_700_000_000.0)
    store = Delayed(latency_ms)
    views = [
        Aggregated(store, interval_ms, latency_ms, clock=clock)  # type: ignore[arg-type]
        for _ in range(sidecars)
    ]
    window = Window(LIMIT_PER_SECOND, Unit.SECOND, approximate=True)
    admitted: dict[int, int] = {}
    made = 0
    syncs: list[asyncio.Future[None]] = []
    start_ms = int(clock.now * 1000)
    spacing = 1000 / rate

    def answered(outcomes: list[Outcome] | Exception, start: int) -> None:
        assert isinstance(outcomes, list)
        if not outcomes[0].over:
            admitted[start] = admitted.get(start, 0) + 1

    for step in range(3000):
        now_ms = start_ms + step
        clock.now = now_ms / 1000
        store.deliver(now_ms)
        for index, view in enumerate(views):
            if step % interval_ms == phases[index] % interval_ms:
                syncs.append(asyncio.ensure_future(view.sync()))
            arrivals = int((step + 1) / spacing + index / sidecars) - int(
                step / spacing + index / sidecars
            )
            for _ in range(arrivals):
                hit = window_hit("d_key_value", window, 1, 0, Role.BLOCKING, now_ms)
                made += 1
                view.apply([hit], False, now_ms, lambda o, s=hit.start_ms: answered(o, s))
        for _ in range(3):
            await asyncio.sleep(0)
    store.deliver(start_ms + 10_000)
    await asyncio.gather(*syncs)
    return admitted, store.count, made


LIMIT_PER_SECOND = 100


@settings(max_examples=20, deadline=None)
@given(
    sidecars=st.integers(2, 5),
    rate=st.integers(200, 1000),
    interval_ms=st.integers(5, 100),
    latency=st.data(),
)
def test_admitted_per_window_stays_within_the_stated_bound(
    sidecars: int, rate: int, interval_ms: int, latency: st.DataObject
) -> None:
    """Sidecars deciding one approximate counter locally and syncing every T, over a store
    answering in d <= the deadline, with demand well past the limit: each whole window admits
    at least the limit and at most limit + (S - 1) × r × 2 × (T + d) (plus one hit per sidecar
    for the rounding of evenly spaced arrivals), as README and the algorithm module state."""
    latency_ms = latency.draw(st.integers(1, interval_ms))
    phases = latency.draw(st.lists(st.integers(0, 99), min_size=sidecars, max_size=sidecars))
    admitted, _, _ = asyncio.run(simulate(sidecars, rate, interval_ms, latency_ms, phases))
    bound = (sidecars - 1) * rate * 2 * (interval_ms + latency_ms) / 1000 + sidecars
    windows = sorted(admitted)[1:-1] or sorted(admitted)  # whole windows (the run starts on one)
    for start in windows:
        assert LIMIT_PER_SECOND <= admitted[start] <= LIMIT_PER_SECOND + bound, (start, admitted)
