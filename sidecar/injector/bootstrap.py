"""The webhook's own certificate, for a cluster without cert-manager and with no hand steps.

`webhook --certificate-secret NAME --ca-bundle-for mutating/CONFIG` (k8s/base/webhook-self-signed):
before it listens, the webhook reads the Secret NAME in its namespace; if there is none, it makes
a certificate authority and a serving certificate for its Service's DNS names (`certificate`)
and creates the Secret, so every replica serves a certificate from the same authority (a
replica that loses the race to create it reads the winner's). It writes the pair where
``--tls-cert`` and ``--tls-key`` say, then puts the authority in the ``caBundle`` of every entry
of CONFIG that calls its Service, with a JSON Patch through the API server. Only then does it
listen, so a webhook that is ready is one the API server can call.

Every `REFRESH_SECONDS` it does the same again: a serving certificate near its end is renewed
from the same authority (the ``caBundle`` does not change), and a ``caBundle`` that someone
removed is put back. Conflicting writes by other replicas (HTTP 409, or 422 when the patch's
``test`` finds the entries moved) are read again and retried, at most `MAX_ATTEMPTS` times.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from sidecar.injector import certificate
from sidecar.injector.apiserver import Client, status_message
from sidecar.injector.certificate import Pair

#: How often a running webhook checks its certificate and its configurations' caBundle.
REFRESH_SECONDS = 600.0
#: Writes lost to another replica (or to someone editing the configuration) before giving up.
MAX_ATTEMPTS = 5
#: On the Secret: the DNS names its serving certificate was made for; a Service renamed gets a
#: new certificate.
NAMES_ANNOTATION = "ratelimit-sidecar.io/dns-names"
_RESOURCES = {
    "mutating": "mutatingwebhookconfigurations",
    "validating": "validatingwebhookconfigurations",
}
_JSON_PATCH = "application/json-patch+json"

log = structlog.get_logger("sidecar.injector")


@dataclass(frozen=True, slots=True)
class Target:
    """A webhook configuration whose caBundle the webhook keeps: ``mutating/NAME``."""

    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"/apis/admissionregistration.k8s.io/v1/{_RESOURCES[self.kind]}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def parse_target(text: str) -> Target:
    """``mutating/NAME`` or ``validating/NAME``; ValueError otherwise."""
    kind, _, name = text.partition("/")
    if kind not in _RESOURCES or not name or "/" in name or len(name) > 253:
        raise ValueError(f"expected mutating/NAME or validating/NAME, not {text[:64]!r}")
    return Target(kind, name)


@dataclass(frozen=True, slots=True)
class Stored:
    """What the Secret holds: the authority (in caBundle) and the serving pair it signed."""

    authority: Pair
    serving: Pair


def secret_document(
    name: str,
    namespace: str,
    names: tuple[str, ...],
    stored: Stored,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The Secret to create (or, with the version read, to replace): ``kubernetes.io/tls``,
    so cert-manager or a hand-made certificate can take its place under the same name."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/part-of": "ratelimit-sidecar"},
        "annotations": {NAMES_ANNOTATION: ",".join(names)},
    }
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    data = {
        "tls.crt": stored.serving.cert,
        "tls.key": stored.serving.key,
        "ca.crt": stored.authority.cert,
        "ca.key": stored.authority.key,
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "kubernetes.io/tls",
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def ca_bundle_patch(
    configuration: dict[str, Any], namespace: str, service: str, ca: bytes
) -> list[dict[str, Any]]:
    """The JSON Patch that puts `ca` in the caBundle of every entry calling ``namespace/service``
    and lacking it; empty when none lacks it. Each change is guarded by a ``test`` of the entry's
    name, so a configuration whose entries moved since it was read refuses the patch whole."""
    value = base64.b64encode(ca).decode()
    operations: list[dict[str, Any]] = []
    for index, hook in enumerate(configuration.get("webhooks") or []):
        client = hook.get("clientConfig") or {}
        called = client.get("service") or {}
        if (called.get("namespace"), called.get("name")) != (namespace, service):
            continue
        if client.get("caBundle") == value:
            continue
        operations.append({"op": "test", "path": f"/webhooks/{index}/name", "value": hook["name"]})
        operations.append(
            {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": value}
        )
    return operations


def calls_service(configuration: dict[str, Any], namespace: str, service: str) -> bool:
    """Whether any entry of the configuration calls ``namespace/service``."""
    return any(
        ((hook.get("clientConfig") or {}).get("service") or {}).get("namespace") == namespace
        and hook["clientConfig"]["service"].get("name") == service
        for hook in configuration.get("webhooks") or []
    )


class Keeper:
    """Keeps the webhook's own certificate and its configurations' caBundle (see the module)."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        secret: str,
        service: str,
        targets: tuple[Target, ...],
        cert_file: Path,
        key_file: Path,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.secret = secret
        self.service = service
        self.targets = targets
        self.cert_file = cert_file
        self.key_file = key_file
        self.names = certificate.service_names(service, namespace)

    async def keep(self) -> None:
        """Make sure the files and every caBundle hold the Secret's certificate; OSError (or
        ValueError for a Secret that is not ours to read) saying why not."""
        stored = await self._certificate()
        self._write(stored.serving)
        for target in self.targets:
            await self._ca_bundle(target, stored.authority.cert)

    async def _certificate(self) -> Stored:
        path = f"/api/v1/namespaces/{self.namespace}/secrets"
        for _ in range(MAX_ATTEMPTS):
            status, document = await self.client.call("GET", f"{path}/{self.secret}")
            if status == 404:
                stored = self._issue(None)
                status, answer = await self.client.call("POST", path, self._document(stored))
                if status == 201:
                    log.info("certificate_created", secret=self._where, names=list(self.names))
                    return stored
            elif status == 200:
                authority, serving, names = _read(document)
                fresh = serving is not None and not certificate.expires_within(
                    serving.cert, certificate.RENEW_SECONDS
                )
                if authority is not None and serving is not None and fresh and names == self.names:
                    return Stored(authority, serving)
                stored = self._issue(authority)
                version = (document.get("metadata") or {}).get("resourceVersion")
                body = self._document(stored, version)
                status, answer = await self.client.call("PUT", f"{path}/{self.secret}", body)
                if status == 200:
                    log.info("certificate_renewed", secret=self._where, names=list(self.names))
                    return stored
            else:
                answer = document
            if status != 409:
                raise OSError(f"Secret {self._where}: {status_message(status, answer)}")
            # 409: another replica created or renewed it first; read theirs.
        raise OSError(f"Secret {self._where}: still conflicting after {MAX_ATTEMPTS} attempts")

    def _issue(self, authority: Pair | None) -> Stored:
        # openssl runs in the event loop: tens of milliseconds, at the first start and then
        # once a year, which no review in flight notices.
        workdir = self.cert_file.parent
        if authority is None or certificate.expires_within(
            authority.cert, certificate.RENEW_SECONDS
        ):
            authority = certificate.new_authority(f"{self.service} webhook CA", workdir)
        serving = certificate.issue_serving(
            authority, self.names, workdir, certificate.SERVING_DAYS
        )
        return Stored(authority, serving)

    def _document(self, stored: Stored, version: str | None = None) -> dict[str, Any]:
        return secret_document(self.secret, self.namespace, self.names, stored, version)

    def _write(self, serving: Pair) -> None:
        """Replace the files only when they differ, each atomically; the webhook's reloader
        (`Certificates`) loads them together, skipping a moment when only one is new."""
        for path, content, mode in (
            (self.key_file, serving.key, 0o600),
            (self.cert_file, serving.cert, 0o644),
        ):
            try:
                if path.read_bytes() == content:
                    continue
            except FileNotFoundError:
                pass
            staging = path.with_name(f".{path.name}.new")
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as file:
                file.write(content)
            os.replace(staging, path)

    async def _ca_bundle(self, target: Target, ca: bytes) -> None:
        for _ in range(MAX_ATTEMPTS):
            status, document = await self.client.call("GET", target.path)
            if status != 200:
                raise OSError(f"{target}: {status_message(status, document)}")
            if not calls_service(document, self.namespace, self.service):
                raise OSError(
                    f"{target}: no webhook in it calls Service {self.namespace}/{self.service} "
                    "(--service names the Service the API server calls)"
                )
            operations = ca_bundle_patch(document, self.namespace, self.service, ca)
            if not operations:
                return
            status, answer = await self.client.call("PATCH", target.path, operations, _JSON_PATCH)
            if status == 200:
                log.info("ca_bundle_patched", configuration=str(target))
                return
            if status not in (409, 422):
                raise OSError(f"{target}: {status_message(status, answer)}")
            # 409 or 422 (a `test` failed): the configuration changed under us; read it again.
        raise OSError(f"{target}: still conflicting after {MAX_ATTEMPTS} attempts")

    @property
    def _where(self) -> str:
        return f"{self.namespace}/{self.secret}"


def _read(document: Any) -> tuple[Pair | None, Pair | None, tuple[str, ...]]:
    """The authority, the serving pair and the names a Secret holds; None for a missing part."""
    data = document.get("data") if isinstance(document, dict) else None
    metadata = document.get("metadata") if isinstance(document, dict) else None
    annotations = (metadata or {}).get("annotations") or {}
    names = tuple(str(annotations.get(NAMES_ANNOTATION, "")).split(","))
    values: dict[str, bytes] = {}
    for key in ("ca.crt", "ca.key", "tls.crt", "tls.key"):
        try:
            values[key] = base64.b64decode((data or {}).get(key) or "", validate=True)
        except (binascii.Error, TypeError):
            values[key] = b""

    def pair(cert: str, key: str) -> Pair | None:
        return Pair(values[cert], values[key]) if values[cert] and values[key] else None

    return pair("ca.crt", "ca.key"), pair("tls.crt", "tls.key"), names
