"""The standard OpenTelemetry variables, read as the reference reads them since its PR #1171:
in place of an unset TRACING_* variable under `ratelimit` and `serve --reference-env`, a set
TRACING_* one winning; the exporter's timeout in milliseconds under `serve` too; and spans
reaching an OTLP receiver named and sent as those variables say."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from support.otlp import grpc_receiver
from support.sidecars import client, request, serve_process, write_rules

from sidecar import cli
from sidecar.cli import image, settings
from sidecar.telemetry import tracing
from sidecar.telemetry.tracing import SERVER_SPAN, TracingSettings

BASE = ["serve", "--config", "r", "--reference-env"]

#: What an OpenTelemetry Operator (or a platform's defaults) puts in every pod's environment.
OTEL_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    "OTEL_SERVICE_NAME": "edge-rls",
    "OTEL_RESOURCE_ATTRIBUTES": "service.namespace=prod, service.instance.id=pod-7,k8s.pod.name",
    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    "OTEL_TRACES_SAMPLER_ARG": "0.25",
}


def traced(env: dict[str, str], *argv: str) -> TracingSettings | None:
    return cli.serve.tracing_settings(cli.parse_args([*BASE, *argv], env))


def test_the_otel_variables_stand_in_for_the_unset_tracing_ones() -> None:
    """OTEL_TRACES_EXPORTER turns tracing on, and the protocol, service name, namespace,
    instance id and sampling rate come from OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES and OTEL_TRACES_SAMPLER(_ARG), as the reference reads them."""
    assert traced(OTEL_ENV) == TracingSettings("grpc", None, "edge-rls", "prod", "pod-7", 0.25)
    for protocol, expected in (("http/protobuf", "http"), ("http/protobuf+json", "http")):
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        assert traced(env) == TracingSettings(protocol=expected)  # type: ignore[arg-type]
    for sampler, rate in (("always_on", 1.0), ("always_off", 0.0), ("traceidratio", 1.0)):
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": sampler}
        assert traced(env) == TracingSettings(sampling_rate=rate)


def test_a_set_tracing_variable_wins_over_its_otel_one() -> None:
    """Each TRACING_* variable that is set wins over the standard one; `serve`'s flags win over
    both; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none leave tracing off."""
    env = {
        **OTEL_ENV,
        "TRACING_EXPORTER_PROTOCOL": "http",
        "TRACING_SERVICE_NAME": "rls",
        "TRACING_SERVICE_NAMESPACE": "edge",
        "TRACING_SERVICE_INSTANCE_ID": "pod-1",
        "TRACING_SAMPLING_RATE": "0.5",
    }
    assert traced(env) == TracingSettings("http", None, "rls", "edge", "pod-1", 0.5)
    assert traced(OTEL_ENV, "--tracing-service-name", "flagged").service_name == "flagged"  # type: ignore[union-attr]
    assert traced({**OTEL_ENV, "TRACING_ENABLED": "false"}) is None
    assert traced({**OTEL_ENV, "OTEL_SDK_DISABLED": "true"}) is None
    assert traced({**OTEL_ENV, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert traced({**OTEL_ENV, "OTEL_TRACES_EXPORTER": ""}) is None  # empty is unset
    # Without --reference-env `serve` reads none of them.
    assert cli.serve.tracing_settings(cli.parse_args(["serve", "--config", "r"], OTEL_ENV)) is None


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/json",
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': expected grpc or http/protobuf",
        ),
        (
            "OTEL_TRACES_SAMPLER",
            "xray",
            "OTEL_TRACES_SAMPLER='xray': expected always_on, always_off, traceidratio or "
            "parentbased_traceidratio",
        ),
        ("OTEL_TRACES_SAMPLER_ARG", "a quarter", "OTEL_TRACES_SAMPLER_ARG='a quarter': expected"),
    ],
)
def test_an_otel_value_the_sidecar_cannot_take_stops_the_start_only_with_tracing_on(
    variable: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A protocol that is not protobuf, a sampler the reference does not take, or a ratio that
    is not a number stops a start that traces, naming the variable (the reference would
    export as http, or sample every call); with tracing off it is not read, as there."""
    env = {**OTEL_ENV, variable: value}
    with pytest.raises(SystemExit) as exited:
        traced(env)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert traced({**env, "OTEL_TRACES_EXPORTER": "none"}) is None


def test_otel_variables_alone_are_not_an_environment_written_for_the_reference() -> None:
    """The standard variables, which other programs' pods carry too, neither make the image
    run as `ratelimit` nor are logged as the reference's unread settings, and the signals'
    own variables near them are not taken for typos; one of the reference's own beside them
    still counts."""
    env = {
        **OTEL_ENV,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=a",
    }
    assert settings.present(env) == []
    assert settings.misspelled(env) == []
    assert settings.present({**env, "REDIS_URL": "redis:6379"}) == ["REDIS_URL"]
    assert settings.misspelled({"OTEL_SERVCE_NAME": "x"}) == [
        ("OTEL_SERVCE_NAME", "OTEL_SERVICE_NAME")
    ]
    # The image's entrypoint with no arguments: `serve`, not `ratelimit`, which would refuse
    # to start without REDIS_URL.
    calls: list[list[str]] = []
    original = cli.main
    try:
        cli.main = lambda argv=None: calls.append(list(argv or [])) or 0  # type: ignore[assignment,func-returns-value]
        assert image.main([], env) == 0
    finally:
        cli.main = original
    assert calls and calls[0][0] == "serve"


def test_the_exporters_timeout_is_in_milliseconds() -> None:
    """OTEL_EXPORTER_OTLP_TIMEOUT (and _TRACES_TIMEOUT, which wins) is milliseconds, as the
    specification and the reference read it; not a whole number above 0 stops the start."""
    assert tracing.export_timeout({}) is None
    assert tracing.export_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}) == 10.0
    both = {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "250"}
    assert tracing.export_timeout(both) == 0.25
    for bad in ("1.5", "0", "-3", "10s"):
        with pytest.raises(tracing.TracingError, match="expected milliseconds"):
            tracing.export_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": bad})


#: How long an export to a collector that never answers may take, with a timeout of 200 ms:
#: far more than that (and than its retries), far less than 200 s, Python's own reading.
GIVE_UP_WITHIN = 30.0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_export_to_a_silent_collector_gives_up_after_the_milliseconds(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OTEL_EXPORTER_OTLP_TIMEOUT=200 an export to a collector that accepts the connection
    and never answers fails after 200 ms (and the exporter's retries within it), not 200 s."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "200")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        endpoint = f"http://127.0.0.1:{port}" + ("/v1/traces" if protocol == "http" else "")
        exporter = tracing._otlp_exporter(TracingSettings(protocol, endpoint))  # type: ignore[arg-type]
        span = TracerProvider().get_tracer("test").start_span("silent")
        span.end()
        results: list[SpanExportResult] = []
        exporting = threading.Thread(
            target=lambda: results.append(exporter.export([span])), daemon=True
        )
        exporting.start()
        exporting.join(GIVE_UP_WITHIN)
        if exporting.is_alive():  # left to end with the process: it would retry for 200 s
            pytest.fail("the export waits as if the timeout were in seconds")
        exporter.shutdown()
    assert results == [SpanExportResult.FAILURE]


async def test_ratelimit_traces_with_only_the_otel_variables(tmp_path: Path) -> None:
    """`serve --reference-env` with no TRACING_* variable and a pod's standard OpenTelemetry
    variables sends its spans over OTLP/gRPC to OTEL_EXPORTER_OTLP_ENDPOINT with the headers
    of OTEL_EXPORTER_OTLP_HEADERS, named by OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES."""
    rules = write_rules(tmp_path)
    async with grpc_receiver() as received:
        env = {
            **OTEL_ENV,
            "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_EXPORTER_OTLP_ENDPOINT": received.endpoint,
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=edge",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "10000",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
                "--http-address", "127.0.0.1:0", "--reference-env"]  # fmt: skip
        async with serve_process(args, {**os.environ, **env}) as served:
            async with client(served.grpc_port) as rls:
                for _ in range(2):
                    await rls.call(request("test", [("user", "alice")]), timeout=10)
            spans = await received.wait_for(SERVER_SPAN, 2)
    resources = {tuple(sorted(span.resource.items())) for span in spans}
    (resource,) = resources
    assert dict(resource)["service.name"] == "edge-rls"
    assert dict(resource)["service.namespace"] == "prod"
    assert dict(resource)["service.instance.id"] == "pod-7"
    assert all(metadata.get("x-tenant") == "edge" for metadata in received.metadata)
