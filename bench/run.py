"""Benchmark the rate limit service: each scenario's server under the same h2load load.

For every scenario the harness starts the server on a free loopback port, proves with a real gRPC
call that it answers `overall_code: OK`, runs a warm-up and then the measured h2load run, and
reads the CPU time the server (and any backing service such as Redis) spent from /proc.
It prints calls/s, p50/p99 latency, CPU µs per call and each scenario's share of the no-op
servicer's calls/s; a scenario that cannot be measured is reported as failed, never with numbers.
Then the fixed-rate table: p50/p99 of the fast transport on Redis (and, for comparison, on the
memory backend and its no-op server) at a fixed offered rate (h2load --rps), 10,000 and 5,000/s.
Last the gateway scenario (bench/gateway.py): wrk through Envoy to an upstream, with the rate
limit filter and without, requests/s and latency percentiles for both and their ratio.
Issue 7's targets are judged beside their rows: CPU per call, p99 at 10,000 calls/s, and the
sidecar's CPU per request behind Envoy.

    .venv/bin/python -m bench.run [--requests N] [--only NAME ...] [--repeat N] [--build DIR]

Servers run from the sources, or with `--build build/compiled` from the compiled build that
`make compiled` unpacks there (what the image ships; `make bench` measures that one).

On a shared machine CPU per call moves by a quarter between runs; `--repeat N` runs every row N
times, in rounds, and reports each row's median run (judged against its target) with what every
run measured.

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
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python bench/run.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gateway, load, probe, processes, report, scenarios
from bench.processes import CLOCK_TICKS_PER_SECOND, BenchError
from bench.report import Result
from bench.scenarios import Paced, Scenario
from bench.services import STARTERS, Service
from sidecar import build as sidecar_build

#: The TLS scenario's certificate is the tests' (tests/support/certs.py), not made twice: its own
#: CA, naming 127.0.0.1, which the probe (a real gRPC client) verifies; h2load does not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.certs import write_certificate

DEFAULT_REQUESTS = 20_000
DEFAULT_RATE_SECONDS = 4


@dataclass
class Settings:
    requests: int
    warmup: int
    clients: int
    streams: int
    start_timeout: float
    load_timeout: float
    #: Seconds of load per fixed-rate row (after one second of warm-up at the same rate).
    rate_seconds: int = DEFAULT_RATE_SECONDS

    def flat_out(self) -> tuple[load.Load, load.Load]:
        """The warm-up and the measured load of a throughput scenario."""
        return (
            load.Load(self.warmup, self.clients, self.streams),
            load.Load(self.requests, self.clients, self.streams),
        )

    def paced(self, rate: int) -> tuple[load.Load, load.Load]:
        """The warm-up and the measured load at `rate` calls/s, split over the connections."""
        per_client = max(1, rate // self.clients)
        offered = per_client * self.clients
        return (
            load.Load(offered, self.clients, self.streams, per_client),
            load.Load(offered * self.rate_seconds, self.clients, self.streams, per_client),
        )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        selected = scenarios.select(args.only)
        paced = scenarios.select_paced(args.only)
        with_gateway = scenarios.includes_gateway(args.only)
        if selected or paced:
            load.h2load_binary()
        if with_gateway:
            gateway.wrk_binary()
            gateway.envoy_binary()
        if args.build is not None:
            # Inherited by every server started below.
            root = Path(__file__).resolve().parent.parent
            os.environ.update(sidecar_build.environ(args.build, also=[root]))
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
        rate_seconds=args.rate_seconds,
    )
    if selected or paced:
        _progress(_header(settings, bool(selected), bool(paced)))
    # A CI timeout sends SIGTERM: unwind like Ctrl-C so `finally` stops every started server.
    signal.signal(signal.SIGTERM, _interrupt)
    services: dict[str, Service | BenchError] = {}
    # Each round runs every row once, so what disturbs the machine for a while falls on the
    # rows of one round rather than on every run of one row.
    flat_runs: dict[str, list[Result]] = {scenario.name: [] for scenario in selected}
    paced_runs: dict[str, list[Result]] = {row.label: [] for row in paced}
    gateway_runs: list[gateway.Result] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
            for round_ in range(1, args.repeat + 1):
                if args.repeat > 1:
                    _progress(f"round {round_} of {args.repeat}")
                for scenario in selected:
                    _progress(f"{scenario.name}: {scenario.description}")
                    result = measure(scenario, settings, services, Path(workdir))
                    _progress(f"{result.label}: {_outcome(result)}")
                    flat_runs[scenario.name].append(result)
                for row in paced:
                    _progress(
                        f"{row.label}: {row.scenario.name} at {row.calls_per_second:,} calls/s "
                        f"for {settings.rate_seconds}s (h2load --rps)"
                    )
                    result = measure(row.scenario, settings, services, Path(workdir), row)
                    _progress(f"{result.label}: {_outcome(result)}")
                    paced_runs[row.label].append(result)
                if with_gateway:
                    gateway_runs.append(_gateway(args, services, Path(workdir)))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        for service in services.values():
            if isinstance(service, Service):
                service.stop()
    median_run = report.median_run
    results = [median_run(runs, report.server_us, report.failed) for runs in flat_runs.values()]
    paced_results = [median_run(runs, report.p99_ms, report.failed) for runs in paced_runs.values()]
    gateway_result = (
        median_run(gateway_runs, gateway.us_per_request, gateway.failed) if gateway_runs else None
    )
    print(f"build: compiled ({args.build})" if args.build is not None else "build: sources")
    if results:
        print(report.throughput(results))
    if paced_results:
        print(report.fixed_rate(paced_results, settings.clients))
    if gateway_result is not None:
        print(gateway.report(gateway_result, _gateway_load(args)))
    failed = any(result.error for result in results + paced_results) or bool(
        gateway_result and gateway_result.error
    )
    return 1 if failed else 0


def _outcome(result: Result) -> str:
    if result.error:
        return f"FAILED: {result.error.splitlines()[0]}"
    return f"measured; answered {result.response}"


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
    scenario: Scenario,
    settings: Settings,
    services: dict[str, Service | BenchError],
    workdir: Path,
    paced: Paced | None = None,
) -> Result:
    """Start the scenario's server, load it (flat out, or at `paced`'s rate), stop it.

    Errors end up in `Result.error`.
    """
    result = Result(scenario, paced)
    try:
        needed = [_service(name, services, workdir) for name in scenario.services]
        placeholders = scenarios.base_placeholders()
        placeholders.update({port: str(processes.free_port()) for port in scenario.ports})
        for service in needed:
            placeholders.update(service.placeholders)
        certificate = None
        if scenario.tls:
            certificate, key = write_certificate(workdir)
            placeholders.update(tls_cert=str(certificate), tls_key=str(key))
        argv = scenario.argv(placeholders)
    except (BenchError, ValueError) as exc:
        result.error = str(exc)
        return result

    port = int(placeholders["grpc_port"])
    message = probe.request(scenario.domain, scenario.entries)
    body = workdir / f"{result.label}.body"
    body.write_bytes(probe.grpc_frame(message))
    scheme = "https" if certificate else "http"
    url = f"{scheme}://127.0.0.1:{port}{probe.METHOD}"
    trusted = certificate.read_bytes() if certificate else None

    try:
        server = processes.start(result.label, argv, scenario.env, workdir)
    except BenchError as exc:
        result.error = str(exc)
        return result
    try:
        result.response = probe.wait_until_ok(
            server, port, message, settings.start_timeout, trusted
        )
        warmup, measured = settings.paced(paced.calls_per_second) if paced else settings.flat_out()
        log = workdir / f"{result.label}.tsv"
        load.run(url, body, warmup, log.with_suffix(".warmup.tsv"), settings.load_timeout)

        server_before = server.cpu_ticks()
        services_before = [service.cpu_ticks() for service in needed]
        result.load = load.run(url, body, measured, log, settings.load_timeout)
        result.server_us_per_call = _us_per_call(server.cpu_ticks() - server_before, measured)
        for service, before in zip(needed, services_before, strict=True):
            ticks = service.cpu_ticks() - before
            result.service_us_per_call[service.kind] = _us_per_call(ticks, measured)

        # Still answering OK after the load: it did not degrade into errors halfway through.
        probe.wait_until_ok(server, port, message, 5.0, trusted)
    except BenchError as exc:
        result.load = None
        result.error = str(exc)
    finally:
        server.stop()
    return result


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


def _header(settings: Settings, flat_out: bool, paced: bool) -> str:
    version = subprocess.run(
        [load.h2load_binary(), "--version"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    parts = [f"{version}; {os.cpu_count()} CPUs shared by h2load and the servers"]
    if flat_out:
        parts.append(
            f"{settings.requests} measured calls after {settings.warmup} warm-up calls flat out"
        )
    if paced:
        parts.append(
            f"fixed rates for {settings.rate_seconds}s after 1s of warm-up at the same rate"
        )
    parts.append(f"{settings.clients} connections x {settings.streams} streams")
    return "; ".join(parts)


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
        "--repeat",
        type=_positive_int,
        default=1,
        help="run every row this many times, in rounds, and report (and judge) each row's "
        "median run beside what every run measured (default 1)",
    )
    parser.add_argument(
        "--gateway-seconds",
        type=_positive_int,
        default=10,
        help="seconds of wrk load per gateway, with and without the filter (default 10)",
    )
    parser.add_argument("--streams", type=_positive_int, default=8, help="h2load -m (default 8)")
    parser.add_argument(
        "--rate-seconds",
        type=_positive_int,
        default=DEFAULT_RATE_SECONDS,
        help="seconds of load per fixed-rate row, after 1 s of warm-up at the same rate "
        f"(default {DEFAULT_RATE_SECONDS})",
    )
    parser.add_argument(
        "--build",
        type=Path,
        help="run the servers from the compiled build unpacked in this directory "
        "(make compiled: build/compiled); default: the sources",
    )
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
