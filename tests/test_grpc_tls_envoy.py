"""The real Envoy calls the sidecar over mTLS, on both transports.

Envoy's bootstrap is envoy/gateway.yaml's own command with these rules and ports; its
`ratelimit` cluster gets a `transport_socket` with TLS (ALPN h2, the test CA as the trusted
root, the sidecar's SAN checked) and a client certificate. The sidecar requires a client
certificate of the test CA carrying the SAN `envoy.gateway.local` (GRPC_CLIENT_TLS_SAN).
Envoy answers 429 only if the sidecar decided so, so the limit proves the calls went through;
an Envoy whose client certificate comes from another CA is refused at the handshake, and the
sidecar answers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.certs import Authority
from support.envoys import Envoy, Sidecar, free_port, get, start_together
from test_gateway_e2e import bootstrap, inside_one_window, unique

RULES = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 3}
"""
CLIENT_SAN = "envoy.gateway.local"


@dataclass
class Pki:
    ca: Path
    server: tuple[Path, Path]
    envoy: tuple[Path, Path]
    stranger: tuple[Path, Path]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    authority, stranger = Authority(), Authority("stranger CA")
    return Pki(
        authority.write(folder / "ca.crt"),
        authority.issue(folder, "sidecar"),
        authority.issue(folder, "envoy", dns=(CLIENT_SAN,), ips=(), client=True),
        stranger.issue(folder, "stranger", dns=(CLIENT_SAN,), ips=(), client=True),
    )


def envoy_config(
    rules: Path, sidecar_port: int, port: int, admin_port: int, pki: Pki, client: tuple[Path, Path]
) -> str:
    """envoy/gateway.yaml's bootstrap for these ports, its ratelimit cluster over mTLS (no
    upstream listens: a 503 means the request passed the limit)."""
    generated = bootstrap(rules, sidecar_port, port, admin_port, free_port())
    config: dict[str, Any] = yaml.safe_load(generated)
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "ratelimit"]
    cert, key = client
    cluster["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": "localhost",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": str(cert)},
                        "private_key": {"filename": str(key)},
                    }
                ],
                "validation_context": {
                    "trusted_ca": {"filename": str(pki.ca)},
                    "match_typed_subject_alt_names": [
                        {"san_type": "DNS", "matcher": {"exact": "localhost"}}
                    ],
                },
            },
        },
    }
    return yaml.safe_dump(config)


@dataclass
class Gateway:
    envoy: Envoy
    sidecar: Sidecar
    port: int


def start_gateway(
    envoy_binary: str, workdir: Path, transport: str, pki: Pki, client: tuple[Path, Path]
) -> Gateway:
    rules = workdir / "rules.yaml"
    rules.write_text(RULES)
    tls = ["--grpc-tls-cert", str(pki.server[0]), "--grpc-tls-key", str(pki.server[1]),
           "--grpc-tls-client-ca", str(pki.ca), "--grpc-tls-client-san", CLIENT_SAN]  # fmt: skip
    port = 0

    def make(attempt: int) -> tuple[Sidecar, Envoy]:
        nonlocal port
        sidecar = Sidecar(
            ["--config", str(rules), "--transport", transport, *tls],
            free_port(), free_port(), workdir / f"sidecar-{attempt}.log", log_level="info",
        )  # fmt: skip
        port, admin_port = free_port(), free_port()
        config = workdir / f"envoy-{attempt}.yaml"
        config.write_text(envoy_config(rules, sidecar.grpc_port, port, admin_port, pki, client))
        return sidecar, Envoy(envoy_binary, config, admin_port, workdir / f"envoy-{attempt}.log")

    sidecar, envoy = start_together(make)
    assert isinstance(sidecar, Sidecar) and isinstance(envoy, Envoy)
    return Gateway(envoy, sidecar, port)


@pytest.fixture
def gateway(envoy_binary: str, pki: Pki, transport: str, tmp_path: Path) -> Iterator[Gateway]:
    running = start_gateway(envoy_binary, tmp_path, transport, pki, pki.envoy)
    try:
        yield running
    finally:
        running.envoy.stop()
        running.sidecar.stop()


def test_envoy_calls_the_sidecar_over_mtls_and_its_limit_holds(gateway: Gateway) -> None:
    """Envoy's TLS client certificate, signed by the CA and carrying the pinned SAN, is
    admitted: the 4th request of an app from one address is refused 429 by the sidecar's
    answer, the others pass to the (absent) upstream, and Envoy counts TLS handshakes."""
    inside_one_window(3600)
    app = unique("app")
    statuses = [get(gateway.port, "/api/orders/x", {"x-app-id": app}).status for _ in range(4)]
    assert statuses[3] == 429
    assert 429 not in statuses[:3]
    assert gateway.envoy.stat("cluster.ratelimit.ssl.handshake") >= 1
    assert gateway.sidecar.calls() == 4


def test_envoy_with_a_certificate_of_another_ca_is_refused(
    envoy_binary: str, pki: Pki, transport: str, tmp_path: Path
) -> None:
    """An Envoy whose client certificate another CA signed never gets a connection: its
    handshakes fail, the sidecar answers no call, and (failure_mode_deny off) requests pass
    unlimited."""
    running = start_gateway(envoy_binary, tmp_path, transport, pki, pki.stranger)
    try:
        app = unique("app")
        statuses = [get(running.port, "/api/orders/x", {"x-app-id": app}).status for _ in range(5)]
        assert 429 not in statuses
        assert running.sidecar.calls() == 0
        stats = running.envoy.stats()
        assert stats.get("cluster.ratelimit.ssl.handshake", 0) == 0
        assert (
            stats.get("cluster.ratelimit.upstream_cx_connect_fail", 0)
            + stats.get("cluster.ratelimit.ssl.connection_error", 0)
            + stats.get("cluster.ratelimit.upstream_cx_destroy_remote", 0)
            >= 1
        )
    finally:
        running.envoy.stop()
        running.sidecar.stop()
