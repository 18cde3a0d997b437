"""Allow and deny lists through the real Envoy: a client whose address is on the deny list gets
429 from its first request, a trusted one is never refused and never counted, and a client on
neither is limited by the rules."""

from __future__ import annotations

from pathlib import Path

from support.envoys import Envoy, Sidecar, Upstream, free_port, get, start_together
from test_gateway_e2e import bootstrap, inside_one_window, unique

RULES = """\
domain: gateway
lists:
  - key: remote_address
    match: cidr
    deny: denied.txt
    allow: trusted.txt
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 2}
"""
DENIED, TRUSTED, OTHER = "127.0.0.66", "127.0.0.77", "127.0.0.88"


def test_a_denied_client_gets_429_and_a_trusted_one_is_never_counted(
    envoy_binary: str, tmp_path: Path
) -> None:
    """Through Envoy's rate limit filter: the denied address's first request is a 429; the
    trusted address passes five times where the limit is 2; another address passes twice and
    then gets 429. The sidecar counted only that other client's three hits on the rule, and
    one denied and five allowed requests on the list."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    (tmp_path / "denied.txt").write_text(f"# abusers\n{DENIED}\n2001:db8::/32\n")
    (tmp_path / "trusted.txt").write_text("# office\n127.0.0.64/28\n")  # .64 to .79
    upstream = Upstream()
    upstream.start()
    port = 0

    def make(attempt: int) -> tuple[Sidecar, Envoy]:
        nonlocal port
        sidecar = Sidecar(
            ["--config", str(rules)], free_port(), free_port(), tmp_path / f"sidecar-{attempt}.log"
        )
        port, admin_port = free_port(), free_port()
        config = tmp_path / f"envoy-{attempt}.yaml"
        config.write_text(bootstrap(rules, sidecar.grpc_port, port, admin_port, upstream.port))
        return sidecar, Envoy(envoy_binary, config, admin_port, tmp_path / f"envoy-{attempt}.log")

    try:
        sidecar, envoy = start_together(make)
    except BaseException:
        upstream.stop()
        raise
    try:
        headers = {"x-app-id": unique("app")}
        inside_one_window(3600, needed=30)
        denied = [get(port, "/api/orders/x", headers, source=DENIED).status for _ in range(2)]
        # The trusted network holds the denied address too: deny comes first.
        trusted = [get(port, "/api/orders/x", headers, source=TRUSTED).status for _ in range(5)]
        other = [get(port, "/api/orders/x", headers, source=OTHER).status for _ in range(3)]
        sidecar.wait_for_calls(10)
        metrics = sidecar.metrics()
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.stop()
    assert denied == [429, 429]
    assert trusted == [200] * 5
    assert other == [200, 200, 429]
    # Only the client on no list reached a counter.
    labels = '{domain="gateway",key1="remote_address"}'
    assert metrics[f"ratelimit_service_rate_limit_denied_by_list{labels}"] == 2
    assert metrics[f"ratelimit_service_rate_limit_allowed_by_list{labels}"] == 5
    rule = '{domain="gateway",key1="app",key2="remote_address"}'
    assert metrics[f"ratelimit_service_rate_limit_total_hits{rule}"] == 3
