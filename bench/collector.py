"""What the cycle collector does for the calls of the fast path: collections per 1,000 calls in
each generation, and the objects each walks. Like the instruction counts (`bench.instructions`),
a figure that does not move with the load of a shared machine, where pause times do.

A collection comes when the objects the collector tracks have grown by 700 since the last
(`gc.set_threshold`, the sidecar's `garbage.THRESHOLDS`): a call that frees all it made by reference
counts, as it ends, adds nothing, and one that leaves objects alive for a while (a cache
entry, a deadline kept until its timer) brings collections closer and gives each more to walk
and promote. Every collection pauses every call in flight, so on real traffic, where most
bodies are new, this is the tail's share that is not the path's length.

The calls are `bench.instructions`' replay (recorded HTTP/2 bytes into the fast transport's
protocol, through the service, the limiter and the backend, in this process), on a backend of
their own, with what the sidecar does once it has started (`gc.freeze` of all made so far, its
thresholds). Each backend has two rows, as there: one body sent again and again, every body new.

    python -m bench.collector                           # memory, redis and cluster, sources
    python -m bench.collector --build build/compiled    # the compiled build (make compiled)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import instructions
from sidecar import build as sidecar_build

#: Replayed passes of `instructions.CALLS` calls: enough calls for tens of young collections.
ROUNDS = 30
ROOT = Path(__file__).parent.parent


class Watch:
    """Collections per generation, the objects each walked (its generation and the younger
    ones, as it found them), and the longest pause (which the counting itself lengthens)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.walked = [0, 0, 0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            found = sum(len(gc.get_objects(younger)) for younger in range(generation + 1))
            self.walked[generation] += found
            self._started = time.perf_counter()
            return
        self.collections[generation] += 1
        pause = time.perf_counter() - self._started
        self.longest[generation] = max(self.longest[generation], pause)


def measure(url: str, distinct: bool) -> Watch:
    """Replay ROUNDS passes on `url`'s backend under the sidecar's collector settings."""
    from sidecar.telemetry.garbage import THRESHOLDS

    watch = Watch()

    def ready() -> None:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*THRESHOLDS)
        gc.callbacks.append(watch)

    try:
        asyncio.run(instructions.replay(url, ROUNDS, distinct, ready))
    finally:
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
    return watch


def _row(url: str, distinct: bool, build: dict[str, str] | None) -> str:
    """One row, measured in a process of its own (on `build`'s environment, or the sources)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.collector", "--measure", url]
        + (["--distinct"] if distinct else []),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, **(build or {})},
    )
    return out.stdout.strip()


def _print(watch: Watch) -> None:
    calls = ROUNDS * instructions.CALLS
    cells = []
    for generation in (0, 1, 2):
        count = watch.collections[generation]
        walked = watch.walked[generation] // count if count else 0
        cells.append(
            f"{count * 1_000 / calls:6.2f} {walked:>7,} {watch.longest[generation] * 1e3:6.2f}"
        )
    print("  ".join(cells), sidecar_build.name())


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.collector", description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("memory", "redis", "cluster"), action="append")
    parser.add_argument(
        "--build", type=Path, help="the compiled build unpacked in this directory (make compiled)"
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--distinct", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _print(measure(args.measure, args.distinct))
        return 0
    build = None
    if args.build is not None:
        try:
            build = sidecar_build.environ(args.build, also=[ROOT])
        except ValueError as exc:
            print(f"bench.collector: {exc}")
            return 1
    calls = ROUNDS * instructions.CALLS
    print(
        f"the cycle collector over {calls:,} calls ({instructions.PER_READ} per read, in-process)"
    )
    print("per generation: collections per 1,000 calls, objects walked each, longest pause ms")
    print(f"{'':28}{'young':^23}  {'middle':^23}  {'full':^23}")
    for name in args.only or ("memory", "redis", "cluster"):
        with instructions.backend(name) as url:
            for distinct in (False, True):
                label = f"{name}, {'new bodies' if distinct else 'one body'}"
                print(f"  {label:<26}{_row(url, distinct, build)}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
