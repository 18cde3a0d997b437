"""The manifests in k8s/: each kustomization builds, every object fits the Kubernetes API's
schema, and the pieces agree with each other and with the sidecar (ports, names, flags, rules).

Builds use tests/support/kube.py's kustomize, which always runs, and also `kubectl kustomize` where
kubectl is installed; both must print the same objects.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube import CUSTOM_GROUPS, K8S, assert_valid, build, by_id, find, kubectl_build

from sidecar.cli import parse_args
from sidecar.core import config
from sidecar.injector import annotations as names
from sidecar.injector import patch, settings
from sidecar.injector.commands import register
from sidecar.injector.container import CONTAINER_NAME, RULES_PATH, SOCKET_DIR, SOCKET_PATH
from sidecar.injector.manifests import inject_yaml
from sidecar.injector.urls import validate_url
from sidecar.injector.webhook import MUTATE, MUTATE_ENABLED, review

ROOT = K8S.parent
KUSTOMIZATIONS = sorted(
    p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml")
)
#: What a user applies: the base and the overlays (the others are their parts).
TOP_LEVEL = [name for name in KUSTOMIZATIONS if name == "base" or name.startswith("overlays/")]
# Built with both where kubectl exists; with the Python kustomize alone where it does not.
BUILDERS = ["python", "kubectl"] if shutil.which("kubectl") else ["python"]


def objects_of(name: str, builder: str = "python") -> list[dict[str, Any]]:
    directory = K8S / name
    return kubectl_build(directory) if builder == "kubectl" else build(directory)


def containers(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every container of a workload's pod template, init containers included, by name."""
    spec = workload["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def test_the_layout_has_a_base_and_an_overlay() -> None:
    """k8s/base and at least one overlay are kustomizations."""
    assert "base" in KUSTOMIZATIONS
    assert any(name.startswith("overlays/") for name in KUSTOMIZATIONS)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_is_valid_for_the_kubernetes_api(name: str, builder: str) -> None:
    """Every object every kustomization builds passes the API's strict schema; kubectl
    kustomize, where it runs, builds exactly the objects tests/support/kube.py builds."""
    objects = objects_of(name, builder)
    assert objects
    for obj in objects:
        if not obj["apiVersion"].startswith(CUSTOM_GROUPS):
            assert_valid(obj)
    if builder == "kubectl":
        assert by_id(objects) == by_id(build(K8S / name))
        if name in TOP_LEVEL:  # these keep the order written (sortOptions: fifo)
            assert list(by_id(objects)) == list(by_id(build(K8S / name)))


def test_base_has_every_part() -> None:
    """The base has the webhook, its Service and configuration, rules, Redis, a gateway and its
    upstream."""
    ids = set(by_id(build(K8S / "base")))
    assert {
        "Namespace ratelimit-sidecar",
        "ServiceAccount ratelimit-sidecar/ratelimit-sidecar-webhook",
        "Deployment ratelimit-sidecar/ratelimit-sidecar-webhook",
        "PodDisruptionBudget ratelimit-sidecar/ratelimit-sidecar-webhook",
        "Service ratelimit-sidecar/ratelimit-sidecar-webhook",
        "MutatingWebhookConfiguration ratelimit-sidecar",
        "Namespace gateway",
        "ConfigMap gateway/ratelimit-rules",
        "ConfigMap gateway/envoy-gateway",
        "Deployment gateway/gateway",
        "Service gateway/gateway",
        "Deployment gateway/upstream",
        "Service gateway/upstream",
        "StatefulSet gateway/redis",
        "Service gateway/redis",
    } <= ids


def test_the_webhook_configuration_reaches_the_webhook() -> None:
    """Both entries of the MutatingWebhookConfiguration call the Service, at the paths the
    webhook serves, and the Service reaches the container's port."""
    objects = build(K8S / "base")
    hooks = find(objects, "MutatingWebhookConfiguration", "ratelimit-sidecar")["webhooks"]
    service = find(objects, "Service", "ratelimit-sidecar-webhook")
    deployment = find(objects, "Deployment", "ratelimit-sidecar-webhook")
    (port,) = service["spec"]["ports"]
    paths = {hook["clientConfig"]["service"]["path"] for hook in hooks}
    assert paths == {MUTATE, MUTATE_ENABLED}
    for hook in hooks:
        target = hook["clientConfig"]["service"]
        assert (target["namespace"], target["name"]) == (
            service["metadata"]["namespace"],
            service["metadata"]["name"],
        )
        assert port["port"] == target["port"]
    webhook = containers(deployment)["webhook"]
    assert port["targetPort"] in {p["name"] for p in webhook["ports"]}
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects these labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def test_the_webhook_fails_closed_only_where_namespaces_or_pods_opted_in() -> None:
    """failurePolicy Fail, v1 reviews, no side effects, pods on CREATE; labelled namespaces go
    to /mutate/injection-enabled, the others to /mutate but only for pods annotated to inject;
    kube-system, kube-public and the webhook's own namespace go nowhere."""
    objects = build(K8S / "base")
    hooks = find(objects, "MutatingWebhookConfiguration", "ratelimit-sidecar")["webhooks"]
    for hook in hooks:
        assert hook["failurePolicy"] == "Fail"
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["sideEffects"] == "None"
        assert hook["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
    by_path = {hook["clientConfig"]["service"]["path"]: hook for hook in hooks}

    def called(name: str, labels: dict[str, str]) -> set[str]:
        labels = {**labels, "kubernetes.io/metadata.name": name}
        return {
            path for path, hook in by_path.items() if selects(hook["namespaceSelector"], labels)
        }

    enabled = {"ratelimit-sidecar/injection": "enabled"}
    assert called("gateway", enabled) == {MUTATE_ENABLED}
    assert called("shop", {}) == {MUTATE}
    assert called("shop", {"ratelimit-sidecar/injection": "disabled"}) == {MUTATE}
    for name in ("kube-system", "kube-public", "ratelimit-sidecar"):
        assert called(name, enabled) == called(name, {}) == set()
    labels = {
        ns["metadata"]["name"]: ns["metadata"].get("labels", {})
        for ns in objects
        if ns["kind"] == "Namespace"
    }
    assert called("gateway", labels["gateway"]) == {MUTATE_ENABLED}
    assert called("ratelimit-sidecar", labels["ratelimit-sidecar"]) == set()
    # Elsewhere, only pods that ask are sent: a webhook outage holds up no other pod.
    (condition,) = by_path[MUTATE]["matchConditions"]
    assert "'ratelimit-sidecar/inject'" in condition["expression"]
    assert "'true'" in condition["expression"]
    # In labelled namespaces, a pod that refuses the sidecar is not sent either.
    (condition,) = by_path[MUTATE_ENABLED]["matchConditions"]
    assert "!= 'false'" in condition["expression"]
    assert find(objects, "Deployment", "ratelimit-sidecar-webhook")["spec"]["replicas"] >= 2


def test_the_webhook_container_args_are_the_webhook_command() -> None:
    """The webhook Deployment's args parse as `ratelimit-sidecar webhook`, image included."""
    deployment = find(build(K8S / "base"), "Deployment", "ratelimit-sidecar-webhook")
    webhook = containers(deployment)["webhook"]
    parser = argparse.ArgumentParser(prog="ratelimit-sidecar")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(webhook["args"])
    assert args.command == "webhook"
    assert args.address == ("0.0.0.0", 8443)
    # No --image: the webhook injects its own pod's image, read through POD_NAME.
    assert args.image is None
    assert webhook["image"] == settings.DEFAULT_IMAGE
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in webhook["env"]} == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
    }
    assert args.native_sidecars == "auto"
    # The token reaches the API server: /version, its own pod, its Secret and caBundle.
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    mount = webhook["volumeMounts"][0]["mountPath"]
    assert Path(args.tls_cert).parent == Path(args.tls_key).parent == Path(mount)


@pytest.mark.parametrize("name", ["base", "overlays/redis-cluster"])
def test_the_gateway_asks_for_a_working_sidecar(name: str) -> None:
    """The sample gateway is annotated for injection, and its annotations pass the injector."""
    objects = build(K8S / name)
    gateway = find(objects, "Deployment", "gateway")
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations[names.INJECT] == "true"
    assert annotations[names.NATIVE_SIDECAR] == "true"
    validate_url(annotations[names.BACKEND])
    assert find(objects, "ConfigMap", annotations[names.RULES_CONFIGMAP])
    for native in (True, False):  # the annotation wins over the webhook's choice
        injected = patch.inject(gateway, settings.Settings(native_sidecars=native))
        spec = injected["spec"]["template"]["spec"]
        assert [c["name"] for c in spec["initContainers"]] == [CONTAINER_NAME]
        assert spec["initContainers"][0]["restartPolicy"] == "Always"
        assert [c["name"] for c in spec["containers"]] == ["envoy"]
        assert_valid(injected)


def test_the_injected_gateway_pod_is_valid_and_starts_the_sidecar_as_the_cli_expects() -> None:
    """A gateway pod through the webhook: valid, and its sidecar args parse as `serve`."""
    import base64
    import json

    import jsonpatch

    gateway = find(build(K8S / "base"), "Deployment", "gateway")
    pod = {"apiVersion": "v1", "kind": "Pod", **gateway["spec"]["template"]}
    pod["metadata"] = {**pod["metadata"], "generateName": "gateway-", "namespace": "gateway"}
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "5f1c0b5e-2a3d-4c44-9f4b-0d8a8f6f1a11",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "gateway",
            "object": pod,
        },
    }
    reply = review(json.dumps(body).encode(), settings.Settings(native_sidecars=False))
    ops = json.loads(base64.b64decode(reply.body["response"]["patch"]))
    injected = jsonpatch.apply_patch(pod, ops)
    assert_valid(injected)
    (sidecar,) = injected["spec"]["initContainers"]
    assert sidecar["name"] == CONTAINER_NAME
    assert sidecar["command"] == ["ratelimit-sidecar"]
    args = parse_args(sidecar["args"], environ={})
    assert args.command == "serve"
    assert args.config == [RULES_PATH]
    assert args.grpc_address == f"unix:{SOCKET_PATH}"
    assert args.backend == "redis://redis:6379"
    assert args.failure_mode == "allow"


def test_the_rules_configmap_holds_valid_rules_for_the_envoy_domain() -> None:
    """Every key of the rules ConfigMap is a *.yaml rules file; its domain is Envoy's."""
    objects = build(K8S / "base")
    rules = find(objects, "ConfigMap", "ratelimit-rules")["data"]
    assert rules
    domains = set()
    for key, text in rules.items():
        assert key.endswith((".yaml", ".yml")), f"{key}: the sidecar loads only *.yaml, *.yml"
        domains.add(config.parse(text, key).name)
    envoy = yaml.safe_load(find(objects, "ConfigMap", "envoy-gateway")["data"]["envoy.yaml"])
    assert ratelimit_filter(envoy)["domain"] in domains


def test_envoy_calls_the_sidecar_where_it_listens() -> None:
    """Envoy's rate limit cluster is a pipe to the injected sidecar's socket, over HTTP/2; the
    injected pod mounts the socket's directory in Envoy's container; the sidecar's HTTP port is
    none of Envoy's."""
    objects = build(K8S / "base")
    envoy = yaml.safe_load(find(objects, "ConfigMap", "envoy-gateway")["data"]["envoy.yaml"])
    service = ratelimit_filter(envoy)["rate_limit_service"]
    assert service["transport_api_version"] == "V3"
    name = service["grpc_service"]["envoy_grpc"]["cluster_name"]
    (cluster,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == name]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": SOCKET_PATH}}
    options = cluster["typed_extension_protocol_options"]
    assert "http2_protocol_options" in str(options)
    gateway = find(objects, "Deployment", "gateway")
    injected = containers(patch.inject(gateway, settings.Settings()))
    assert {"name": "ratelimit-sidecar-socket", "mountPath": SOCKET_DIR, "readOnly": True} in (
        injected["envoy"]["volumeMounts"]
    )
    args = parse_args(injected[CONTAINER_NAME]["args"], environ={})
    assert args.grpc_address == f"unix:{SOCKET_PATH}"
    envoy_ports = {p["containerPort"] for p in containers(gateway)["envoy"]["ports"]}
    listeners = {
        listener["address"]["socket_address"]["port_value"]
        for listener in envoy["static_resources"]["listeners"]
        if listener["address"]["socket_address"]["address"] == "0.0.0.0"
    }
    assert listeners == envoy_ports
    http_port = int(args.http_address.rpartition(":")[2])
    assert http_port not in envoy_ports | listeners


def test_the_sidecar_outlives_envoy_when_the_pod_stops() -> None:
    """Envoy's preStop is shorter than the sidecar's; the grace period covers the sidecar."""
    gateway = find(build(K8S / "base"), "Deployment", "gateway")
    envoy = containers(gateway)["envoy"]
    envoy_sleep = int(envoy["lifecycle"]["preStop"]["exec"]["command"][-1])
    defaults = settings.Settings()
    assert envoy_sleep < defaults.pre_stop_seconds
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= (
        defaults.grace_seconds
    )


def test_the_overlay_uses_an_external_redis_cluster_and_no_development_redis() -> None:
    """overlays/redis-cluster points the sidecars at a Redis Cluster and drops the dev Redis."""
    objects = build(K8S / "overlays/redis-cluster")
    gateway = find(objects, "Deployment", "gateway")
    backend = gateway["spec"]["template"]["metadata"]["annotations"][names.BACKEND]
    assert backend.startswith("redis+cluster://")
    assert len(backend.removeprefix("redis+cluster://").split(",")) >= 3
    validate_url(backend)
    assert not [o for o in objects if o["metadata"]["name"] == "redis"]
    (injected,) = yaml.safe_load_all(inject_yaml(yaml.safe_dump(gateway), settings.Settings()))
    args = containers(injected)[CONTAINER_NAME]["args"]
    assert args[args.index("--backend") + 1] == backend


def test_every_container_runs_as_non_root_with_a_read_only_root() -> None:
    """Every container the manifests (and the injector) run is locked down the same way."""
    for name in KUSTOMIZATIONS:
        for obj in build(K8S / name):
            if obj["kind"] not in patch.WORKLOAD_KINDS:
                continue
            pod = patch.inject(obj, settings.Settings())["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                security = container["securityContext"]
                label = f"{name}: {obj['metadata']['name']}/{container['name']}"
                assert security["readOnlyRootFilesystem"] is True, label
                assert security["allowPrivilegeEscalation"] is False, label
                assert security["capabilities"] == {"drop": ["ALL"]}, label
                assert container.get("securityContext", {}).get("runAsNonRoot", True), label
                assert pod["securityContext"]["runAsNonRoot"] is True, label
                assert "limits" in container["resources"], label
                assert "requests" in container["resources"], label


def test_the_dockerfile_builds_the_image_the_manifests_use() -> None:
    """The Dockerfile: slim Python, a build stage that compiles the hot path and checks it runs
    compiled, a final stage with no compilers, user 65532."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)[1:]
    assert len(stages) >= 2, "a build stage and a final stage"
    built = stages[0]
    assert "RATELIMIT_SIDECAR_COMPILE=1" in built and "--no-build-isolation" in built
    assert "COPY pyproject.toml setup.py" in built
    assert "build.name() == 'compiled'" in built
    final = stages[-1]
    assert re.match(r"python:\$\{PYTHON_VERSION\}-slim\n", final)
    assert re.search(r"^ARG PYTHON_VERSION=3\.1[1-9]$", dockerfile, re.MULTILINE)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|apt-get install)\b", final)
    uid = settings.SIDECAR_UID
    assert re.search(rf"^USER {uid}(:{uid})?$", final, re.MULTILINE)
    # The image's entrypoint (tests/test_image.py); the manifests name their command.
    assert re.search(r'^ENTRYPOINT \["ratelimit-sidecar-image"\]', final, re.MULTILINE)
    assert (ROOT / ".dockerignore").read_text().count(".venv")
    images = {
        c["image"]
        for obj in build(K8S / "base")
        if obj["metadata"]["name"] == "ratelimit-sidecar-webhook" and obj["kind"] == "Deployment"
        for c in obj["spec"]["template"]["spec"]["containers"]
    }
    assert images == {settings.DEFAULT_IMAGE}


def ratelimit_filter(envoy: dict[str, Any]) -> dict[str, Any]:
    for listener in envoy["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for http_filter in network_filter["typed_config"].get("http_filters", []):
                    if http_filter["name"] == "envoy.filters.http.ratelimit":
                        typed: dict[str, Any] = http_filter["typed_config"]
                        return typed
    raise AssertionError("no envoy.filters.http.ratelimit filter in the Envoy config")


# --- the webhook's certificate, the order of a first install, the image named once -----------


def webhook_args(objects: list[dict[str, Any]]) -> argparse.Namespace:
    deployment = find(objects, "Deployment", "ratelimit-sidecar-webhook")
    parser = argparse.ArgumentParser(prog="ratelimit-sidecar")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(containers(deployment)["webhook"]["args"])


def rules_of(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rules of every `kind` (Role, ClusterRole) bound to the webhook's service account."""
    bound = set()
    for binding in objects:
        if (
            binding["kind"] == f"{kind}Binding"
            and {
                "kind": "ServiceAccount",
                "name": "ratelimit-sidecar-webhook",
                "namespace": "ratelimit-sidecar",
            }
            in binding["subjects"]
        ):
            assert binding["roleRef"]["kind"] == kind
            bound.add(binding["roleRef"]["name"])
    return [rule for o in objects if o["kind"] == kind and o["metadata"]["name"] in bound
            for rule in o["rules"]]  # fmt: skip


@pytest.mark.parametrize("name", ["base", "overlays/redis-cluster"])
def test_without_cert_manager_the_webhook_keeps_its_own_certificate(name: str) -> None:
    """The base and the Redis Cluster overlay run the webhook with --certificate-secret: it
    writes the certificate in a memory emptyDir where --tls-cert says, keeps it in the Secret
    the other setups mount, and patches the caBundle of the configuration the manifests ship,
    for the Service the configuration calls; RBAC grants exactly that, by name."""
    objects = build(K8S / name)
    args = webhook_args(objects)
    deployment = find(objects, "Deployment", "ratelimit-sidecar-webhook")
    spec = deployment["spec"]["template"]["spec"]
    (volume,) = spec["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    (mount,) = containers(deployment)["webhook"]["volumeMounts"]
    assert mount["readOnly"] is False
    assert Path(args.tls_cert).parent == Path(mount["mountPath"])
    assert args.certificate_secret == "ratelimit-sidecar-webhook-tls"
    configuration = find(objects, "MutatingWebhookConfiguration", "ratelimit-sidecar")
    assert [str(t) for t in args.ca_bundle_for] == ["mutating/ratelimit-sidecar"]
    service = find(objects, "Service", args.service)
    for hook in configuration["webhooks"]:
        assert hook["clientConfig"]["service"]["name"] == service["metadata"]["name"]
        assert "caBundle" not in hook["clientConfig"]  # the webhook's to fill
    assert rules_of(objects, "ClusterRole") == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations"],
            "resourceNames": ["ratelimit-sidecar"],
            "verbs": ["get", "patch"],
        }
    ]
    assert rules_of(objects, "Role") == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [args.certificate_secret],
            "verbs": ["get", "update"],
        },
        # RBAC cannot limit create to a name; the namespace holds only the webhook.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    ]
    for role in objects:
        if role["kind"] == "Role":
            assert role["metadata"]["namespace"] == "ratelimit-sidecar"


# The fields of cert-manager.io/v1 this overlay uses, each where cert-manager's CRDs have it
# (kubernetes-validate has no schema for custom resources).
CERTIFICATE_FIELDS = {
    "secretName", "dnsNames", "commonName", "isCA", "duration", "renewBefore", "privateKey",
    "usages", "issuerRef",
}  # fmt: skip
ISSUER_FIELDS = {"selfSigned", "ca"}
USAGES = {"server auth", "digital signature", "key encipherment", "client auth"}


def test_the_cert_manager_overlay_issues_the_secret_the_webhook_mounts() -> None:
    """overlays/cert-manager: a self-signed Issuer signs a CA, the CA Issuer signs a certificate
    for the webhook Service's .svc name into the Secret the Deployment mounts, and cainjector is
    told to fill the configuration's caBundle from that Certificate; the webhook keeps no
    certificate of its own there, and needs no ClusterRole."""
    objects = build(K8S / "overlays/cert-manager")
    certificates = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Issuer"}
    for obj in [*certificates.values(), *issuers.values()]:
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert obj["metadata"]["namespace"] == "ratelimit-sidecar"
    for cert in certificates.values():
        assert set(cert["spec"]) <= CERTIFICATE_FIELDS
        assert set(cert["spec"].get("usages", [])) <= USAGES
        assert cert["spec"]["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
    for issuer in issuers.values():
        assert len(issuer["spec"]) == 1 and set(issuer["spec"]) <= ISSUER_FIELDS

    deployment = find(objects, "Deployment", "ratelimit-sidecar-webhook")
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    serving = certificates["ratelimit-sidecar-webhook"]["spec"]
    assert serving["secretName"] == volume["secret"]["secretName"]
    service = find(objects, "Service", "ratelimit-sidecar-webhook")
    assert (
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
        in (serving["dnsNames"])
    )
    assert "server auth" in serving["usages"]
    assert serving.get("isCA", False) is False
    ca_issuer = issuers[serving["issuerRef"]["name"]]["spec"]
    assert serving["issuerRef"]["kind"] == "Issuer"
    (ca,) = [c["spec"] for c in certificates.values() if c["spec"]["secretName"] == ca_issuer["ca"]["secretName"]]  # fmt: skip
    assert ca["isCA"] is True
    assert issuers[ca["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}

    configuration = find(objects, "MutatingWebhookConfiguration", "ratelimit-sidecar")
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "ratelimit-sidecar/ratelimit-sidecar-webhook"
    }
    args = webhook_args(objects)
    assert args.certificate_secret is None and args.ca_bundle_for == []
    assert not rules_of(objects, "ClusterRole")
    # Installed in the order that lets it start: namespace, then the Certificate the pods wait
    # for, and the webhook configuration before any pod it is called for.
    ids = list(by_id(objects))
    assert ids.index("Namespace ratelimit-sidecar") < ids.index(
        "Certificate ratelimit-sidecar/ratelimit-sidecar-webhook"
    )


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("name", TOP_LEVEL)
def test_a_first_install_creates_the_webhook_configuration_before_the_pods_it_is_for(
    name: str, builder: str
) -> None:
    """One `kubectl apply -k` creates objects in the order built: every namespace before what
    goes in it, and the webhook configuration before every workload it would be called for (so
    their pods wait for the webhook instead of starting without the sidecar); the webhook's own
    namespace is never sent to it, so the webhook never waits for itself."""
    objects = objects_of(name, builder)
    ids = list(by_id(objects))
    configuration = ids.index("MutatingWebhookConfiguration ratelimit-sidecar")
    namespaces = {o["metadata"]["name"]: ids.index(_id) for _id, o in by_id(objects).items()
                  if o["kind"] == "Namespace"}  # fmt: skip
    for position, obj in enumerate(objects):
        namespace = obj["metadata"].get("namespace")
        if namespace:
            assert namespaces[namespace] < position, ids[position]
        if obj["kind"] in patch.WORKLOAD_KINDS and namespace != "ratelimit-sidecar":
            assert configuration < position, f"{ids[position]} comes before the configuration"
    hooks = find(objects, "MutatingWebhookConfiguration", "ratelimit-sidecar")["webhooks"]
    for hook in hooks:
        excluded = hook["namespaceSelector"]["matchExpressions"][-1]
        assert excluded["key"] == "kubernetes.io/metadata.name"
        assert "ratelimit-sidecar" in excluded["values"]


def test_the_manifests_name_the_image_once() -> None:
    """The image appears once in k8s/ (the webhook container's `image`), and nothing passes it
    as --image: the webhook injects its own pod's image."""
    image = settings.DEFAULT_IMAGE
    found = [
        (path.relative_to(K8S).as_posix(), line.strip())
        for path in sorted(K8S.rglob("*.yaml"))
        for line in path.read_text().splitlines()
        if image in line and not line.lstrip().startswith("#")
    ]
    assert found == [("base/webhook/deployment.yaml", f"image: {image}")]
    for name in TOP_LEVEL:
        assert webhook_args(build(K8S / name)).image is None


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("name", TOP_LEVEL)
def test_one_images_entry_changes_every_image(name: str, builder: str, tmp_path: Path) -> None:
    """A kustomization on top of any top-level one, with one `images:` entry, leaves the old
    image nowhere in what it builds: the webhook runs the new one, and so injects it."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes only relative paths to other kustomizations.
                "resources": [os.path.relpath(K8S / name, overlay)],
                "images": [
                    {
                        "name": "ratelimit-sidecar",
                        "newName": "registry.example.com:5000/team/ratelimit-sidecar",
                        "newTag": "1.2.3",
                    }
                ],
            }
        )
    )
    objects = kubectl_build(overlay) if builder == "kubectl" else build(overlay)
    text = yaml.safe_dump_all(objects)
    assert settings.DEFAULT_IMAGE not in text
    deployment = find(objects, "Deployment", "ratelimit-sidecar-webhook")
    assert containers(deployment)["webhook"]["image"] == (
        "registry.example.com:5000/team/ratelimit-sidecar:1.2.3"
    )
