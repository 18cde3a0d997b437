"""Drive a server with h2load and read back calls/s and per-request latency percentiles.

calls/s is h2load's own figure; p50 and p99 come from its `--log-file`, one row per request.
A run only counts when every request succeeded with HTTP 200 and every response carried a gRPC
message: a gRPC error is a trailers-only response with status 200 and no DATA at all.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.processes import BenchError

INSTALL_HINT = "h2load not found on PATH; install it with: apt-get install nghttp2-client"

# The smallest gRPC message frame that can answer: 5-byte prefix + `overall_code` (2 bytes).
MIN_RESPONSE_DATA_BYTES = 7


@dataclass(frozen=True)
class Load:
    """How hard to push: h2load's -n, -c and -m."""

    requests: int
    clients: int = 4
    streams_per_client: int = 8
    #: Calls per second per client (h2load --rps), for latency at a steady rate; None: flat out.
    rate_per_client: int | None = None


@dataclass(frozen=True)
class LoadResult:
    requests: int
    seconds: float
    calls_per_second: float
    p50_ms: float
    p99_ms: float


def h2load_binary() -> str:
    binary = shutil.which("h2load")
    if binary is None:
        raise BenchError(INSTALL_HINT)
    return binary


def run(url: str, body: Path, load: Load, log_file: Path, timeout: float) -> LoadResult:
    """One h2load run against `url`, POSTing `body` as a gRPC call; raises BenchError on failure."""
    log_file.unlink(missing_ok=True)  # h2load appends: a row run again (--repeat) starts empty
    argv = [
        h2load_binary(),
        "-n", str(load.requests),
        "-c", str(load.clients),
        "-m", str(load.streams_per_client),
        "-d", str(body),
        "-H", "content-type: application/grpc",
        "-H", "te: trailers",
        # A server that stops answering drops the connection instead of hanging the bench.
        "-N", "10s",
        "--log-file", str(log_file),
        *(["--rps", str(load.rate_per_client)] if load.rate_per_client else []),
        url,
    ]  # fmt: skip
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"h2load did not finish within {timeout:g}s") from exc
    output = completed.stdout + completed.stderr
    if completed.returncode != 0:
        raise BenchError(f"h2load exited with code {completed.returncode}\n{_indent(output)}")
    summary = _parse_summary(output, load.requests)
    latencies_us = _read_latencies(log_file, load.requests)
    return LoadResult(
        requests=load.requests,
        seconds=summary.seconds,
        calls_per_second=summary.calls_per_second,
        p50_ms=percentile(latencies_us, 0.50) / 1000,
        p99_ms=percentile(latencies_us, 0.99) / 1000,
    )


def percentile(sorted_values: list[int], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list: the smallest value covering `fraction`."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return float(sorted_values[rank - 1])


@dataclass(frozen=True)
class _Summary:
    seconds: float
    calls_per_second: float


_FINISHED = re.compile(r"finished in ([\d.]+)(us|ms|s), ([\d.]+) req/s")
_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
    r"(\d+) failed, (\d+) errored, (\d+) timeout"
)
_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")
_PER_SECOND = {"us": 1e6, "ms": 1e3, "s": 1.0}
_DATA = re.compile(r"traffic: .*?\((\d+)\) data")


def _parse_summary(output: str, expected: int) -> _Summary:
    finished, requests, status, data = (
        pattern.search(output) for pattern in (_FINISHED, _REQUESTS, _STATUS, _DATA)
    )
    if not (finished and requests and status and data):
        raise BenchError(f"cannot read h2load's summary\n{_indent(output)}")
    succeeded, failed, errored, timed_out = (int(requests.group(i)) for i in (4, 5, 6, 7))
    ok_2xx = int(status.group(1))
    if succeeded != expected or ok_2xx != expected:
        raise BenchError(
            f"{expected} requests sent, {succeeded} succeeded, {ok_2xx} answered 2xx "
            f"({failed} failed, {errored} errored, {timed_out} timed out)\n{_indent(output)}"
        )
    data_bytes = int(data.group(1))
    if data_bytes < expected * MIN_RESPONSE_DATA_BYTES:
        raise BenchError(
            f"responses carried {data_bytes} DATA bytes for {expected} calls; some calls "
            f"ended with a gRPC error status instead of a RateLimitResponse\n{_indent(output)}"
        )
    seconds = float(finished.group(1)) / _PER_SECOND[finished.group(2)]
    return _Summary(seconds=seconds, calls_per_second=float(finished.group(3)))


def _read_latencies(log_file: Path, expected: int) -> list[int]:
    """Per-request durations in µs from h2load's log: start time, HTTP status, duration."""
    latencies, bad_status = [], 0
    for line in log_file.read_text().splitlines():
        _start, status, duration = line.split("\t")[:3]
        if status != "200":
            bad_status += 1
        latencies.append(int(duration))
    if len(latencies) != expected or bad_status:
        raise BenchError(
            f"h2load log {log_file}: {len(latencies)} rows for {expected} requests, "
            f"{bad_status} without HTTP 200"
        )
    latencies.sort()
    return latencies


def _indent(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if not line.startswith("progress:")]
    return "\n".join(f"    | {line}" for line in lines)
