"""The 429 names its limit, through the real Envoy: with `--response-limit-name` the sidecar's
OVER_LIMIT answer carries a `RateLimit-Policy` header, which Envoy adds to the 429 the client
gets, and dynamic metadata, which Envoy's access log records under its rate limit filter's name."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from support.envoys import Envoy, Response, Sidecar, Upstream, free_port, get, start_together
from test_gateway_e2e import bootstrap, inside_one_window, unique

RULES = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 2, name: per-client-hourly}
"""
#: What the access log writes per request: status, then the limit's name, quota and window
#: from the dynamic metadata the sidecar answered with ("-" when there is none).
LOG_FORMAT = (
    "%RESPONSE_CODE% name=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_name)% "
    "quota=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_quota)% "
    "window=%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_window)%\n"
)


def envoy_config(
    rules: Path,
    sidecar_port: int,
    port: int,
    admin_port: int,
    upstream_port: int,
    log: Path,
    log_format: str = LOG_FORMAT,
) -> str:
    """envoy/gateway.yaml's bootstrap for these ports, with an access log to `log`."""
    config: dict[str, Any] = yaml.safe_load(
        bootstrap(rules, sidecar_port, port, admin_port, upstream_port)
    )
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager["typed_config"]["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(log),
                "log_format": {"text_format_source": {"inline_string": log_format}},
            },
        }
    ]
    return yaml.safe_dump(config)


def three_calls_through_envoy(
    envoy_binary: str,
    tmp_path: Path,
    rules_text: str,
    flags: list[str],
    log_format: str = LOG_FORMAT,
    request_headers: Mapping[str, str] | None = None,
) -> tuple[list[Response], list[str], float]:
    """Three calls of one client (a new `x-app-id`, and `request_headers`) through the real
    Envoy to a sidecar serving `rules_text` with `flags`, all in one hour: the responses,
    Envoy's access log lines (in `log_format`) and the time of the last answer."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(rules_text)
    access_log = tmp_path / "access.log"
    port = 0
    upstream = Upstream()
    upstream.start()

    def make(attempt: int) -> tuple[Sidecar, Envoy]:
        nonlocal port
        sidecar = Sidecar(
            ["--config", str(rules), *flags],
            free_port(), free_port(), tmp_path / f"sidecar-{attempt}.log",
        )  # fmt: skip
        port, admin_port = free_port(), free_port()
        config = tmp_path / f"envoy-{attempt}.yaml"
        config.write_text(
            envoy_config(
                rules, sidecar.grpc_port, port, admin_port, upstream.port, access_log, log_format
            )
        )
        return sidecar, Envoy(envoy_binary, config, admin_port, tmp_path / f"envoy-{attempt}.log")

    try:
        sidecar, envoy = start_together(make)
    except BaseException:
        upstream.stop()
        raise
    try:
        headers = {"x-app-id": unique("app"), **(request_headers or {})}
        inside_one_window(3600, needed=10)
        responses = [get(port, "/api/orders/x", headers) for _ in range(3)]
        ended = time.time()
        deadline = time.monotonic() + 10
        while not access_log.exists() or access_log.read_text().count("\n") < 3:
            assert time.monotonic() < deadline, "Envoy's access log has not three lines"
            time.sleep(0.05)
        lines = access_log.read_text().splitlines()
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.stop()
    return responses, lines, ended


def test_an_over_limit_answer_names_its_limit_to_the_client_and_the_access_log(
    envoy_binary: str, tmp_path: Path
) -> None:
    """Two requests of one client pass; the third gets 429 with `RateLimit-Policy:
    "per-client-hourly";q=2;w=3600`, and Envoy's access log records the limit's name, quota
    and window for the 429 only (the admitted requests log "-")."""
    statuses, lines, _ = three_calls_through_envoy(
        envoy_binary, tmp_path, RULES, ["--response-limit-name"]
    )
    assert [r.status for r in statuses] == [200, 200, 429]
    assert statuses[2].headers["ratelimit-policy"] == '"per-client-hourly";q=2;w=3600'
    assert "ratelimit-policy" not in statuses[0].headers
    assert lines == [
        "200 name=- quota=- window=-",
        "200 name=- quota=- window=-",
        "429 name=per-client-hourly quota=2 window=3600",
    ]
