"""The mutating admission webhook: AdmissionReview v1 in, a JSON Patch that adds the sidecar out.

`review` is pure and total: whatever bytes arrive, it answers with an AdmissionReview (or,
when the body is not a v1 AdmissionReview with a uid, an HTTP 400 carrying one that explains
why), never an exception. `WebhookServer` serves it at ``POST /mutate`` and
``/mutate/injection-enabled`` over HTTPS only (the API server refuses to call a webhook over
plain HTTP anyway), with ``GET /healthz`` for probes, and reloads its certificate when the
files change, as cert-manager or a Secret update does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from aiohttp import web

from sidecar.errors import InjectionError
from sidecar.http.bodies import BodyRefused, read_body
from sidecar.http.listener import Listener
from sidecar.injector.patch import KINDS, WORKLOAD_KINDS, Sidecar, operations, plan
from sidecar.injector.settings import Settings

API_VERSION = "admission.k8s.io/v1"
#: Reviews of pods in namespaces not labelled for injection: only pods annotated
#: ``ratelimit-sidecar/inject: "true"`` get the sidecar.
MUTATE = "/mutate"
#: Reviews of pods in namespaces labelled ``ratelimit-sidecar/injection: enabled``: every pod
#: gets the sidecar but those annotated ``ratelimit-sidecar/inject: "false"``. The API server
#: tells the two apart by calling different paths (see k8s/base/webhook); the review itself
#: does not carry the namespace's labels.
MUTATE_ENABLED = "/mutate/injection-enabled"
#: An object is at most about 1.5 MiB (etcd's limit) and a review may carry two (object and
#: oldObject); anything larger is not from an API server.
MAX_BODY_BYTES = 4 << 20
#: How often the certificate files are checked for a new version.
RELOAD_SECONDS = 30.0
#: How long reviews in flight may take to finish once the webhook is told to stop.
SHUTDOWN_SECONDS = 5.0
_MAX_UID = 128  # a UID is a UUID; a longer one is not echoed back

Outcome = Literal["injected", "unchanged", "denied", "bad_request"]

log = structlog.get_logger("sidecar.injector")


@dataclass(frozen=True, slots=True)
class Reply:
    """The HTTP status and AdmissionReview body to send, and what happened, for the log."""

    status: int
    body: dict[str, Any]
    outcome: Outcome
    message: str = ""
    subject: str = ""  # namespace/name of the object reviewed, when known


def review(body: bytes, settings: Settings, *, namespace_enabled: bool = False) -> Reply:
    """Answer one AdmissionReview v1 request body.

    `namespace_enabled`: the review came through the webhook entry for namespaces labelled for
    injection, so pods without a ``ratelimit-sidecar/inject`` annotation get the sidecar too.
    """
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return _bad_request(f"request body is not JSON: {_short(str(exc))}")
    if not isinstance(document, dict):
        return _bad_request("request body is not an AdmissionReview object")
    api_version, kind = document.get("apiVersion"), document.get("kind")
    if api_version != API_VERSION or kind != "AdmissionReview":
        return _bad_request(
            f"expected kind AdmissionReview, apiVersion {API_VERSION}; got kind "
            f"{_short(repr(kind))}, apiVersion {_short(repr(api_version))} "
            "(the webhook configuration must list admissionReviewVersions: [v1])"
        )
    request = document.get("request")
    if not isinstance(request, dict):
        return _bad_request("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > _MAX_UID:
        return _bad_request("AdmissionReview request has no uid (or one that is not a UID)")

    subject = _subject(request)
    resource_kind = _get(request, "kind", "kind")
    operation = request.get("operation")
    if resource_kind not in KINDS:
        shown = _short(repr(resource_kind))
        return _allowed(uid, subject, f"kind {shown} is not injected (only {', '.join(KINDS)})")
    # A pod's containers are fixed once it exists; workload templates may change on UPDATE.
    injected_on = ("CREATE", "UPDATE") if resource_kind in WORKLOAD_KINDS else ("CREATE",)
    if operation not in injected_on:
        shown = _short(repr(operation))
        return _allowed(uid, subject, f"{shown} of a {resource_kind} is not injected")
    obj = request.get("object")
    if not isinstance(obj, dict):
        message = f"request.object is missing: no {resource_kind} to inject into"
        return _denied(uid, subject, message)
    namespace = request.get("namespace")
    try:
        decided = plan(
            obj,
            settings,
            kind=resource_kind,
            namespace=namespace if isinstance(namespace, str) else None,
            namespace_enabled=namespace_enabled,
        )
        if not isinstance(decided, Sidecar):
            return _allowed(uid, subject, decided.reason)
        ops = operations(obj, decided, resource_kind)
    except InjectionError as exc:
        return _denied(uid, subject, str(exc))
    encoded = base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode()
    response = {"uid": uid, "allowed": True, "patchType": "JSONPatch", "patch": encoded}
    return Reply(200, _envelope(response), "injected", "", subject)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context for the certificate chain and key (PEM); TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


@dataclass
class Certificates:
    """The serving certificate, loaded again into the same context when its files change.

    Loading into the live context means new connections get the new certificate while open
    ones keep theirs; a half-written pair (key and certificate not matching yet) is skipped
    and tried again at the next check.
    """

    cert_file: str
    key_file: str
    context: ssl.SSLContext = field(init=False)
    _stamp: tuple[tuple[int, int], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.context = tls_context(self.cert_file, self.key_file)
        self._stamp = self._current_stamp()

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since the last load; whether it did."""
        try:
            stamp = self._current_stamp()
        except OSError:
            return False
        if stamp == self._stamp:
            return False
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("certificate_reload_failed", error=str(exc))
            return False
        self._stamp = stamp
        log.info("certificate_reloaded", cert=self.cert_file)
        return True

    def _current_stamp(self) -> tuple[tuple[int, int], ...]:
        # os.stat follows the symlinks a Secret volume swaps on update.
        stats = [os.stat(path) for path in (self.cert_file, self.key_file)]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)


class WebhookServer:
    """``POST /mutate`` and ``GET /healthz`` over HTTPS; `start` returns the bound port."""

    def __init__(
        self,
        settings: Settings,
        certificates: Certificates,
        host: str,
        port: int,
        reload_seconds: float = RELOAD_SECONDS,
    ) -> None:
        #: Replaced whole (never mutated) when the API server's version changes what to inject.
        self.settings = settings
        #: Whether the API server's version was read (`commands.detect_native`).
        self.version_known = False
        self.certificates = certificates
        self.host = host
        self.port = port
        self._reload_seconds = reload_seconds
        self._listener = Listener("HTTPS", host, port, shutdown_timeout=SHUTDOWN_SECONDS)
        self._reloader: asyncio.Task[None] | None = None

    def application(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(MUTATE, self._mutate)
        app.router.add_post(MUTATE_ENABLED, self._mutate)
        app.router.add_get("/healthz", self._healthz)
        return app

    async def start(self) -> int:
        port = await self._listener.start(self.application(), self.certificates.context)
        self._reloader = asyncio.create_task(self._reload_forever())
        log.info("webhook_started", address=f"{self.host}:{port}", image=self.settings.image)
        return port

    async def stop(self) -> None:
        """Stop listening; reviews in flight finish first."""
        if self._reloader is not None:
            self._reloader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reloader
            self._reloader = None
        await self._listener.stop()

    async def _reload_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reload_seconds)
            self.certificates.reload_if_changed()

    async def _mutate(self, request: web.Request) -> web.Response:
        refused: BodyRefused | None = None
        try:
            body = await read_body(request, MAX_BODY_BYTES)
        except BodyRefused as exc:
            refused = exc
            reply = _bad_request(str(exc), status=exc.status)
        else:
            enabled = request.path == MUTATE_ENABLED
            reply = review(body, self.settings, namespace_enabled=enabled)
        if reply.outcome == "injected":
            log.info("sidecar_injected", object=reply.subject)
        elif reply.outcome == "unchanged" and reply.message:
            log.info("sidecar_not_injected", object=reply.subject, reason=reply.message)
        elif reply.outcome == "denied":
            log.warning("injection_denied", object=reply.subject, reason=reply.message)
        elif reply.outcome == "bad_request":
            log.warning("bad_admission_request", reason=reply.message)
        response = web.json_response(reply.body, status=reply.status)
        return response if refused is None else refused.answer(response)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")


def _envelope(response: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _allowed(uid: str, subject: str, message: str) -> Reply:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    return Reply(200, _envelope(response), "unchanged", message, subject)


def _denied(uid: str, subject: str, message: str) -> Reply:
    status = {"status": "Failure", "code": 400, "reason": "BadRequest", "message": message}
    response = {"uid": uid, "allowed": False, "status": status}
    return Reply(200, _envelope(response), "denied", message, subject)


def _bad_request(message: str, status: int = 400) -> Reply:
    """Not a v1 review with a uid: no admission answer is possible, so say why over HTTP."""
    failure = {"status": "Failure", "code": status, "reason": "BadRequest", "message": message}
    response = {"uid": "", "allowed": False, "status": failure}
    return Reply(status, _envelope(response), "bad_request", message)


def _subject(request: dict[str, Any]) -> str:
    """``namespace/name`` for the log; a pod of a ReplicaSet has only its generateName yet."""
    name = request.get("name") or _get(request, "object", "metadata", "generateName") or "?"
    namespace = request.get("namespace") or ""
    return _short(f"{namespace}/{name}" if namespace else str(name), limit=80)


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(name)
    return obj


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
