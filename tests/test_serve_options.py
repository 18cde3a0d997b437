"""What `serve` starts with: the `Options` a command line, its RLS_* variables and the reference's
variables make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar import cli
from sidecar.cli import serve
from sidecar.options import Options
from sidecar.rls.tls import TlsFiles
from sidecar.statsd import StatsdSettings
from sidecar.tracing import TracingSettings
from sidecar.xds.client import XdsOptions

CASES: list[tuple[str, list[str], dict[str, str], dict[str, Any]]] = [
    ("defaults", ["--config", "a.yaml"], {}, {"config": ["a.yaml"]}),
    (
        "flags",
        [
            "--config", "a.yaml", "--config", "rules/", "--backend", "redis://r:6379",
            "--backend-per-second", "redis://s:6379", "--grpc-address", "unix:/run/rls.sock",
            "--grpc-socket-mode", "660", "--http-address", "127.0.0.1:9080",
            "--transport", "grpcio", "--redis-timeout-ms", "20", "--failure-mode", "local",
            "--local-divisor", "3", "--rejected-hits", "skip", "--shadow-mode",
            "--over-limit-cache", "0", "--usage-metrics-top", "4", "--response-limit-name",
            "--response-headers", "--response-limit-header", "X-Limit",
            "--response-dynamic-metadata", "--reuse-port", "--dedupe-horizon", "60",
            "--config-poll-seconds", "0", "--rlqs-address", "127.0.0.1:18081",
            "--rlqs-assignment-ttl", "2.5", "--health-requires-config", "--merge-domain-config",
            "--calendar-months", "--metrics-address", "127.0.0.1:9090", "--metrics-path", "/m",
            "--debug-address", "127.0.0.1:6070", "--grpc-tls-cert", "c.pem",
            "--grpc-tls-key", "k.pem", "--grpc-tls-client-ca", "ca.pem",
            "--grpc-tls-client-san", "envoy.local", "--tracing", "--tracing-protocol", "grpc",
            "--tracing-endpoint", "otel:4317", "--tracing-service-name", "rl",
            "--tracing-service-namespace", "ns", "--tracing-service-instance-id", "i-1",
            "--tracing-sampling-rate", "0.25", "--statsd-address", "statsd:8125",
            "--statsd-protocol", "udp", "--stats-flush-interval", "500ms",
            "--stats-tags", "a:b,c:d", "--sync-interval-ms", "100",
        ],
        {},
        {
            "config": ["a.yaml", "rules/"],
            "backend": "redis://r:6379",
            "backend_per_second": "redis://s:6379",
            "grpc_address": "unix:/run/rls.sock",
            "grpc_socket_mode": 0o660,
            "http_address": "127.0.0.1:9080",
            "transport": "grpcio",
            "redis_timeout_ms": 20,
            "failure_mode": "local",
            "local_divisor": 3,
            "rejected_hits": "skip",
            "shadow_mode": True,
            "over_limit_cache": 0,
            "usage_metrics_top": 4,
            "response_limit_name": True,
            "response_headers": True,
            "response_limit_header": "X-Limit",
            "response_dynamic_metadata": True,
            "reuse_port": True,
            "dedupe_horizon": 60,
            "config_poll_seconds": 0.0,
            "rlqs_address": "127.0.0.1:18081",
            "rlqs_assignment_ttl_ms": 2500,
            "health_requires_config": True,
            "merge_domain_config": True,
            "calendar_months": True,
            "metrics_address": "127.0.0.1:9090",
            "metrics_path": "/m",
            "debug_address": "127.0.0.1:6070",
            "tls": TlsFiles(
                Path("c.pem"), Path("k.pem"), client_ca=Path("ca.pem"), client_san="envoy.local"
            ),
            "tracing": TracingSettings(
                protocol="grpc",
                endpoint="otel:4317",
                service_name="rl",
                service_namespace="ns",
                service_instance_id="i-1",
                sampling_rate=0.25,
            ),
            "statsd": StatsdSettings(
                host="statsd",
                port=8125,
                protocol="udp",
                format="statsd",
                flush_interval=0.5,
                tags=(("a", "b"), ("c", "d")),
                mogrifiers=(),
            ),
            "sync_interval_ms": 100,
        },
    ),
    (
        "rls-variables",
        [],
        {
            "RLS_XDS_SERVER": "cp:18000",
            "RLS_XDS_NODE_ID": "n1",
            "RLS_XDS_NODE_METADATA": "zone=a,team=b",
            "RLS_XDS_HEADER": "X-Token:t",
            "RLS_XDS_TLS": "true",
            "RLS_XDS_BACKOFF_NO_JITTER": "true",
            "RLS_XDS_MAX_MESSAGE_BYTES": "1024",
            "RLS_FORCE_START_WITHOUT_INITIAL_CONFIG": "yes",
            "RLS_CALENDAR_MONTHS": "1",
            "RLS_LOCAL_DIVISOR": "auto",
            "RLS_RESPONSE_RESET_HEADER": "X-Reset",
        },
        {
            "config": [],
            "calendar_months": True,
            "response_reset_header": "X-Reset",
            "xds": XdsOptions(
                server="cp:18000",
                node_id="n1",
                node_metadata={"zone": "a", "team": "b"},
                headers=(("x-token", "t"),),
                tls=True,
                backoff_jitter=False,
                max_message_bytes=1024,
                force_start=True,
                calendar_months=True,
            ),
        },
    ),
    (
        "reference-variables",
        ["--reference-env"],
        {
            "RUNTIME_ROOT": "/srv",
            "RUNTIME_SUBDIRECTORY": "rl",
            "REDIS_URL": "redis:6379",
            "REDIS_TIMEOUT": "30ms",
            "HOST": "127.0.0.1",
            "PORT": "9080",
            "GRPC_PORT": "9081",
            "SHADOW_MODE": "true",
            "USE_PROMETHEUS": "true",
            "LIMIT_RESPONSE_HEADERS_ENABLED": "true",
            "RLS_SHADOW_MODE": "false",
        },
        {
            "config": ["/srv/rl/config"],
            "backend": "redis://redis:6379",
            "redis_timeout_ms": 30,
            "http_address": "127.0.0.1:9080",
            "grpc_address": "0.0.0.0:9081",
            "shadow_mode": False,
            "metrics_address": "0.0.0.0:9090",
            "response_headers": True,
        },
    ),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "expected"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_a_command_line_and_its_variables_make_these_options(
    argv: list[str], env: dict[str, str], expected: dict[str, Any]
) -> None:
    """Flags, RLS_* variables (beneath flags) and, with --reference-env, the reference's
    variables (beneath both) fill `Options`; what none sets keeps `Options`' default."""
    args = cli.parse_args(["serve", *argv], env)

    assert serve.serve_options(args) == Options(**expected)
