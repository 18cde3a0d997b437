"""Injection without Kubernetes: annotations to the sidecar (native or ordinary), JSON Patch,
the pod-level guarantees (start and stop order, ports, idempotence), manifests,
`ratelimit-sidecar inject -f`, and the backend URL check that refuses what the sidecar would."""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kube import NATIVE_VERSIONS, VERSIONS, assert_valid

from sidecar import __version__
from sidecar.cli import parse_args
from sidecar.errors import InjectionError
from sidecar.injector import patch as injector
from sidecar.injector.commands import register
from sidecar.injector.container import SOCKET_PATH
from sidecar.injector.manifests import inject_yaml
from sidecar.injector.patch import Sidecar, Skipped, inject, patch, plan
from sidecar.injector.settings import Settings
from sidecar.injector.urls import validate_url
from sidecar.storage.backends import open_backend

SETTINGS = Settings()
ORDINARY = Settings(native_sidecars=False)
ANNOTATIONS = {
    "ratelimit-sidecar/inject": "true",
    "ratelimit-sidecar/backend": "redis://redis.gateway:6379/2",
    "ratelimit-sidecar/rules-configmap": "gateway-rules",
    "ratelimit-sidecar/failure-mode": "deny",
}


def pod_template(
    annotations: dict[str, str] | None = None, ports: tuple[int, ...] = (10000,)
) -> dict[str, Any]:
    return {
        "metadata": {
            "labels": {"app": "gateway"},
            "annotations": dict(ANNOTATIONS if annotations is None else annotations),
        },
        "spec": {
            "containers": [
                {
                    "name": "envoy",
                    "image": "envoyproxy/envoy:v1.32-latest",
                    "ports": [{"name": f"http-{port}", "containerPort": port} for port in ports],
                }
            ]
        },
    }


def manifest(
    kind: str, annotations: dict[str, str] | None = None, ports: tuple[int, ...] = (10000,)
) -> dict[str, Any]:
    """A minimal valid Pod, Deployment, StatefulSet or DaemonSet named gateway."""
    template = pod_template(annotations, ports)
    if kind == "Pod":
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "gateway", **template["metadata"]},
            "spec": template["spec"],
        }
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "gateway"}}, "template": template}
    if kind == "StatefulSet":
        spec["serviceName"] = "gateway"
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "gateway"}, "spec": spec}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
    return spec


def pod_annotations(obj: dict[str, Any]) -> dict[str, str]:
    meta = obj["metadata"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]
    found: dict[str, str] = meta["annotations"]
    return found


def sidecar_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The sidecar container, wherever it is (an init container or a container)."""
    spec = pod_spec(obj)
    every = spec.get("initContainers", []) + spec["containers"]
    (container,) = [c for c in every if c["name"] == "ratelimit-sidecar"]
    return container


def failure(obj: dict[str, Any], settings: Settings = SETTINGS) -> str:
    with pytest.raises(InjectionError) as caught:
        patch(obj, settings)
    return str(caught.value)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- the order Kubernetes gives the pod's containers -----------------------------------------
# The kubelet's rules for a pod spec (KEP-753, Kubernetes 1.29): init containers start one by
# one in their order; an ordinary init container must exit before the next starts, a
# restartable one (restartPolicy Always) must pass its startupProbe (or, with none, have
# started); the containers start together after the last; on termination the containers stop
# together, then the restartable init containers one by one in reverse order.


def start_phases(spec: dict[str, Any]) -> list[set[str]]:
    """The names started in each phase; a phase starts only once the one before is done."""
    phases = [{c["name"]} for c in spec.get("initContainers", [])]
    return [*phases, {c["name"] for c in spec["containers"]}]


def stop_phases(spec: dict[str, Any]) -> list[set[str]]:
    """The names told to stop in each phase; a phase is told only once the one before exited."""
    sidecars = [c["name"] for c in spec.get("initContainers", []) if c.get("restartPolicy")]
    return [{c["name"] for c in spec["containers"]}, *({name} for name in reversed(sidecars))]


def phase_of(phases: list[set[str]], name: str) -> int:
    (index,) = [i for i, names in enumerate(phases) if name in names]
    return index


# --- the sidecar -----------------------------------------------------------------------------


def test_the_sidecar_runs_serve_on_the_pods_socket_with_the_annotated_settings() -> None:
    """Annotations become `serve` flags; gRPC on the Unix socket in the shared emptyDir, which
    any container of the pod may connect to; the rules ConfigMap is mounted read-only."""
    injected = inject(manifest("Pod"), SETTINGS)
    container = sidecar_of(injected)
    assert container["image"] == injector_image()
    assert container["command"] == ["ratelimit-sidecar"]
    assert container["args"] == [
        "serve",
        "--config", "/etc/ratelimit-sidecar/rules",
        "--backend", "redis://redis.gateway:6379/2",
        "--failure-mode", "deny",
        "--grpc-address", "unix:/var/run/ratelimit-sidecar/rls.sock",
        "--grpc-socket-mode", "666",
        "--http-address", "0.0.0.0:8080",
        "--log-format", "json",
    ]  # fmt: skip
    args = parse_args(container["args"], environ={})
    assert args.grpc_address == f"unix:{SOCKET_PATH}"
    assert args.grpc_socket_mode == 0o666
    assert container["volumeMounts"] == [
        {
            "name": "ratelimit-sidecar-rules",
            "mountPath": "/etc/ratelimit-sidecar/rules",
            "readOnly": True,
        },
        {"name": "ratelimit-sidecar-socket", "mountPath": "/var/run/ratelimit-sidecar"},
    ]
    assert pod_spec(injected)["volumes"] == [
        {"name": "ratelimit-sidecar-rules", "configMap": {"name": "gateway-rules"}},
        {"name": "ratelimit-sidecar-socket", "emptyDir": {"sizeLimit": "1Mi"}},
    ]
    (envoy,) = pod_spec(injected)["containers"]
    assert envoy["volumeMounts"] == [
        {
            "name": "ratelimit-sidecar-socket",
            "mountPath": "/var/run/ratelimit-sidecar",
            "readOnly": True,
        }
    ]


def injector_image() -> str:
    return SETTINGS.image


def test_a_native_sidecar_is_the_last_init_container_restarted_always_with_a_startup_probe() -> (
    None
):
    """Native: restartPolicy Always, a startupProbe on /healthcheck, no preStop sleep (it stops
    after the pod's containers anyway); the pod's own init containers keep their place."""
    obj = manifest("Pod")
    pod_spec(obj)["initContainers"] = [{"name": "migrate", "image": "busybox"}]
    injected = inject(obj, SETTINGS)
    spec = pod_spec(injected)
    assert [c["name"] for c in spec["initContainers"]] == ["migrate", "ratelimit-sidecar"]
    assert [c["name"] for c in spec["containers"]] == ["envoy"]
    sidecar = spec["initContainers"][-1]
    assert sidecar["restartPolicy"] == "Always"
    startup = sidecar["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthcheck", "port": 8080}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    assert "lifecycle" not in sidecar
    assert_valid(injected, NATIVE_VERSIONS)


def test_an_ordinary_sidecar_is_the_last_container_and_sleeps_before_stopping() -> None:
    """Ordinary (for clusters before 1.29): a container beside Envoy, no restartPolicy and no
    startupProbe (neither means anything there), a preStop sleep so Envoy stops first."""
    injected = inject(manifest("Pod"), ORDINARY)
    spec = pod_spec(injected)
    assert "initContainers" not in spec
    assert [c["name"] for c in spec["containers"]] == ["envoy", "ratelimit-sidecar"]
    sidecar = spec["containers"][-1]
    assert "restartPolicy" not in sidecar and "startupProbe" not in sidecar
    assert sidecar["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    assert_valid(injected, VERSIONS)


@pytest.mark.parametrize("kind", injector.KINDS)
def test_the_native_sidecar_starts_before_every_container_and_stops_after_them(
    kind: str,
) -> None:
    """By the kubelet's rules applied to the injected pod spec: the sidecar's start (its
    startupProbe passing) comes before any container starts, and it is told to stop only once
    every container has exited, whatever other init containers the pod has."""
    obj = manifest(kind)
    pod_spec(obj)["containers"].append({"name": "app", "image": "app:1"})
    pod_spec(obj)["initContainers"] = [{"name": "migrate", "image": "busybox"}]
    spec = pod_spec(inject(obj, SETTINGS))
    sidecar = sidecar_of(inject(obj, SETTINGS))
    assert "startupProbe" in sidecar, "without one, 'started' is only 'the process exists'"
    start, stop = start_phases(spec), stop_phases(spec)
    for name in ("envoy", "app"):
        assert phase_of(start, "ratelimit-sidecar") < phase_of(start, name)
        assert phase_of(stop, "ratelimit-sidecar") > phase_of(stop, name)
    assert phase_of(start, "migrate") < phase_of(start, "ratelimit-sidecar")


def test_the_ordinary_sidecar_has_no_start_order_and_outlives_envoy_only_by_its_sleep() -> None:
    """By the same rules, an ordinary sidecar starts and is told to stop together with Envoy:
    its preStop sleep, within the grace period, is what keeps it answering Envoy's drain."""
    spec = pod_spec(inject(manifest("Pod"), ORDINARY))
    start, stop = start_phases(spec), stop_phases(spec)
    assert phase_of(start, "ratelimit-sidecar") == phase_of(start, "envoy")
    assert phase_of(stop, "ratelimit-sidecar") == phase_of(stop, "envoy")
    sidecar = spec["containers"][-1]
    assert int(sidecar["lifecycle"]["preStop"]["exec"]["command"][-1]) == ORDINARY.pre_stop_seconds


def test_the_sidecar_is_probed_limited_and_locked_down() -> None:
    """Probes on /healthcheck, requests and limits, a restrictive securityContext."""
    for settings_ in (SETTINGS, ORDINARY):
        container = sidecar_of(inject(manifest("Pod"), settings_))
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthcheck", "port": 8080}
        liveness = container["livenessProbe"]
        assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 60, (
            "a backend outage must not restart the sidecar at once"
        )
        assert container["resources"] == {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "256Mi"},
        }
        assert container["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }


def test_without_backend_or_failure_mode_annotations_the_sidecar_keeps_its_defaults() -> None:
    """No --backend and no --failure-mode flags unless annotated (or a default backend is set)."""
    annotations = {k: v for k, v in ANNOTATIONS.items() if not k.endswith(("backend", "mode"))}
    args = sidecar_of(inject(manifest("Pod", annotations), SETTINGS))["args"]
    assert "--backend" not in args and "--failure-mode" not in args
    settings_ = Settings(default_backend="redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    args = sidecar_of(inject(manifest("Pod", annotations), settings_))["args"]
    assert flag(args, "--backend") == "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"


def test_image_resources_and_user_come_from_annotations_over_the_webhooks_flags() -> None:
    """ratelimit-sidecar/image, cpu-*, memory-*, run-as-* win over Settings; Settings win over
    the built-in defaults."""
    settings_ = Settings(
        image="registry.example/rls:2", cpu_request="50m", memory_limit="512Mi", run_as_user=1000
    )
    container = sidecar_of(inject(manifest("Pod"), settings_))
    assert container["image"] == "registry.example/rls:2"
    assert container["resources"]["requests"]["cpu"] == "50m"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert container["securityContext"]["runAsUser"] == 1000
    annotations = {
        **ANNOTATIONS,
        "ratelimit-sidecar/image": "mirror.internal/rls:2@sha256:" + "a" * 64,
        "ratelimit-sidecar/cpu-request": "250m",
        "ratelimit-sidecar/cpu-limit": "2",
        "ratelimit-sidecar/memory-request": "0.25Gi",
        "ratelimit-sidecar/memory-limit": "1Gi",
        "ratelimit-sidecar/run-as-user": "1000650000",
        "ratelimit-sidecar/run-as-group": "1000650000",
    }
    injected = inject(manifest("Pod", annotations), settings_)
    container = sidecar_of(injected)
    assert container["image"] == "mirror.internal/rls:2@sha256:" + "a" * 64
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "0.25Gi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    assert container["securityContext"]["runAsUser"] == 1000650000
    assert container["securityContext"]["runAsGroup"] == 1000650000
    assert_valid(injected)


@pytest.mark.parametrize(
    ("settings_", "annotation", "native"),
    [
        (SETTINGS, None, True),
        (ORDINARY, None, False),
        (SETTINGS, "false", False),
        (ORDINARY, "true", True),
        (ORDINARY, "TRUE", True),
    ],
)
def test_the_native_sidecar_annotation_overrides_the_webhooks_choice(
    settings_: Settings, annotation: str | None, native: bool
) -> None:
    """ratelimit-sidecar/native-sidecar decides per pod; without it, Settings.native_sidecars."""
    annotations = dict(ANNOTATIONS)
    if annotation is not None:
        annotations["ratelimit-sidecar/native-sidecar"] = annotation
    spec = pod_spec(inject(manifest("Deployment", annotations), settings_))
    where = "initContainers" if native else "containers"
    assert "ratelimit-sidecar" in [c["name"] for c in spec.get(where, [])]


# --- ports -----------------------------------------------------------------------------------


@pytest.mark.parametrize("settings_", [SETTINGS, ORDINARY], ids=["native", "ordinary"])
def test_an_envoy_on_8080_and_8081_gets_the_sidecar_with_nothing_but_the_inject_annotation(
    settings_: Settings,
) -> None:
    """gRPC on the socket takes no port; HTTP moves to the first free port, 8082, and the
    probes, the container port, the Prometheus annotations and the status follow it."""
    annotations = {
        "ratelimit-sidecar/inject": "true",
        "ratelimit-sidecar/rules-configmap": "gateway-rules",
    }
    injected = inject(manifest("Deployment", annotations, ports=(8080, 8081)), settings_)
    assert_valid(injected)
    container = sidecar_of(injected)
    assert flag(container["args"], "--http-address") == "0.0.0.0:8082"
    assert flag(container["args"], "--grpc-address") == f"unix:{SOCKET_PATH}"
    assert container["ports"] == [{"name": "rls-http", "containerPort": 8082, "protocol": "TCP"}]
    probes = ["readinessProbe", "livenessProbe"] + (
        ["startupProbe"] if settings_.native_sidecars else []
    )
    for probe in probes:
        assert container[probe]["httpGet"]["port"] == 8082
    annotations_ = pod_annotations(injected)
    assert annotations_["prometheus.io/port"] == "8082"
    assert annotations_["prometheus.io/scrape"] == "true"
    assert annotations_["prometheus.io/path"] == "/metrics"
    assert json.loads(annotations_["ratelimit-sidecar/status"])["httpPort"] == 8082


def test_probe_ports_and_init_container_ports_count_as_taken() -> None:
    """A port only probed (Envoy's admin on 8080) or declared by an init container is not free."""
    obj = manifest("Pod")
    envoy = pod_spec(obj)["containers"][0]
    envoy["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8080}}
    pod_spec(obj)["initContainers"] = [
        {"name": "warm", "image": "busybox", "ports": [{"containerPort": 8081}]}
    ]
    assert flag(sidecar_of(inject(obj, SETTINGS))["args"], "--http-address") == "0.0.0.0:8082"


def test_an_http_port_annotation_that_is_taken_is_refused_with_a_free_port_to_use() -> None:
    """An explicit ratelimit-sidecar/http-port is never moved: a taken one is an error that
    names the container, and the fix."""
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/http-port": "8080"}
    assert failure(manifest("Pod", annotations, ports=(8080, 8081))) == (
        "container 'envoy' already uses port 8080, which ratelimit-sidecar/http-port asks for; "
        "set it to a free port such as 8082, or remove it to have one chosen"
    )
    annotations["ratelimit-sidecar/http-port"] = "9080"
    container = sidecar_of(inject(manifest("Pod", annotations, ports=(8080, 8081)), SETTINGS))
    assert flag(container["args"], "--http-address") == "0.0.0.0:9080"


def test_a_grpc_port_annotation_serves_grpc_on_loopback_instead_of_the_socket() -> None:
    """ratelimit-sidecar/grpc-port (for an Envoy that reaches the sidecar over TCP): gRPC on
    127.0.0.1 at that port, no socket volume, no mount in Envoy; the HTTP port avoids it."""
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/grpc-port": "8080"}
    injected = inject(manifest("Pod", annotations), SETTINGS)
    container = sidecar_of(injected)
    assert flag(container["args"], "--grpc-address") == "127.0.0.1:8080"
    assert "--grpc-socket-mode" not in container["args"]
    assert flag(container["args"], "--http-address") == "0.0.0.0:8081"
    assert [v["name"] for v in pod_spec(injected)["volumes"]] == ["ratelimit-sidecar-rules"]
    assert "volumeMounts" not in pod_spec(injected)["containers"][0]
    taken = {**ANNOTATIONS, "ratelimit-sidecar/grpc-port": "10000"}
    assert failure(manifest("Pod", taken)) == (
        "container 'envoy' already uses port 10000, which ratelimit-sidecar/grpc-port asks for; "
        "set it to a free port such as 8080"
    )


def test_a_pod_with_its_own_prometheus_annotations_keeps_them() -> None:
    """The scrape annotations are added only to a pod that has none: Envoy's own stay."""
    annotations = {**ANNOTATIONS, "prometheus.io/port": "9901"}
    found = pod_annotations(inject(manifest("Pod", annotations), SETTINGS))
    assert found["prometheus.io/port"] == "9901"
    assert "prometheus.io/scrape" not in found


def test_the_status_annotation_says_what_was_injected_and_by_which_version() -> None:
    """ratelimit-sidecar/status: version, native or container, the container, image, volumes,
    where gRPC and HTTP are."""
    for settings_, form in ((SETTINGS, "native"), (ORDINARY, "container")):
        status = json.loads(
            pod_annotations(inject(manifest("Pod"), settings_))["ratelimit-sidecar/status"]
        )
        assert status == {
            "version": __version__,
            "sidecar": form,
            "container": "ratelimit-sidecar",
            "image": settings_.image,
            "volumes": ["ratelimit-sidecar-rules", "ratelimit-sidecar-socket"],
            "grpc": f"unix:{SOCKET_PATH}",
            "httpPort": 8080,
        }


def test_a_grace_period_too_short_to_drain_is_raised_and_a_long_one_kept() -> None:
    """terminationGracePeriodSeconds under preStop + drain becomes 15; 30 stays 30."""
    short = manifest("Pod")
    pod_spec(short)["terminationGracePeriodSeconds"] = 2
    assert pod_spec(inject(short, SETTINGS))["terminationGracePeriodSeconds"] == 15
    enough = manifest("Pod")
    pod_spec(enough)["terminationGracePeriodSeconds"] = 30
    assert pod_spec(inject(enough, SETTINGS))["terminationGracePeriodSeconds"] == 30


# --- which pods ------------------------------------------------------------------------------


def test_host_network_pods_are_not_injected() -> None:
    """A pod on the node's network would put the sidecar's HTTP port on the node."""
    obj = manifest("DaemonSet")
    pod_spec(obj)["hostNetwork"] = True
    decided = plan(obj, SETTINGS)
    assert isinstance(decided, Skipped) and "host's network" in decided.reason
    assert inject(obj, SETTINGS) is obj


@pytest.mark.parametrize("namespace", ["kube-system", "kube-public"])
def test_pods_in_kube_system_and_kube_public_are_not_injected(namespace: str) -> None:
    """Whatever their annotations say, from the object's namespace or the webhook's request."""
    obj = manifest("Deployment")
    assert isinstance(plan(obj, SETTINGS, namespace=namespace), Skipped)
    obj["metadata"]["namespace"] = namespace
    assert inject(obj, SETTINGS) is obj


@pytest.mark.parametrize(
    ("namespace_enabled", "annotation", "injected"),
    [
        (True, None, True),
        (True, "false", False),
        (False, None, False),
        (False, "true", True),
        (True, "true", True),
        (False, "false", False),
    ],
)
def test_the_pod_annotation_overrides_the_namespace_label_both_ways(
    namespace_enabled: bool, annotation: str | None, injected: bool
) -> None:
    """A labelled namespace injects pods without the annotation, not those annotated "false";
    elsewhere only pods annotated "true" are injected."""
    annotations = {k: v for k, v in ANNOTATIONS.items() if k != "ratelimit-sidecar/inject"}
    if annotation is not None:
        annotations["ratelimit-sidecar/inject"] = annotation
    decided = plan(manifest("Pod", annotations), SETTINGS, namespace_enabled=namespace_enabled)
    assert isinstance(decided, Sidecar) is injected


# --- JSON Patch and idempotence --------------------------------------------------------------


@pytest.mark.parametrize("kind", injector.KINDS)
@pytest.mark.parametrize("settings_", [SETTINGS, ORDINARY], ids=["native", "ordinary"])
def test_the_patch_applied_by_a_json_patch_library_is_the_injected_manifest(
    kind: str, settings_: Settings
) -> None:
    """patch() and inject() agree, for each kind and form, with and without existing volumes,
    init containers, mounts and annotations."""
    for existing in (False, True):
        obj = manifest(kind)
        if existing:
            pod_spec(obj)["volumes"] = [{"name": "cache", "emptyDir": {}}]
            pod_spec(obj)["initContainers"] = [{"name": "warm", "image": "busybox"}]
            pod_spec(obj)["containers"][0]["volumeMounts"] = [{"name": "cache", "mountPath": "/c"}]
        else:
            template = obj if kind == "Pod" else obj["spec"]["template"]
            del template["metadata"]["labels"]
        ops = patch(obj, settings_)
        assert jsonpatch.apply_patch(obj, ops) == inject(obj, settings_)
        assert_valid(inject(obj, settings_))


def test_a_pod_with_no_annotations_in_a_labelled_namespace_gets_them_added() -> None:
    """With no annotations at all (and no metadata), a pod in a labelled namespace gets the
    sidecar with the default rules ConfigMap, and the status and scrape annotations as a map."""
    for without_metadata in (False, True):
        obj = manifest("Deployment", {})
        template = obj["spec"]["template"]
        if without_metadata:  # the selector needs the labels; a bare Pod does not
            obj = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"]}
            obj["metadata"] = {"name": "gateway"}
        else:
            del template["metadata"]["annotations"]
        ops = patch(obj, SETTINGS, namespace_enabled=True)
        result = jsonpatch.apply_patch(obj, ops)
        assert result == inject_enabled(obj)
        template = result if without_metadata else result["spec"]["template"]
        assert set(template["metadata"]["annotations"]) == {
            "ratelimit-sidecar/status",
            "prometheus.io/scrape",
            "prometheus.io/port",
            "prometheus.io/path",
        }
        volumes = template["spec"]["volumes"]
        assert volumes[0] == {
            "name": "ratelimit-sidecar-rules",
            "configMap": {"name": "ratelimit-rules"},
        }
        assert_valid(result)


def inject_enabled(obj: dict[str, Any]) -> Any:
    return injector.apply(obj, patch(obj, SETTINGS, namespace_enabled=True))


@pytest.mark.parametrize("kind", injector.KINDS)
def test_injecting_twice_is_injecting_once(kind: str) -> None:
    """A pod that already has the sidecar gets no patch, whatever its annotations say now."""
    once = inject(manifest(kind), SETTINGS)
    assert patch(once, SETTINGS) == []
    assert inject(once, SETTINGS) == once
    changed = copy.deepcopy(once)
    pod_annotations(changed)["ratelimit-sidecar/backend"] = "not a url"
    assert patch(changed, SETTINGS) == []


@pytest.mark.parametrize(
    ("first", "second"),
    [(SETTINGS, ORDINARY), (ORDINARY, SETTINGS)],
    ids=["native-then-ordinary", "ordinary-then-native"],
)
def test_injecting_again_in_the_other_form_adds_nothing(first: Settings, second: Settings) -> None:
    """A pod injected as a native sidecar is not injected again as an ordinary container, nor
    the other way round (linkerd2#12395 looked in one list only and added a second proxy)."""
    once = inject(manifest("Pod"), first)
    assert patch(once, second) == []
    annotations = {
        **pod_annotations(once),
        "ratelimit-sidecar/native-sidecar": str(second.native_sidecars).lower(),
    }
    pod_annotations(once).update(annotations)
    assert patch(once, second) == []
    assert isinstance(plan(once, second), Skipped)


@pytest.mark.parametrize("annotations", [{}, {"ratelimit-sidecar/inject": "false"}, None])
def test_a_pod_that_does_not_ask_gets_nothing(annotations: dict[str, str] | None) -> None:
    """No inject annotation, or "false", or no annotations at all: no patch, object unchanged."""
    obj = manifest("Deployment", annotations or {})
    if annotations is None:
        del obj["spec"]["template"]["metadata"]["annotations"]
    assert patch(obj, SETTINGS) == []
    assert inject(obj, SETTINGS) is obj


# --- the schemas of the Kubernetes versions --------------------------------------------------


def test_a_native_sidecar_needs_the_1_29_schema_and_an_ordinary_one_fits_1_28() -> None:
    """The native pod validates strictly for 1.29 and the newest version; the ordinary one for
    1.28 and the newest. The native one is refused by 1.27's schema (no restartPolicy on a
    container then), which shows the strict check is real."""
    native = inject(manifest("Deployment"), SETTINGS)
    ordinary = inject(manifest("Deployment"), ORDINARY)
    assert_valid(native, NATIVE_VERSIONS)
    assert_valid(ordinary, VERSIONS)
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(native, "1.27", strict=True)
    assert "restartPolicy" in caught.value.message


# --- annotations the injector refuses --------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"ratelimit-sidecar/backend": "redis://cache:notaport"},
            "ratelimit-sidecar/backend: 'redis://cache:notaport': bad port in 'cache:notaport' "
            "(want a number from 1 to 65535)",
        ),
        (
            {"ratelimit-sidecar/backend": "http://redis:6379"},
            "ratelimit-sidecar/backend: unsupported backend URL 'http://redis:6379': use "
            "memory://, redis://host:port, rediss://host:port, "
            "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS) "
            "or redis+sentinel://host:port[,host:port...]/master-name (rediss+sentinel:// for TLS)",
        ),
        (
            {"ratelimit-sidecar/failure-mode": "open"},
            "ratelimit-sidecar/failure-mode: must be 'allow', 'deny' or 'local', not 'open'",
        ),
        (
            {"ratelimit-sidecar/rules-configmap": "Rules_Map"},
            "ratelimit-sidecar/rules-configmap: 'Rules_Map' is not a ConfigMap name (lower-case "
            "letters, digits, '-' and '.', at most 253 characters)",
        ),
        (
            {"ratelimit-sidecar/inject": "yes"},
            'ratelimit-sidecar/inject: must be "true" or "false", not \'yes\'',
        ),
        (
            {"ratelimit-sidecar/native-sidecar": "1"},
            'ratelimit-sidecar/native-sidecar: must be "true" or "false", not \'1\'',
        ),
        (
            {"ratelimit-sidecar/backnd": "redis://redis:6379"},
            "unknown annotation 'ratelimit-sidecar/backnd' (did you mean "
            "'ratelimit-sidecar/backend'?); known: ratelimit-sidecar/inject, "
            "ratelimit-sidecar/backend, ratelimit-sidecar/rules-configmap, "
            "ratelimit-sidecar/failure-mode, ratelimit-sidecar/grpc-port, "
            "ratelimit-sidecar/http-port, ratelimit-sidecar/native-sidecar, "
            "ratelimit-sidecar/image, ratelimit-sidecar/cpu-request, ratelimit-sidecar/cpu-limit, "
            "ratelimit-sidecar/memory-request, ratelimit-sidecar/memory-limit, "
            "ratelimit-sidecar/run-as-user, ratelimit-sidecar/run-as-group",
        ),
        (
            {"ratelimit-sidecar/grpc-port": "70000"},
            "ratelimit-sidecar/grpc-port: must be a port number from 1 to 65535, not '70000'",
        ),
        (
            {"ratelimit-sidecar/grpc-port": "9000", "ratelimit-sidecar/http-port": "9000"},
            "ratelimit-sidecar/grpc-port and ratelimit-sidecar/http-port: both are 9000; the "
            "sidecar needs two ports",
        ),
        (
            {"ratelimit-sidecar/cpu-request": "lots"},
            "ratelimit-sidecar/cpu-request: 'lots' is not a Kubernetes quantity (e.g. 100m, 1, "
            "128Mi)",
        ),
        (
            {"ratelimit-sidecar/memory-request": "1Gi"},
            "ratelimit-sidecar/{cpu,memory}-{request,limit}: memory request 1Gi is above its "
            "limit 256Mi (the API server would refuse the pod)",
        ),
        (
            {"ratelimit-sidecar/run-as-user": "0"},
            "ratelimit-sidecar/run-as-user must be a non-root id from 1 to 2147483647, not 0",
        ),
        (
            {"ratelimit-sidecar/run-as-group": "root"},
            "ratelimit-sidecar/run-as-group: must be a numeric id, not 'root'",
        ),
        (
            {"ratelimit-sidecar/image": "rls:1 --privileged"},
            "ratelimit-sidecar/image: 'rls:1 --privileged' is not an image reference",
        ),
    ],
)
def test_a_bad_annotation_is_refused_with_a_message_naming_it(
    changes: dict[str, str | None], message: str
) -> None:
    """Each bad annotation raises InjectionError with the annotation and the fix."""
    annotations = {**ANNOTATIONS, **changes}
    clean = {key: value for key, value in annotations.items() if value is not None}
    assert failure(manifest("Pod", clean)) == message


def test_a_password_in_a_refused_backend_url_is_not_shown() -> None:
    """The message hides the password: admission messages end up in events and logs."""
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/backend": "redis://app:s3cret@redis/zero"}
    message = failure(manifest("Pod", annotations))
    assert "s3cret" not in message
    assert "redis://app:***@redis/zero" in message


def test_a_sentinel_password_in_a_refused_backend_url_is_not_shown() -> None:
    """A Sentinel URL's two passwords (the master's userinfo, `sentinel_password`) are hidden."""
    url = "redis+sentinel://:m4ster@s1/mymaster/db?sentinel_password=s3ntinel&x=1"
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/backend": url}
    message = failure(manifest("Pod", annotations))
    assert "m4ster" not in message and "s3ntinel" not in message
    assert "redis+sentinel://:***@s1/mymaster/db?sentinel_password=***&x=1" in message


def test_a_huge_annotation_gets_a_short_message() -> None:
    """A 200 KiB value is refused with a message that quotes only its start."""
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/failure-mode": "x" * 200_000}
    message = failure(manifest("Pod", annotations))
    assert message.endswith("... (200000 characters)")
    assert len(message) < 200


@pytest.mark.parametrize("name", ["ratelimit-sidecar-rules", "ratelimit-sidecar-socket"])
def test_the_sidecars_volume_names_must_be_free(name: str) -> None:
    """A pod that already has a volume of one of the sidecar's names is refused."""
    obj = manifest("Pod")
    pod_spec(obj)["volumes"] = [{"name": name, "emptyDir": {}}]
    assert failure(obj) == f"the pod already has a volume named '{name}', which the sidecar needs"


def test_a_container_that_mounts_the_socket_directory_already_is_refused() -> None:
    """Two mounts at one path cannot be: the fix is gRPC on a port."""
    obj = manifest("Pod")
    pod_spec(obj)["containers"][0]["volumeMounts"] = [
        {"name": "run", "mountPath": "/var/run/ratelimit-sidecar"}
    ]
    assert failure(obj) == (
        "container 'envoy' already mounts /var/run/ratelimit-sidecar, where the sidecar's socket "
        "goes; set ratelimit-sidecar/grpc-port to serve gRPC on a port instead"
    )
    pod_annotations(obj)["ratelimit-sidecar/grpc-port"] = "9081"  # the fix it names works
    assert flag(sidecar_of(inject(obj, SETTINGS))["args"], "--grpc-address") == "127.0.0.1:9081"


def test_other_kinds_cannot_be_patched_but_pass_through_inject() -> None:
    """patch() refuses a Service; inject() returns it unchanged."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gateway"}}
    assert failure(service) == (
        "cannot inject into kind 'Service': only Pod, Deployment, StatefulSet and DaemonSet"
    )
    assert inject(service, SETTINGS) is service


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"cpu_request": "2", "cpu_limit": "1"},
            "default resources: cpu request 2 is above its limit 1",
        ),
        ({"memory_limit": "big"}, "default resources: memory: 'big' is not a Kubernetes quantity"),
        ({"run_as_user": 0}, "run-as-user must be a non-root id from 1 to 2147483647, not 0"),
        ({"image": ""}, "the sidecar image must be an image reference, not ''"),
    ],
)
def test_settings_refuse_defaults_that_would_make_every_pod_fail(
    flags: dict[str, Any], message: str
) -> None:
    """The webhook's flags are checked once, at start, as the annotations are per pod."""
    with pytest.raises(ValueError) as caught:
        Settings(**flags)
    assert str(caught.value).startswith(message)


# --- backend URLs ----------------------------------------------------------------------------

ACCEPTED = [
    "memory://",
    "memory://?max_counters=1000",
    "redis://127.0.0.1:6379",
    "redis://redis",
    "redis://user:p%40ss@redis.gateway.svc.cluster.local:6380/3",
    "redis://[::1]:6379/0",
    "rediss://redis:6380?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
    "redis+cluster://10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000",
    "redis+cluster://:secret@node-0.redis:6379/0",
    "rediss+cluster://10.0.0.1:7000,10.0.0.2:7000?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required",
    "redis+sentinel://10.0.0.1:26379,10.0.0.2/mymaster",
    "redis+sentinel://:pw@sentinel:26379/mymaster/2?sentinel_password=x&sentinel_username=u",
    "rediss+sentinel://sentinel/mymaster?ssl_ca_certs=/etc/ca.pem&sentinel_password=x",
]
REFUSED = [
    "",
    "redis",
    "http://redis:6379",
    "redis://",
    "redis://redis:0",
    "redis://redis:65536",
    "redis://redis:port",
    "redis://redis:6379/db",
    "redis://redis:6379?ssl_cert_reqs=none",
    "rediss://redis:6379?ssl_cert_reqs=maybe",
    "rediss://redis:6379?verify=1",
    "redis://redis:6379#frag",
    "redis://[::1:6379",
    "redis+cluster://",
    "redis+cluster://a:1,b:x",
    "redis+cluster://a:1/2",
    "redis+cluster://a:1?x=1",
    "redis+cluster://a:1?ssl_ca_certs=/etc/ca.pem",
    "rediss+cluster://a:1?verify=1",
    "rediss+cluster://a:1?ssl_cert_reqs=maybe",
    "rediss+cluster://a:1#frag",
    "redis+sentinel://sentinel:26379",
    "redis+sentinel://sentinel/",
    "redis+sentinel:///mymaster",
    "redis+sentinel://sentinel:0/mymaster",
    "redis+sentinel://sentinel/mymaster/db",
    "redis+sentinel://sentinel/mymaster?ssl_ca_certs=/etc/ca.pem",
    "rediss+sentinel://sentinel/mymaster?verify=1",
    "redis+sentinel://sentinel/mymaster#frag",
    "memory://somewhere",
    "memory://?max_counters=0",
    "memory://?x=1",
    "redis://re dis:6379",
    "redis://redis:6379\n",
    "redis://" + "a" * 3000,
]


@pytest.mark.parametrize("url", ACCEPTED)
async def test_backend_urls_the_sidecar_accepts_pass(url: str) -> None:
    """Every backend URL form the sidecar documents passes the check, and the sidecar opens it."""
    validate_url(url)
    backend = open_backend(url)
    await backend.close()


@pytest.mark.parametrize("url", REFUSED)
def test_backend_urls_the_sidecar_cannot_use_are_refused(url: str) -> None:
    """Unknown schemes, bad ports, databases, query parameters, whitespace, absurd lengths."""
    with pytest.raises(ValueError):
        validate_url(url)


URL_PARTS = st.tuples(
    st.sampled_from(
        [
            "memory",
            "redis",
            "rediss",
            "redis+cluster",
            "rediss+cluster",
            "redis+sentinel",
            "rediss+sentinel",
            "http",
            "",
            "REDIS",
        ]
    ),
    st.sampled_from(["", "user@", "user:pw@", ":pw@", "a:b:c@"]),
    st.lists(
        st.tuples(
            st.sampled_from(["redis", "10.0.0.1", "[::1]", "[::1", "", "a.b-c", "x y"]),
            st.sampled_from(["", ":6379", ":0", ":65536", ":-1", ":x", ":"]),
        ),
        max_size=3,
    ),
    st.sampled_from(["", "/", "/0", "/15", "/db", "//", "/m", "/m/2", "/m/x", "/m/1/2"]),
    st.sampled_from(
        ["", "?ssl_cert_reqs=none", "?ssl_cert_reqs=bad", "?x=1", "#f", "?sentinel_password=p"]
    ),
)


@settings(max_examples=300, deadline=None)
@given(URL_PARTS)
def test_any_url_the_check_passes_the_sidecar_can_open(parts: Any) -> None:
    """The admission check never passes a URL the sidecar's `open_backend` would refuse."""
    scheme, userinfo, hosts, path, tail = parts
    url = f"{scheme}://{userinfo}{','.join(h + p for h, p in hosts)}{path}{tail}"
    try:
        validate_url(url)
    except ValueError:
        return

    async def opens() -> None:
        backend = open_backend(url)
        await backend.close()

    asyncio.run(opens())


# --- manifests and `ratelimit-sidecar inject -f` ---------------------------------------------


def test_inject_yaml_injects_every_workload_and_passes_other_documents_through() -> None:
    """A file with a Service and all four kinds: each workload gets the sidecar, once."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gateway"}}
    documents = [service] + [manifest(kind) for kind in injector.KINDS]
    text = yaml.safe_dump_all(documents, sort_keys=False)
    injected = list(yaml.safe_load_all(inject_yaml(text, SETTINGS)))
    assert injected[0] == service
    for obj in injected[1:]:
        assert sidecar_of(obj)["name"] == "ratelimit-sidecar"
        assert_valid(obj)


def test_inject_yaml_twice_prints_what_once_prints() -> None:
    """The output of inject, injected again, is byte for byte the same."""
    text = "\n---\n".join(yaml.safe_dump(manifest(kind)) for kind in injector.KINDS)
    once = inject_yaml(text, SETTINGS)
    assert inject_yaml(once, SETTINGS) == once


def test_inject_yaml_writes_every_value_in_full() -> None:
    """No YAML anchors in the output, even for a document that shared a value through one."""
    text = yaml.safe_dump(manifest("Pod")) + (
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x, labels: &labels {a: b}}\n"
        "data: *labels\n"
    )
    output = inject_yaml(text, SETTINGS)
    assert "&" not in output
    pod, configmap = yaml.safe_load_all(output)
    assert sidecar_of(pod)["name"] == "ratelimit-sidecar"
    assert configmap["data"] == configmap["metadata"]["labels"] == {"a": "b"}


def test_inject_yaml_names_the_document_that_cannot_be_injected() -> None:
    """The error names the file, the document's position, kind and name, and the fault."""
    bad = manifest("StatefulSet", {**ANNOTATIONS, "ratelimit-sidecar/failure-mode": "open"})
    text = yaml.safe_dump(manifest("Pod")) + "---\n" + yaml.safe_dump(bad)
    with pytest.raises(InjectionError) as caught:
        inject_yaml(text, SETTINGS, source="gateway.yaml")
    assert str(caught.value) == (
        "gateway.yaml: document 2 (StatefulSet gateway): ratelimit-sidecar/failure-mode: "
        "must be 'allow', 'deny' or 'local', not 'open'"
    )


def run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """`ratelimit-sidecar ARGV` through `register`, as the CLI dispatches it."""
    parser = argparse.ArgumentParser(prog="ratelimit-sidecar")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdin", io.StringIO(stdin))
        mp.setattr("sys.stdout", out)
        mp.setattr("sys.stderr", err)
        status = args.func(args)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kind", injector.KINDS)
def test_inject_command_prints_each_kind_injected_and_is_idempotent(
    kind: str, tmp_path: Path
) -> None:
    """`inject -f FILE` prints the manifest with the sidecar; `inject -f -` on that prints it
    unchanged."""
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(manifest(kind)))
    status, once, err = run(["inject", "-f", str(path), "--image", "registry.example/rls:1.2"])
    assert (status, err) == (0, "")
    (obj,) = yaml.safe_load_all(once)
    assert sidecar_of(obj)["image"] == "registry.example/rls:1.2"
    status, twice, err = run(["inject", "-f", "-", "--image", "registry.example/rls:1.2"], once)
    assert (status, twice, err) == (0, once, "")


def test_inject_command_reports_bad_input_and_exits_1(tmp_path: Path) -> None:
    """A missing file, invalid YAML or a bad annotation: a one-line reason and status 1."""
    status, out, err = run(["inject", "-f", str(tmp_path / "missing.yaml")])
    assert (status, out) == (1, "")
    assert err.startswith(f"ratelimit-sidecar inject: {tmp_path / 'missing.yaml'}: ")
    status, out, err = run(["inject", "-f", "-"], "kind: Pod\n  bad: [indent\n")
    assert (status, out) == (1, "")
    assert err.startswith("ratelimit-sidecar inject: <stdin>: not valid YAML: ")
    bad = yaml.safe_dump(manifest("Pod", {**ANNOTATIONS, "ratelimit-sidecar/backend": "x://"}))
    status, out, err = run(["inject", "-f", "-"], bad)
    assert (status, out) == (1, "")
    assert err == (
        "ratelimit-sidecar inject: <stdin>: document 1 (Pod gateway): ratelimit-sidecar/backend: "
        "unsupported backend URL 'x://': use memory://, redis://host:port, rediss://host:port, "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS) "
        "or redis+sentinel://host:port[,host:port...]/master-name (rediss+sentinel:// for TLS)\n"
    )


def test_inject_command_refuses_a_bad_default_backend_with_status_2() -> None:
    """--default-backend is checked like an annotation, before anything is read."""
    status, out, err = run(["inject", "-f", "-", "--default-backend", "redis://:0"])
    assert (status, out) == (2, "")
    assert err == "ratelimit-sidecar inject: default backend: 'redis://:0': missing host in ':0'\n"


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ([], True),
        (["--kube-version", "1.28"], False),
        (["--kube-version", "v1.29.3"], True),
        (["--native-sidecars", "false"], False),
        (["--native-sidecars", "true", "--kube-version", "1.28"], True),
        (["--native-sidecars", "auto", "--kube-version", "1.31"], True),
    ],
)
def test_inject_command_chooses_native_or_ordinary_from_its_flags(
    flags: list[str], native: bool
) -> None:
    """--native-sidecars auto (the default) is native unless --kube-version is older than 1.29;
    true and false decide whatever the version."""
    text = yaml.safe_dump(manifest("Deployment"))
    status, out, err = run(["inject", "-f", "-", *flags], text)
    assert (status, err) == (0, "")
    (obj,) = yaml.safe_load_all(out)
    names = [c["name"] for c in pod_spec(obj).get("initContainers", [])]
    assert ("ratelimit-sidecar" in names) is native
    assert_valid(obj)


def test_inject_command_takes_the_defaults_of_resources_user_and_rules_configmap() -> None:
    """The same flags as the webhook: what a pod without the annotations gets."""
    annotations = {"ratelimit-sidecar/inject": "true"}
    text = yaml.safe_dump(manifest("Pod", annotations))
    argv = ["inject", "-f", "-", "--cpu-request", "200m", "--memory-limit", "1Gi"]
    argv += ["--run-as-user", "1001", "--default-rules-configmap", "edge-rules"]
    status, out, err = run(argv, text)
    assert (status, err) == (0, "")
    (obj,) = yaml.safe_load_all(out)
    container = sidecar_of(obj)
    assert container["resources"]["requests"]["cpu"] == "200m"
    assert container["resources"]["limits"]["memory"] == "1Gi"
    assert container["securityContext"]["runAsUser"] == 1001
    assert pod_spec(obj)["volumes"][0]["configMap"] == {"name": "edge-rules"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cpu-request", "2", "--cpu-limit", "1"], "default resources: cpu request 2 is above"),
        (["--default-rules-configmap", "Bad_Name"], "rules ConfigMap: 'Bad_Name' is not a"),
    ],
)
def test_inject_command_refuses_bad_defaults_with_status_2(flags: list[str], message: str) -> None:
    """`inject` refuses default resources or a default rules ConfigMap that would make a bad pod,
    with exit status 2 and the reason, before reading anything."""
    status, out, err = run(["inject", "-f", "-", *flags])
    assert (status, out) == (2, "")
    assert err.startswith(f"ratelimit-sidecar inject: {message}")


def test_a_kube_version_that_is_not_one_is_a_usage_error() -> None:
    """`inject --kube-version` that is not a Kubernetes version is a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as caught:
        run(["inject", "-f", "-", "--kube-version", "latest"])
    assert caught.value.code == 2
