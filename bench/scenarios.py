"""What the bench measures: one scenario per server configuration, all under the same load.

A scenario is a command line with placeholders, extra environment, the backing services it needs
and, optionally, its targets: a share of the baseline's calls/s, server CPU µs per call.
To measure something new (another algorithm, a Redis Cluster, an Envoy in front), add a
`Scenario` to `SCENARIOS`, a rules directory if it needs one, and a starter in `services.py` if it
needs a new backing server.

Placeholders: `{python}`, `{sidecar}`, `{bench_dir}`, `{rules}`, one free port per name in
`ports` (the load goes to `{grpc_port}`), those of each service (`{redis_url}`,
`{redis_cluster_url}`), and for a TLS scenario `{tls_cert}` and `{tls_key}`.

Two more names are not scenarios of their own:
`fixed-rate` measures latency at a fixed offered rate (h2load `--rps`), on scenarios from this
list (`PACED`), and `gateway` drives HTTP with wrk through Envoy to an upstream, with the rate
limit filter (and `GATEWAY_SIDECAR` beside it) and without, in `bench/gateway.py`.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
BASELINE = "noop"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    services: tuple[str, ...] = ()
    ports: tuple[str, ...] = ("grpc_port",)
    # The request: one descriptor with these entries, in this domain.
    domain: str = "bench"
    entries: tuple[tuple[str, str], ...] = (("user", "u1"),)
    # Minimum calls/s as a share of the baseline scenario's; None reports the ratio only.
    target_ratio: float | None = None
    # Maximum server CPU µs per call under the flat-out load (issue 7); None: no target.
    target_cpu_us: float | None = None
    # Over TLS: the harness makes a certificate ({tls_cert}, {tls_key}), loads https:// and
    # probes with a client that trusts it.
    tls: bool = False

    def argv(self, placeholders: Mapping[str, str]) -> list[str]:
        try:
            return [part.format_map(placeholders) for part in self.command]
        except KeyError as exc:
            raise ValueError(f"scenario {self.name}: no value for placeholder {exc}") from exc


def _sidecar(backend: str, transport: str | None = None) -> tuple[str, ...]:
    command = (
        "{sidecar}", "serve",
        "--config", "{rules}",
        "--backend", backend,
        "--grpc-address", "127.0.0.1:{grpc_port}",
        "--http-address", "127.0.0.1:{http_port}",
        "--log-level", "warning",
    )  # fmt: skip
    return command if transport is None else (*command, "--transport", transport)


_TLS_FLAGS = ("--grpc-tls-cert", "{tls_cert}", "--grpc-tls-key", "{tls_key}")
_TRACING_FLAGS = ("--tracing", "--tracing-endpoint", "{otlp_url}")
_NOOP = ("{python}", "{bench_dir}/noop_server.py", "--port", "{grpc_port}")

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name=BASELINE,
        description="grpc.aio servicer answering a constant OK, no parsing (the ceiling)",
        command=_NOOP,
    ),
    Scenario(
        name="sidecar-memory",
        description="sidecar on grpc.aio (--transport grpcio), fixed window, memory backend",
        command=_sidecar("memory://", "grpcio"),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="sidecar-redis",
        description="sidecar on grpc.aio (--transport grpcio), fixed window, single Redis",
        command=_sidecar("{redis_url}", "grpcio"),
        services=("redis",),
        ports=("grpc_port", "http_port"),
        target_ratio=0.85,
    ),
    Scenario(
        name="sidecar-cluster",
        description="sidecar on grpc.aio (--transport grpcio), fixed window, 3-master Redis Cluster",
        command=_sidecar("{redis_cluster_url}", "grpcio"),
        services=("redis-cluster",),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="noop-fast",
        description="the fast transport's HTTP/2 server answering a constant OK (its floor)",
        command=(*_NOOP, "--transport", "fast"),
    ),
    Scenario(
        name="fast-memory",
        description="sidecar on its own HTTP/2 server (--transport fast), memory backend",
        command=_sidecar("memory://", "fast"),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="fast-redis",
        description="sidecar on its own HTTP/2 server (--transport fast), single Redis",
        command=_sidecar("{redis_url}", "fast"),
        services=("redis",),
        ports=("grpc_port", "http_port"),
        target_cpu_us=35.0,
    ),
    Scenario(
        name="fast-redis-tls",
        description="as fast-redis, over TLS (--grpc-tls-cert; h2load negotiates TLS 1.3, ALPN h2)",
        command=(*_sidecar("{redis_url}", "fast"), *_TLS_FLAGS),
        services=("redis",),
        ports=("grpc_port", "http_port"),
        tls=True,
    ),
    Scenario(
        name="fast-redis-tracing",
        description="as fast-redis, every call traced (--tracing, OTLP http to a sink that drops it)",
        command=(*_sidecar("{redis_url}", "fast"), *_TRACING_FLAGS),
        services=("redis", "otlp"),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="fast-redis-tracing-1pct",
        description="as fast-redis-tracing, 1% of calls sampled (--tracing-sampling-rate 0.01)",
        command=(
            *_sidecar("{redis_url}", "fast"),
            *_TRACING_FLAGS,
            "--tracing-sampling-rate",
            "0.01",
        ),
        services=("redis", "otlp"),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="fast-cluster",
        description="sidecar on its own HTTP/2 server (--transport fast), 3-master Redis Cluster",
        command=_sidecar("{redis_cluster_url}", "fast"),
        services=("redis-cluster",),
        ports=("grpc_port", "http_port"),
    ),
    Scenario(
        name="fast-redis-asyncio",
        description="as fast-redis, on asyncio's own event loop (--loop asyncio) instead of uvloop",
        command=(*_sidecar("{redis_url}", "fast"), "--loop", "asyncio"),
        services=("redis",),
        ports=("grpc_port", "http_port"),
    ),
    # Each algorithm beside the fixed window above, same transport, same Redis (issue 3).
    *(
        Scenario(
            name=f"fast-redis-{key}",
            description=f"as fast-redis, {what}",
            command=_sidecar("{redis_url}", "fast"),
            services=("redis",),
            ports=("grpc_port", "http_port"),
            entries=((key, "u1"),),
        )
        for key, what in (
            ("borrowing", "a fixed window that may borrow (reads the previous window too)"),
            ("bucket", "a token bucket that may borrow"),
            ("sliding", "a sliding window (previous and current counters)"),
            ("calendar", "two calendar windows in Asia/Shanghai (day and month)"),
        )
    ),
)


@dataclass(frozen=True)
class Paced:
    """A scenario loaded at a fixed offered rate instead of flat out, for its latency."""

    scenario: Scenario
    calls_per_second: int
    # Maximum p99 at this rate; None: the row is there for comparison.
    target_p99_ms: float | None = None

    @property
    def label(self) -> str:
        return f"{self.scenario.name}@{self.calls_per_second}"


#: The fixed-rate table's name for `--only`, and its rows: the fast transport on Redis at the
#: target rate (issue 7: p99 <= 2 ms at 10,000 calls/s) and at half of it, each after its no-op
#: server at the same rate (what this machine and h2load add to any server), and the memory
#: backend at the target rate (what Redis adds).
FIXED_RATE = "fixed-rate"
_BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
PACED: tuple[Paced, ...] = (
    Paced(_BY_NAME["noop-fast"], 10_000),
    Paced(_BY_NAME["fast-memory"], 10_000),
    Paced(_BY_NAME["fast-redis"], 10_000, target_p99_ms=2.0),
    Paced(_BY_NAME["noop-fast"], 5_000),
    Paced(_BY_NAME["fast-redis"], 5_000),
)

#: The gateway scenario's name, and the sidecar it runs beside Envoy (on Redis, as deployed).
GATEWAY = "gateway"
GATEWAY_SIDECAR = _sidecar("{redis_url}")
#: Maximum sidecar CPU µs per request behind Envoy (issue 7).
GATEWAY_TARGET_CPU_US = 70.0


def names() -> list[str]:
    """Every name `--only` accepts, in the order a full run measures them."""
    return [scenario.name for scenario in SCENARIOS] + [FIXED_RATE, GATEWAY]


def by_name(name: str) -> Scenario:
    """The scenario called `name`; raises ValueError for an unknown name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name}; known: {', '.join(_BY_NAME)}") from None


def select(only: list[str] | None) -> list[Scenario]:
    """The flat-out gRPC scenarios named in `only` (all of them when it is empty)."""
    if not only:
        return list(SCENARIOS)
    unknown = [name for name in only if name not in names()]
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(names())}")
    return [_BY_NAME[name] for name in only if name in _BY_NAME]


def select_paced(only: list[str] | None) -> list[Paced]:
    """The fixed-rate rows, when `only` names them (or is empty)."""
    return list(PACED) if not only or FIXED_RATE in only else []


def includes_gateway(only: list[str] | None) -> bool:
    return not only or GATEWAY in only


def base_placeholders() -> dict[str, str]:
    """Placeholders that do not depend on the run: interpreter, sidecar entry point, rules."""
    return {
        "python": sys.executable,
        "sidecar": _sidecar_entry_point(),
        "bench_dir": str(BENCH_DIR),
        "rules": str(BENCH_DIR / "rules"),
    }


def _sidecar_entry_point() -> str:
    # Prefer the one next to the running interpreter, so `.venv/bin/python -m bench.run` uses
    # the project's virtualenv even when another one is first on PATH.
    for candidate in (
        Path(sys.executable).parent / "ratelimit-sidecar",
        BENCH_DIR.parent / ".venv" / "bin" / "ratelimit-sidecar",
    ):
        if candidate.exists():
            return str(candidate)
    return shutil.which("ratelimit-sidecar") or "ratelimit-sidecar"
