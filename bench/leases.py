"""Leases measured against exact and approximate decisions: Redis calls per 1,000 requests, CPU
per request, latency and over- and under-admission per window, on one hot counter and on
100,000 counters under Zipf-distributed traffic.

Several sidecars (limiters in this process, each on its own Redis connection, as separate
processes would be) share one redis-server this script starts and stops by its PID. Each mode
decides the same rule its own way: `exact` (every request a script call), `leased`
(`leased: true` under `--lease-ms`, `sidecar.storage.leases`) and `approximate`
(`approximate: true` under `--sync-interval-ms`, `sidecar.storage.aggregation`). Two loads:

- hot: one counter (`client: c1`) limited to LIMIT a second; each sidecar receives RATE
  requests a second, paced, so demand is several times the limit;
- zipf: 100,000 counters (`user: <n>`) limited to USER_LIMIT a second each; each request's
  user drawn from a Zipf law (the n-th user weighs 1/n), so a few users are far over their
  limit and most are hit once or never.

Reported per mode: Redis calls (script calls) and commands (those inside the scripts too) per
1,000 requests, counted by the server (INFO commandstats); this process's CPU and
redis-server's per request (timed, so compare rows of one run); p50/p99 of the time from a
request's decide call to its answer; and per whole window of each counter, the admissions past
the limit (over) and, in windows whose demand reached the limit, the budget left unadmitted
(under).

    python -m bench.leases                                # both loads, the three modes
    python -m bench.leases --loads hot --rate 3000 --lease-ms 100
    PYTHONSAFEPATH=1 PYTHONPATH=build/compiled python -m bench.leases   # compiled build
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.aggregation import counted
from bench.processes import CLOCK_TICKS_PER_SECOND
from bench.services import Service, start_redis
from sidecar import build
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.model import Code, Decision, Descriptor, Entry, Request
from sidecar.storage import Backend
from sidecar.storage.aggregation import Aggregated
from sidecar.storage.backends import open_backend
from sidecar.storage.leases import Leased, store_for
from sidecar.telemetry import logs

TIMEOUT_MS = 50
TICK_SECONDS = 0.005
USERS = 100_000
#: How long a fresh redis-server lends nothing of the windows it may have forgotten
#: (`lua/lease.lua`: the window in progress, and the clock margin).
FRESH_SERVER_SECONDS = 2.5
MODES = ("exact", "leased", "approximate")


@dataclass
class Measured:
    mode: str
    requests: int
    store_calls: int
    commands: int
    cpu_seconds: float
    redis_cpu_seconds: float
    latencies: list[float]
    windows: int  # (counter, whole window) pairs whose demand reached the limit
    over: int
    under: int
    worst_over: int

    def row(self) -> str:
        n = max(1, self.requests)
        ordered = sorted(self.latencies)
        p50 = ordered[len(ordered) // 2] * 1000 if ordered else 0.0
        p99 = ordered[int(len(ordered) * 0.99)] * 1000 if ordered else 0.0
        return (
            f"  {self.mode:<12} {self.requests:>7,} {1000 * self.store_calls / n:>9.1f} "
            f"{1000 * self.commands / n:>9.1f} {1e6 * self.cpu_seconds / n:>8.1f} "
            f"{1e6 * self.redis_cpu_seconds / n:>6.1f} {p50:>7.3f} {p99:>7.3f} "
            f"{self.windows:>7,} {self.over:>6,} {self.worst_over:>5,} {self.under:>7,}"
        )


def rules(mode: str, key: str, limit: int) -> Rules:
    flag = {"leased": "    leased: true\n", "approximate": "    approximate: true\n"}.get(mode, "")
    text = (
        f"domain: bench\ndescriptors:\n  - key: {key}\n{flag}"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    )
    return Rules({"bench": config.parse(text, "bench.yaml")})


def backend(mode: str, url: str, lease_ms: int, interval_ms: int) -> Backend:
    store = open_backend(url, timeout_ms=TIMEOUT_MS)
    if mode == "leased":
        leased = Leased(store, store_for(store, TIMEOUT_MS, lease_ms), lease_ms)
        leased.start()
        return leased
    if mode == "approximate":
        aggregated = Aggregated(store, interval_ms, TIMEOUT_MS)
        aggregated.start()
        return aggregated
    return store


def zipf_users(users: int) -> Callable[[random.Random], str]:
    """A draw of a user id, the n-th (from 1) with weight 1/n."""
    weights = list(itertools.accumulate(1 / n for n in range(1, users + 1)))
    total = weights[-1]

    def draw(rng: random.Random) -> str:
        return str(bisect.bisect_left(weights, rng.random() * total) + 1)

    return draw


async def measure(
    redis_server: Service,
    mode: str,
    load: str,
    sidecars: int,
    rate: int,
    limit: int,
    seconds: float,
    lease_ms: int,
    interval_ms: int,
) -> Measured:
    url = redis_server.placeholders["redis_url"]
    with redis.Redis.from_url(url) as client:
        client.flushall()
        client.config_resetstat()
    key = "client" if load == "hot" else "user"
    the_rules = rules(mode, key, limit)
    instant = [time.time()]  # every limiter's clock: a request counts in the window it was sent in
    backends = [backend(mode, url, lease_ms, interval_ms) for _ in range(sidecars)]
    # Deny on a store failure: an over-admission here is the mode's own, not the failure mode's.
    deny = Settings(failure_mode="deny")
    limiters = [Limiter(the_rules, b, settings=deny, clock=lambda: instant[0]) for b in backends]
    draw = zipf_users(USERS) if load == "zipf" else (lambda rng: "c1")
    rng = random.Random(7)
    admitted: Counter[tuple[str, int]] = Counter()
    demand: Counter[tuple[str, int]] = Counter()
    latencies: list[float] = []
    answered = 0
    await asyncio.sleep(math.ceil(time.time()) - time.time())  # start on a whole second
    start = time.time()
    stop_at = start + seconds
    per_tick = rate * TICK_SECONDS

    class Done:
        """One request's answer: counted in its counter's window, timed."""

        __slots__ = ("sent", "where")

        def __init__(self, where: tuple[str, int]) -> None:
            self.where = where
            self.sent = time.perf_counter()

        def __call__(self, decision: Decision | Exception) -> None:
            nonlocal answered
            answered += 1
            latencies.append(time.perf_counter() - self.sent)
            if isinstance(decision, Decision) and decision.overall_code is Code.OK:
                admitted[self.where] += 1

    async def drive(limiter: Limiter) -> None:
        sent = 0
        while (now := time.time()) < stop_at:
            instant[0] = now
            due = int((now - start) / TICK_SECONDS * per_tick) + 1
            while sent < due:
                sent += 1
                user = draw(rng)
                where = (user, int(now))
                demand[where] += 1
                plan = limiter.prepare(Request("bench", (Descriptor((Entry(key, user),)),)))
                limiter.decide(plan, _same, Done(where))
            await asyncio.sleep(TICK_SECONDS)

    cpu, redis_ticks = time.process_time(), redis_server.cpu_ticks()
    await asyncio.gather(*(drive(limiter) for limiter in limiters))
    waited = 0
    while answered < sum(demand.values()) and waited < 1000:  # 10 s at most: say what is left
        await asyncio.sleep(0.01)
        waited += 1
    if answered < sum(demand.values()):
        print(f"  {mode}: {sum(demand.values()) - answered} requests never answered")
    cpu = time.process_time() - cpu
    redis_cpu = (redis_server.cpu_ticks() - redis_ticks) / CLOCK_TICKS_PER_SECOND
    for each in backends:
        await each.close()
    last = int(stop_at)  # the last second is not a whole window
    over = [max(0, admitted[w] - limit) for w in demand if w[1] < last]
    saturated = [w for w in demand if w[1] < last and demand[w] >= limit]
    return Measured(
        mode,
        sum(demand.values()),
        *counted(url),
        cpu,
        redis_cpu,
        latencies,
        len(saturated),
        sum(over),
        sum(limit - min(limit, admitted[w]) for w in saturated),
        max(over, default=0),
    )


def _same(decision: Decision) -> Decision:
    return decision


def report(load: str, args: argparse.Namespace, results: Sequence[Measured]) -> None:
    what = (
        f"one counter limited to {args.limit:,}/s"
        if load == "hot"
        else f"{USERS:,} counters limited to {args.user_limit}/s each, Zipf traffic"
    )
    print(
        f"{load} ({build.name()} build): {args.sidecars} sidecars x {args.rate:,} requests/s on "
        f"{what}, {args.seconds:g} s; --lease-ms {args.lease_ms}, --sync-interval-ms "
        f"{args.interval_ms}, deadline {TIMEOUT_MS} ms"
    )
    print(
        "  mode         requests    Redis    Redis  CPU us/request   ms to answer  "
        "windows   over worst   under"
    )
    print(
        "                          calls/1k cmds/1k  sidecar  Redis    p50     p99  "
        "at limit  units  unit   units"
    )
    for result in results:
        print(result.row())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leases", description=__doc__)
    parser.add_argument("--sidecars", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000, help="requests per second per sidecar")
    parser.add_argument(
        "--limit", type=int, default=1000, help="the hot counter's limit per second"
    )
    parser.add_argument(
        "--user-limit", type=int, default=10, help="each Zipf user's limit per second"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--lease-ms", type=int, default=200)
    parser.add_argument("--interval-ms", type=int, default=50)
    parser.add_argument("--loads", default="hot,zipf")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    logs.configure(
        "error", "console"
    )  # a store call past its deadline under load is counted, not logged
    with tempfile.TemporaryDirectory(prefix="bench-leases-") as workdir:
        service = start_redis(Path(workdir))
        try:
            time.sleep(FRESH_SERVER_SECONDS)
            for load in args.loads.split(","):
                limit = args.limit if load == "hot" else args.user_limit
                results = [
                    asyncio.run(
                        measure(
                            service,
                            mode,
                            load,
                            args.sidecars,
                            args.rate,
                            limit,
                            args.seconds,
                            args.lease_ms,
                            args.interval_ms,
                        )
                    )
                    for mode in args.modes.split(",")
                ]
                report(load, args, results)
        finally:
            service.stop()
    print(
        "  (calls and commands are counted by Redis; CPU is timed on a shared machine: compare "
        "rows of one run; over: admissions past a limit in whole windows; under: budget left "
        "in whole windows whose demand reached the limit)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
