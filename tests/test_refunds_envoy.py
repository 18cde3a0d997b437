"""Refunds through the real Envoy 1.40: a route whose rate limit filter counts a request when it
starts and gives it back when its stream ends (`RateLimitPerRoute` with `hits_addend:
{is_negative_hits: true}` and `apply_on_stream_done`), so the limit bounds what is in flight,
not what has started. Envoy sends the refund as `is_negative_hits` (field 4), which the
sidecar reads on either transport (the fast one's own decoder, or protobuf with the messages of
proto/envoy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.envoys import HOST, Envoy, Sidecar, Upstream, free_port, get, start_together
from test_gateway_e2e import inside_one_window, unique

RULES = """\
domain: inflight
descriptors:
  - key: client
    rate_limit: {unit: hour, requests_per_unit: 2}
"""
#: The limited descriptor: the client named by a header.
ACTIONS = [{"request_headers": {"header_name": "x-client", "descriptor_key": "client"}}]


def envoy_config(sidecar_port: int, port: int, admin_port: int, upstream_port: int) -> str:
    """A listener whose one route charges the client's descriptor when a request starts and
    refunds it when the stream ends, both from the filter's per-route config (Envoy sends
    `hits_addend` and `is_negative_hits` from there, not from a route's own `rate_limits`)."""

    def cluster(name: str, cluster_port: int, http2: bool) -> dict[str, object]:
        found: dict[str, object] = {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": HOST,
                                            "port_value": cluster_port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
        if http2:
            found["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            }
        return found

    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "upstream"},
        "typed_per_filter_config": {
            "envoy.filters.http.ratelimit": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                "rate_limits": [
                    {"actions": ACTIONS},
                    {
                        "actions": ACTIONS,
                        "apply_on_stream_done": True,
                        "hits_addend": {"number": 1, "is_negative_hits": True},
                    },
                ],
            }
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [
            {
                "name": "envoy.filters.http.ratelimit",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                    "domain": "inflight",
                    "failure_mode_deny": True,
                    "timeout": "2s",
                    "rate_limit_service": {
                        "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}},
                        "transport_api_version": "V3",
                    },
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    config = {
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": HOST, "port_value": port}},
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
            ],
            "clusters": [
                cluster("upstream", upstream_port, http2=False),
                cluster("ratelimit", sidecar_port, http2=True),
            ],
        },
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin_port}}},
    }
    return yaml.safe_dump(config)


def calls_through_envoy(
    envoy_binary: str, tmp_path: Path, flags: list[str], requests: int
) -> tuple[list[int], Sidecar, dict[str, float]]:
    """`requests` requests of one client, one after another, each once its stream-done call
    (if any) is answered: their statuses, and the sidecar's metrics after them."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    upstream = Upstream()
    upstream.start()
    port = 0

    def make(attempt: int) -> tuple[Sidecar, Envoy]:
        nonlocal port
        sidecar = Sidecar(
            ["--config", str(rules), *flags],
            free_port(), free_port(), tmp_path / f"sidecar-{attempt}.log",
        )  # fmt: skip
        port, admin_port = free_port(), free_port()
        config = tmp_path / f"envoy-{attempt}.yaml"
        config.write_text(envoy_config(sidecar.grpc_port, port, admin_port, upstream.port))
        return sidecar, Envoy(envoy_binary, config, admin_port, tmp_path / f"envoy-{attempt}.log")

    try:
        sidecar, envoy = start_together(make)
    except BaseException:
        upstream.stop()
        raise
    try:
        headers = {"x-client": unique("client")}
        inside_one_window(3600, needed=30)
        statuses = []
        for number in range(1, requests + 1):
            statuses.append(get(port, "/work", headers).status)
            # Envoy calls the sidecar when the request starts, and again when its stream ends.
            sidecar.wait_for_calls(2 * number)
        metrics = sidecar.metrics()
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.stop()
    assert isinstance(sidecar, Sidecar)
    return statuses, sidecar, metrics


@pytest.mark.parametrize("transport", ["fast", "grpcio"])
def test_each_request_is_given_back_when_its_stream_ends(
    envoy_binary: str, tmp_path: Path, transport: str
) -> None:
    """On a limit of 2 per hour, five requests one after another all pass: each is counted when
    it starts and given back when it ends, so at most one is ever counted. The sidecar counts
    five hits and five refunds (`total_negative_hits`), read from Envoy's field 4 by either
    transport; read as a charge, as before refunds, the second request would get 429."""
    statuses, _, metrics = calls_through_envoy(
        envoy_binary, tmp_path, ["--negative-hits", "--transport", transport], 5
    )
    assert statuses == [200] * 5
    labels = '{domain="inflight",key1="client"}'
    assert metrics[f"ratelimit_service_rate_limit_total_hits{labels}"] == 5
    assert metrics[f"ratelimit_service_rate_limit_total_negative_hits{labels}"] == 5
    assert metrics[f"ratelimit_service_rate_limit_over_limit{labels}"] == 0


def test_a_sidecar_without_negative_hits_refuses_the_refunds_and_counts_only_starts(
    envoy_binary: str, tmp_path: Path
) -> None:
    """Without `--negative-hits` each stream-done refund is refused (UNIMPLEMENTED, a service
    error; Envoy, done with the request, lets it be), never counted as a charge: the limit of 2
    counts the requests that started, so the third gets 429."""
    statuses, _, metrics = calls_through_envoy(envoy_binary, tmp_path, [], 3)
    assert statuses == [200, 200, 429]
    labels = '{domain="inflight",key1="client"}'
    assert metrics[f"ratelimit_service_rate_limit_total_hits{labels}"] == 3
    assert metrics[f"ratelimit_service_rate_limit_total_negative_hits{labels}"] == 0
    assert metrics['ratelimit_service_should_rate_limit_error{err_type="service_error"}'] == 3
