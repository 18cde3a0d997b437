"""Kubernetes without a cluster, for the tests: the API's schema, and kustomize builds.

`assert_valid` checks an object against the Kubernetes API's JSON schema in strict mode
(unknown fields are errors, as `kubectl apply --validate=strict` makes them), for the oldest
and newest Kubernetes the manifests target. `build` is a small kustomize that understands
exactly the fields our kustomizations use and refuses any other, so it never silently builds
something kustomize would build differently; `kubectl_build` runs the real one when present.
It keeps the objects in the order written (kustomize's ``sortOptions: {order: fifo}``, which
every top-level kustomization here asks for), and applies ``images:`` entries to containers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
#: Oldest and newest Kubernetes minor versions the manifests and the injected pods must fit.
#: The schemas come with the kubernetes-validate package (the test extra), one per version.
VERSIONS = ("1.28", kubernetes_validate.latest_version())
#: A pod with a native sidecar needs Kubernetes 1.29 (SidecarContainers, on by default there).
NATIVE_VERSIONS = ("1.29", kubernetes_validate.latest_version())

_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "sortOptions", "images"}
_IMAGE_FIELDS = {"name", "newName", "newTag"}
#: Custom resources (cert-manager's) have no schema in kubernetes-validate: their tests check
#: them field by field instead (tests/test_k8s_manifests.py).
CUSTOM_GROUPS = ("cert-manager.io/",)
_TARGET_FIELDS = {"group", "version", "kind", "name", "namespace"}


def assert_valid(obj: Any, versions: tuple[str, ...] | None = None) -> None:
    """Fail with the field and the reason unless `obj` is valid for every Kubernetes version:
    by default VERSIONS, or NATIVE_VERSIONS for a pod (template) with a native sidecar."""
    assert isinstance(obj, dict), f"not a Kubernetes object: {obj!r}"
    label = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    if versions is None:
        versions = NATIVE_VERSIONS if has_native_sidecar(obj) else VERSIONS
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{label}: invalid for Kubernetes {version}: {exc.json_path}: {exc.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{label}: {exc.message}")


def pod_spec_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec of a Pod or of a workload's template; None for other kinds."""
    spec = obj.get("spec")
    if obj.get("kind") == "Pod":
        return spec if isinstance(spec, dict) else None
    template = spec.get("template") if isinstance(spec, dict) else None
    found = template.get("spec") if isinstance(template, dict) else None
    return found if isinstance(found, dict) else None


def has_native_sidecar(obj: dict[str, Any]) -> bool:
    """Whether a Pod or workload has an init container with restartPolicy Always."""
    spec = pod_spec_of(obj) or {}
    return any(c.get("restartPolicy") == "Always" for c in spec.get("initContainers", []))


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects `kustomize build directory` prints, for the fields our kustomizations use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KUSTOMIZATION_FIELDS
    if unknown:
        raise ValueError(
            f"{directory}: kustomization fields {sorted(unknown)} are not understood by "
            "tests/support/kube.py: extend `build`, or keep to resources and patches"
        )
    if kustomization.get("sortOptions", {"order": "fifo"}) != {"order": "fifo"}:
        raise ValueError(f"{directory}: only sortOptions {{order: fifo}} is understood")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += build(path)
        elif path.parent != directory.resolve():
            # kustomize's default load restrictor: files only from the kustomization's own
            # directory (other directories must be kustomizations themselves).
            raise ValueError(f"{directory}: {entry} is outside the kustomization's directory")
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for entry in kustomization.get("patches", []):
        objects = _patch(directory, objects, entry)
    for entry in kustomization.get("images", []):
        objects = [_image(directory, obj, entry) for obj in objects]
    ids = [_id(obj) for obj in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: objects declared twice: {sorted(duplicates)}")
    return objects


def kubectl_build(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize directory`, parsed."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def by_id(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Objects keyed ``Kind namespace/name``."""
    return {_id(obj): obj for obj in objects}


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"want one {kind} {name}, found {len(matches)}"
    return matches[0]


def _patch(
    directory: Path, objects: list[dict[str, Any]], entry: dict[str, Any]
) -> list[dict[str, Any]]:
    if set(entry) != {"target", "patch"} or not set(entry["target"]) <= _TARGET_FIELDS:
        raise ValueError(f"{directory}: only inline JSON 6902 patches with a target: {entry}")
    target = entry["target"]
    operations = jsonpatch.JsonPatch(yaml.safe_load(entry["patch"]))
    result, matched = [], 0
    for obj in objects:
        if _matches(obj, target):
            matched += 1
            obj = operations.apply(obj)
        result.append(obj)
    if not matched:
        raise ValueError(f"{directory}: no resource matches patch target {json.dumps(target)}")
    return result


def _image(directory: Path, obj: dict[str, Any], entry: dict[str, str]) -> dict[str, Any]:
    """kustomize's images transformer, for containers and init containers of pod specs: an
    image named ``entry["name"]`` (with any tag) gets ``newName`` and ``newTag``."""
    if not set(entry) <= _IMAGE_FIELDS or "name" not in entry:
        raise ValueError(f"{directory}: only images entries with {sorted(_IMAGE_FIELDS)}: {entry}")
    spec = pod_spec_of(obj)
    for container in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
        image: str = container["image"]
        colon = image.rfind(":")
        # A colon after the last slash starts the tag; one before it is a registry's port.
        name, tag = (image[:colon], image[colon + 1 :]) if colon > image.rfind("/") else (image, "")
        if name == entry["name"]:
            name = entry.get("newName", name)
            tag = entry.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name
    return obj


def _matches(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    actual = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "namespace": obj["metadata"].get("namespace", ""),
    }
    return all(actual[key] == value for key, value in target.items())


def _id(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    namespace = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj['kind']} {namespace}{meta['name']}"
