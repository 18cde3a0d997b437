"""Benchmark usage counting (`sidecar.core.usage`): what it costs a request, and what it keeps.

1. CPU per request, in this process (the limiter and the backend's client; memory's store too):
   the same requests decided with and without `usage` in the rules, timed over N calls each
   (`time.process_time`, so the other processes of a busy machine weigh less).
2. Redis CPU per request: `usec_per_call` of EVALSHA in `INFO commandstats` (the script's own
   commands are counted inside it), with and without usage, on a fresh `redis-server`. Without
   usage the request runs count.lua; with it, decide.lua (which judges the request before it
   counts it) plus the usage writes.
3. Memory per distinct key per day: K apps each call once (three dimensions: by app, by app
   and interface, unique users per app, so a key's hash fields and its HyperLogLog), and
   `used_memory` before and after, over K; the memory backend's the same, by tracemalloc.

    .venv/bin/python -m bench.usage [--calls N] [--keys K]

Numbers taken on a busy machine vary by a few tens of percent: the CPU rows compare two runs
taken side by side. Exit status: 0 when measured, 1 when something failed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

if not __package__:  # run as `python bench/usage.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.services import start_redis
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.loop.callbacks import awaited
from sidecar.model import Decision, Descriptor, Entry, Request
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: open
{usage}
descriptors:
  - key: app
    rate_limit: {{unit: day, requests_per_unit: 1000000000}}
    descriptors:
      - key: interface
        rate_limit: {{unit: minute, requests_per_unit: 1000000000}}
"""
USAGE = """\
usage:
  - by: [app]
  - by: [app, interface]
  - by: [app]
    unique: user
"""


def request(app: str, interface: str, user: str) -> Request:
    return Request(
        "open",
        (
            Descriptor((Entry("app", app),)),
            Descriptor((Entry("app", app), Entry("interface", interface))),
            Descriptor((Entry("app", app), Entry("user", user))),
        ),
    )


def limiter(url: str, counted: bool) -> Limiter:
    domain = config.parse(RULES.format(usage=USAGE if counted else ""), "rules.yaml")
    return Limiter(Rules({domain.name: domain}), open_backend(url, timeout_ms=2_000))


async def decide(limiter: Limiter, body: Request) -> Decision:
    plan = limiter.prepare(body)
    decision: Decision = await awaited(lambda done: limiter.decide(plan, _same, done))
    return decision


def _same(decision: Decision) -> Decision:
    return decision


async def cpu_per_call(url: str, counted: bool, calls: int) -> float:
    """Microseconds of this process's CPU per decision (100 users of 10 apps, 3 interfaces)."""
    used = limiter(url, counted)
    bodies = [request(f"app{n % 10}", f"i{n % 3}", f"user{n % 100}") for n in range(300)]
    for body in bodies:  # plans made, scripts loaded
        await decide(used, body)
    started = time.process_time()
    for n in range(calls):
        await decide(used, bodies[n % len(bodies)])
    spent = time.process_time() - started
    await used.backend.close()
    return spent / calls * 1e6


async def redis_usec_per_call(url: str, client: redis.Redis, counted: bool, calls: int) -> float:
    """Redis's own microseconds per script call (INFO commandstats), with or without usage."""
    used = limiter(url, counted)
    bodies = [request(f"app{n % 10}", f"i{n % 3}", f"user{n % 100}") for n in range(300)]
    await decide(used, bodies[0])
    client.config_resetstat()
    for n in range(calls):
        await decide(used, bodies[n % len(bodies)])
    stats = client.info("commandstats")["cmdstat_evalsha"]
    await used.backend.close()
    return float(stats["usec_per_call"])


async def redis_bytes_per_key(url: str, client: redis.Redis, keys: int) -> float:
    """Redis bytes per distinct app and day: its usage hash (fields of by app and by app and
    interface, admitted) and its HyperLogLog of one user, beside its counters, less what the
    counters alone take (measured the same way without usage)."""
    spent = []
    for counted in (False, True):
        client.flushall()
        used = limiter(url, counted)
        before = int(client.info("memory")["used_memory"])
        for n in range(keys):
            await decide(used, request(f"app-{n:08d}", "orders", f"user-{n}"))
        spent.append(int(client.info("memory")["used_memory"]) - before)
        await used.backend.close()
    return (spent[1] - spent[0]) / keys


async def memory_bytes_per_key(keys: int) -> float:
    """The memory backend's bytes per distinct app and day (tracemalloc), less its counters'."""
    spent = []
    for counted in (False, True):
        used = limiter("memory://", counted)
        assert isinstance(used.backend, MemoryBackend)
        bodies = [request(f"app-{n:08d}", "orders", f"user-{n}") for n in range(keys)]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for body in bodies:
            await decide(used, body)
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        spent.append(after - before)
        await used.backend.close()
    return (spent[1] - spent[0]) / keys


async def run(args: argparse.Namespace, workdir: Path) -> str:
    service = start_redis(workdir)
    url = service.placeholders["redis_url"]
    client = redis.Redis.from_url(url)
    try:
        cpu = {
            (store, counted): await cpu_per_call(target, counted, args.calls)
            for store, target in (("memory", "memory://"), ("redis", url))
            for counted in (False, True)
        }
        server = {
            counted: await redis_usec_per_call(url, client, counted, args.calls)
            for counted in (False, True)
        }
        redis_bytes = await redis_bytes_per_key(url, client, args.keys)
        memory_bytes = await memory_bytes_per_key(args.keys)
    finally:
        client.close()
        service.stop()
    lines = [
        f"usage counting ({args.calls:,} calls of 3 descriptors; dimensions by app, by app and "
        "interface, unique users per app)",
        "                          without usage   with usage",
    ]
    for store in ("memory", "redis"):
        lines.append(
            f"  sidecar CPU, {store + ':':8}  {cpu[(store, False)]:8.1f} us   {cpu[(store, True)]:8.1f} us per call"
        )
    lines.append(
        f"  Redis CPU (EVALSHA):    {server[False]:8.1f} us   {server[True]:8.1f} us per call"
    )
    lines.append(
        f"memory per distinct key per day ({args.keys:,} apps, one call each): "
        f"Redis {redis_bytes:,.0f} bytes, memory backend {memory_bytes:,.0f} bytes"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.usage", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=20_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as workdir:
        try:
            print(asyncio.run(run(args, Path(workdir))))
        except Exception as exc:
            print(f"bench.usage: {exc!r}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
