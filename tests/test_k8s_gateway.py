"""The Kubernetes sample gateway runs envoy/'s gateway: its two ConfigMaps are exactly what
k8s/gateway_configmaps.py writes from envoy/, Envoy accepts the config, and it proxies to the
sample's upstream Service.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from support.envoys import validate
from support.kube import K8S, build, find

from sidecar.core import config
from sidecar.injector import annotations as names
from sidecar.injector.container import SOCKET_PATH

ROOT = K8S.parent
SCRIPT = K8S / "gateway_configmaps.py"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gateway_configmaps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def envoy_of(objects: list[dict[str, Any]]) -> str:
    text: str = find(objects, "ConfigMap", "envoy-gateway")["data"]["envoy.yaml"]
    return text


def test_regenerating_the_configmaps_changes_nothing(generator: ModuleType) -> None:
    """Each ConfigMap file is exactly what the generator writes, and `--check` agrees."""
    for path, text in generator.render().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run make k8s-config"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_rules_configmap_is_envoys_rules_file_and_loads() -> None:
    """ratelimit-rules holds envoy/rules/gateway.yaml word for word, under a *.yaml key the
    mounted sidecar reads, and it parses as the gateway domain."""
    objects = build(K8S / "base")
    gateway = find(objects, "Deployment", "gateway")
    name = gateway["spec"]["template"]["metadata"]["annotations"][names.RULES_CONFIGMAP]
    data = find(objects, "ConfigMap", name)["data"]
    text = (ROOT / "envoy" / "rules" / "gateway.yaml").read_text()
    assert data == {"gateway.yaml": text}
    assert config.parse(data["gateway.yaml"], "gateway.yaml").name == "gateway"


def test_the_configmap_envoy_config_passes_envoy_validate(
    envoy_binary: str, tmp_path: Path
) -> None:
    """`envoy --mode validate` accepts the envoy.yaml the gateway pods mount."""
    path = tmp_path / "envoy.yaml"
    path.write_text(envoy_of(build(K8S / "base")))
    result = validate(envoy_binary, path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"configuration '{path}' OK" in result.stdout + result.stderr


def test_the_sample_is_envoys_gateway_sending_to_the_upstream_service() -> None:
    """The pods' Envoy config is envoy/gateway.yaml but for the upstream cluster, which reaches
    the sample's upstream Service by name, and the sidecar's address, its socket in the pod;
    listener and admin addresses fit a pod."""
    objects = build(K8S / "base")
    sample = yaml.safe_load(envoy_of(objects))
    local = yaml.safe_load((ROOT / "envoy" / "gateway.yaml").read_text())

    def upstream(bootstrap: dict[str, Any]) -> dict[str, Any]:
        clusters = bootstrap["static_resources"]["clusters"]
        (cluster,) = [c for c in clusters if c["name"] == "upstream"]
        clusters.remove(cluster)
        return cluster

    def sidecar(bootstrap: dict[str, Any]) -> Any:
        clusters = bootstrap["static_resources"]["clusters"]
        (cluster,) = [c for c in clusters if c["name"] == "ratelimit"]
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        return endpoint.pop("address"), cluster.pop("type")

    cluster = upstream(sample)
    upstream(local)
    # The pods' Envoy calls the injected sidecar on its socket; the local one on loopback TCP.
    assert sidecar(sample) == ({"pipe": {"path": SOCKET_PATH}}, "STATIC")
    local_address = {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}
    assert sidecar(local) == (local_address, "STATIC")
    assert sample == local
    assert cluster["type"] == "STRICT_DNS"
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    service = find(objects, "Service", "upstream")
    (port,) = service["spec"]["ports"]
    assert (address["address"], address["port_value"]) == (
        service["metadata"]["name"],
        port["port"],
    )
    assert service["metadata"]["namespace"] == "gateway"
    deployment = find(objects, "Deployment", "upstream")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (listener,) = sample["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 10000}
    assert sample["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }
