"""The sidecar a pod asks for, as RFC 6902 JSON Patch operations or as the injected manifest.

A pod (or the pod template of a Deployment, StatefulSet or DaemonSet) that asks for it gets:
- the ``ratelimit-sidecar`` container, as the last init container with ``restartPolicy:
  Always`` (a native sidecar) or as the last container (see `container`);
- its volumes: the rules ConfigMap, read-only, and an emptyDir holding the gRPC Unix socket,
  which every container of the pod mounts, so Envoy reaches the sidecar as a ``pipe`` with no
  port to collide with;
- an HTTP port (probes, /metrics) among the ports no container declares: 8080 if free, else
  the next free one; the Prometheus scrape annotations name it, unless the pod has its own;
- the ``ratelimit-sidecar/status`` annotation: what was injected, and by which version.
A pod that already has the sidecar, as a container or as an init container, gets nothing, so
injecting twice changes nothing whichever form the first injection chose. Pods on the host's
network and pods in kube-system and kube-public are never injected.
Pure: objects in, operations out; a pod that cannot get a working sidecar raises
InjectionError naming the annotation and the fix.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar import __version__
from sidecar.errors import InjectionError
from sidecar.injector import annotations as names
from sidecar.injector.annotations import Request, annotations_of, read, show, wants_sidecar
from sidecar.injector.container import (
    CONTAINER_NAME,
    PORT_NAME,
    RULES_VOLUME,
    SOCKET_DIR,
    SOCKET_VOLUME,
    container,
    grpc_address,
)
from sidecar.injector.settings import Settings

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
KINDS = ("Pod", *WORKLOAD_KINDS)
#: Never injected: the cluster's own pods, and the namespace anyone may read.
SKIPPED_NAMESPACES = ("kube-system", "kube-public")
#: The HTTP port the sidecar takes when no container of the pod declares it.
DEFAULT_HTTP_PORT = 8080
#: Added when the pod has no prometheus.io/* annotation of its own.
PROMETHEUS = "prometheus.io/"


@dataclass(frozen=True, slots=True)
class Sidecar:
    """What one pod gets (see the module docstring); `grace_seconds` only when too short."""

    container: dict[str, Any]
    native: bool
    volumes: list[dict[str, Any]]
    #: Added to each of the pod's containers (by index): the socket directory.
    mounts: dict[int, dict[str, Any]]
    annotations: dict[str, str]
    grace_seconds: int | None
    http_port: int


@dataclass(frozen=True, slots=True)
class Skipped:
    """No sidecar, and why ("" when the pod simply did not ask for one)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Pod:
    pointer: str  # JSON Pointer to the pod (template): "" or "/spec/template"
    meta: Mapping[str, Any]
    spec: Mapping[str, Any]
    has_meta: bool
    containers: list[dict[str, Any]]
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def plan(
    obj: Any,
    settings: Settings,
    *,
    kind: str | None = None,
    namespace: str | None = None,
    namespace_enabled: bool = False,
) -> Sidecar | Skipped:
    """What a Pod or workload gets. `kind` and `namespace` override the object's own (the
    webhook knows them from the request); `namespace_enabled`: the namespace is labelled for
    injection, so a pod without ``ratelimit-sidecar/inject`` gets the sidecar too."""
    kind = kind or _field(obj, "kind")
    pod = _pod(obj, kind)
    namespace = namespace or _field(_field(obj, "metadata"), "namespace")
    if namespace in SKIPPED_NAMESPACES:
        return Skipped(f"pods in {namespace} are never injected")
    annotations = annotations_of(pod.meta)
    if not wants_sidecar(annotations, namespace_enabled):
        return Skipped()
    if any(c.get("name") == CONTAINER_NAME for c in [*pod.containers, *pod.init_containers]):
        return Skipped("the pod already has the sidecar")
    if pod.spec.get("hostNetwork") is True:
        return Skipped("pods on the host's network are not injected (no port would be the pod's)")
    request = read(annotations, settings)
    return _sidecar(pod, annotations, request, settings)


def operations(obj: Any, sidecar: Sidecar, kind: str | None = None) -> list[dict[str, Any]]:
    """The JSON Patch operations that add `sidecar` to the object it was planned for."""
    pod = _pod(obj, kind or _field(obj, "kind"))
    base = f"{pod.pointer}/spec"
    ops: list[dict[str, Any]] = []

    def append(path: str, owner: Mapping[str, Any], key: str, values: list[Any]) -> None:
        """Append to the list `owner[key]`, made first if it is missing (or null)."""
        if values and not isinstance(owner.get(key), list):
            ops.append({"op": "add", "path": f"{path}/{key}", "value": []})
        ops.extend({"op": "add", "path": f"{path}/{key}/-", "value": v} for v in values)

    key = "initContainers" if sidecar.native else "containers"
    append(base, pod.spec, key, [sidecar.container])
    for index, mount in sidecar.mounts.items():
        append(f"{base}/containers/{index}", pod.containers[index], "volumeMounts", [mount])
    append(base, pod.spec, "volumes", sidecar.volumes)
    if sidecar.grace_seconds is not None:
        # "add" on an existing member replaces it (RFC 6902, 4.1).
        path = f"{base}/terminationGracePeriodSeconds"
        ops.append({"op": "add", "path": path, "value": sidecar.grace_seconds})
    meta = f"{pod.pointer}/metadata"
    if not pod.has_meta:
        ops.append({"op": "add", "path": meta, "value": {}})
    if pod.meta.get("annotations") is None:
        ops.append({"op": "add", "path": f"{meta}/annotations", "value": sidecar.annotations})
    else:
        for name, value in sidecar.annotations.items():
            ops.append({"op": "add", "path": f"{meta}/annotations/{_escape(name)}", "value": value})
    return ops


def patch(
    obj: Any,
    settings: Settings,
    kind: str | None = None,
    *,
    namespace: str | None = None,
    namespace_enabled: bool = False,
) -> list[dict[str, Any]]:
    """The operations that inject the sidecar, or none when the object gets no sidecar."""
    decided = plan(
        obj, settings, kind=kind, namespace=namespace, namespace_enabled=namespace_enabled
    )
    return operations(obj, decided, kind) if isinstance(decided, Sidecar) else []


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


def used_ports(pod: Mapping[str, Any]) -> dict[int, str]:
    """Every port a container of the pod declares or is probed on, and the container's name.

    A port a container listens on without declaring it cannot be seen: declare Envoy's
    listeners (containerPort), as Kubernetes asks anyway.
    """
    found: dict[int, str] = {}
    for key in ("initContainers", "containers"):
        containers = pod.get(key)
        for c in containers if isinstance(containers, list) else []:
            if not isinstance(c, dict):
                continue
            owner = str(c.get("name"))
            ports = c.get("ports")
            for port in ports if isinstance(ports, list) else []:
                for name in ("containerPort", "hostPort"):
                    number = _field(port, name)
                    if isinstance(number, int):
                        found.setdefault(number, owner)
            for number in _probe_ports(c):
                found.setdefault(number, owner)
    return found


def _sidecar(
    pod: _Pod, annotations: Mapping[str, str], request: Request, settings: Settings
) -> Sidecar:
    used = used_ports(pod.spec)
    _check_names_free(pod, socket=request.grpc_port is None)
    if request.grpc_port is not None:
        _check_free(used, request.grpc_port, names.GRPC_PORT)
    if request.http_port is not None:
        _check_free(used, request.http_port, names.HTTP_PORT)
        http_port = request.http_port
    else:
        http_port = _free_port(used, {request.grpc_port})
    volumes = [{"name": RULES_VOLUME, "configMap": {"name": request.configmap}}]
    mounts: dict[int, dict[str, Any]] = {}
    if request.grpc_port is None:
        # A socket file takes no room: the limit only stops the directory being misused.
        volumes.append({"name": SOCKET_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}})
        mount = {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR, "readOnly": True}
        mounts = {index: mount for index in range(len(pod.containers))}
    spec = container(request, settings, http_port, request.native)
    grace = pod.spec.get("terminationGracePeriodSeconds")
    too_short = isinstance(grace, int) and grace < settings.grace_seconds
    added = {names.STATUS: _status(request, spec, volumes, http_port)}
    if not any(name.startswith(PROMETHEUS) for name in annotations):
        added.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(http_port),
                "prometheus.io/path": "/metrics",
            }
        )
    return Sidecar(
        container=spec,
        native=request.native,
        volumes=volumes,
        mounts=mounts,
        annotations=added,
        grace_seconds=settings.grace_seconds if too_short else None,
        http_port=http_port,
    )


def _status(
    request: Request, spec: Mapping[str, Any], volumes: list[dict[str, Any]], http_port: int
) -> str:
    """The status annotation: one JSON object, as Istio's sidecar.istio.io/status is."""
    status = {
        "version": __version__,
        "sidecar": "native" if request.native else "container",
        "container": spec["name"],
        "image": spec["image"],
        "volumes": [v["name"] for v in volumes],
        "grpc": grpc_address(request),
        "httpPort": http_port,
    }
    return json.dumps(status, separators=(",", ":"))


def _pod(obj: Any, kind: Any) -> _Pod:
    if kind == "Pod":
        pointer, pod = "", obj
    elif kind in WORKLOAD_KINDS:
        pointer = "/spec/template"
        pod = _field(_field(obj, "spec"), "template")
        if not isinstance(pod, dict):
            raise InjectionError(f"a {kind} needs spec.template, the pod template to inject into")
    else:
        shown = show(kind) if isinstance(kind, str) else repr(type(kind).__name__)
        raise InjectionError(
            f"cannot inject into kind {shown}: only Pod, Deployment, StatefulSet and DaemonSet"
        )
    meta, spec = _field(pod, "metadata"), _field(pod, "spec")
    if meta is not None and not isinstance(meta, dict):
        raise InjectionError("metadata must be an object")
    if not isinstance(spec, dict):
        where = "spec" if kind == "Pod" else "spec.template.spec"
        raise InjectionError(f"a {kind} needs {where}, the pod spec to inject into")
    lists = {}
    for key in ("containers", "initContainers"):
        items = spec.get(key, [] if key == "initContainers" else None)
        if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
            raise InjectionError(f"the pod's spec.{key} must be a list of containers")
        lists[key] = items
    if spec.get("volumes") is not None and not isinstance(spec.get("volumes"), list):
        raise InjectionError("the pod's spec.volumes must be a list")
    return _Pod(
        pointer, meta or {}, spec, meta is not None, lists["containers"], lists["initContainers"]
    )


def _check_names_free(pod: _Pod, socket: bool) -> None:
    """Containers of a pod share its volume names and port names: the sidecar's must be free,
    and so must the socket's directory in the containers that will mount it."""
    volumes = pod.spec.get("volumes") or []
    for name in (RULES_VOLUME, SOCKET_VOLUME) if socket else (RULES_VOLUME,):
        if any(isinstance(v, dict) and v.get("name") == name for v in volumes):
            raise InjectionError(
                f"the pod already has a volume named '{name}', which the sidecar needs"
            )
    for c in [*pod.init_containers, *pod.containers]:
        ports = c.get("ports")
        if any(_field(p, "name") == PORT_NAME for p in (ports if isinstance(ports, list) else [])):
            raise InjectionError(
                f"container {show(str(c.get('name')))} already has a port named '{PORT_NAME}', "
                "which the sidecar needs"
            )
    for c in pod.containers:
        mounts = c.get("volumeMounts")
        if mounts is not None and not isinstance(mounts, list):
            raise InjectionError("a container's volumeMounts must be a list")
        if socket and any(
            _field(m, "mountPath") in (SOCKET_DIR, SOCKET_DIR + "/") for m in mounts or []
        ):
            raise InjectionError(
                f"container {show(str(c.get('name')))} already mounts {SOCKET_DIR}, where the "
                f"sidecar's socket goes; set {names.GRPC_PORT} to serve gRPC on a port instead"
            )


def _check_free(used: Mapping[int, str], port: int, annotation: str) -> None:
    owner = used.get(port)
    if owner is not None:
        suggestion = _free_port(used, set())
        raise InjectionError(
            f"container {show(owner)} already uses port {port}, which {annotation} asks for; "
            f"set it to a free port such as {suggestion}"
            + ("" if annotation == names.GRPC_PORT else ", or remove it to have one chosen")
        )


def _free_port(used: Mapping[int, str], taken: set[int | None]) -> int:
    for port in range(DEFAULT_HTTP_PORT, 65536):
        if port not in used and port not in taken:
            return port
    raise InjectionError(f"no free port from {DEFAULT_HTTP_PORT} up; set {names.HTTP_PORT}")


def _probe_ports(c: Mapping[str, Any]) -> Iterator[int]:
    handlers = [c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    lifecycle = c.get("lifecycle")
    if isinstance(lifecycle, dict):
        handlers += [lifecycle.get("postStart"), lifecycle.get("preStop")]
    for handler in handlers:
        for action in ("httpGet", "tcpSocket", "grpc"):
            port = _field(_field(handler, action), "port")
            if isinstance(port, int):
                yield port


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else None


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")
