"""The webhook's own certificate, for clusters without cert-manager: made with openssl, kept in a
Secret, its CA put in the webhook configuration's caBundle through the API server.

The API server is played by an HTTPS server on 127.0.0.1 (real TLS, real HTTP) that keeps the
Secret and the MutatingWebhookConfiguration as the API server does: resourceVersion checked on
update, 409 on a second create, JSON Patch applied (a failed ``test`` is a 422), every call's
bearer token recorded. The certificates are read back with `cryptography` (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import datetime
import json
import os
import re
import signal
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
import structlog
from aiohttp import web
from conftest import require_binary
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID
from support.certs import write_certificate

from sidecar.injector import bootstrap, certificate, commands
from sidecar.injector.apiserver import Client, pod_image
from sidecar.injector.bootstrap import Keeper, Target, ca_bundle_patch, parse_target
from sidecar.injector.webhook import Certificates, tls_context

NAMESPACE = "ratelimit-sidecar"
SERVICE = "ratelimit-sidecar-webhook"
SECRET = "ratelimit-sidecar-webhook-tls"
CONFIG = "ratelimit-sidecar"
TOKEN = "the-service-account-token"
SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
CONFIG_PATH = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{CONFIG}"


@pytest.fixture(autouse=True)
def _openssl() -> None:
    require_binary("openssl")


def configuration() -> dict[str, Any]:
    """The base's MutatingWebhookConfiguration as the API server returns it: two entries calling
    the webhook's Service, and a third (another product's) calling a URL."""

    def hook(name: str, path: str) -> dict[str, Any]:
        service = {"namespace": NAMESPACE, "name": SERVICE, "path": path, "port": 443}
        return {"name": name, "clientConfig": {"service": service}, "sideEffects": "None"}

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIG, "resourceVersion": "1"},
        "webhooks": [
            hook("namespace.inject.ratelimit-sidecar.io", "/mutate/injection-enabled"),
            {"name": "other.example.com", "clientConfig": {"url": "https://other.example/"}},
            hook("pod.inject.ratelimit-sidecar.io", "/mutate"),
        ],
    }


@dataclass
class ApiServer:
    """What the stand-in API server holds and saw."""

    environ: dict[str, str]
    account: Path
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    configuration: dict[str, Any] = field(default_factory=configuration)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: (method, path, Authorization, Content-Type, body) of every call.
    calls: list[tuple[str, str, str | None, str | None, Any]] = field(default_factory=list)
    #: Statuses to answer the next calls of a method with, before doing what it asks.
    refuse: dict[str, list[int]] = field(default_factory=dict)
    #: Each called before one write is done, in turn (another replica's write, a user's edit).
    before_write: list[Any] = field(default_factory=list)
    version: int = 1

    def client(self) -> Client:
        return Client.in_cluster(self.environ, self.account)

    def made(self, method: str) -> list[tuple[str, Any]]:
        return [(path, body) for m, path, _, _, body in self.calls if m == method]


def status(code: int, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    return web.json_response({**body, "code": code}, status=code)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[ApiServer]:
    """The stand-in API server on a free loopback port, with a service account directory."""
    (tmp_path / "api").mkdir()
    cert_file, key_file = write_certificate(tmp_path / "api")
    account = tmp_path / "account"
    account.mkdir()
    (account / "ca.crt").write_bytes(cert_file.read_bytes())
    (account / "token").write_text(TOKEN + "\n")
    state = ApiServer({}, account)

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        state.calls.append(
            (
                request.method,
                request.path,
                request.headers.get("Authorization"),
                request.headers.get("Content-Type"),
                body,
            )
        )
        refused = state.refuse.get(request.method)
        if refused:
            return status(refused.pop(0), "refused by the test")
        if request.method != "GET" and state.before_write:
            state.before_write.pop(0)(state)
        return answer(request, body)

    def answer(request: web.Request, body: Any) -> web.Response:
        path, method = request.path, request.method
        if path == "/version":
            return web.json_response({"major": "1", "minor": "30"})
        if path == CONFIG_PATH:
            if method == "GET":
                return web.json_response(state.configuration)
            if request.headers.get("Content-Type") != "application/json-patch+json":
                return status(415, "unsupported patch type")
            try:
                patched = jsonpatch.apply_patch(state.configuration, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                return status(422, str(exc))
            state.configuration = patched
            return web.json_response(patched)
        if path.startswith(f"/api/v1/namespaces/{NAMESPACE}/pods/"):
            pod = state.pods.get(path.rpartition("/")[2])
            return web.json_response(pod) if pod else status(404, "pod not found")
        if path == SECRETS and method == "POST":
            name = body["metadata"]["name"]
            if name in state.secrets:
                return status(409, f'secrets "{name}" already exists')
            return web.json_response(store(body), status=201)
        name = path.removeprefix(SECRETS + "/")
        if method == "GET":
            found = state.secrets.get(name)
            return web.json_response(found) if found else status(404, "not found")
        if method == "PUT":
            current = state.secrets.get(name)
            if current is None:
                return status(404, "not found")
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return status(409, "the object has been modified")
            return web.json_response(store(body))
        return status(405, "not here")

    def store(secret: dict[str, Any]) -> dict[str, Any]:
        state.version += 1
        secret = copy.deepcopy(secret)
        secret["metadata"]["resourceVersion"] = str(state.version)
        state.secrets[secret["metadata"]["name"]] = secret
        return secret

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(
        runner, "127.0.0.1", 0, ssl_context=tls_context(str(cert_file), str(key_file))
    )
    await site.start()
    port = runner.addresses[0][1]
    state.environ.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(port))
    yield state
    await runner.cleanup()


def keeper(api: ApiServer, directory: Path) -> Keeper:
    directory.mkdir(exist_ok=True)
    return Keeper(
        api.client(),
        NAMESPACE,
        SECRET,
        SERVICE,
        (Target("mutating", CONFIG),),
        directory / "tls.crt",
        directory / "tls.key",
    )


def secret_data(api: ApiServer, key: str) -> bytes:
    return base64.b64decode(api.secrets[SECRET]["data"][key])


async def handshake(port: int, ca: bytes, server_name: str) -> x509.Certificate:
    """The certificate a TLS server on 127.0.0.1 presents, verified against `ca` for the name."""
    context = ssl.create_default_context(cadata=ca.decode())
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=server_name
    )
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return x509.load_der_x509_certificate(der)


# --- the certificate -----------------------------------------------------------------------


def test_the_serving_certificate_names_the_service_and_is_valid_for_a_year(
    tmp_path: Path,
) -> None:
    """The CA signs only serving certificates; the serving certificate names the Service's DNS
    names (the API server calls SERVICE.NAMESPACE.svc), is valid from now for SERVING_DAYS,
    serves TLS only, and its signature verifies with the CA's key."""
    authority = certificate.new_authority("test CA", tmp_path)
    names = certificate.service_names(SERVICE, NAMESPACE)
    serving = certificate.issue_serving(authority, names, tmp_path, certificate.SERVING_DAYS)
    ca = x509.load_pem_x509_certificate(authority.cert)
    cert = x509.load_pem_x509_certificate(serving.cert)
    now = datetime.datetime.now(datetime.UTC)

    assert names[0] == f"{SERVICE}.{NAMESPACE}.svc"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "ratelimit-sidecar-webhook.ratelimit-sidecar.svc",
        "ratelimit-sidecar-webhook.ratelimit-sidecar.svc.cluster.local",
        "ratelimit-sidecar-webhook.ratelimit-sidecar",
        "ratelimit-sidecar-webhook",
    ]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime == datetime.timedelta(days=certificate.SERVING_DAYS)
    assert abs(cert.not_valid_before_utc - now) < datetime.timedelta(minutes=5)
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)

    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert (constraints.ca, constraints.path_length) == (True, 0)
    assert ca.not_valid_after_utc - ca.not_valid_before_utc == datetime.timedelta(
        days=certificate.CA_DAYS
    )
    assert certificate.expires_within(serving.cert, certificate.RENEW_SECONDS) is False
    assert certificate.expires_within(serving.cert, (certificate.SERVING_DAYS + 1) * 86400)
    assert certificate.expires_within(b"not a certificate", 0) is True


async def test_the_made_certificate_serves_tls_for_the_service_name(tmp_path: Path) -> None:
    """A TLS client that trusts only the CA (as the API server does with caBundle) completes a
    handshake for the Service's name, and refuses a name the certificate does not carry."""
    authority = certificate.new_authority("test CA", tmp_path)
    names = certificate.service_names(SERVICE, NAMESPACE)
    serving = certificate.issue_serving(authority, names, tmp_path, 1)
    (tmp_path / "tls.crt").write_bytes(serving.cert)
    (tmp_path / "tls.key").write_bytes(serving.key)
    server = await asyncio.start_server(
        lambda r, w: w.close(),
        "127.0.0.1",
        0,
        ssl=tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")),
    )
    port = server.sockets[0].getsockname()[1]
    try:
        presented = await handshake(port, authority.cert, names[0])
        assert presented.public_bytes(Encoding.PEM) == serving.cert
        with pytest.raises(ssl.SSLCertVerificationError):
            await handshake(port, authority.cert, "elsewhere.ratelimit-sidecar.svc")
    finally:
        server.close()
        await server.wait_closed()


def test_names_that_are_not_dns_names_are_refused(tmp_path: Path) -> None:
    """A name that could change the OpenSSL config line is refused before openssl runs."""
    authority = certificate.new_authority("test CA", tmp_path)
    for names in (("a.svc, DNS:evil.example",), ("a\nb",), ()):
        with pytest.raises(ValueError, match="DNS name"):
            certificate.issue_serving(authority, names, tmp_path, 1)


# --- the caBundle patch ---------------------------------------------------------------------


def test_the_patch_puts_the_ca_in_each_entry_calling_the_service_guarded_by_its_name() -> None:
    """Entries calling the Service get the CA, each after a test of its name; an entry calling
    something else is left alone; an entry that has the CA already needs nothing."""
    ca = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    value = base64.b64encode(ca).decode()
    document = configuration()
    assert ca_bundle_patch(document, NAMESPACE, SERVICE, ca) == [
        {
            "op": "test",
            "path": "/webhooks/0/name",
            "value": "namespace.inject.ratelimit-sidecar.io",
        },
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": value},
        {"op": "test", "path": "/webhooks/2/name", "value": "pod.inject.ratelimit-sidecar.io"},
        {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": value},
    ]
    document["webhooks"][0]["clientConfig"]["caBundle"] = value
    assert [op["path"] for op in ca_bundle_patch(document, NAMESPACE, SERVICE, ca)] == [
        "/webhooks/2/name",
        "/webhooks/2/clientConfig/caBundle",
    ]
    document["webhooks"][2]["clientConfig"]["caBundle"] = value
    assert ca_bundle_patch(document, NAMESPACE, SERVICE, ca) == []
    assert ca_bundle_patch(document, "elsewhere", SERVICE, ca) == []


def test_targets_are_mutating_or_validating_configurations() -> None:
    """--ca-bundle-for takes mutating/NAME or validating/NAME, each to its API path."""
    assert parse_target("mutating/ratelimit-sidecar").path == CONFIG_PATH
    assert parse_target("validating/x").path.endswith("/validatingwebhookconfigurations/x")
    for text in ("ratelimit-sidecar", "mutating/", "other/x", "mutating/a/b"):
        with pytest.raises(ValueError, match="mutating/NAME or validating/NAME"):
            parse_target(text)


# --- against the API server -----------------------------------------------------------------


async def test_a_first_start_makes_the_secret_and_patches_the_ca_bundle(
    api: ApiServer, tmp_path: Path
) -> None:
    """No Secret: the webhook creates one with a CA and a serving certificate, writes the pair to
    its files, and patches the configuration's caBundle with exactly the CA, every call carrying
    the service account's token; the files then serve TLS the caBundle verifies."""
    kept = keeper(api, tmp_path / "files")
    await kept.keep()

    assert {auth for _, _, auth, _, _ in api.calls} == {f"Bearer {TOKEN}"}
    assert [(m, p) for m, p, _, _, _ in api.calls] == [
        ("GET", f"{SECRETS}/{SECRET}"),
        ("POST", SECRETS),
        ("GET", CONFIG_PATH),
        ("PATCH", CONFIG_PATH),
    ]
    ((_, created),) = api.made("POST")
    assert created["type"] == "kubernetes.io/tls"
    assert created["metadata"]["annotations"][bootstrap.NAMES_ANNOTATION] == ",".join(
        certificate.service_names(SERVICE, NAMESPACE)
    )
    assert set(created["data"]) == {"tls.crt", "tls.key", "ca.crt", "ca.key"}
    ca = secret_data(api, "ca.crt")
    value = base64.b64encode(ca).decode()
    ((_, operations),) = api.made("PATCH")
    assert operations == [
        {
            "op": "test",
            "path": "/webhooks/0/name",
            "value": "namespace.inject.ratelimit-sidecar.io",
        },
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": value},
        {"op": "test", "path": "/webhooks/2/name", "value": "pod.inject.ratelimit-sidecar.io"},
        {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": value},
    ]
    patch_type = [t for m, _, _, t, _ in api.calls if m == "PATCH"]
    assert patch_type == ["application/json-patch+json"]
    assert "caBundle" not in api.configuration["webhooks"][1]["clientConfig"]

    assert (tmp_path / "files" / "tls.crt").read_bytes() == secret_data(api, "tls.crt")
    assert (tmp_path / "files" / "tls.key").read_bytes() == secret_data(api, "tls.key")
    assert (tmp_path / "files" / "tls.key").stat().st_mode & 0o077 == 0
    certificates = Certificates(
        str(tmp_path / "files" / "tls.crt"), str(tmp_path / "files" / "tls.key")
    )
    server = await asyncio.start_server(
        lambda r, w: w.close(), "127.0.0.1", 0, ssl=certificates.context
    )
    try:
        bundle = base64.b64decode(api.configuration["webhooks"][2]["clientConfig"]["caBundle"])
        await handshake(server.sockets[0].getsockname()[1], bundle, f"{SERVICE}.{NAMESPACE}.svc")
    finally:
        server.close()
        await server.wait_closed()


async def test_another_replica_uses_the_same_certificate_and_patches_nothing(
    api: ApiServer, tmp_path: Path
) -> None:
    """A second replica reads the Secret the first made: same files, no write at all."""
    await keeper(api, tmp_path / "first").keep()
    api.calls.clear()
    await keeper(api, tmp_path / "second").keep()
    assert [m for m, _, _, _, _ in api.calls] == ["GET", "GET"]
    for name in ("tls.crt", "tls.key"):
        assert (tmp_path / "second" / name).read_bytes() == (tmp_path / "first" / name).read_bytes()


async def test_a_replica_that_loses_the_race_to_create_the_secret_uses_the_winners(
    api: ApiServer, tmp_path: Path
) -> None:
    """Two replicas start together: the second one's create gets a 409, and it serves the
    certificate the first one stored, so the caBundle trusts both."""
    winner = tmp_path / "winner"
    await keeper(api, winner).keep()
    made = api.secrets.pop(SECRET)

    def first_replica_creates(state: ApiServer) -> None:
        state.secrets[SECRET] = made  # between our GET and our POST

    api.before_write.append(first_replica_creates)
    api.calls.clear()
    await keeper(api, tmp_path / "loser").keep()
    assert [(m, p) for m, p, _, _, _ in api.calls][:3] == [
        ("GET", f"{SECRETS}/{SECRET}"),
        ("POST", SECRETS),
        ("GET", f"{SECRETS}/{SECRET}"),
    ]
    assert (tmp_path / "loser" / "tls.crt").read_bytes() == (winner / "tls.crt").read_bytes()
    assert not api.made("PATCH")  # the winner's CA is the caBundle already


async def test_a_configuration_that_changed_under_the_patch_is_read_again(
    api: ApiServer, tmp_path: Path
) -> None:
    """Someone reorders the entries between the webhook's read and its patch: the patch's test
    fails (422), the webhook reads the configuration again and patches the moved entries."""

    def reorder(state: ApiServer) -> None:
        state.configuration["webhooks"].reverse()

    kept = keeper(api, tmp_path / "files")
    api.before_write.append(lambda state: None)  # the Secret's POST
    api.before_write.append(reorder)  # the first PATCH
    await kept.keep()
    patches = api.made("PATCH")
    assert len(patches) == 2
    assert patches[1][1][0] == {
        "op": "test",
        "path": "/webhooks/0/name",
        "value": "pod.inject.ratelimit-sidecar.io",
    }
    ca = base64.b64encode(secret_data(api, "ca.crt")).decode()
    bundles = {
        hook["name"]: hook["clientConfig"].get("caBundle") for hook in api.configuration["webhooks"]
    }
    assert bundles == {
        "pod.inject.ratelimit-sidecar.io": ca,
        "other.example.com": None,
        "namespace.inject.ratelimit-sidecar.io": ca,
    }


async def test_a_serving_certificate_near_its_end_is_renewed_from_the_same_ca(
    api: ApiServer, tmp_path: Path
) -> None:
    """A Secret whose serving certificate has less than RENEW_SECONDS left is replaced (PUT, with
    the version read) by one from the same CA: the caBundle needs no patch, the files change."""
    await keeper(api, tmp_path / "files").keep()
    ca_before = secret_data(api, "ca.crt")
    authority = certificate.Pair(ca_before, secret_data(api, "ca.key"))
    names = certificate.service_names(SERVICE, NAMESPACE)
    short = certificate.issue_serving(authority, names, tmp_path, 10)  # 10 days left
    stored = bootstrap.Stored(authority, short)
    version = api.secrets[SECRET]["metadata"]["resourceVersion"]
    api.secrets[SECRET] = bootstrap.secret_document(SECRET, NAMESPACE, names, stored, version)
    api.calls.clear()

    await keeper(api, tmp_path / "files").keep()
    ((path, replaced),) = api.made("PUT")
    assert path == f"{SECRETS}/{SECRET}"
    assert replaced["metadata"]["resourceVersion"] == version
    assert secret_data(api, "ca.crt") == ca_before
    renewed = x509.load_pem_x509_certificate(secret_data(api, "tls.crt"))
    remaining = renewed.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert remaining > datetime.timedelta(days=certificate.SERVING_DAYS - 1)
    assert (tmp_path / "files" / "tls.crt").read_bytes() == secret_data(api, "tls.crt")
    assert not api.made("PATCH")


async def test_a_removed_ca_bundle_is_put_back(api: ApiServer, tmp_path: Path) -> None:
    """Someone applies the configuration again without caBundle: the next round patches it."""
    kept = keeper(api, tmp_path / "files")
    await kept.keep()
    for hook in api.configuration["webhooks"]:
        hook["clientConfig"].pop("caBundle", None)
    api.calls.clear()
    await kept.keep()
    assert len(api.made("PATCH")) == 1
    assert api.configuration["webhooks"][0]["clientConfig"]["caBundle"]


@pytest.mark.parametrize(
    ("refused", "message"),
    [
        ({"GET": [403]}, "Secret ratelimit-sidecar/ratelimit-sidecar-webhook-tls: HTTP 403: "),
        ({"PATCH": [403]}, "mutating/ratelimit-sidecar: HTTP 403: refused by the test"),
        (
            {"PATCH": [422] * bootstrap.MAX_ATTEMPTS},
            "mutating/ratelimit-sidecar: still conflicting after 5 attempts",
        ),
    ],
)
async def test_a_refusal_says_what_and_why(
    api: ApiServer, tmp_path: Path, refused: dict[str, list[int]], message: str
) -> None:
    """RBAC refusing, or a conflict that never ends, stops the start with the object and the
    API server's reason (the webhook then exits 1 and is restarted)."""
    api.refuse = refused
    with pytest.raises(OSError, match="^" + re.escape(message)):
        await keeper(api, tmp_path / "files").keep()


async def test_a_configuration_with_no_entry_calling_the_service_is_an_error(
    api: ApiServer, tmp_path: Path
) -> None:
    """A --service that no entry calls would leave every caBundle empty: it is refused."""
    for hook in api.configuration["webhooks"]:
        if "service" in hook["clientConfig"]:
            hook["clientConfig"]["service"]["name"] = "renamed"
    with pytest.raises(OSError, match="no webhook in it calls Service"):
        await keeper(api, tmp_path / "files").keep()


async def test_the_webhook_injects_its_own_pods_image(api: ApiServer) -> None:
    """Without --image, the image injected is the one the webhook's own pod runs."""
    image = "registry.example.com/ratelimit-sidecar:1.2.3"
    api.pods["webhook-abc"] = {
        "spec": {"containers": [{"name": "webhook", "image": image}]},
    }
    assert await pod_image(api.client(), NAMESPACE, "webhook-abc") == image
    with pytest.raises(OSError, match="give --image, or let its service account get pods"):
        await pod_image(api.client(), NAMESPACE, "gone")
    (_, path, auth, _, _) = api.calls[0]
    assert (path, auth) == (f"/api/v1/namespaces/{NAMESPACE}/pods/webhook-abc", f"Bearer {TOKEN}")


async def test_the_webhook_command_trusts_itself_before_it_listens_and_injects_its_pods_image(
    api: ApiServer, tmp_path: Path
) -> None:
    """`webhook --certificate-secret --ca-bundle-for` in a pod (POD_NAME, no --image): a first
    refusal (RBAC not there yet) is tried again; the caBundle is patched before it listens; a client that trusts only that caBundle
    reaches it by the Service's name; the sidecar it injects runs its own pod's image; SIGTERM
    stops it with status 0."""
    image = "registry.example.com/ratelimit-sidecar:1.2.3"
    api.pods["webhook-0"] = {"spec": {"containers": [{"name": "webhook", "image": image}]}}
    (api.account / "namespace").write_text(NAMESPACE)
    files = tmp_path / "files"
    files.mkdir()
    parser = argparse.ArgumentParser(prog="ratelimit-sidecar")
    commands.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "webhook",
            f"--tls-cert={files / 'tls.crt'}",
            f"--tls-key={files / 'tls.key'}",
            "--address=127.0.0.1:0",
            f"--certificate-secret={SECRET}",
            f"--ca-bundle-for=mutating/{CONFIG}",
        ]
    )
    settings = commands._settings(args, "webhook")
    assert settings is not None
    environ = {**api.environ, "POD_NAME": "webhook-0"}
    # Its RBAC is not there yet at the first try (a first install): it tries again.
    api.refuse = {"GET": [403]}
    with structlog.testing.capture_logs() as logs:
        start = commands._start(args, settings, True, environ, api.account, retry_seconds=(0,))
        task = asyncio.create_task(start)
        deadline = asyncio.get_running_loop().time() + 30
        while not any(e["event"] == "webhook_started" for e in logs):
            assert not task.done(), task.result()
            assert asyncio.get_running_loop().time() < deadline, logs
            await asyncio.sleep(0.01)
        events = [e["event"] for e in logs]
        assert events.index("ca_bundle_patched") < events.index("webhook_started")
        (failed,) = [e for e in logs if e["event"] == "certificate_keeping_failed"]
        assert "HTTP 403: refused by the test" in failed["error"]
        (started,) = [e for e in logs if e["event"] == "webhook_started"]
        assert started["image"] == image
        port = int(started["address"].rpartition(":")[2])
        bundle = base64.b64decode(api.configuration["webhooks"][0]["clientConfig"]["caBundle"])
        client_tls = ssl.create_default_context(cadata=bundle.decode())
        review = (Path(__file__).parent / "admission" / "pod_create.json").read_bytes()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"https://127.0.0.1:{port}/mutate",
                data=review,
                ssl=client_tls,
                server_hostname=f"{SERVICE}.{NAMESPACE}.svc",
            ) as response,
        ):
            answer = await response.json()
        os.kill(os.getpid(), signal.SIGTERM)
        assert await task == 0
    operations = json.loads(base64.b64decode(answer["response"]["patch"]))
    images = [op["value"]["image"] for op in operations if isinstance(op.get("value"), dict) and "image" in op["value"]]  # fmt: skip
    assert images == [image]
