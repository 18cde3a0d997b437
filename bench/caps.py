"""Benchmark the frequency-cap API: Redis memory per counter, CheckAds latency, record throughput.

Everything goes through a real sidecar process and its gRPC port, on a fresh `redis-server`:

1. Memory: every user of N (default 50,000) sees 20 ads of a 10,000-ad catalog once, recorded
   with RecordImpressions in batches of 100; each impression moves the ad's day and month
   counters, so N × 20 × 2 counters. `used_memory` from `INFO memory` before and after gives the
   bytes; deleting the impression-id keys afterwards splits them into counters and ids. The
   same is measured for the reference layout (a rules tree without `group_counters`, one string
   key per counter) on fewer users, since bytes per counter do not depend on the count, and for
   windows anchored on events (a window from the first event and a lifetime cap to a flight's
   end, each a field holding its count and its end).
   The packed layout (`group_counters: packed`: an ad's day and month counts in one field) is
   measured at 100,000 and 10,000,000 counters (`--packed-counters`): a sample of users is
   recorded through the sidecar, then the rest is written with pipelined HSETs of the very
   fields and values `sidecar.core.counters.grouped_hits` and `sidecar.algorithms.packing` make (the sample's
   hashes written both ways must be equal, byte for byte), since 250,000 users' impressions
   through the API would take the bench an hour. `used_memory` before and after, and `MEMORY
   USAGE` of sampled hashes, give bytes per counter; the grouped layout is loaded the same way
   at the same sizes, beside it.
2. Latency: CheckAds of 50 ads (a user's 20 seen ads and 30 others, 10 of them naming one of 3
   campaigns) at a steady 200 calls/s from h2load (`--rps`, 2 connections), p50/p99 over every
   call, after a warm-up.
3. Throughput: RecordImpressions of 100 new impressions a batch, 4 calls in flight: impressions/s.
4. The Zipf row, on the largest packed load: CheckAds of 50 ads naming 3 identifiers (a person's
   cap summed across them), each call on a user drawn by Zipf from ten million, at a fixed
   `--check-rate` from bench/h2client.py (open loop), through a sidecar with the default 50 ms
   Redis deadline: p50/p99/p99.9, the slowest call, the answers by gRPC status, the longest GC
   pause (the sidecar's histogram), the sidecar's and Redis's CPU per call, the load average.

    .venv/bin/python -m bench.caps [--users N] [--reference-users N] [--seconds S]
                                   [--packed-counters N,N] [--check-rate N]
                                   [--build build/compiled] [--zipf-only]

`--zipf-only` loads the largest packed layout and measures the Zipf row alone (at each rate of
`--check-rate`, comma-separated); `--build` runs the sidecars from the compiled build.

The clients run on the same CPUs as the sidecar and Redis, so their share is in every number.
Exit status: 0 when measured (targets met or not), 1 when something failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python bench/caps.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # type: ignore[import-untyped]
import redis

from bench import h2client, keyspace, probe
from bench.distinct import longest_pause, scrape
from bench.load import Load, LoadResult
from bench.load import run as run_load
from bench.probe import grpc_frame
from bench.processes import CLOCK_TICKS_PER_SECOND, BenchError, Process, free_port, start
from bench.services import Service, start_redis
from sidecar import build as sidecar_build
from sidecar.algorithms import packing
from sidecar.core import config
from sidecar.core.counters import grouped_hits
from sidecar.core.keys import field_head, group_key
from sidecar.frequency.service import CHECK_ADS, RECORD_IMPRESSIONS
from sidecar.model import Limit
from sidecar.proto.ratelimit_sidecar.frequency.v1 import frequency_pb2 as pb

RULES = """\
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 10}
          - {unit: month, requests_per_unit: 100}
      - key: campaign
        rate_limit: {unit: day, requests_per_unit: 30}
"""

#: The same caps as windows anchored on events: 10 per 24 hours from the first impression, and
#: 100 for a flight ending in 30 days (its end is worked out when the bench starts).
ANCHORED_RULES = """\
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {algorithm: first_event, unit: hour, unit_multiplier: 24, requests_per_unit: 10}
          - {algorithm: lifetime, requests_per_unit: 100, ends: FLIGHT_END}
"""

#: Redis's hash encoding thresholds (its defaults): up to 128 entries (64 fields) of at most
#: 64 bytes each, a hash is one listpack.
LISTPACK = {"hash-max-listpack-entries": 128, "hash-max-listpack-value": 64}
PACKED_RULES = RULES.replace("group_counters: true", "group_counters: packed")
#: Users recorded through the sidecar before the bulk load, whose hashes prove it equivalent.
SAMPLE_USERS = 200
#: Hashes whose MEMORY USAGE is averaged.
USAGE_SAMPLES = 200
PIPELINE = 500

BENCH_DIR = Path(__file__).resolve().parent
ADS_PER_USER = 20
CATALOG = 10_000
BATCH = 100
IN_FLIGHT = 8
TARGET_BYTES_PER_COUNTER = 26
TARGET_PACKED_BYTES = 16
TARGET_P99_MS = 2.0
CHECK_RATE = 200
START_TIMEOUT = 30.0


def user_id(n: int) -> str:
    return f"u{n:07d}"


def ads_of(n: int) -> list[str]:
    """The 20 distinct ads user `n` saw, spread over the catalog."""
    return [f"a{(n * 7 + k * 131) % CATALOG:04d}" for k in range(ADS_PER_USER)]


def impression_id(user: int, ad: int, round_: int = 0) -> str:
    """A 20-character id, the size of a typical 80-bit beacon id in hex."""
    return f"{user:09x}{ad:02x}{round_:09x}"


@dataclass
class Memory:
    layout: str
    users: int
    counters: int
    impressions: int
    counter_bytes: int
    id_bytes: int
    seconds: float

    @property
    def per_counter(self) -> float:
        return self.counter_bytes / self.counters

    @property
    def per_impression(self) -> float:
        return self.id_bytes / self.impressions


@dataclass
class Calls:
    latency: LoadResult
    back_to_back: LoadResult
    baseline: LoadResult
    steal: float
    record_rate: float
    recorded: int


class Sidecar:
    """A `python -m sidecar serve` process with the bench's rules, and a channel to it."""

    def __init__(
        self, workdir: Path, redis_url: str, rules: str, name: str, timeout_ms: int = 1000
    ) -> None:
        rules_dir = workdir / f"rules-{name}"
        rules_dir.mkdir()
        (rules_dir / "ads.yaml").write_text(rules)
        self.port = free_port()
        self.metrics = f"http://127.0.0.1:{(http_port := free_port())}/metrics"
        argv = [
            sys.executable, "-m", "sidecar", "serve",
            "--config", str(rules_dir),
            "--backend", redis_url,
            "--grpc-address", f"127.0.0.1:{self.port}",
            "--http-address", f"127.0.0.1:{http_port}",
            "--redis-timeout-ms", str(timeout_ms),
            "--log-level", "warning",
        ]  # fmt: skip
        self.process: Process = start(f"sidecar-{name}", argv, {}, workdir)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        # Raw bytes both ways: the client does not parse what it does not need.
        self.check = self.channel.unary_unary(CHECK_ADS)
        self.record = self.channel.unary_unary(RECORD_IMPRESSIONS)

    async def ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        probe = pb.CheckAdsRequest(domain="ads", user="probe").SerializeToString()
        while True:
            code = self.process.exit_code()
            if code is not None:
                raise BenchError(f"sidecar exited with {code}\n{self.process.log_tail()}")
            try:
                await self.check(probe, timeout=1)
                return
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise BenchError(f"sidecar never answered CheckAds: {exc.details()}") from exc
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.channel.close()
        self.process.stop()


async def record_all(sidecar: Sidecar, users: range, round_: int = 0) -> int:
    """Every user's 20 ads once, batches of 100 with IN_FLIGHT calls at a time; impressions."""
    impressions = (
        pb.Impression(id=impression_id(u, k, round_), user=user_id(u), ad=ad)
        for u in users
        for k, ad in enumerate(ads_of(u))
    )
    batches = (
        pb.RecordImpressionsRequest(domain="ads", impressions=chunk).SerializeToString()
        for chunk in iter(lambda: list(itertools.islice(impressions, BATCH)), [])
    )
    counted = 0

    async def worker() -> None:
        nonlocal counted
        for body in batches:
            answer = pb.RecordImpressionsResponse.FromString(await sidecar.record(body, timeout=30))
            counted += sum(result.counted for result in answer.results)

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return counted


def cpu_times() -> list[int]:
    """The machine's CPU time counters from /proc/stat (user, nice, system, idle, ..., steal)."""
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1:]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of CPU time the hypervisor gave to others: latency here depends on it."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / max(1, sum(spent))


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def delete_ids(client: redis.Redis) -> None:
    for keys in _chunks(client.scan_iter(match="*|%ids|*", count=10_000), 10_000):
        client.delete(*keys)


def _chunks(items: object, size: int) -> list[list[bytes]]:
    iterator = iter(items)  # type: ignore[call-overload]
    return list(iter(lambda: list(itertools.islice(iterator, size)), []))


async def measure_memory(
    workdir: Path, service: Service, client: redis.Redis, layout: str, rules: str, users: int
) -> Memory:
    client.flushall()
    # Measured with no sidecar connected, so its connection's buffers are not counted.
    before = used_memory(client)
    sidecar = Sidecar(workdir, service.placeholders["redis_url"], rules, layout)
    try:
        await sidecar.ready()
        started = time.perf_counter()
        counted = await record_all(sidecar, range(users))
        seconds = time.perf_counter() - started
    finally:
        await sidecar.close()
    after = used_memory(client)
    impressions = users * ADS_PER_USER
    if counted != impressions:
        raise BenchError(f"{layout}: {counted} of {impressions} impressions counted")
    delete_ids(client)
    without_ids = used_memory(client)
    return Memory(
        layout,
        users,
        impressions * 2,
        impressions,
        without_ids - before,
        after - without_ids,
        seconds,
    )


@dataclass
class Bulk:
    """Bytes per counter of a layout loaded in bulk: `used_memory`'s delta, and the mean
    MEMORY USAGE of sampled hashes (the hash alone: its key, value and listpack)."""

    layout: str
    counters: int
    per_counter: float
    usage_per_counter: float
    seconds: float


def user_hash(limit: Limit, user: int, now_ms: int) -> tuple[bytes, dict[bytes, int], int]:
    """User `user`'s hash after one impression of each of its 20 ads, as the sidecar writes
    it: its key, fields and values, and the ms it lives (the real naming and arithmetic:
    `grouped_hits`, then each hit's value as `decide` applies it)."""
    key = group_key("ads", [("user", user_id(user))])
    fields: dict[bytes, int] = {}
    ttl = 0
    for ad in ads_of(user):
        for hit in grouped_hits(key, field_head([("user", ""), ("ad", ad)]), limit, 1, 0,
                                limit.role, now_ms):  # fmt: skip
            if hit.packed is not None:
                fields[hit.field] = packing.add(hit.packed, fields.get(hit.field), 1)
            else:
                fields[hit.field] = fields.get(hit.field, 0) + 1
            ttl = max(ttl, hit.ttl * 1000)
    return key, fields, ttl


def ad_limit(rules: str) -> Limit:
    domain = config.parse(rules, "ads.yaml")
    user = next(iter(domain.root.nodes()))
    ad = next(node for node in user.children.nodes() if node.key == "ad")
    assert ad.limit is not None
    return ad.limit


async def measure_bulk(
    workdir: Path,
    service: Service,
    client: redis.Redis,
    layout: str,
    rules: str,
    counters: int,
    keep: bool = False,
) -> Bulk:
    """`counters` counters of `rules` (20 ads × 2 windows a user), the first SAMPLE_USERS users
    recorded through a sidecar and compared with what the bulk load writes; left in Redis
    when `keep`."""
    users = counters // (ADS_PER_USER * 2)
    client.flushall()
    limit = ad_limit(rules)
    sidecar = Sidecar(
        workdir, service.placeholders["redis_url"], rules, f"bulk-{layout}-{counters}"
    )
    try:
        await sidecar.ready()
        now_ms = int(time.time() * 1000)
        await record_all(sidecar, range(SAMPLE_USERS))
    finally:
        await sidecar.close()
    for user in range(SAMPLE_USERS):
        key, fields, _ = user_hash(limit, user, now_ms)
        stored = client.hgetall(key)
        expected = {field: str(value).encode() for field, value in fields.items()}
        if stored != expected:
            raise BenchError(f"{layout}: the bulk layout of {key!r} is not the sidecar's: "
                             f"{expected} != {stored}")  # fmt: skip
    client.flushall()
    before = used_memory(client)
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for user in range(users):
        key, fields, ttl = user_hash(limit, user, now_ms)
        pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
        pipe.pexpire(key, ttl)
        if user % PIPELINE == PIPELINE - 1:
            pipe.execute()
            if user % 50_000 == PIPELINE - 1:
                _progress(f"  {layout}: {user + 1:,} of {users:,} users")
    pipe.execute()
    seconds = time.perf_counter() - started
    after = used_memory(client)
    step = max(1, users // USAGE_SAMPLES)
    sampled = [client.memory_usage(user_hash(limit, u, now_ms)[0], samples=0) or 0
               for u in range(0, users, step)]  # fmt: skip
    per_hash = sum(sampled) / len(sampled)
    total = users * ADS_PER_USER * 2
    if not keep:
        client.flushall()
    return Bulk(layout, total, (after - before) / total, per_hash / (ADS_PER_USER * 2), seconds)


#: The Zipf row's rules: each user's caps as PACKED_RULES, and a person's counted across three
#: identifiers, so every check reads three hashes.
PERSON_RULES = (
    PACKED_RULES
    + """\
  - key: person
    identifiers: [user, device, cookie]
    group_counters: packed
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 20}
          - {unit: month, requests_per_unit: 200}
"""
)
TEN_M = 10_000_000
#: The sidecar's default Redis deadline, which the Zipf row keeps: a call past it is an answer
#: the auction no longer waits for.
REDIS_DEADLINE_MS = 50
TARGET_PAUSE_MS = 5.0
SEED, WARMUP_SEED = 35, 36


@dataclass
class Distinct:
    """The Zipf row: CheckAds of 50 ads naming 3 identifiers, each call on a user drawn from
    ten million (Zipf), at a fixed rate, open loop (latency from when each call was due)."""

    rate: int
    tally: h2client.Tally
    gc_pause_ms: float | None
    steal: float
    load: str
    server_us: float
    redis_us: float

    def percentile(self, share: float) -> float:
        ordered = sorted(self.tally.latencies_us)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] / 1000

    def lines(self) -> list[str]:
        tally = self.tally
        outcomes = ", ".join(f"{name} {count:,}" for name, count in sorted(tally.outcomes.items()))
        pause = "n/a" if self.gc_pause_ms is None else f"{self.gc_pause_ms:g} ms"
        return [
            f"  CheckAds, 50 ads x 3 identifiers, Zipf over {TEN_M:,} users, {self.rate}/s "
            f"open loop, {tally.calls:,} calls: p50 {self.percentile(0.5):.2f} ms, "
            f"p99 {self.percentile(0.99):.2f} ms, p99.9 {self.percentile(0.999):.2f} ms, "
            f"slowest {max(tally.latencies_us) / 1000:.2f} ms; answers: {outcomes}; "
            f"longest GC pause {pause}; CPU per call: sidecar {self.server_us:,.0f} µs, "
            f"redis {self.redis_us:,.0f} µs "
            f"(CPU steal {self.steal:.0%}, load average {self.load})",
        ]

    def targets(self) -> list[str]:
        p99 = self.percentile(0.99)
        slowest = max(self.tally.latencies_us) / 1000
        failed = self.tally.calls - self.tally.outcomes.get("OK", 0)
        pause = self.gc_pause_ms
        checks = [
            (p99 <= TARGET_P99_MS, f"Zipf CheckAds p99 <= {TARGET_P99_MS:g} ms: {p99:.2f} ms"),
            (
                slowest <= REDIS_DEADLINE_MS,
                f"no call past the {REDIS_DEADLINE_MS} ms Redis deadline: slowest {slowest:.2f} ms",
            ),
            (failed == 0, f"no answer but OK (UNAVAILABLE and the like): {failed}"),
            (
                pause is not None and pause <= TARGET_PAUSE_MS,
                f"longest GC pause <= {TARGET_PAUSE_MS:g} ms: {pause} ms",
            ),
        ]
        return [f"target {'met' if met else 'missed'} ({text})" for met, text in checks]


def person_body(rank: int) -> bytes:
    """CheckAds for the user of `rank`, named by three identifiers: its 20 seen ads and 30
    others, 10 of the 50 in campaigns."""
    others = [f"a{(rank * 13 + k * 97 + 5_000) % CATALOG:04d}" for k in range(30)]
    candidates = [pb.AdCandidate(ad=ad) for ad in ads_of(rank) + others]
    for k in range(10):
        candidates[k * 5].campaign = f"c{k % 3}"
    identities = {"user": user_id(rank), "device": f"d{rank:07d}", "cookie": f"k{rank:07d}"}
    message = pb.CheckAdsRequest(domain="ads", identities=identities, ads=candidates)
    return grpc_frame(message.SerializeToString())


async def measure_distinct(workdir: Path, service: Service, rate: int, seconds: float) -> Distinct:
    """The Zipf row, on the counters the bulk load left, through a sidecar with the default
    Redis deadline."""
    sidecar = Sidecar(
        workdir, service.placeholders["redis_url"], PERSON_RULES, "zipf", REDIS_DEADLINE_MS
    )
    users = keyspace.Keys(TEN_M, keyspace.Spread.ZIPF)
    bodies = [person_body(rank) for rank in users.draw(int(rate * seconds), SEED)]
    warmup = [person_body(rank) for rank in users.draw(rate * 2, WARMUP_SEED)]
    pace = h2client.Pace(connections=2, streams=8, rate=rate, timeout=10.0)
    try:
        await sidecar.ready()
        await asyncio.to_thread(_generate, sidecar.port, warmup, pace)
        before = scrape(sidecar.metrics)
        ticks = sidecar.process.cpu_ticks()
        redis_ticks = service.cpu_ticks()
        times = cpu_times()
        tally = await asyncio.to_thread(_generate, sidecar.port, bodies, pace)
        steal = steal_share(times, cpu_times())
        spent = sidecar.process.cpu_ticks() - ticks
        redis_spent = service.cpu_ticks() - redis_ticks
        after = scrape(sidecar.metrics)
    finally:
        await sidecar.close()
    pause = longest_pause(before, after)
    load = Path("/proc/loadavg").read_text().split()[0]
    per_call = CLOCK_TICKS_PER_SECOND / 1e6 * max(1, tally.calls)
    return Distinct(
        rate,
        tally,
        None if pause is None else pause * 1000,
        steal,
        load,
        spent / per_call,
        redis_spent / per_call,
    )


def _generate(port: int, bodies: list[bytes], pace: h2client.Pace) -> h2client.Tally:
    with asyncio.Runner(loop_factory=h2client.event_loop) as runner:
        return runner.run(h2client.run("127.0.0.1", port, bodies, pace, CHECK_ADS.encode()))


def check_body(users: int) -> bytes:
    """CheckAds for a user who saw 20 ads: those and 30 others, 10 of the 50 in campaigns."""
    u = users // 2
    others = [f"a{(u * 13 + k * 97 + 5_000) % CATALOG:04d}" for k in range(30)]
    candidates = [pb.AdCandidate(ad=ad) for ad in ads_of(u) + others]
    for k in range(10):
        candidates[k * 5].campaign = f"c{k % 3}"
    message = pb.CheckAdsRequest(domain="ads", user=user_id(u), ads=candidates)
    body: bytes = message.SerializeToString()
    return body


async def measure_calls(workdir: Path, service: Service, users: int, seconds: float) -> Calls:
    """CheckAds latency at a steady rate (h2load) and the CPU steal meanwhile, back to back,
    and a no-op server's at the same rate; then RecordImpressions throughput."""
    sidecar = Sidecar(workdir, service.placeholders["redis_url"], RULES, "calls")
    try:
        await sidecar.ready()
        body = workdir / "check.body"
        body.write_bytes(grpc_frame(check_body(users)))
        url = f"http://127.0.0.1:{sidecar.port}{CHECK_ADS}"
        clients = 2
        steady = Load(int(CHECK_RATE * seconds), clients, 8, CHECK_RATE // clients)
        warmup = Load(CHECK_RATE * 2, clients, 8, CHECK_RATE // clients)
        await asyncio.to_thread(run_load, url, body, warmup, workdir / "warmup.tsv", 120)
        before = cpu_times()
        latency = await asyncio.to_thread(
            run_load, url, body, steady, workdir / "check.tsv", seconds * 4 + 60
        )
        steal = steal_share(before, cpu_times())
        back_to_back = await asyncio.to_thread(
            run_load, url, body, Load(1_000, 1, 1), workdir / "closed.tsv", 120
        )
        recorded_users = range(min(users, 2_000))
        started = time.perf_counter()
        counted = await record_all(sidecar, recorded_users, round_=1)
        rate = counted / (time.perf_counter() - started)
    finally:
        await sidecar.close()
    baseline = await asyncio.to_thread(noop_latency, workdir, steady)
    return Calls(latency, back_to_back, baseline, steal, rate, len(recorded_users) * ADS_PER_USER)


def noop_latency(workdir: Path, load: Load) -> LoadResult:
    """The same paced load on the bench's no-op gRPC servicer: what the machine adds to any
    server's latency (waking an idle process on a shared host is not free)."""
    port = free_port()
    server = start(
        "noop",
        [sys.executable, str(BENCH_DIR / "noop_server.py"), "--port", str(port)],
        {},
        workdir,
    )
    try:
        message = probe.request("bench", (("user", "u1"),))
        probe.wait_until_ok(server, port, message, START_TIMEOUT)
        body = workdir / "noop.body"
        body.write_bytes(grpc_frame(message))
        url = f"http://127.0.0.1:{port}{probe.METHOD}"
        return run_load(url, body, load, workdir / "noop.tsv", 300)
    finally:
        server.stop()


def listpack_client(service: Service) -> redis.Redis:
    """A client of `service` with Redis's default listpack settings made sure of: the layouts'
    bytes rest on each user's hash staying a listpack, so a redis.conf cannot change what is
    measured (README: for operators)."""
    port = int(service.placeholders["redis_url"].rsplit(":", 1)[1])
    client = redis.Redis(host="127.0.0.1", port=port, protocol=2)
    for name, value in LISTPACK.items():
        client.config_set(name, value)
    return client


async def run_zipf(args: argparse.Namespace, workdir: Path) -> str:
    """The Zipf row alone, at each rate asked, on the largest packed layout loaded once."""
    service = start_redis(workdir)
    try:
        client = listpack_client(service)
        counters = max(args.packed_counters)
        _progress(f"memory, packed layout in bulk: {counters:,} counters")
        bulk = await measure_bulk(workdir, service, client, "packed", PACKED_RULES, counters, True)
        lines = []
        for number, rate in enumerate(args.check_rate):
            _progress(f"CheckAds on Zipf users, {rate}/s, on the counters loaded")
            rundir = workdir / f"zipf-{number}"
            rundir.mkdir()
            distinct = await measure_distinct(rundir, service, rate, args.seconds)
            lines += distinct.lines() + distinct.targets()
        client.close()
    finally:
        service.stop()
    return "\n".join(
        [f"  packed {bulk.counters:,} counters: {bulk.per_counter:.1f} B/counter", *lines]
    )


async def run(args: argparse.Namespace, workdir: Path) -> str:
    if args.zipf_only:
        return await run_zipf(args, workdir)
    rate = args.check_rate[0]
    service = start_redis(workdir)
    try:
        client = listpack_client(service)
        bulks = []
        for counters in args.packed_counters:
            for layout, rules in (("grouped", RULES), ("packed", PACKED_RULES)):
                _progress(f"memory, {layout} layout in bulk: {counters:,} counters")
                keep = layout == "packed" and counters == max(args.packed_counters)
                bulks.append(
                    await measure_bulk(workdir, service, client, layout, rules, counters, keep)
                )
        _progress(f"CheckAds on Zipf users, {rate}/s, on the counters loaded")
        distinct = await measure_distinct(workdir, service, rate, args.seconds)
        client.flushall()
        _progress(f"memory, grouped layout: {args.users:,} users x 20 ads x (day + month)")
        grouped = await measure_memory(workdir, service, client, "grouped", RULES, args.users)
        _progress(f"memory, reference layout: {args.reference_users:,} users")
        reference = await measure_memory(
            workdir,
            service,
            client,
            "reference",
            RULES.replace("    group_counters: true\n", ""),
            args.reference_users,
        )
        _progress(f"memory, anchored windows: {args.reference_users:,} users")
        anchored = await measure_memory(
            workdir,
            service,
            client,
            "anchored",
            ANCHORED_RULES.replace("FLIGHT_END", str(int(time.time()) + 30 * 86_400)),
            args.reference_users,
        )
        client.flushall()
        _progress("calls: populating, then CheckAds at 200/s and RecordImpressions")
        populate = Sidecar(workdir, service.placeholders["redis_url"], RULES, "populate")
        try:
            await populate.ready()
            await record_all(populate, range(min(args.users, 2_000)))
        finally:
            await populate.close()
        calls = await measure_calls(workdir, service, min(args.users, 2_000), args.seconds)
        client.close()
    finally:
        service.stop()
    return report(grouped, reference, anchored, calls, bulks, distinct)


def report(
    grouped: Memory,
    reference: Memory,
    anchored: Memory,
    calls: Calls,
    bulks: list[Bulk],
    distinct: Distinct,
) -> str:
    lines = ["", "frequency caps (gRPC, fresh redis-server, sidecar --transport fast)", ""]
    lines += distinct.lines()
    for bulk in bulks:
        lines.append(
            f"  {bulk.layout:7} {bulk.counters:>11,} counters (bulk, {SAMPLE_USERS} users "
            f"through the sidecar): {bulk.per_counter:5.1f} B/counter used_memory, "
            f"{bulk.usage_per_counter:5.1f} B/counter MEMORY USAGE; loaded in {bulk.seconds:.0f} s"
        )
    for memory in (grouped, reference, anchored):
        lines.append(
            f"  {memory.layout:9} {memory.users:>7,} users {memory.counters:>10,} counters: "
            f"{memory.per_counter:6.1f} B/counter, ids {memory.per_impression:5.1f} B/impression"
            f" (20-char ids); recorded at {memory.impressions / memory.seconds:,.0f} impressions/s"
        )
    latency, closed, noop = calls.latency, calls.back_to_back, calls.baseline
    lines += [
        f"  CheckAds, 50 ads, {CHECK_RATE} calls/s (h2load --rps), {latency.requests:,} calls: "
        f"p50 {latency.p50_ms:.2f} ms, p99 {latency.p99_ms:.2f} ms "
        f"(CPU steal by other guests meanwhile: {calls.steal:.0%})",
        f"    the same back to back (1 connection, 1 call at a time): p50 {closed.p50_ms:.2f} ms, "
        f"p99 {closed.p99_ms:.2f} ms, {closed.calls_per_second:,.0f} calls/s",
        f"    a no-op gRPC servicer at {CHECK_RATE} calls/s: p50 {noop.p50_ms:.2f} ms, "
        f"p99 {noop.p99_ms:.2f} ms (what this machine adds to any server)",
        f"  RecordImpressions, batches of {BATCH}, {IN_FLIGHT} in flight: "
        f"{calls.record_rate:,.0f} impressions/s ({calls.recorded:,} impressions)",
        "",
    ]
    met = grouped.per_counter <= TARGET_BYTES_PER_COUNTER
    lines.append(
        f"target {'met' if met else 'missed'} (<= {TARGET_BYTES_PER_COUNTER} B/counter): "
        f"{grouped.per_counter:.1f}"
    )
    for bulk in bulks:
        if bulk.layout == "packed":
            met = bulk.per_counter <= TARGET_PACKED_BYTES
            lines.append(
                f"target {'met' if met else 'missed'} (packed <= {TARGET_PACKED_BYTES} "
                f"B/counter at {bulk.counters:,}): {bulk.per_counter:.1f}"
            )
    lines += distinct.targets()
    met = latency.p99_ms <= TARGET_P99_MS
    lines.append(
        f"target {'met' if met else 'missed'} (CheckAds p99 <= {TARGET_P99_MS:g} ms at "
        f"{CHECK_RATE}/s): {latency.p99_ms:.2f} ms"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.caps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=50_000, help="users for the memory run")
    parser.add_argument(
        "--reference-users", type=int, default=5_000, help="users for the reference layout"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="CheckAds load duration")
    parser.add_argument(
        "--check-rate",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[CHECK_RATE],
        help="CheckAds/s of the Zipf row (comma-separated with --zipf-only: one run each)",
    )
    parser.add_argument(
        "--zipf-only", action="store_true", help="measure the Zipf CheckAds row alone"
    )
    parser.add_argument(
        "--build", type=Path,
        help="run the sidecars from the compiled build in this directory (make compiled)",
    )  # fmt: skip
    parser.add_argument(
        "--packed-counters",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[100_000, 10_000_000],
        help="counters of the bulk loads (comma-separated; empty: none)",
    )
    args = parser.parse_args(argv)
    if args.build is not None:
        try:
            root = Path(__file__).resolve().parent.parent
            os.environ.update(sidecar_build.environ(args.build, also=[root]))
        except ValueError as exc:
            print(f"bench.caps: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-caps-") as workdir:
            print(asyncio.run(run(args, Path(workdir))))
            print(f"build: compiled ({args.build})" if args.build is not None else "build: sources")
    except BenchError as exc:
        print(f"bench.caps FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.caps: interrupted", file=sys.stderr)
        return 130
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _progress(text: str) -> None:
    print(f"bench.caps: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())
