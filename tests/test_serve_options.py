"""What `serve` starts with: the `Options` a command line, its RLS_* variables and the reference's
variables make, and the command line a worker of `serve --workers N` is given."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sidecar import cli
from sidecar.cli import serve, settings
from sidecar.cli.serve_flags import SERVE_FLAGS
from sidecar.rls.tls import TlsFiles
from sidecar.runner.options import Options
from sidecar.telemetry.statsd import StatsdSettings
from sidecar.telemetry.tracing import TracingSettings
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


@pytest.mark.parametrize(("argv", "env"), [case[1:3] for case in CASES],
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_a_worker_is_given_a_command_line_that_makes_the_same_options(
    argv: list[str], env: dict[str, str]
) -> None:
    """`serve --workers 2` gives each worker flags, not variables, that make its parent's
    options, but for the addresses (the parent's supervisor sets them) and the local divisor,
    split between the workers."""
    parent = cli.parse_args(["serve", "--workers", "2", *argv], env)
    worker_argv = serve.worker_flags(parent)
    assert "--workers" not in worker_argv and "--grpc-address" not in worker_argv
    worker = cli.parse_args(["serve", *worker_argv], {})

    options = serve.serve_options(parent)
    divisor = options.local_divisor
    assert serve.serve_options(worker) == Options(
        **{
            **vars(options),
            "grpc_address": "0.0.0.0:8081",
            "http_address": "0.0.0.0:8080",
            "local_divisor": divisor * 2 if divisor is not None else None,
        }
    )
    assert (worker.log_level, worker.log_format, worker.loop) == (
        parent.log_level,
        parent.log_format,
        parent.loop,
    )


def test_every_option_is_filled_by_a_declared_flag_and_every_reference_variable_sets_one() -> None:
    """Each `Options` field is filled by the flags declared to fill it, no declaration names a
    field `Options` lacks, and every flag the reference's variables set is a declared one."""
    fields = {field.name for field in dataclasses.fields(Options)}
    declared = {flag.field for flag in SERVE_FLAGS if flag.field is not None}
    assert declared == fields
    names = {flag.dest for flag in SERVE_FLAGS}
    assert {flag.dest for flag in settings.FLAGS} <= names
    variables = [flag.variable for flag in SERVE_FLAGS if not flag.hidden]
    assert len(set(variables)) == len(variables)


def test_a_flag_left_unset_fills_its_field_with_the_options_default() -> None:
    """`Options`' defaults (what tests and embedders get) are the flags' defaults."""
    defaults = {
        field.name: field.default
        for field in dataclasses.fields(Options)
        if field.default is not dataclasses.MISSING
    }
    for flag in SERVE_FLAGS:
        if flag.field in defaults and flag.field not in serve.BUILT:
            assert flag.to_option(flag.default) == defaults[flag.field], flag.option
