"""The ``ratelimit-sidecar/*`` pod annotations: their names, and what they ask for once checked.

`read` turns a pod's annotations and the injector's `Settings` into a `Request`: every value
the sidecar will be built from, each annotation checked as the sidecar (or the API server)
would check it, so a pod that cannot get a working sidecar is refused with the annotation's
name and the fix instead of crash-looping. Pure: no I/O, no clock.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.errors import InjectionError
from sidecar.injector.settings import (
    DNS_SUBDOMAIN,
    Settings,
    check_resources,
    check_user,
    quantity,
)
from sidecar.injector.urls import validate_url

PREFIX = "ratelimit-sidecar/"
INJECT = PREFIX + "inject"
BACKEND = PREFIX + "backend"
RULES_CONFIGMAP = PREFIX + "rules-configmap"
FAILURE_MODE = PREFIX + "failure-mode"
GRPC_PORT = PREFIX + "grpc-port"
HTTP_PORT = PREFIX + "http-port"
NATIVE_SIDECAR = PREFIX + "native-sidecar"
IMAGE = PREFIX + "image"
CPU_REQUEST = PREFIX + "cpu-request"
CPU_LIMIT = PREFIX + "cpu-limit"
MEMORY_REQUEST = PREFIX + "memory-request"
MEMORY_LIMIT = PREFIX + "memory-limit"
RUN_AS_USER = PREFIX + "run-as-user"
RUN_AS_GROUP = PREFIX + "run-as-group"
#: Written by the injector on the pods it injected: what it added, and its version.
STATUS = PREFIX + "status"
ANNOTATIONS = (
    INJECT, BACKEND, RULES_CONFIGMAP, FAILURE_MODE, GRPC_PORT, HTTP_PORT, NATIVE_SIDECAR, IMAGE,
    CPU_REQUEST, CPU_LIMIT, MEMORY_REQUEST, MEMORY_LIMIT, RUN_AS_USER, RUN_AS_GROUP, STATUS,
)  # fmt: skip

_SHOWN = 64  # characters of a bad value quoted back in a message


@dataclass(frozen=True, slots=True)
class Request:
    """What one pod's annotations ask for, checked; None where the sidecar's default holds.

    `grpc_port` None serves gRPC on the Unix socket; `http_port` None lets the injector pick a
    free port.
    """

    configmap: str
    backend: str | None
    failure_mode: str | None
    grpc_port: int | None
    http_port: int | None
    native: bool
    image: str
    cpu: tuple[str, str]  # request, limit
    memory: tuple[str, str]
    run_as_user: int
    run_as_group: int


def annotations_of(meta: Mapping[str, object]) -> Mapping[str, str]:
    """The pod's annotations; InjectionError unless they map names to strings."""
    annotations = meta.get("annotations")
    if annotations is None:
        return {}
    if not isinstance(annotations, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in annotations.items()
    ):
        raise InjectionError("metadata.annotations must map names to string values")
    return annotations


def wants_sidecar(annotations: Mapping[str, str], default: bool = False) -> bool:
    """Whether ``ratelimit-sidecar/inject`` asks for the sidecar: "true" or "false" decide; with
    no annotation, `default` (true where the namespace is labelled for injection)."""
    value = annotations.get(INJECT)
    if value is None:
        return default
    return _boolean(value, INJECT)


def read(annotations: Mapping[str, str], settings: Settings) -> Request:
    """The checked request of a pod that wants the sidecar; InjectionError naming what is wrong."""
    _check_names(annotations)
    backend = annotations.get(BACKEND, settings.default_backend)
    if backend is not None:
        try:
            validate_url(backend)
        except ValueError as exc:
            raise InjectionError(f"{BACKEND}: {exc}") from None
    failure_mode = annotations.get(FAILURE_MODE)
    if failure_mode is not None and failure_mode not in ("allow", "deny", "local"):
        shown = show(failure_mode)
        raise InjectionError(f"{FAILURE_MODE}: must be 'allow', 'deny' or 'local', not {shown}")
    grpc_port = _port(annotations, GRPC_PORT)
    http_port = _port(annotations, HTTP_PORT)
    if grpc_port is not None and grpc_port == http_port:
        raise InjectionError(
            f"{GRPC_PORT} and {HTTP_PORT}: both are {grpc_port}; the sidecar needs two ports"
        )
    native = annotations.get(NATIVE_SIDECAR)
    image = annotations.get(IMAGE, settings.image)
    if not image or len(image) > 512 or any(c.isspace() for c in image):
        raise InjectionError(f"{IMAGE}: {show(image)} is not an image reference")
    cpu = (
        _quantity(annotations, CPU_REQUEST, settings.cpu_request),
        _quantity(annotations, CPU_LIMIT, settings.cpu_limit),
    )
    memory = (
        _quantity(annotations, MEMORY_REQUEST, settings.memory_request),
        _quantity(annotations, MEMORY_LIMIT, settings.memory_limit),
    )
    try:
        check_resources(cpu, memory, f"{PREFIX}{{cpu,memory}}-{{request,limit}}")
    except ValueError as exc:
        raise InjectionError(str(exc)) from None
    return Request(
        configmap=_configmap(annotations.get(RULES_CONFIGMAP, settings.rules_configmap)),
        backend=backend,
        failure_mode=failure_mode,
        grpc_port=grpc_port,
        http_port=http_port,
        native=settings.native_sidecars if native is None else _boolean(native, NATIVE_SIDECAR),
        image=image,
        cpu=cpu,
        memory=memory,
        run_as_user=_user(annotations, RUN_AS_USER, settings.run_as_user),
        run_as_group=_user(annotations, RUN_AS_GROUP, settings.run_as_group),
    )


def show(value: str) -> str:
    """A value quoted for a message, cut short: annotations can be up to 256 KiB."""
    if len(value) <= _SHOWN:
        return repr(value)
    return f"{value[:_SHOWN]!r}... ({len(value)} characters)"


def _boolean(value: str, name: str) -> bool:
    if value.lower() == "true":
        return True
    if value.lower() == "false":
        return False
    raise InjectionError(f'{name}: must be "true" or "false", not {show(value)}')


def _check_names(annotations: Mapping[str, str]) -> None:
    """A misspelt annotation would be silently ignored, and the sidecar run with a default."""
    for name in annotations:
        if name.startswith(PREFIX) and name not in ANNOTATIONS:
            close = difflib.get_close_matches(name[:_SHOWN], ANNOTATIONS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            known = ", ".join(a for a in ANNOTATIONS if a != STATUS)
            raise InjectionError(f"unknown annotation {show(name)}{hint}; known: {known}")


def _configmap(name: str) -> str:
    if len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        raise InjectionError(
            f"{RULES_CONFIGMAP}: {show(name)} is not a ConfigMap name (lower-case letters, "
            "digits, '-' and '.', at most 253 characters)"
        )
    return name


def _port(annotations: Mapping[str, str], name: str) -> int | None:
    value = annotations.get(name)
    if value is None:
        return None
    if not (len(value) <= 5 and value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise InjectionError(f"{name}: must be a port number from 1 to 65535, not {show(value)}")
    return int(value)


def _quantity(annotations: Mapping[str, str], name: str, default: str) -> str:
    value = annotations.get(name)
    if value is None:
        return default
    try:
        quantity(value)
    except ValueError:
        raise InjectionError(
            f"{name}: {show(value)} is not a Kubernetes quantity (e.g. 100m, 1, 128Mi)"
        ) from None
    return value


def _user(annotations: Mapping[str, str], name: str, default: int) -> int:
    value = annotations.get(name)
    if value is None:
        return default
    if not (len(value) <= 10 and value.isascii() and value.isdigit()):
        raise InjectionError(f"{name}: must be a numeric id, not {show(value)}")
    try:
        check_user(int(value), name)
    except ValueError as exc:
        raise InjectionError(str(exc)) from None
    return int(value)
