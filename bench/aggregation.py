"""Local aggregation measured: Redis commands per 1,000 requests, CPU per call and the overshoot,
with every hit decided by Redis and with `--sync-interval-ms` at several intervals.

Several sidecars (limiters in this process, each on its own Redis connection, as separate
processes would be) share one redis-server this script starts and stops by its PID, and one
approximate counter (`client: c1`, LIMIT per second). Each receives RATE calls per second, paced,
for SECONDS: demand is sidecars × rate, several times the limit. Reported per mode:

- Redis calls and commands per 1,000 calls, counted by the server (INFO commandstats, as
  `bench.quota_gateway` counts them), so steady on a shared machine: the calls the sidecars
  made (script calls), and every command Redis ran, those inside the scripts too;
- CPU per call: this process's CPU time over the calls (the limiters, the load's own loop and
  the Redis client), and redis-server's (from /proc): timed, so it moves with the machine's
  load (compare the rows of one run);
- admitted per whole window: the least and the most, against the limit and the stated bound
  ``limit + (S - 1) × r × 2 × (T + d)`` (README, "Local aggregation").

    python -m bench.aggregation                       # exact, then 10, 50 and 100 ms
    python -m bench.aggregation --intervals 20 --sidecars 4 --rate 3000
    PYTHONSAFEPATH=1 PYTHONPATH=build/compiled python -m bench.aggregation   # compiled build
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.processes import CLOCK_TICKS_PER_SECOND
from bench.services import Service, start_redis
from sidecar import build
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.model import Code, Decision, Descriptor, Entry, Request
from sidecar.storage import Backend
from sidecar.storage.aggregation import Aggregated
from sidecar.storage.backends import open_backend

TIMEOUT_MS = 50
#: Calls issued per sidecar at each tick of the paced load.
TICK_SECONDS = 0.005
#: Commands this script sends Redis itself, not counted.
_OWN = ("cmdstat_info", "cmdstat_config", "cmdstat_flushall")


@dataclass
class Measured:
    mode: str
    calls: int
    store_calls: int
    commands: int
    cpu_seconds: float
    redis_cpu_seconds: float
    admitted: list[int]
    busiest_rate: float
    bound: float | None

    def row(self, limit: int) -> str:
        calls_1000 = 1000 * self.store_calls / max(1, self.calls)
        per_1000 = 1000 * self.commands / max(1, self.calls)
        cpu_us = 1e6 * self.cpu_seconds / max(1, self.calls)
        redis_us = 1e6 * self.redis_cpu_seconds / max(1, self.calls)
        low, high = (min(self.admitted), max(self.admitted)) if self.admitted else (0, 0)
        bound = "" if self.bound is None else f"{limit + self.bound:,.0f}"
        return (
            f"  {self.mode:<8} {self.calls:>8,} {calls_1000:>12.1f} {per_1000:>14.1f} "
            f"{cpu_us:>9.1f} {redis_us:>7.1f} "
            f"{low:>7,} {high:>7,} {100 * (high - limit) / limit:>+8.1f}% {bound:>6}"
        )


def rules(limit: int) -> Rules:
    text = (
        "domain: bench\ndescriptors:\n  - key: client\n    approximate: true\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    )
    return Rules({"bench": config.parse(text, "bench.yaml")})


def counted(url: str) -> tuple[int, int]:
    """(script calls the sidecars made, every command Redis ran but this script's own)."""
    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    names = {key.split("|")[0]: int(value["calls"]) for key, value in stats.items()}
    calls = names.get("cmdstat_evalsha", 0) + names.get("cmdstat_eval", 0)
    return calls, sum(n for name, n in names.items() if name not in _OWN)


async def measure(
    redis_server: Service,
    interval_ms: int | None,
    sidecars: int,
    rate: int,
    limit: int,
    seconds: float,
) -> Measured:
    url = redis_server.placeholders["redis_url"]
    with redis.Redis.from_url(url) as client:
        client.flushall()
        client.config_resetstat()
    backends: list[Backend] = []
    for _ in range(sidecars):
        store = open_backend(url, timeout_ms=TIMEOUT_MS)
        if interval_ms is not None:
            aggregated = Aggregated(store, interval_ms, TIMEOUT_MS)
            aggregated.start()
            store = aggregated
        backends.append(store)
    the_rules = rules(limit)
    limiters = [Limiter(the_rules, backend) for backend in backends]
    request = Request("bench", (Descriptor((Entry("client", "c1"),)),))
    admitted: Counter[int] = Counter()
    demand: Counter[tuple[int, int]] = Counter()
    answered = 0
    # Start on a whole second, so that every second but the last is a whole window.
    await asyncio.sleep(math.ceil(time.time()) - time.time())
    start = time.time()
    stop_at = start + seconds
    per_tick = rate * TICK_SECONDS

    def done(decision: Decision | Exception, window: int) -> None:
        nonlocal answered
        answered += 1
        if isinstance(decision, Decision) and decision.overall_code is Code.OK:
            admitted[window] += 1

    async def drive(index: int, limiter: Limiter) -> None:
        plan = limiter.prepare(request)
        sent = 0
        while (now := time.time()) < stop_at:
            due = int((now - start) / TICK_SECONDS * per_tick) + 1
            window = int(now)
            while sent < due:
                sent += 1
                demand[(index, window)] += 1
                limiter.decide(plan, lambda d: d, lambda d, w=window: done(d, w))
            await asyncio.sleep(TICK_SECONDS)

    cpu, redis_ticks = time.process_time(), redis_server.cpu_ticks()
    await asyncio.gather(*(drive(i, limiter) for i, limiter in enumerate(limiters)))
    while answered < sum(demand.values()):
        await asyncio.sleep(0.01)
    cpu = time.process_time() - cpu
    redis_cpu = (redis_server.cpu_ticks() - redis_ticks) / CLOCK_TICKS_PER_SECOND
    for backend in backends:
        await backend.close()
    windows = sorted(admitted)[:-1]
    busiest = max((demand[(i, w)] for i in range(sidecars) for w in windows), default=0)
    bound = (
        None
        if interval_ms is None
        else (sidecars - 1) * busiest * 2 * (interval_ms + TIMEOUT_MS) / 1000
    )
    return Measured(
        "exact" if interval_ms is None else f"{interval_ms} ms",
        sum(demand.values()),
        *counted(url),
        cpu,
        redis_cpu,
        [admitted[w] for w in windows],
        busiest,
        bound,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aggregation", description=__doc__)
    parser.add_argument("--sidecars", type=int, default=3)
    parser.add_argument("--rate", type=int, default=2000, help="calls per second per sidecar")
    parser.add_argument("--limit", type=int, default=1000, help="the counter's limit per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--intervals", default="10,50,100", help="sync intervals, in ms")
    args = parser.parse_args(argv)
    intervals: list[int | None] = [None, *(int(i) for i in args.intervals.split(","))]
    with tempfile.TemporaryDirectory(prefix="bench-aggregation-") as workdir:
        service = start_redis(Path(workdir))
        try:
            results = [
                asyncio.run(
                    measure(service, interval, args.sidecars, args.rate, args.limit, args.seconds)
                )
                for interval in intervals
            ]
        finally:
            service.stop()
    print(
        f"local aggregation ({build.name()} build): {args.sidecars} sidecars x {args.rate:,} "
        f"calls/s on one counter limited to {args.limit:,}/s, {args.seconds:g} s, deadline "
        f"{TIMEOUT_MS} ms"
    )
    print(
        "  mode        calls  Redis calls  Redis commands  CPU us/call     admitted/window "
        "overshoot  bound"
    )
    print("                       per 1,000       per 1,000  sidecar  Redis   least    most")
    for result in results:
        print(result.row(args.limit))
    print(
        "  (commands are counted by Redis; CPU is this process's time per call, timed on a "
        "shared machine: compare rows of one run)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
