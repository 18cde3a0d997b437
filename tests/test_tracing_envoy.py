"""Envoy's trace reaches the sidecar: the real Envoy, tracing with its OpenTelemetry tracer,
calls the sidecar (each transport) with `traceparent`, and both export over OTLP grpc to a
receiver in the test process. The sidecar's ShouldRateLimit span is in the client's trace, its
parent the span Envoy made for the rate limit call."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.envoys import Envoy, Sidecar, free_port, get, start_together
from support.otlp import Received, threaded_grpc_receiver
from test_gateway_e2e import bootstrap, unique

from sidecar.runner.app import TRANSPORTS
from sidecar.telemetry.tracing import SERVER_SPAN

RULES = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 100}
"""
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def envoy_config(rules: Path, sidecar_port: int, port: int, admin_port: int, otlp_port: int) -> str:
    """envoy/gateway.yaml's bootstrap for these ports, tracing every request with Envoy's
    OpenTelemetry tracer to `otlp_port`, its spans flushed at once."""
    generated = bootstrap(rules, sidecar_port, port, admin_port, free_port())
    config: dict[str, Any] = yaml.safe_load(generated)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager["typed_config"]["tracing"] = {
        "random_sampling": {"value": 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "2s"},
                "service_name": "envoy",
            },
        },
    }
    config["static_resources"]["clusters"].append(
        {
            "name": "otlp",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "otlp",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": otlp_port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
        }
    )
    config["layered_runtime"] = {
        "layers": [
            {
                "name": "flush",
                "static_layer": {
                    "tracing.opentelemetry.min_flush_spans": 1,
                    "tracing.opentelemetry.flush_interval_ms": 100,
                },
            }
        ]
    }
    return yaml.safe_dump(config)


def wait_for(received: Received, found: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not received in {timeout:g}s; spans: {received.spans}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_sidecars_span_has_envoys_trace_id_and_envoys_span_as_parent(
    envoy_binary: str, tmp_path: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request with `traceparent` through Envoy: the sidecar's ShouldRateLimit span carries
    the client's trace id, and its parent is one of the spans Envoy exported for that trace
    (Envoy's rate limit call), not the client's span."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the sidecar's batches, for the test
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    port = 0
    with threaded_grpc_receiver() as received:

        def make(attempt: int) -> tuple[Sidecar, Envoy]:
            nonlocal port
            sidecar = Sidecar(
                ["--config", str(rules), "--transport", transport, "--tracing",
                 "--tracing-protocol", "grpc", "--tracing-endpoint", received.endpoint],
                free_port(), free_port(), tmp_path / f"sidecar-{attempt}.log",
            )  # fmt: skip
            port, admin_port = free_port(), free_port()
            config = tmp_path / f"envoy-{attempt}.yaml"
            config.write_text(
                envoy_config(rules, sidecar.grpc_port, port, admin_port, received.port)
            )
            return sidecar, Envoy(
                envoy_binary, config, admin_port, tmp_path / f"envoy-{attempt}.log"
            )

        sidecar, envoy = start_together(make)
        try:
            headers = {"x-app-id": unique("app"), "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
            get(port, "/api/orders/x", headers)
            (ours,) = wait_for(
                received,
                lambda: [s for s in received.named(SERVER_SPAN) if s.service == "RateLimit"],
            )
            parent = wait_for(
                received,
                lambda: [s for s in received.spans if s.span_id == ours.parent_span_id],
            )[0]
        finally:
            envoy.stop()
            sidecar.stop()
    assert ours.trace_id == TRACE_ID
    assert ours.parent_span_id not in ("", CLIENT_SPAN)
    assert parent.service == "envoy" and parent.trace_id == TRACE_ID
