"""The admission webhook: AdmissionReview v1 JSON in, a base64 JSON Patch out; hostile input
answered clearly; HTTPS only, with a certificate the tests make; the `webhook` command."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import os
import select
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
import structlog
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from support.certs import write_certificate
from support.kube import assert_valid

from sidecar.http import bodies as http_bodies
from sidecar.injector.commands import detect_native
from sidecar.injector.settings import Settings
from sidecar.injector.webhook import (
    MAX_BODY_BYTES,
    Certificates,
    Reply,
    WebhookServer,
    review,
    tls_context,
)

SETTINGS = Settings(image="registry.example/ratelimit-sidecar:0.1.0")
POD_CREATE = Path(__file__).parent / "admission" / "pod_create.json"


def pod_review() -> dict[str, Any]:
    """The AdmissionReview an API server sends for a gateway pod its ReplicaSet creates."""
    document: dict[str, Any] = json.loads(POD_CREATE.read_text())
    return document


def ask(document: Any) -> Reply:
    return review(json.dumps(document).encode(), SETTINGS)


def patched(reply: Reply, obj: dict[str, Any]) -> dict[str, Any]:
    response = reply.body["response"]
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"], validate=True))
    result: dict[str, Any] = jsonpatch.JsonPatch(ops).apply(obj)
    return result


def assert_no_patch(reply: Reply, uid: str) -> None:
    assert reply.status == 200
    assert reply.body == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": True},
    }


def denied_message(reply: Reply, uid: str) -> str:
    assert reply.status == 200
    assert reply.outcome == "denied"
    response = reply.body["response"]
    assert (response["uid"], response["allowed"]) == (uid, False)
    assert response["status"]["code"] == 400
    message: str = response["status"]["message"]
    return message


def bad_request_message(reply: Reply) -> str:
    assert reply.status == 400
    assert reply.outcome == "bad_request"
    assert reply.body["apiVersion"] == "admission.k8s.io/v1"
    response = reply.body["response"]
    assert response["allowed"] is False
    message: str = response["status"]["message"]
    return message


# --- review ----------------------------------------------------------------------------------


def test_a_real_review_gets_a_patch_that_makes_a_valid_pod_with_the_sidecar() -> None:
    """The uid is echoed, the patch is base64 JSON Patch, and the patched pod is a valid Pod
    with the sidecar beside Envoy and the rules volume beside the existing ones."""
    document = pod_review()
    reply = ask(document)
    assert reply.status == 200
    assert reply.outcome == "injected"
    assert reply.body["response"]["uid"] == "0df28fbd-5f5f-11e8-bc74-36e6bb280816"
    assert reply.body["response"]["allowed"] is True
    pod = patched(reply, document["request"]["object"])
    assert_valid(pod)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["envoy"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["name"] == "ratelimit-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "registry.example/ratelimit-sidecar:0.1.0"
    assert [v["name"] for v in pod["spec"]["volumes"]] == [
        "envoy-config",
        "kube-api-access-8x2lq",
        "ratelimit-sidecar-rules",
        "ratelimit-sidecar-socket",
    ]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30
    assert "ratelimit-sidecar/status" in pod["metadata"]["annotations"]


def test_a_gateway_on_8080_and_8081_annotated_only_to_inject_gets_a_sidecar_envoy_reaches() -> None:
    """With nothing but ratelimit-sidecar/inject: the sidecar serves gRPC on the socket that
    Envoy's container now mounts, and HTTP on the first port Envoy does not declare."""
    for native in (True, False):
        document = pod_review()
        pod = document["request"]["object"]
        pod["metadata"]["annotations"] = {"ratelimit-sidecar/inject": "true"}
        (envoy,) = pod["spec"]["containers"]
        envoy["ports"] = [
            {"name": "http", "containerPort": 8080, "protocol": "TCP"},
            {"name": "https", "containerPort": 8081, "protocol": "TCP"},
        ]
        reply = review(json.dumps(document).encode(), Settings(native_sidecars=native))
        injected = patched(reply, pod)
        assert_valid(injected)
        where = "initContainers" if native else "containers"
        (sidecar,) = [c for c in injected["spec"][where] if c["name"] == "ratelimit-sidecar"]
        args = sidecar["args"]
        assert args[args.index("--grpc-address") + 1] == "unix:/var/run/ratelimit-sidecar/rls.sock"
        assert args[args.index("--http-address") + 1] == "0.0.0.0:8082"
        mounts = injected["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "ratelimit-sidecar-socket", "mountPath": "/var/run/ratelimit-sidecar",
                "readOnly": True} in mounts  # fmt: skip


@pytest.mark.parametrize("namespace", ["kube-system", "kube-public"])
def test_pods_of_kube_system_and_kube_public_are_allowed_unchanged(namespace: str) -> None:
    """Even if the webhook configuration sends them, and they ask for the sidecar."""
    document = pod_review()
    document["request"]["namespace"] = namespace
    reply = ask(document)
    assert_no_patch(reply, "0df28fbd-5f5f-11e8-bc74-36e6bb280816")
    assert reply.message == f"pods in {namespace} are never injected"


def test_a_labelled_namespace_injects_pods_without_the_annotation_but_not_those_saying_false() -> (
    None
):
    """review(namespace_enabled=True), as the /mutate/injection-enabled path calls it."""
    document = pod_review()
    annotations = document["request"]["object"]["metadata"]["annotations"]
    del annotations["ratelimit-sidecar/inject"]
    body = json.dumps(document).encode()
    assert review(body, SETTINGS, namespace_enabled=True).outcome == "injected"
    assert review(body, SETTINGS).outcome == "unchanged"
    annotations["ratelimit-sidecar/inject"] = "false"
    body = json.dumps(document).encode()
    assert review(body, SETTINGS, namespace_enabled=True).outcome == "unchanged"


def test_a_second_review_of_the_patched_pod_has_no_patch() -> None:
    """Reviewing the result again (a reinvocation) allows it with no patch."""
    document = pod_review()
    pod = patched(ask(document), document["request"]["object"])
    again = copy.deepcopy(document)
    again["request"]["object"] = pod
    assert_no_patch(ask(again), "0df28fbd-5f5f-11e8-bc74-36e6bb280816")


@pytest.mark.parametrize("value", [None, "false", "False"])
def test_a_pod_that_does_not_ask_is_allowed_unchanged(value: str | None) -> None:
    """No inject annotation, or "false": allowed, no patch."""
    document = pod_review()
    annotations = document["request"]["object"]["metadata"]["annotations"]
    del annotations["ratelimit-sidecar/inject"]
    if value is not None:
        annotations["ratelimit-sidecar/inject"] = value
    assert_no_patch(ask(document), "0df28fbd-5f5f-11e8-bc74-36e6bb280816")


def test_an_unparsable_backend_is_denied_with_the_annotation_and_the_reason() -> None:
    """A bad annotation is an admission error that names it, never a broken pod."""
    document = pod_review()
    annotations = document["request"]["object"]["metadata"]["annotations"]
    annotations["ratelimit-sidecar/backend"] = "redis://redis:70000"
    assert denied_message(ask(document), "0df28fbd-5f5f-11e8-bc74-36e6bb280816") == (
        "ratelimit-sidecar/backend: 'redis://redis:70000': bad port in 'redis:70000' "
        "(want a number from 1 to 65535)"
    )


def test_a_deployment_template_is_patched_on_create_and_update() -> None:
    """Workloads sent to the webhook get the sidecar in spec.template; Pods only on CREATE."""
    document = pod_review()
    pod = document["request"]["object"]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gateway", "namespace": "gateway"},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}},
            "template": {"metadata": pod["metadata"], "spec": pod["spec"]},
        },
    }
    del deployment["spec"]["template"]["metadata"]["ownerReferences"]
    del deployment["spec"]["template"]["metadata"]["managedFields"]
    for operation in ("CREATE", "UPDATE"):
        document["request"].update(
            operation=operation,
            kind={"group": "apps", "version": "v1", "kind": "Deployment"},
            object=deployment,
        )
        result = patched(ask(document), deployment)
        assert_valid(result)
        containers = result["spec"]["template"]["spec"]["initContainers"]
        assert containers[-1]["name"] == "ratelimit-sidecar"


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT", None])
def test_a_pod_is_patched_only_when_created(operation: str | None) -> None:
    """A pod's containers cannot change after creation: other operations pass unchanged."""
    document = pod_review()
    document["request"]["operation"] = operation
    assert_no_patch(ask(document), "0df28fbd-5f5f-11e8-bc74-36e6bb280816")


# --- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "request body is not JSON: Expecting value: line 1 column 1 (char 0)"),
        (
            b'{"apiVersion": ',
            "request body is not JSON: Expecting value: line 1 column 16 (char 15)",
        ),
        (b"\xff\xfe\x00garbage", "request body is not JSON: "),
        (b"[" * 100_000 + b"]" * 100_000, "request body is not JSON: "),
        (b"[]", "request body is not an AdmissionReview object"),
        (
            b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", '
            b'"request": {"uid": "1"}}',
            "expected kind AdmissionReview, apiVersion admission.k8s.io/v1; got kind "
            "'AdmissionReview', apiVersion 'admission.k8s.io/v1beta1' (the webhook "
            "configuration must list admissionReviewVersions: [v1])",
        ),
        (
            b'{"apiVersion": "v1", "kind": "Pod"}',
            "expected kind AdmissionReview, apiVersion admission.k8s.io/v1; got kind 'Pod', "
            "apiVersion 'v1' (the webhook configuration must list admissionReviewVersions: [v1])",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
            "AdmissionReview has no request",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
            "AdmissionReview request has no uid (or one that is not a UID)",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", '
            b'"request": {"uid": ["x"]}}',
            "AdmissionReview request has no uid (or one that is not a UID)",
        ),
    ],
)
def test_a_body_that_is_not_a_v1_review_gets_a_400_saying_why(body: bytes, message: str) -> None:
    """Malformed JSON, deep nesting, other kinds, the wrong API version, no request, no uid."""
    assert bad_request_message(review(body, SETTINGS)).startswith(message)


def test_a_huge_uid_is_not_echoed() -> None:
    """A uid far longer than a UID gets a 400 whose body stays small."""
    document = pod_review()
    document["request"]["uid"] = "u" * 1_000_000
    reply = ask(document)
    assert bad_request_message(reply)
    assert len(json.dumps(reply.body)) < 1000


@pytest.mark.parametrize("kind", ["Service", "ConfigMap", "ReplicaSet", None, 42])
def test_kinds_other_than_pods_and_workloads_are_allowed_unchanged(kind: Any) -> None:
    """A misrouted Service (or a missing kind) is allowed as it is, with the reason logged."""
    document = pod_review()
    document["request"]["kind"] = {"group": "", "version": "v1", "kind": kind}
    reply = ask(document)
    assert_no_patch(reply, "0df28fbd-5f5f-11e8-bc74-36e6bb280816")
    assert reply.message.startswith(f"kind {kind!r} is not injected")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda request: request.pop("object"),
            "request.object is missing: no Pod to inject into",
        ),
        (
            lambda request: request.update(object=[1, 2]),
            "request.object is missing: no Pod to inject into",
        ),
        (
            lambda request: request["object"].pop("spec"),
            "a Pod needs spec, the pod spec to inject into",
        ),
        (
            lambda request: request["object"]["spec"].update(containers={"name": "envoy"}),
            "the pod's spec.containers must be a list of containers",
        ),
        (
            lambda request: request["object"]["metadata"]["annotations"].update(x=7),
            "metadata.annotations must map names to string values",
        ),
        (
            lambda request: request["object"].update(metadata="gateway"),
            "metadata must be an object",
        ),
        (
            lambda request: request["object"]["spec"].update(volumes="none"),
            "the pod's spec.volumes must be a list",
        ),
    ],
)
def test_missing_or_malformed_fields_are_denied_with_a_clear_message(
    change: Any, message: str
) -> None:
    """A review with a uid but a broken object is denied, saying what is wrong."""
    document = pod_review()
    change(document["request"])
    assert denied_message(ask(document), "0df28fbd-5f5f-11e8-bc74-36e6bb280816") == message


def test_a_huge_annotation_is_denied_with_a_short_message() -> None:
    """A 256 KiB backend annotation: denied, quoted only by its start and length."""
    document = pod_review()
    annotations = document["request"]["object"]["metadata"]["annotations"]
    annotations["ratelimit-sidecar/backend"] = "redis://" + "r" * (256 * 1024)
    message = denied_message(ask(document), "0df28fbd-5f5f-11e8-bc74-36e6bb280816")
    assert message == (
        "ratelimit-sidecar/backend: backend URL is 262152 characters long; the limit is 2048"
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
KEYS = st.sampled_from(["metadata", "spec", "annotations", "containers", "volumes", "kind"])


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["Pod", "Deployment", "StatefulSet", "DaemonSet", "Job"]),
    operation=st.sampled_from(["CREATE", "UPDATE", "DELETE"]),
    obj=st.dictionaries(KEYS, JSON, max_size=5),
    spec=st.dictionaries(KEYS, JSON, max_size=4),
    annotations=st.dictionaries(
        st.sampled_from(["ratelimit-sidecar/inject", "ratelimit-sidecar/backend", "other"]),
        st.sampled_from(["true", "false", "redis://r:1", "", "x"]) | JSON,
        max_size=3,
    ),
)
def test_review_answers_any_object_without_raising(
    kind: str, operation: str, obj: dict[str, Any], spec: Any, annotations: Any
) -> None:
    """Whatever the object holds, the answer is an AdmissionReview response for the same uid."""
    obj = {**obj, "metadata": {"annotations": annotations}}
    if isinstance(spec, dict):
        obj["spec"] = {**spec, "template": {"metadata": {"annotations": annotations}, "spec": spec}}
    document = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": kind}, "operation": operation, "object": obj},
    }
    reply = ask(document)
    assert reply.status == 200
    assert reply.body["response"]["uid"] == "u-1"
    json.dumps(reply.body)


# --- HTTPS -----------------------------------------------------------------------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    return write_certificate(tmp_path)


@pytest.fixture
async def webhook(tls_files: tuple[Path, Path]) -> Any:
    """A WebhookServer on a free loopback port; yields (port, client SSL context)."""
    cert_file, key_file = tls_files
    server = WebhookServer(SETTINGS, Certificates(str(cert_file), str(key_file)), "127.0.0.1", 0)
    port = await server.start()
    yield port, ssl.create_default_context(cafile=str(cert_file))
    await server.stop()


async def test_the_webhook_answers_a_review_over_tls(webhook: Any) -> None:
    """POST /mutate over HTTPS, verified against the test's certificate: the patch comes back."""
    port, client_tls = webhook
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"https://localhost:{port}/mutate", data=POD_CREATE.read_bytes(), ssl=client_tls
        ) as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            body = await response.json()
        async with session.get(f"https://127.0.0.1:{port}/healthz", ssl=client_tls) as response:
            assert (response.status, await response.text()) == (200, "OK")
    assert body["response"]["allowed"] is True
    assert body["response"]["patchType"] == "JSONPatch"


async def test_the_injection_enabled_path_injects_pods_without_the_annotation(
    webhook: Any,
) -> None:
    """POST /mutate/injection-enabled (the labelled namespaces' entry): a pod with no inject
    annotation gets the patch; on /mutate it does not."""
    port, client_tls = webhook
    document = pod_review()
    del document["request"]["object"]["metadata"]["annotations"]["ratelimit-sidecar/inject"]
    answers = {}
    async with aiohttp.ClientSession() as session:
        for path in ("/mutate", "/mutate/injection-enabled"):
            url = f"https://127.0.0.1:{port}{path}"
            async with session.post(url, json=document, ssl=client_tls) as response:
                assert response.status == 200
                answers[path] = (await response.json())["response"]
    assert "patch" not in answers["/mutate"]
    assert answers["/mutate/injection-enabled"]["patchType"] == "JSONPatch"


@pytest.fixture
async def api_server(tmp_path: Path) -> Any:
    """An HTTPS server on loopback answering GET /version as an API server does, with the
    version a test sets; yields (environ, service account directory, state)."""
    cert_file, key_file = write_certificate(
        tmp_path / "api" if (tmp_path / "api").mkdir() is None else tmp_path
    )
    account = tmp_path / "account"
    account.mkdir()
    (account / "ca.crt").write_bytes(cert_file.read_bytes())
    (account / "token").write_text("the-token\n")
    state: dict[str, Any] = {"version": {"major": "1", "minor": "29+"}, "seen": []}

    async def version(request: web.Request) -> web.Response:
        state["seen"].append(request.headers.get("Authorization"))
        return web.json_response(state["version"])

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(
        runner, "127.0.0.1", 0, ssl_context=tls_context(str(cert_file), str(key_file))
    )
    await site.start()
    port = runner.addresses[0][1]
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
    yield environ, account, state
    await runner.cleanup()


@pytest.mark.parametrize(
    ("version", "native"),
    [
        ({"major": "1", "minor": "29+", "gitVersion": "v1.29.4-gke.1"}, True),
        ({"major": "1", "minor": "33"}, True),
        ({"major": "1", "minor": "28"}, False),
        ({"gitVersion": "v1.30.2"}, True),
    ],
)
async def test_auto_native_sidecars_follow_the_api_servers_version(
    api_server: Any, version: dict[str, str], native: bool
) -> None:
    """`webhook --native-sidecars auto`: GET /version with the service account's token and
    CA; native sidecars from 1.29 on (managed clusters' "29+" included)."""
    environ, account, state = api_server
    state["version"] = version
    server = WebhookServer(Settings(native_sidecars=not native), None, "127.0.0.1", 0)  # type: ignore[arg-type]
    await detect_native(server, environ, account)
    assert server.settings.native_sidecars is native
    assert server.version_known is True
    assert state["seen"] == ["Bearer the-token"]


async def test_an_api_server_that_cannot_be_read_means_ordinary_sidecars(
    api_server: Any, tmp_path: Path
) -> None:
    """No API server in the environment, an untrusted certificate, or an answer without a
    version: ordinary containers (they work on every version), and the reason is logged."""
    environ, account, state = api_server
    server = WebhookServer(Settings(native_sidecars=True), None, "127.0.0.1", 0)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        await detect_native(server, {}, account)
        assert server.settings.native_sidecars is False
        server.settings = Settings(native_sidecars=True)
        untrusted = tmp_path / "untrusted"
        untrusted.mkdir()
        other, _ = write_certificate(
            tmp_path / "other" if (tmp_path / "other").mkdir() is None else tmp_path
        )
        (untrusted / "ca.crt").write_bytes(other.read_bytes())
        await detect_native(server, environ, untrusted)
        assert server.settings.native_sidecars is False
        state["version"] = {"major": "one"}
        server.settings = Settings(native_sidecars=True)
        await detect_native(server, environ, account)
        assert server.settings.native_sidecars is False
    events = [e for e in logs if e["event"] == "kubernetes_version_unknown"]
    assert len(events) == 3
    assert "KUBERNETES_SERVICE_HOST" in events[0]["error"]
    assert "major and minor" in events[2]["error"]
    assert server.version_known is False


async def test_plain_http_is_refused(webhook: Any) -> None:
    """The same port spoken to in plain HTTP gives no HTTP answer at all."""
    port, _ = webhook
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(
                f"http://127.0.0.1:{port}/mutate", data=POD_CREATE.read_bytes()
            ) as response:
                await response.read()


async def test_a_review_whose_body_trickles_in_is_a_408_and_the_connection_closes(
    webhook: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends a review's headers and part of its body, then nothing, is answered
    408 in an AdmissionReview body once the body deadline passes (0.3 s here), and its
    connection is closed."""
    monkeypatch.setattr(http_bodies, "BODY_TIMEOUT", 0.3)
    port, client_tls = webhook
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_tls, server_hostname="localhost"
    )
    try:
        head = "POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        writer.write(head.encode() + b'{"kind": ')
        async with asyncio.timeout(5):
            status = await reader.readline()
            rest = await reader.read()  # to the end: the server closes the connection
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 408")
    assert b'"message": "the body took longer than 0.3 s"' in rest


async def test_hostile_bodies_over_https_get_json_answers(webhook: Any) -> None:
    """Malformed JSON gets a 400 and an oversized body a 413, each an AdmissionReview body."""
    port, client_tls = webhook
    url = f"https://127.0.0.1:{port}/mutate"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=b"{nope", ssl=client_tls) as response:
            assert response.status == 400
            body = await response.json()
            assert body["response"]["status"]["message"].startswith("request body is not JSON")
        big = io.BytesIO(b"x" * (MAX_BODY_BYTES + 1))
        async with session.post(url, data=big, ssl=client_tls) as response:
            assert response.status == 413
            body = await response.json()
            assert body["response"]["status"]["message"] == (
                f"body too large: at most {MAX_BODY_BYTES} bytes"
            )


async def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    """After the files change, new connections get the new certificate."""
    cert_file, key_file = write_certificate(tmp_path, "first")
    certificates = Certificates(str(cert_file), str(key_file))
    assert certificates.reload_if_changed() is False
    server = WebhookServer(SETTINGS, certificates, "127.0.0.1", 0)
    port = await server.start()
    try:
        write_certificate(tmp_path, "second")
        stat = os.stat(cert_file)
        os.utime(cert_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert certificates.reload_if_changed() is True
        client_tls = ssl.create_default_context(cafile=str(cert_file))
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"https://127.0.0.1:{port}/healthz", ssl=client_tls) as response,
        ):
            assert response.status == 200
    finally:
        await server.stop()


# --- the command -----------------------------------------------------------------------------

# The CLI's dispatch, as sidecar/cli/__init__.py does it once `register` is wired in.
SHIM = """
import argparse, sys
from sidecar.injector.commands import register
parser = argparse.ArgumentParser(prog="ratelimit-sidecar")
register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def test_the_webhook_command_serves_https_and_exits_0_on_sigterm(
    tls_files: tuple[Path, Path],
) -> None:
    """`ratelimit-sidecar webhook` logs its address, injects over HTTPS, stops on SIGTERM."""
    cert_file, key_file = tls_files
    argv = [sys.executable, "-c", SHIM, "webhook", "--tls-cert", str(cert_file)]
    argv += ["--tls-key", str(key_file), "--address", "127.0.0.1:0"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    with subprocess.Popen(argv, stderr=subprocess.PIPE, env=environ) as process:
        try:
            port, log = started_port(process)
            context = ssl.create_default_context(cafile=str(cert_file))
            request = urllib.request.Request(
                f"https://127.0.0.1:{port}/mutate",
                data=POD_CREATE.read_bytes(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                body = json.load(response)
            assert body["response"]["patchType"] == "JSONPatch"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.stderr is not None
        log += process.stderr.read()
    events = [json.loads(line)["event"] for line in log.splitlines()]
    assert "webhook_stopping" in events
    assert "sidecar_injected" in events
    # Not in a pod, so no API server to ask: --native-sidecars auto falls back to ordinary.
    assert "kubernetes_version_unknown" in events
    ops = json.loads(base64.b64decode(body["response"]["patch"]))
    assert ops[0]["path"] == "/spec/containers/-"


def test_the_webhook_command_refuses_missing_certificate_files(tmp_path: Path) -> None:
    """A certificate that cannot be loaded stops the start with status 2 and the reason."""
    argv = [sys.executable, "-c", SHIM, "webhook", "--tls-cert", str(tmp_path / "none.crt")]
    argv += ["--tls-key", str(tmp_path / "none.key"), "--address", "127.0.0.1:0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith("ratelimit-sidecar webhook: cannot load --tls-cert/--tls-key: ")


def started_port(process: subprocess.Popen[bytes]) -> tuple[int, bytes]:
    """The port from the webhook_started log line (within 15 s), and the log read so far."""
    assert process.stderr is not None
    fd = process.stderr.fileno()
    log = b""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        log += chunk
        for line in log.splitlines():
            event = json.loads(line) if line.endswith(b"}") else {}
            if event.get("event") == "webhook_started":
                return int(event["address"].rpartition(":")[2]), log
    raise AssertionError(f"the webhook did not start (exit status {process.poll()}): {log!r}")


def test_ca_bundle_for_without_a_certificate_secret_is_refused(tmp_path: Path) -> None:
    """--ca-bundle-for without --certificate-secret has no CA to put anywhere: status 2."""
    cert_file, key_file = write_certificate(tmp_path)
    argv = [sys.executable, "-c", SHIM, "webhook", "--tls-cert", str(cert_file)]
    argv += ["--tls-key", str(key_file), "--ca-bundle-for", "mutating/ratelimit-sidecar"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr == (
        "ratelimit-sidecar webhook: --ca-bundle-for needs --certificate-secret "
        "(the CA comes from it)\n"
    )


def test_a_webhook_that_cannot_reach_its_api_server_for_its_certificate_exits_1(
    tmp_path: Path,
) -> None:
    """--certificate-secret outside a pod: no API server to keep the certificate with, so the
    start stops with status 1 and the reason, before listening."""
    argv = [sys.executable, "-c", SHIM, "webhook", "--tls-cert", str(tmp_path / "tls.crt")]
    argv += ["--tls-key", str(tmp_path / "tls.key"), "--certificate-secret", "s"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=environ)
    assert result.returncode == 1
    assert result.stderr == (
        "ratelimit-sidecar webhook: not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set\n"
    )
