"""The admission webhook: AdmissionReview v1 JSON in, a base64 JSON Patch out; hostile input
answered clearly; HTTPS only, with a certificate the tests make; the `webhook` command."""

from __future__ import annotations

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
from certs import write_certificate
from hypothesis import given, settings
from hypothesis import strategies as st
from kube import assert_valid

from sidecar.injector.patch import Settings
from sidecar.injector.webhook import (
    MAX_BODY_BYTES,
    Certificates,
    Reply,
    WebhookServer,
    review,
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
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["envoy", "ratelimit-sidecar"]
    sidecar = pod["spec"]["containers"][1]
    assert sidecar["image"] == "registry.example/ratelimit-sidecar:0.1.0"
    assert [v["name"] for v in pod["spec"]["volumes"]] == [
        "envoy-config",
        "kube-api-access-8x2lq",
        "ratelimit-sidecar-rules",
    ]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30


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
        "ratelimit-sidecar/backend: 'redis://redis:70000': bad address 'redis:70000' "
        "(want host:port, port from 1 to 65535)"
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
        containers = result["spec"]["template"]["spec"]["containers"]
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


async def test_plain_http_is_refused(webhook: Any) -> None:
    """The same port spoken to in plain HTTP gives no HTTP answer at all."""
    port, _ = webhook
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(
                f"http://127.0.0.1:{port}/mutate", data=POD_CREATE.read_bytes()
            ) as response:
                await response.read()


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
                f"request body larger than {MAX_BODY_BYTES} bytes"
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

# The CLI's dispatch, as sidecar/cli.py does it once `register` is wired in.
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
    with subprocess.Popen(argv, stderr=subprocess.PIPE) as process:
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
