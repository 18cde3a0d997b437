"""Benchmark the rate limit service: each scenario's server under the same h2load load.

For every scenario the harness starts the server on a free loopback port, proves with a real gRPC
call that it answers `overall_code: OK`, runs a warm-up and then the measured h2load run, and
reads the CPU time the server (and any backing service such as Redis) spent from /proc.
It prints calls/s, p50/p99 latency, CPU µs per call and each scenario's share of the no-op
servicer's calls/s; a scenario that cannot be measured is reported as failed, never with numbers.
Then the gateway scenario (bench/gateway.py): wrk through Envoy to an upstream, with the rate
limit filter and without, requests/s and latency percentiles for both and their ratio.

    .venv/bin/python -m bench.run [--requests N] [--only NAME ...]

Exit status: 0 when every scenario was measured (whether or not a target was met), 1 when a
scenario failed, 2 for a usage error or missing tool.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `python bench/run.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gateway, load, probe, processes, scenarios
from bench.processes import CLOCK_TICKS_PER_SECOND, BenchError
from bench.scenarios import BASELINE, Scenario
from bench.services import STARTERS, Service

DEFAULT_REQUESTS = 20_000


@dataclass
class Settings:
    requests: int
    warmup: int
    clients: int
    streams: int
    start_timeout: float
    load_timeout: float


@dataclass
class Result:
    scenario: Scenario
    load: load.LoadResult | None = None
    server_us_per_call: float = 0.0
    service_us_per_call: dict[str, float] = field(default_factory=dict)
    response: str = ""
    error: str | None = None


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        selected = scenarios.select(args.only)
        with_gateway = scenarios.includes_gateway(args.only)
        if selected:
            load.h2load_binary()
        if with_gateway:
            gateway.wrk_binary()
            gateway.envoy_binary()
    except (ValueError, BenchError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    settings = Settings(
        requests=args.requests,
        warmup=args.warmup if args.warmup is not None else max(1_000, args.requests // 10),
        clients=args.clients,
        streams=args.streams,
        start_timeout=args.start_timeout,
        load_timeout=args.load_timeout,
    )
    if selected:
        _progress(_header(settings))
    # A CI timeout sends SIGTERM: unwind like Ctrl-C so `finally` stops every started server.
    signal.signal(signal.SIGTERM, _interrupt)
    services: dict[str, Service | BenchError] = {}
    results: list[Result] = []
    gateway_result: gateway.Result | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
            for scenario in selected:
                _progress(f"{scenario.name}: {scenario.description}")
                result = measure(scenario, settings, services, Path(workdir))
                outcome = (
                    f"FAILED: {result.error.splitlines()[0]}"
                    if result.error
                    else f"measured; answered {result.response}"
                )
                _progress(f"{scenario.name}: {outcome}")
                results.append(result)
            if with_gateway:
                gateway_result = _gateway(args, services, Path(workdir))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        for service in services.values():
            if isinstance(service, Service):
                service.stop()
    if results:
        print(report(results, settings))
    if gateway_result is not None:
        print(gateway.report(gateway_result, _gateway_load(args)))
    failed = any(result.error for result in results) or bool(
        gateway_result and gateway_result.error
    )
    return 1 if failed else 0


def _gateway(
    args: argparse.Namespace, services: dict[str, Service | BenchError], workdir: Path
) -> gateway.Result:
    """The gateway scenario, beside the Redis the gRPC scenarios started (or its own)."""
    wrk = _gateway_load(args)
    _progress(
        f"{gateway.NAME}: wrk → Envoy → upstream, without and with the rate limit filter, "
        f"{wrk.seconds}s each after {wrk.warmup_seconds}s of warm-up"
    )
    try:
        redis = _service("redis", services, workdir)
    except BenchError as exc:
        return gateway.Result(error=str(exc))
    result = gateway.measure(
        wrk,
        redis,
        scenarios.GATEWAY_SIDECAR,
        scenarios.base_placeholders(),
        workdir,
        args.start_timeout,
    )
    outcome = f"FAILED: {result.error.splitlines()[0]}" if result.error else "measured"
    _progress(f"{gateway.NAME}: {outcome}")
    return result


def _gateway_load(args: argparse.Namespace) -> gateway.Load:
    return gateway.Load(seconds=args.gateway_seconds)


def measure(
    scenario: Scenario, settings: Settings, services: dict[str, Service | BenchError], workdir: Path
) -> Result:
    """Start the scenario's server, load it, stop it; errors end up in `Result.error`."""
    result = Result(scenario)
    try:
        needed = [_service(name, services, workdir) for name in scenario.services]
        placeholders = scenarios.base_placeholders()
        placeholders.update({port: str(processes.free_port()) for port in scenario.ports})
        for service in needed:
            placeholders.update(service.placeholders)
        argv = scenario.argv(placeholders)
    except (BenchError, ValueError) as exc:
        result.error = str(exc)
        return result

    port = int(placeholders["grpc_port"])
    message = probe.request(scenario.domain, scenario.entries)
    body = workdir / f"{scenario.name}.body"
    body.write_bytes(probe.grpc_frame(message))
    url = f"http://127.0.0.1:{port}{probe.METHOD}"

    try:
        server = processes.start(scenario.name, argv, scenario.env, workdir)
    except BenchError as exc:
        result.error = str(exc)
        return result
    try:
        result.response = probe.wait_until_ok(server, port, message, settings.start_timeout)
        warmup = load.Load(settings.warmup, settings.clients, settings.streams)
        load.run(url, body, warmup, workdir / f"{scenario.name}.warmup.tsv", settings.load_timeout)

        server_before = server.cpu_ticks()
        services_before = {service.name: service.cpu_ticks() for service in needed}
        measured = load.Load(settings.requests, settings.clients, settings.streams)
        result.load = load.run(
            url, body, measured, workdir / f"{scenario.name}.tsv", settings.load_timeout
        )
        result.server_us_per_call = _us_per_call(server.cpu_ticks() - server_before, measured)
        for service in needed:
            ticks = service.cpu_ticks() - services_before[service.name]
            result.service_us_per_call[service.name] = _us_per_call(ticks, measured)

        # Still answering OK after the load: it did not degrade into errors halfway through.
        probe.wait_until_ok(server, port, message, timeout=5.0)
    except BenchError as exc:
        result.load = None
        result.error = str(exc)
    finally:
        server.stop()
    return result


def report(results: list[Result], settings: Settings) -> str:
    baseline = next((r for r in results if r.scenario.name == BASELINE and r.load), None)
    service_names = sorted({name for r in results for name in r.service_us_per_call})
    header = ["scenario", "calls/s", f"vs {BASELINE}", "p50 ms", "p99 ms", "server µs/call"]
    header += [f"{name} µs/call" for name in service_names]
    rows = [header]
    for r in results:
        if r.load is None:
            rows.append([r.scenario.name, "FAILED"] + [""] * (len(header) - 2))
            continue
        row = [
            r.scenario.name,
            f"{r.load.calls_per_second:,.0f}",
            f"{_ratio(r, baseline):.1%}" if baseline else "-",
            f"{r.load.p50_ms:.2f}",
            f"{r.load.p99_ms:.2f}",
            f"{r.server_us_per_call:.0f}",
        ]
        row += [
            f"{r.service_us_per_call[name]:.0f}" if name in r.service_us_per_call else "-"
            for name in service_names
        ]
        rows.append(row)

    lines = ["", _table(rows), ""]
    for r in results:
        if r.scenario.target_ratio is not None:
            lines.append(_verdict(r, baseline))
    for r in results:
        if r.error:
            lines.append(f"{r.scenario.name} FAILED: {r.error}")
    return "\n".join(lines)


def _verdict(result: Result, baseline: Result | None) -> str:
    target = result.scenario.target_ratio
    goal = f"{result.scenario.name} >= {target:.0%} of {BASELINE} calls/s"
    if result.load is None:
        return f"target missed ({goal}): {result.scenario.name} failed"
    if baseline is None or baseline.load is None:
        return f"target not judged ({goal}): no {BASELINE} run to compare with"
    ratio = _ratio(result, baseline)
    verdict = "target met" if target is not None and ratio >= target else "target missed"
    return f"{verdict} ({goal}): {ratio:.1%}"


def _ratio(result: Result, baseline: Result) -> float:
    assert result.load is not None and baseline.load is not None
    return result.load.calls_per_second / baseline.load.calls_per_second


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _service(name: str, services: dict[str, Service | BenchError], workdir: Path) -> Service:
    """Start a backing service on first use; a failed start fails every scenario that needs it."""
    if name not in services:
        if name not in STARTERS:
            raise BenchError(f"no starter for service {name!r} in bench/services.py")
        _progress(f"starting {name}")
        try:
            services[name] = STARTERS[name](workdir)
        except BenchError as exc:
            services[name] = exc
    service = services[name]
    if isinstance(service, BenchError):
        raise service
    return service


def _us_per_call(ticks: int, measured: load.Load) -> float:
    return ticks / CLOCK_TICKS_PER_SECOND * 1e6 / measured.requests


def _header(settings: Settings) -> str:
    version = subprocess.run(
        [load.h2load_binary(), "--version"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    return (
        f"{version}; {os.cpu_count()} CPUs shared by h2load and the servers; "
        f"{settings.requests} measured calls after {settings.warmup} warm-up calls, "
        f"{settings.clients} connections x {settings.streams} streams"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.run", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--requests",
        type=_positive_int,
        # argparse runs a string default through `type`, so a bad BENCH_REQUESTS is a usage error.
        default=os.environ.get("BENCH_REQUESTS") or str(DEFAULT_REQUESTS),
        help=f"measured calls per scenario (env BENCH_REQUESTS; default {DEFAULT_REQUESTS})",
    )
    parser.add_argument(
        "--warmup", type=_positive_int, help="warm-up calls (default: max(1000, requests/10))"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this scenario (repeatable; comma-separated works too); "
        f"known: {', '.join(scenarios.names())}",
    )
    parser.add_argument("--clients", type=_positive_int, default=4, help="h2load -c (default 4)")
    parser.add_argument(
        "--gateway-seconds",
        type=_positive_int,
        default=10,
        help="seconds of wrk load per gateway, with and without the filter (default 10)",
    )
    parser.add_argument("--streams", type=_positive_int, default=8, help="h2load -m (default 8)")
    parser.add_argument(
        "--start-timeout", type=float, default=30.0, help="seconds for a server to answer OK"
    )
    parser.add_argument(
        "--load-timeout", type=float, default=300.0, help="seconds for one h2load run"
    )
    args = parser.parse_args(argv)
    if args.only:
        args.only = [name for value in args.only for name in value.split(",") if name]
    return args


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
