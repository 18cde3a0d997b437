"""Envoy with the quota service (RLQS) against the same Envoy with the RLS filter and with none:
requests per second, latency, and Redis commands per 1,000 requests.

One redis-server and one sidecar (`--rlqs-address` beside its RLS port) serve three Envoys in
turn, in front of the same upstream (a second Envoy answering every request itself), each driven
by wrk:
- no filter;
- `envoy.filters.http.ratelimit`: one `ShouldRateLimit` per request, descriptor
  `[(tenant, acme)]`;
- `envoy.filters.http.rate_limit_quota`: every request in the bucket `{tenant: acme}`,
  enforced by Envoy itself on the sidecar's assignment; a usage report every 5 s (Envoy 1.40's).
The rule's limit (100,000,000 a minute) is never reached, so every answer is a 200 and the
three rows measure the cost of deciding, not of refusing. Redis commands are counted from
`INFO commandstats` around the measured run (INFO itself left out): the calls the sidecar made
(script calls, and the health check's PING every 2 s), and every command Redis ran, those inside
the scripts too.

    .venv/bin/python -m bench.quota_gateway [--seconds 10] [--connections 32]

The clients, Envoy, the sidecar and Redis share this machine's CPUs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

if not __package__:  # run as `python bench/quota_gateway.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench import gateway
from bench.processes import BenchError, Process, free_port, start
from bench.report import table
from bench.services import start_redis

RULES = """\
domain: bench
descriptors:
  - key: tenant
    value: acme
    rate_limit: {unit: minute, requests_per_unit: 100000000}
"""

LISTENER = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: /}}
                route:
                  cluster: upstream
{rate_limits}
          http_filters:
{filter}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}
  - name: sidecar
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: sidecar
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {sidecar}}}}}}}
"""

RLS_ROUTE = """\
                  rate_limits:
                  - actions:
                    - generic_key: {descriptor_key: tenant, descriptor_value: acme}"""

UPSTREAM = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: upstream
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: upstream
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: /}}
                direct_response: {{status: 200, body: {{inline_string: ok}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""

RLS_FILTER = """\
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              failure_mode_deny: true
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: sidecar}}"""

RLQS_FILTER = """\
          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: {envoy_grpc: {cluster_name: sidecar}}
              domain: bench
              bucket_matchers:
                matcher_list:
                  matchers:
                  - predicate:
                      single_predicate:
                        input:
                          name: path
                          typed_config:
                            "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                            header_name: ":path"
                        value_match: {prefix: /}
                    on_match:
                      action:
                        name: acme
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                          bucket_id_builder:
                            bucket_id_builder:
                              tenant: {string_value: acme}
                          reporting_interval: 5s
                          no_assignment_behavior: {fallback_rate_limit: {blanket_rule: ALLOW_ALL}}
                          expired_assignment_behavior: {fallback_rate_limit: {blanket_rule: ALLOW_ALL}}"""


def bootstrap(
    kind: str, port: int, admin: int, upstream: int, grpc_port: int, rlqs_port: int
) -> str:
    """The gateway with no filter ("none"), the RLS filter ("rls") or the RLQS filter ("rlqs")."""
    filters = {"none": "", "rls": RLS_FILTER, "rlqs": RLQS_FILTER}
    text = LISTENER.format(
        admin=admin,
        port=port,
        upstream=upstream,
        sidecar=rlqs_port if kind == "rlqs" else grpc_port,
        rate_limits=RLS_ROUTE if kind == "rls" else "",
        filter=filters[kind],
    )
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


#: What the sidecar sends Redis itself; every other command runs inside its scripts.
CALLS = ("cmdstat_eval", "cmdstat_evalsha", "cmdstat_ping", "cmdstat_script")


def redis_commands(url: str) -> tuple[int, int]:
    """(calls the sidecar made, commands Redis ran in all: those inside scripts too), INFO
    left out."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = sum(int(v["calls"]) for k, v in stats.items() if k.split("|")[0] in CALLS)
    commands = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    return calls, commands


def wait_ready(process: Process, url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.exit_code() is not None:
            raise BenchError(f"{process.name} exited:\n{process.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise BenchError(f"{process.name}: {url} not ready after {timeout:g}s\n{process.log_tail()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quota_gateway")
    parser.add_argument("--seconds", type=int, default=10, help="measured seconds per gateway")
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args(argv)
    load = gateway.Load(seconds=args.seconds, connections=args.connections)
    gateway.HEADERS.clear()  # no headers: the bucket and the descriptor are constants
    rows = [
        [
            "gateway",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "Redis calls / 1,000 requests",
            "commands (in scripts too)",
        ]
    ]
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as folder:
        workdir = Path(folder)
        (workdir / "rules.yaml").write_text(RULES)
        started: list[Process] = []
        redis_service = start_redis(workdir)
        url = redis_service.placeholders["redis_url"]
        try:
            grpc_port, http_port, rlqs_port = free_port(), free_port(), free_port()
            sidecar = start(
                "sidecar",
                [sys.executable, "-m", "sidecar", "serve", "--config", str(workdir / "rules.yaml"),
                 "--backend", url, "--grpc-address", f"127.0.0.1:{grpc_port}",
                 "--http-address", f"127.0.0.1:{http_port}",
                 "--rlqs-address", f"127.0.0.1:{rlqs_port}", "--log-level", "warning"],
                {},
                workdir,
            )  # fmt: skip
            started.append(sidecar)
            wait_ready(sidecar, f"http://127.0.0.1:{http_port}/healthcheck")
            upstream_port, upstream_admin = free_port(), free_port()
            (workdir / "upstream.yaml").write_text(
                UPSTREAM.format(admin=upstream_admin, port=upstream_port)
            )
            upstream = start(
                "upstream",
                [gateway.envoy_binary(), "-c", str(workdir / "upstream.yaml"),
                 "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning"],
                {},
                workdir,
            )  # fmt: skip
            started.append(upstream)
            wait_ready(upstream, f"http://127.0.0.1:{upstream_admin}/ready")
            for kind, name in (("none", "no filter"), ("rls", "RLS filter"), ("rlqs", "RLQS")):
                port, admin = free_port(), free_port()
                config = workdir / f"envoy-{kind}.yaml"
                config.write_text(bootstrap(kind, port, admin, upstream_port, grpc_port, rlqs_port))
                envoy = start(
                    f"envoy-{kind}",
                    [gateway.envoy_binary(), "-c", str(config), "--disable-hot-restart",
                     "--concurrency", "1", "--log-level", "warning"],
                    {},
                    workdir,
                )  # fmt: skip
                try:
                    wait_ready(envoy, f"http://127.0.0.1:{admin}/ready")
                    target = f"http://127.0.0.1:{port}/orders"
                    gateway.wrk(target, load.warmup_seconds, load, 60)
                    calls_before, commands_before = redis_commands(url)
                    measured = gateway.wrk(target, load.seconds, load, 60)
                    calls_after, commands_after = redis_commands(url)
                finally:
                    envoy.stop()
                requests = int(measured["requests"])
                rows.append(
                    [
                        name,
                        f"{measured['requests_per_second']:,.0f}",
                        f"{measured['p50_ms']:.2f}",
                        f"{measured['p99_ms']:.2f}",
                        f"{(calls_after - calls_before) * 1000 / max(1, requests):.2f}",
                        f"{(commands_after - commands_before) * 1000 / max(1, requests):.2f}",
                    ]
                )
        except BenchError as exc:
            print(f"quota gateway FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            for process in reversed(started):
                process.stop()
            redis_service.stop()
    print(
        f"\nquota gateway: wrk -t{load.threads} -c{load.connections} -d{load.seconds}s → Envoy "
        "→ upstream (Envoy answering itself); sidecar on Redis; one bucket / descriptor, never "
        "over its limit"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
