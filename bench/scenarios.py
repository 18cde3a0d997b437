"""What the bench measures: one scenario per server configuration, all under the same load.

A scenario is a command line with placeholders, extra environment, the backing services it needs
and, optionally, a target as a share of the baseline's calls/s.
To measure something new (another algorithm, a Redis Cluster, an Envoy in front), add a
`Scenario` to `SCENARIOS`, a rules directory if it needs one, and a starter in `services.py` if it
needs a new backing server.

Placeholders: `{python}`, `{sidecar}`, `{bench_dir}`, `{rules}`, one free port per name in
`ports` (the load goes to `{grpc_port}`), and those of each service (`{redis_url}`).

One more name, `gateway`, is not a gRPC scenario: wrk drives HTTP through Envoy to an upstream,
with the rate limit filter (and `GATEWAY_SIDECAR` beside it) and without, in `bench/gateway.py`.
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


#: The gateway scenario's name, and the sidecar it runs beside Envoy (on Redis, as deployed).
GATEWAY = "gateway"
GATEWAY_SIDECAR = _sidecar("{redis_url}")


def names() -> list[str]:
    """Every scenario name `--only` accepts, in the order a full run measures them."""
    return [scenario.name for scenario in SCENARIOS] + [GATEWAY]


def select(only: list[str] | None) -> list[Scenario]:
    """The gRPC scenarios named in `only` (all of them when it is empty)."""
    if not only:
        return list(SCENARIOS)
    unknown = [name for name in only if name not in names()]
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(names())}")
    known = {scenario.name: scenario for scenario in SCENARIOS}
    return [known[name] for name in only if name in known]


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
