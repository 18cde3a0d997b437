"""The sidecar a pod asks for, as RFC 6902 JSON Patch operations or as the injected manifest.

A pod (or the pod template of a Deployment, StatefulSet or DaemonSet) annotated
``ratelimit-sidecar/inject: "true"`` gets a ``ratelimit-sidecar`` container, configured from
its other ``ratelimit-sidecar/*`` annotations, and a read-only volume of its rules ConfigMap.
A pod that already has the container gets nothing, so injecting twice changes nothing.
Everything here is pure: annotations in, a container spec and patch operations out; an
annotation that cannot make a working sidecar raises InjectionError naming it and the fix.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.errors import InjectionError
from sidecar.injector.urls import validate_url

PREFIX = "ratelimit-sidecar/"
INJECT = PREFIX + "inject"
BACKEND = PREFIX + "backend"
RULES_CONFIGMAP = PREFIX + "rules-configmap"
FAILURE_MODE = PREFIX + "failure-mode"
GRPC_PORT = PREFIX + "grpc-port"
HTTP_PORT = PREFIX + "http-port"
ANNOTATIONS = (INJECT, BACKEND, RULES_CONFIGMAP, FAILURE_MODE, GRPC_PORT, HTTP_PORT)

CONTAINER_NAME = "ratelimit-sidecar"
VOLUME_NAME = "ratelimit-sidecar-rules"
PORT_NAME = "rls-http"
RULES_PATH = "/etc/ratelimit-sidecar/rules"
DEFAULT_IMAGE = "ratelimit-sidecar:0.1.0"
DEFAULT_GRPC_PORT = 8081
DEFAULT_HTTP_PORT = 8080
#: The image's user (see the Dockerfile); set on the container too, so `runAsNonRoot` holds
#: whatever user the pod asks for.
SIDECAR_UID = 65532
#: After its preStop sleep the sidecar gets SIGTERM; this is what it may need to finish the
#: calls in flight (each bounded by the backend deadline) and exit.
DRAIN_SECONDS = 5

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
KINDS = ("Pod", *WORKLOAD_KINDS)

# Python serves gRPC from one event loop: a second core buys little, so one core is the limit
# that never throttles it in practice, while memory is capped well above its working set.
RESOURCES: Mapping[str, Mapping[str, str]] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"cpu": "1", "memory": "256Mi"},
}

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SHOWN = 64  # characters of a bad value quoted back in a message


@dataclass(frozen=True, slots=True)
class Settings:
    """What the webhook (or `inject`) decides for every pod: no annotation overrides these.

    `default_backend` is used when a pod has no ``ratelimit-sidecar/backend`` annotation;
    None leaves the sidecar's own default (``memory://``, counters private to each pod).
    `pre_stop_seconds` keeps the sidecar serving after the pod starts terminating, so Envoy,
    which stops sending when it exits, is gone before the sidecar stops answering.
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    default_backend: str | None = None
    pre_stop_seconds: int = 10

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("the sidecar image must not be empty")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(
                f"image pull policy must be Always, IfNotPresent or Never, "
                f"not {self.image_pull_policy!r}"
            )
        if self.default_backend is not None:
            try:
                validate_url(self.default_backend)
            except ValueError as exc:
                raise ValueError(f"default backend: {exc}") from None
        if not 0 <= self.pre_stop_seconds <= 300:
            raise ValueError(f"pre-stop seconds must be 0 to 300, not {self.pre_stop_seconds}")

    @property
    def grace_seconds(self) -> int:
        """The least terminationGracePeriodSeconds that lets the sidecar drain."""
        return self.pre_stop_seconds + DRAIN_SECONDS


@dataclass(frozen=True, slots=True)
class Sidecar:
    """What one pod gets: the container, its rules volume and, if too short, a longer grace."""

    container: dict[str, Any]
    volume: dict[str, Any]
    grace_seconds: int | None


def patch(obj: Any, settings: Settings, kind: str | None = None) -> list[dict[str, Any]]:
    """The JSON Patch operations that inject the sidecar into a Pod or a workload's template.

    `kind` overrides the object's own (the webhook knows it from the request). Returns no
    operations for an object that does not ask for the sidecar or already has it.
    """
    pointer, meta, spec = _pod(obj, kind or _field(obj, "kind"))
    sidecar = plan(meta, spec, settings)
    if sidecar is None:
        return []
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": f"{pointer}/spec/containers/-", "value": sidecar.container}
    ]
    if isinstance(spec.get("volumes"), list):
        ops.append({"op": "add", "path": f"{pointer}/spec/volumes/-", "value": sidecar.volume})
    else:
        ops.append({"op": "add", "path": f"{pointer}/spec/volumes", "value": [sidecar.volume]})
    if sidecar.grace_seconds is not None:
        # "add" on an existing member replaces it (RFC 6902, 4.1).
        path = f"{pointer}/spec/terminationGracePeriodSeconds"
        ops.append({"op": "add", "path": path, "value": sidecar.grace_seconds})
    return ops


def inject(obj: Any, settings: Settings) -> Any:
    """A copy of a manifest object with the sidecar injected where it asks for it.

    Pods and workloads are injected; a ``List`` has its items injected; any other object
    (a Service, a ConfigMap) comes back unchanged, so whole files can be piped through.
    """
    kind = _field(obj, "kind")
    if kind == "List" and isinstance(obj.get("items"), list):
        result = dict(obj)
        result["items"] = [inject(item, settings) for item in obj["items"]]
        return result
    if kind not in KINDS:
        return obj
    ops = patch(obj, settings)
    return apply(obj, ops) if ops else obj


def plan(meta: Mapping[str, Any], spec: Mapping[str, Any], settings: Settings) -> Sidecar | None:
    """The sidecar for a pod with this metadata and spec, or None when it gets none."""
    annotations = _annotations(meta)
    if not wants_sidecar(annotations):
        return None
    containers = spec.get("containers")
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise InjectionError("the pod's spec.containers must be a list of containers")
    if any(c.get("name") == CONTAINER_NAME for c in containers):
        return None
    _check_names(annotations)

    backend = annotations.get(BACKEND, settings.default_backend)
    if backend is not None:
        try:
            validate_url(backend)
        except ValueError as exc:
            raise InjectionError(f"{BACKEND}: {exc}") from None
    configmap = _configmap(annotations.get(RULES_CONFIGMAP))
    failure_mode = annotations.get(FAILURE_MODE)
    if failure_mode is not None and failure_mode not in ("allow", "deny", "local"):
        shown = _show(failure_mode)
        raise InjectionError(f"{FAILURE_MODE}: must be 'allow', 'deny' or 'local', not {shown}")
    grpc_port = _port(annotations, GRPC_PORT, DEFAULT_GRPC_PORT)
    http_port = _port(annotations, HTTP_PORT, DEFAULT_HTTP_PORT)
    if grpc_port == http_port:
        raise InjectionError(
            f"{GRPC_PORT} and {HTTP_PORT}: both are {grpc_port}; the sidecar needs two ports"
        )
    _check_free(containers, spec.get("volumes"), grpc_port, http_port)

    args = ["serve", "--config", RULES_PATH]
    if backend is not None:
        args += ["--backend", backend]
    if failure_mode is not None:
        args += ["--failure-mode", failure_mode]
    # gRPC on loopback: only the Envoy beside it should call this sidecar. HTTP on every
    # address: the kubelet probes it on the pod's IP, and Prometheus scrapes /metrics there.
    args += ["--grpc-address", f"127.0.0.1:{grpc_port}", "--http-address", f"0.0.0.0:{http_port}"]
    args += ["--log-format", "json"]

    grace = spec.get("terminationGracePeriodSeconds")
    too_short = isinstance(grace, int) and grace < settings.grace_seconds
    return Sidecar(
        container=_container(settings, args, http_port),
        volume={"name": VOLUME_NAME, "configMap": {"name": configmap}},
        grace_seconds=settings.grace_seconds if too_short else None,
    )


def wants_sidecar(annotations: Mapping[str, str]) -> bool:
    """Whether ``ratelimit-sidecar/inject`` asks for the sidecar ("true"; absent or "false": no)."""
    value = annotations.get(INJECT)
    if value is None or value.lower() == "false":
        return False
    if value.lower() == "true":
        return True
    raise InjectionError(f'{INJECT}: must be "true" or "false", not {_show(value)}')


def apply(obj: Any, ops: list[dict[str, Any]]) -> Any:
    """A copy of `obj` with the "add" operations of `patch` applied (all it ever emits)."""
    result = copy.deepcopy(obj)
    for op in ops:
        if op["op"] != "add":
            raise ValueError(f"only 'add' operations are applied here, not {op['op']!r}")
        *parents, last = [_unescape(token) for token in op["path"].split("/")[1:]]
        target = result
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        value = copy.deepcopy(op["value"])
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            target[last] = value
    return result


def _container(settings: Settings, args: list[str], http_port: int) -> dict[str, Any]:
    def probe() -> dict[str, Any]:
        return {"httpGet": {"path": "/healthcheck", "port": http_port}, "timeoutSeconds": 3}

    return {
        "name": CONTAINER_NAME,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["ratelimit-sidecar"],
        "args": args,
        "ports": [{"name": PORT_NAME, "containerPort": http_port, "protocol": "TCP"}],
        # Ready takes the pod out of its Service while the sidecar drains or its backend is down.
        "readinessProbe": {**probe(), "periodSeconds": 5, "failureThreshold": 2},
        # /healthcheck also fails while the backend is down, which a restart cannot fix: give a
        # minute before the kubelet concludes the process itself is stuck.
        "livenessProbe": {
            **probe(),
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        # Every container of the pod is told to stop at once. Sleeping first keeps the sidecar
        # answering while Envoy finishes its requests and exits; then SIGTERM makes the sidecar
        # report unhealthy, finish the calls in flight and exit 0.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.pre_stop_seconds)]}}},
        "resources": copy.deepcopy(dict(RESOURCES)),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": RULES_PATH, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _pod(obj: Any, kind: Any) -> tuple[str, Mapping[str, Any], Mapping[str, Any]]:
    """The JSON Pointer to the pod (template), its metadata and its spec."""
    if kind == "Pod":
        pointer, pod = "", obj
    elif kind in WORKLOAD_KINDS:
        pointer = "/spec/template"
        pod = _field(_field(obj, "spec"), "template")
        if not isinstance(pod, dict):
            raise InjectionError(f"a {kind} needs spec.template, the pod template to inject into")
    else:
        shown = _show(kind) if isinstance(kind, str) else repr(type(kind).__name__)
        raise InjectionError(
            f"cannot inject into kind {shown}: only Pod, Deployment, StatefulSet and DaemonSet"
        )
    meta, spec = _field(pod, "metadata"), _field(pod, "spec")
    if meta is not None and not isinstance(meta, dict):
        raise InjectionError("metadata must be an object")
    if not isinstance(spec, dict):
        where = "spec" if kind == "Pod" else "spec.template.spec"
        raise InjectionError(f"a {kind} needs {where}, the pod spec to inject into")
    return pointer, meta or {}, spec


def _annotations(meta: Mapping[str, Any]) -> Mapping[str, str]:
    annotations = meta.get("annotations")
    if annotations is None:
        return {}
    if not isinstance(annotations, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in annotations.items()
    ):
        raise InjectionError("metadata.annotations must map names to string values")
    return annotations


def _check_names(annotations: Mapping[str, str]) -> None:
    """A misspelt annotation would be silently ignored, and the sidecar run with a default."""
    for name in annotations:
        if name.startswith(PREFIX) and name not in ANNOTATIONS:
            close = difflib.get_close_matches(name[:_SHOWN], ANNOTATIONS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            known = ", ".join(ANNOTATIONS)
            raise InjectionError(f"unknown annotation {_show(name)}{hint}; known: {known}")


def _configmap(name: str | None) -> str:
    if name is None:
        raise InjectionError(
            f"{RULES_CONFIGMAP}: missing; name the ConfigMap, in the pod's namespace, whose "
            "*.yaml keys hold the rate limit rules"
        )
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise InjectionError(
            f"{RULES_CONFIGMAP}: {_show(name)} is not a ConfigMap name (lower-case letters, "
            "digits, '-' and '.', at most 253 characters)"
        )
    return name


def _port(annotations: Mapping[str, str], name: str, default: int) -> int:
    value = annotations.get(name)
    if value is None:
        return default
    if not (len(value) <= 5 and value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise InjectionError(f"{name}: must be a port number from 1 to 65535, not {_show(value)}")
    return int(value)


def _check_free(containers: list[dict[str, Any]], volumes: Any, grpc: int, http: int) -> None:
    """Containers of a pod share its network and its volume names: the sidecar's must be free."""
    for container in containers:
        ports = container.get("ports")
        for port in ports if isinstance(ports, list) else []:
            if not isinstance(port, dict):
                continue
            number, name = port.get("containerPort"), port.get("name")
            owner = _show(str(container.get("name")))
            if number in (grpc, http):
                which = GRPC_PORT if number == grpc else HTTP_PORT
                raise InjectionError(
                    f"container {owner} already uses port {number}, which the sidecar needs; "
                    f"set {which} to a free port"
                )
            if name == PORT_NAME:
                raise InjectionError(
                    f"container {owner} already has a port named '{PORT_NAME}', "
                    "which the sidecar needs"
                )
    if volumes is not None and not isinstance(volumes, list):
        raise InjectionError("the pod's spec.volumes must be a list")
    if any(isinstance(v, dict) and v.get("name") == VOLUME_NAME for v in volumes or []):
        raise InjectionError(
            f"the pod already has a volume named '{VOLUME_NAME}', which the sidecar needs"
        )


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else None


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _show(value: str) -> str:
    """A value quoted for a message, cut short: annotations can be up to 256 KiB."""
    if len(value) <= _SHOWN:
        return repr(value)
    return f"{value[:_SHOWN]!r}... ({len(value)} characters)"
