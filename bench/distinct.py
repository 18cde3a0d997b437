"""Real traffic: `ShouldRateLimit` calls whose bodies are mostly new, straight at the sidecar and
through a real Envoy, beside the same load with one body repeated.

Every other benchmark sends one body again and again, so every call after the first finds its
plan cached. Here each row draws its calls' keys from a large key space (bench/keyspace.py:
100,000 or 10,000,000 users, uniform or Zipf, one or two descriptors a call) and sends them with
bench/h2client.py, flat out or at a fixed rate (an open-loop schedule, latency from the time each
call was due). Each row starts its own server (as bench/run.py does, on the run's one Redis),
proves it answers OK, warms it up for a second with other keys of the same space, then measures.

Per row: calls, calls/s, p50/p99/p99.9 and the slowest call, the calls not answered OK by gRPC
status, the calls the sidecar answered by its failure mode (`redis_error` in /metrics) or refused
as overloaded, the server's and Redis's CPU per call (/proc), the sidecar's longest GC pause
(`ratelimit_sidecar_gc_pause_max_seconds` in /metrics; where the histogram
`ratelimit_sidecar_gc_pause_seconds` is exported too, the upper bound of the largest bucket that
counted a pause during the row, which leaves out the pauses of start-up and warm-up; "n/a" where
the sidecar exports neither) and the generator's own lag (how late calls left, at p99).
The first rows are the generator's ceiling: the no-op server flat out, and at the fixed rate.
Then the gateway table (bench/gateway.py's distinct-users mode): wrk through Envoy with its
default 20 ms rate limit timeout, one user repeated or ten million.

    .venv/bin/python -m bench.distinct [--build build/compiled] [--seconds S] [--only NAME,...]

Exit status: 0 when every row was measured, 1 when one failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python bench/distinct.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gateway, h2client, keyspace, load, probe, processes, scenarios
from bench.keyspace import Keys, Shape, Spread
from bench.processes import CLOCK_TICKS_PER_SECOND, BenchError
from bench.report import table
from bench.services import STARTERS, Service
from sidecar import build as sidecar_build

RULES = scenarios.BENCH_DIR / "distinct-rules"
DEFAULT_SECONDS = 3
DEFAULT_RATE = 10_000
#: Flat-out rows send this many calls per second of --seconds: a fixed count, so they end
#: sooner or later than --seconds as the server is faster or slower.
FLAT_OUT_CALLS_PER_SECOND = 10_000
HUNDRED_K = 100_000
TEN_M = 10_000_000
#: The seeds of the measured draws and of the warm-up's, so a row is the same calls every run.
SEED, WARMUP_SEED = 30, 31
GC_PAUSE = "ratelimit_sidecar_gc_pause_max_seconds"
GC_PAUSES = "ratelimit_sidecar_gc_pause_seconds_bucket"
_LE = re.compile(r'le="([^"]+)"')
FAILURE_MODE = 'ratelimit_service_should_rate_limit_error{err_type="redis_error"}'
OVERLOADED = 'ratelimit_service_should_rate_limit_error{err_type="overloaded"}'


@dataclass(frozen=True)
class Row:
    """One measured row: a server (a scenario of bench/scenarios.py), its calls' keys (None:
    one body repeated), descriptors per call, and a rate (None: flat out)."""

    server: str
    keys: Keys | None
    shape: Shape = Shape.ONE
    rate: int | None = DEFAULT_RATE
    #: Issue 30's headline: p99 <= 1 ms, p99.9 <= 5 ms, GC pause <= 5 ms, no failure mode.
    headline: bool = False

    @property
    def label(self) -> str:
        pace = f"{self.rate // 1000}k/s" if self.rate else "flat out"
        if self.keys is None:
            keys = "1 body"
        else:
            size = self.keys.size
            size_text = f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"
            keys = f"{self.keys.spread.value} {size_text}"
        return f"{self.server} {pace} {keys} x{self.shape.value}"

    def indices(self, count: int, seed: int) -> list[int]:
        return self.keys.draw(count, seed) if self.keys else [0] * count


def _uniform(size: int) -> Keys:
    return Keys(size, Spread.UNIFORM)


def _zipf(size: int) -> Keys:
    return Keys(size, Spread.ZIPF)


#: The rows, in order; `--only` names them by group (the part of the label before the rate).
ROWS: tuple[Row, ...] = (
    # The generator's ceiling: the no-op server costs next to nothing, so what limits this row
    # is the generator (and the machine).
    Row("noop-fast", _zipf(HUNDRED_K), Shape.TWO, rate=None),
    Row("noop-fast", _zipf(HUNDRED_K), Shape.TWO),
    Row("fast-redis", None),
    Row("fast-redis", _uniform(HUNDRED_K), headline=True),
    Row("fast-redis", _zipf(HUNDRED_K)),
    Row("fast-redis", None, Shape.TWO),
    Row("fast-redis", _uniform(HUNDRED_K), Shape.TWO),
    Row("fast-redis", _uniform(TEN_M), Shape.TWO),
    Row("fast-redis", _zipf(TEN_M), Shape.TWO),
    Row("fast-redis", None, Shape.TWO, rate=None),
    Row("fast-redis", _uniform(TEN_M), Shape.TWO, rate=None),
    Row("fast-memory", None),
    Row("fast-memory", _uniform(HUNDRED_K)),
)
GATEWAY = "gateway"


@dataclass
class Measured:
    row: Row
    tally: h2client.Tally | None = None
    server_us: float = 0.0
    redis_us: float | None = None
    failure_mode: int | None = None
    overloaded: int | None = None
    gc_pause_ms: float | None = None
    #: The pause is a histogram bucket's upper bound (the row's own), not the gauge's value.
    gc_pause_bound: bool = False
    #: This process's CPU per call while it generated the load.
    generator_us: float = 0.0
    error: str | None = None


def measure(
    row: Row, seconds: int, redis: Service | None, workdir: Path, timeout: float
) -> Measured:
    """Start the row's server, warm it up, load it, read what it spent; errors end in `error`."""
    result = Measured(row)
    scenario = scenarios.by_name(row.server)
    placeholders = {**scenarios.base_placeholders(), "rules": str(RULES)}
    placeholders.update({port: str(processes.free_port()) for port in scenario.ports})
    if redis is not None:
        placeholders.update(redis.placeholders)
    port = int(placeholders["grpc_port"])
    metrics = (
        f"http://127.0.0.1:{placeholders['http_port']}/metrics"
        if "http_port" in placeholders
        else None
    )
    rate = row.rate or FLAT_OUT_CALLS_PER_SECOND
    bodies = list(keyspace.bodies(row.indices(rate * seconds, SEED), row.shape))
    warmup = list(keyspace.bodies(row.indices(rate, WARMUP_SEED), row.shape))
    pace = h2client.Pace(rate=row.rate, timeout=timeout)
    try:
        server = processes.start(
            row.label.replace(" ", "_").replace("/", ""),
            scenario.argv(placeholders),
            scenario.env,
            workdir,
        )
    except BenchError as exc:
        result.error = str(exc)
        return result
    try:
        probe.wait_until_ok(server, port, keyspace.message(0, row.shape), timeout)
        _generate(port, warmup, pace)
        before = scrape(metrics)
        server_ticks = server.cpu_ticks()
        redis_ticks = redis.cpu_ticks() if redis else 0
        generator_before = time.process_time()
        tally = _generate(port, bodies, pace)
        result.generator_us = (time.process_time() - generator_before) * 1e6 / max(1, tally.calls)
        result.server_us = _us(server.cpu_ticks() - server_ticks, tally.calls)
        if redis is not None and "redis" in scenario.services:
            result.redis_us = _us(redis.cpu_ticks() - redis_ticks, tally.calls)
        after = scrape(metrics)
        result.tally = tally
        if metrics is not None:
            result.failure_mode = int(after.get(FAILURE_MODE, 0) - before.get(FAILURE_MODE, 0))
            result.overloaded = int(after.get(OVERLOADED, 0) - before.get(OVERLOADED, 0))
            pause = longest_pause(before, after)
            result.gc_pause_ms = None if pause is None else pause * 1000
            result.gc_pause_bound = any(name.startswith(GC_PAUSES) for name in after)
        probe.wait_until_ok(server, port, keyspace.message(1, row.shape), 5.0)
    except BenchError as exc:
        result.error = str(exc)
    finally:
        server.stop()
    return result


def _generate(port: int, bodies: list[bytes], pace: h2client.Pace) -> h2client.Tally:
    with asyncio.Runner(loop_factory=h2client.event_loop) as runner:
        try:
            return runner.run(h2client.run("127.0.0.1", port, bodies, pace))
        except OSError as exc:
            raise BenchError(f"load generator: {exc}") from exc


def scrape(url: str | None) -> dict[str, float]:
    """The sidecar's /metrics samples by name and labels; a metric with several samples also
    under its bare name, the largest (the GC gauge, whatever its labels)."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"GET {url}: {exc}") from exc
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
        bare = name.partition("{")[0]
        if bare != name:
            samples[bare] = max(samples.get(bare, float(value)), float(value))
    return samples


def longest_pause(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """The longest GC pause in seconds: during the row, as the smallest histogram bound that
    holds every pause the row added (all generations); else the gauge; None without either."""
    added: dict[float, float] = {}
    for name, count in after.items():
        if name.startswith(GC_PAUSES + "{") and (bound := _LE.search(name)):
            le = float(bound.group(1))
            added[le] = added.get(le, 0.0) + count - before.get(name, 0.0)
    if added:
        total = added.get(float("inf"), 0.0)
        return 0.0 if not total else min(le for le, count in added.items() if count >= total)
    return after.get(GC_PAUSE)


def _us(ticks: int, calls: int) -> float:
    return ticks / CLOCK_TICKS_PER_SECOND * 1e6 / max(1, calls)


# --- the report ----------------------------------------------------------------------------------


def report(results: list[Measured], seconds: int) -> str:
    lines = [
        f"distinct bodies: {seconds}s per row after 1s of warm-up on other keys; "
        f"{h2client.Pace().connections} connections x {h2client.Pace().streams} streams; "
        "latency from each call's due time at a fixed rate (no coordinated omission), from its "
        "send flat out",
    ]
    rows = [
        [
            "row", "calls", "calls/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "not OK",
            "failure mode", "overloaded", "server µs/call", "redis µs/call", "GC pause ms",
            "lag p99 ms", "generator µs/call", "",
        ]
    ]  # fmt: skip
    for result in results:
        tally = result.tally
        if tally is None:
            rows.append([result.row.label, "FAILED", *[""] * 14])
            continue
        latencies = sorted(tally.latencies_us)
        lags = sorted(tally.lags_us)
        rows.append(
            [
                result.row.label,
                f"{tally.calls:,}",
                f"{tally.calls / tally.seconds:,.0f}",
                *(f"{load.percentile(latencies, q) / 1000:.2f}" for q in (0.5, 0.99, 0.999)),
                f"{latencies[-1] / 1000:.2f}",
                _not_ok(tally.outcomes),
                _count(result.failure_mode),
                _count(result.overloaded),
                f"{result.server_us:.1f}",
                "-" if result.redis_us is None else f"{result.redis_us:.1f}",
                _gc(result),
                f"{load.percentile(lags, 0.99) / 1000:.2f}" if lags else "-",
                f"{result.generator_us:.1f}",
                "headline" if result.row.headline else "",
            ]
        )
    lines.append(table(rows))
    lines.extend(f"{result.row.label} FAILED: {result.error}" for result in results if result.error)
    for result in results:
        if result.row.server == "noop-fast" and result.row.rate is None and result.tally:
            lines.append(
                f"generator ceiling: {result.tally.calls / result.tally.seconds:,.0f} calls/s flat "
                f"out against the no-op server, {result.generator_us:.1f} µs of its own CPU per "
                "call (on the same CPUs as the server)"
            )
        if result.row.headline and result.tally is not None:
            lines.append(_headline(result))
    return "\n".join(lines)


def _not_ok(outcomes: Mapping[str, int]) -> str:
    bad = {name: count for name, count in outcomes.items() if name != "OK"}
    return ", ".join(f"{name} {count}" for name, count in sorted(bad.items())) or "0"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _gc(result: Measured) -> str:
    if result.failure_mode is None:  # the no-op server has no /metrics
        return "-"
    if result.gc_pause_ms is None:
        return "n/a"
    return f"{'<=' if result.gc_pause_bound else ''}{result.gc_pause_ms:g}"


def _headline(result: Measured) -> str:
    """Issue 30's goal for the headline row, judged."""
    assert result.tally is not None
    latencies = sorted(result.tally.latencies_us)
    p99, p999 = (load.percentile(latencies, q) / 1000 for q in (0.99, 0.999))
    unavailable = result.tally.outcomes.get("UNAVAILABLE", 0)
    checks = [
        p99 <= 1.0,
        p999 <= 5.0,
        result.gc_pause_ms is not None and result.gc_pause_ms <= 5.0,
        result.failure_mode == 0 and unavailable == 0,
    ]
    state = "met" if all(checks) else "missed"
    return (
        f"target {state} ({result.row.label}: p99 <= 1 ms, p99.9 <= 5 ms, GC pause <= 5 ms, "
        f"no failure-mode or UNAVAILABLE answers): p99 {p99:.2f} ms, p99.9 {p999:.2f} ms, "
        f"GC pause {_gc(result)} ms, failure mode {_count(result.failure_mode)}, "
        f"UNAVAILABLE {unavailable}"
    )


# --- the command ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rows = [row for row in ROWS if not args.only or row.server in args.only]
    with_gateway = not args.only or GATEWAY in args.only
    try:
        if with_gateway:
            gateway.wrk_binary()
            gateway.envoy_binary()
        if args.build is not None:
            root = Path(__file__).resolve().parent.parent
            os.environ.update(sidecar_build.environ(args.build, also=[root]))
    except (ValueError, BenchError) as exc:
        print(f"bench.distinct: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    results: list[Measured] = []
    gateway_rows: list[gateway.UsersResult] = []
    redis: Service | None = None
    gateway_error = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-distinct-") as name:
            workdir = Path(name)
            redis = STARTERS["redis"](workdir)
            for row in rows:
                _progress(f"{row.label}: {args.seconds}s")
                result = measure(row, args.seconds, redis, workdir, args.timeout)
                _progress(
                    f"{row.label}: " + (f"FAILED: {result.error}" if result.error else "measured")
                )
                results.append(result)
            if with_gateway:
                _progress(
                    f"{GATEWAY}: wrk → Envoy (20 ms timeout) → upstream, one user or ten million"
                )
                try:
                    gateway_rows = gateway.measure_users(
                        gateway.USERS_LOADS,
                        args.gateway_seconds,
                        redis,
                        scenarios.GATEWAY_SIDECAR,
                        scenarios.base_placeholders(),
                        workdir,
                        args.timeout,
                    )
                except BenchError as exc:
                    gateway_error = str(exc)
    except BenchError as exc:
        print(f"bench.distinct: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.distinct: interrupted", file=sys.stderr)
        return 130
    finally:
        if redis is not None:
            redis.stop()
    print(f"build: compiled ({args.build})" if args.build is not None else "build: sources")
    if results:
        print(report(results, args.seconds))
    if with_gateway:
        print(gateway.users_report(gateway_rows, args.gateway_seconds, gateway_error))
    failed = any(result.error for result in results) or gateway_error is not None
    return 1 if failed else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _progress(text: str) -> None:
    print(f"bench.distinct: {text}", file=sys.stderr, flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.distinct", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    groups = [*sorted({row.server for row in ROWS}), GATEWAY]
    parser.add_argument(
        "--only", action="append", metavar="NAME",
        help=f"only these rows (repeatable, or comma-separated): {', '.join(groups)}",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=int, default=DEFAULT_SECONDS,
        help=f"seconds of load per row after 1 s of warm-up (default {DEFAULT_SECONDS})",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-seconds", type=int, default=5,
        help="seconds of wrk per gateway row, after 2 s of warm-up (default 5)",
    )  # fmt: skip
    parser.add_argument(
        "--build", type=Path,
        help="run the servers from the compiled build in this directory (make compiled)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=30.0,
        help="seconds for a server to start, and for the last answers of a row",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.only:
        args.only = {name for value in args.only for name in value.split(",") if name}
        unknown = args.only - set(groups)
        if unknown:
            parser.error(f"unknown --only {', '.join(sorted(unknown))}; known: {', '.join(groups)}")
    if args.seconds <= 0 or args.gateway_seconds <= 0:
        parser.error("--seconds and --gateway-seconds must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
