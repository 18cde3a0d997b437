"""The cycle garbage collector while the sidecar serves: how its pauses are kept short (its
thresholds, and what lives until the rules change frozen out of its sight) and measured for
/metrics (`GcPauses`, `GcCollector`).

A collection stops every call in flight for its length: its pauses are what a call's tail
latency is made of (README, "Garbage collection"), so the hot path makes no reference cycle
(tests/test_garbage.py) and what serving keeps is not walked again and again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from time import perf_counter

from prometheus_client import Metric
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.telemetry.metrics import Latency

#: The cycle collector's thresholds while serving (`gc.set_threshold`; Python's are 700, 10, 10).
#: A call makes no reference cycle (tests/test_garbage.py), so a collection finds nothing to
#: free: 300,000 calls each on a user of its own (compiled, in one process, Redis) ran 934
#: collections that collected 0 objects. What one costs is its pause, every call in flight
#: waiting. A young collection walks at most about 700 × 10 objects: medians 0.05 and 1 ms,
#: at most 0.7 and 5.6 ms. A full one walks all that is kept and not frozen (`settle`),
#: mostly the plan cache (`sidecar.rls.service`; when it held 4,096 plans, of two descriptors
#: each, about 90,000 objects: 20 to 65 ms; it holds 1,024 now) and the memory backend's
#: counters. The third threshold makes
#: full ones ten times rarer: over 1,000,000 such calls, 23 (21 over 10 ms, up to 66 ms) at 10,
#: 2 (5 ms each) at 100, none at 1,000; 100 still collects, every few hundred thousand new
#: users, what other libraries may leave in cycles. The first two stay as they are: young
#: collections walk threshold 0 × threshold 1 objects, and measured up to 81 ms at 10,000 × 10
#: and 19 ms at 700 × 100.
THRESHOLDS = (700, 10, 100)


def settle() -> None:
    """Collect, then freeze what is left: what exists once the sidecar has started (modules,
    rules, servers) or has taken new rules lives until the process ends or the rules change.
    Out of the collector's sight, it is not walked again by every full collection
    (THRESHOLDS), whose pause then grows only with what serving keeps since.

    Frozen objects are still freed by their reference counts, as the old rules are when new ones
    replace them (loading and dropping rules leaves nothing to collect), and as a closed
    connection is (`Connection.release`); only what would end in a cycle after this is never
    collected. The collection costs a full collection's pause once per change of rules (20 to
    40 ms with 4,096 plans cached, compiled; the cache holds at most 1,024 now).
    """
    gc.collect()
    gc.freeze()


def take_over() -> None:
    """Run this process's collector as a serving sidecar does (`App.run`, not the tests, which
    run many apps in one process): at THRESHOLDS, with what exists now settled."""
    gc.set_threshold(*THRESHOLDS)
    settle()


class GcPauses:
    """The cycle collector's pauses: how long each collection held the event loop, by
    generation, and the longest, timed from `gc.callbacks` (while `watch`ed).

    A collection stops every call in flight for its length (README, "Garbage collection"):
    these are what a call's latency can gain that the latency histogram does not show by its
    cause. Timing one costs two clock reads and a bisect, at most a few hundred times a
    second however busy the sidecar is.
    """

    GENERATIONS = 3

    def __init__(self) -> None:
        self.generations = [Latency() for _ in range(self.GENERATIONS)]
        #: The longest pause so far, in seconds.
        self.max = 0.0
        self._started = 0.0

    def watch(self) -> None:
        """Time every collection of this process from now on."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def unwatch(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        """`gc.callbacks`' call, before (`start`) and after (`stop`) each collection."""
        if phase == "start":
            self._started = perf_counter()
            return
        seconds = perf_counter() - self._started
        self.generations[info["generation"]].observe(seconds)
        if seconds > self.max:
            self.max = seconds


class GcCollector(Collector):
    """The collector's pauses (`GcPauses`) as `ratelimit_sidecar_gc_pause_seconds{generation}`
    and `ratelimit_sidecar_gc_pause_max_seconds`, read at scrape time."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily(
            "ratelimit_sidecar_gc_pause_seconds",
            "Pauses of the cycle garbage collector, by generation (2: a full collection), "
            "each stopping every call in flight for its length.",
            labels=["generation"],
        )
        for generation, pauses in enumerate(self.pauses.generations):
            histogram.add_metric([str(generation)], pauses.cumulative(), pauses.sum)
        yield histogram
        gauge = Metric(
            "ratelimit_sidecar_gc_pause_max_seconds",
            "The longest pause of the cycle garbage collector since the sidecar started.",
            "gauge",
        )
        gauge.add_sample("ratelimit_sidecar_gc_pause_max_seconds", {}, self.pauses.max)
        yield gauge
