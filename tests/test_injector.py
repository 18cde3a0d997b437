"""Injection without Kubernetes: annotations to the sidecar container, JSON Patch, manifests,
`ratelimit-sidecar inject -f`, and the backend URL check that refuses what the sidecar would."""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kube import assert_valid

from sidecar.errors import InjectionError
from sidecar.injector import patch as injector
from sidecar.injector.commands import register
from sidecar.injector.manifests import inject_yaml
from sidecar.injector.patch import Settings, inject, patch
from sidecar.injector.urls import validate_url
from sidecar.storage import open_backend

SETTINGS = Settings()
ANNOTATIONS = {
    "ratelimit-sidecar/inject": "true",
    "ratelimit-sidecar/backend": "redis://redis.gateway:6379/2",
    "ratelimit-sidecar/rules-configmap": "gateway-rules",
    "ratelimit-sidecar/failure-mode": "deny",
}


def pod_template(annotations: dict[str, str] | None = None) -> dict[str, Any]:
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
                    "ports": [{"name": "http", "containerPort": 10000}],
                }
            ]
        },
    }


def manifest(kind: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A minimal valid Pod, Deployment, StatefulSet or DaemonSet named gateway."""
    template = pod_template(annotations)
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


def sidecar_of(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(obj)["containers"] if c["name"] == "ratelimit-sidecar"]
    return container


def failure(obj: dict[str, Any]) -> str:
    with pytest.raises(InjectionError) as caught:
        patch(obj, SETTINGS)
    return str(caught.value)


# --- the sidecar container -------------------------------------------------------------------


def test_the_sidecar_runs_serve_with_the_annotated_backend_rules_and_failure_mode() -> None:
    """Annotations become `serve` flags; the rules ConfigMap is mounted read-only at --config."""
    container = sidecar_of(inject(manifest("Pod"), SETTINGS))
    assert container["image"] == injector.DEFAULT_IMAGE
    assert container["command"] == ["ratelimit-sidecar"]
    assert container["args"] == [
        "serve",
        "--config",
        "/etc/ratelimit-sidecar/rules",
        "--backend",
        "redis://redis.gateway:6379/2",
        "--failure-mode",
        "deny",
        "--grpc-address",
        "127.0.0.1:8081",
        "--http-address",
        "0.0.0.0:8080",
        "--log-format",
        "json",
    ]
    assert container["volumeMounts"] == [
        {
            "name": "ratelimit-sidecar-rules",
            "mountPath": "/etc/ratelimit-sidecar/rules",
            "readOnly": True,
        }
    ]
    volumes = pod_spec(inject(manifest("Pod"), SETTINGS))["volumes"]
    assert volumes == [{"name": "ratelimit-sidecar-rules", "configMap": {"name": "gateway-rules"}}]


def test_the_sidecar_is_probed_limited_locked_down_and_drains_after_envoy() -> None:
    """Probes on /healthcheck, requests and limits, a restrictive securityContext, a preStop."""
    container = sidecar_of(inject(manifest("Pod"), SETTINGS))
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthcheck", "port": 8080}
    assert (
        container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"]
        >= 60
    ), "a backend outage must not restart the sidecar at once"
    assert set(container["resources"]) == {"requests", "limits"}
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
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}


def test_without_backend_or_failure_mode_annotations_the_sidecar_keeps_its_defaults() -> None:
    """No --backend and no --failure-mode flags unless annotated (or a default backend is set)."""
    annotations = {k: v for k, v in ANNOTATIONS.items() if not k.endswith(("backend", "mode"))}
    args = sidecar_of(inject(manifest("Pod", annotations), SETTINGS))["args"]
    assert "--backend" not in args and "--failure-mode" not in args
    settings = Settings(default_backend="redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    args = sidecar_of(inject(manifest("Pod", annotations), settings))["args"]
    assert args[args.index("--backend") + 1] == "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"


def test_port_annotations_move_the_sidecar_off_ports_envoy_uses() -> None:
    """ratelimit-sidecar/grpc-port and http-port change the addresses, probes and port."""
    annotations = {**ANNOTATIONS, "ratelimit-sidecar/grpc-port": "9081"}
    annotations["ratelimit-sidecar/http-port"] = "9080"
    obj = manifest("Pod", annotations)
    pod_spec(obj)["containers"][0]["ports"].append({"containerPort": 8080})
    container = sidecar_of(inject(obj, SETTINGS))
    assert "127.0.0.1:9081" in container["args"] and "0.0.0.0:9080" in container["args"]
    assert container["readinessProbe"]["httpGet"]["port"] == 9080
    assert container["ports"] == [{"name": "rls-http", "containerPort": 9080, "protocol": "TCP"}]


def test_a_grace_period_too_short_to_drain_is_raised_and_a_long_one_kept() -> None:
    """terminationGracePeriodSeconds under preStop + drain becomes 15; 30 stays 30."""
    short = manifest("Pod")
    pod_spec(short)["terminationGracePeriodSeconds"] = 2
    assert pod_spec(inject(short, SETTINGS))["terminationGracePeriodSeconds"] == 15
    enough = manifest("Pod")
    pod_spec(enough)["terminationGracePeriodSeconds"] = 30
    assert pod_spec(inject(enough, SETTINGS))["terminationGracePeriodSeconds"] == 30


# --- JSON Patch ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", injector.KINDS)
def test_the_patch_applied_by_a_json_patch_library_is_the_injected_manifest(kind: str) -> None:
    """patch() and inject() agree, for each kind, with and without existing volumes."""
    for volumes in (None, [{"name": "cache", "emptyDir": {}}]):
        obj = manifest(kind)
        if volumes is not None:
            pod_spec(obj)["volumes"] = volumes
        ops = patch(obj, SETTINGS)
        assert jsonpatch.apply_patch(obj, ops) == inject(obj, SETTINGS)
        prefix = "" if kind == "Pod" else "/spec/template"
        assert ops[0]["path"] == f"{prefix}/spec/containers/-"
        assert_valid(inject(obj, SETTINGS))


@pytest.mark.parametrize("kind", injector.KINDS)
def test_injecting_twice_is_injecting_once(kind: str) -> None:
    """A pod that already has the sidecar gets no patch, whatever its annotations say now."""
    once = inject(manifest(kind), SETTINGS)
    assert patch(once, SETTINGS) == []
    assert inject(once, SETTINGS) == once
    changed = copy.deepcopy(once)
    template = changed if kind == "Pod" else changed["spec"]["template"]
    template["metadata"]["annotations"]["ratelimit-sidecar/backend"] = "not a url"
    assert patch(changed, SETTINGS) == []


@pytest.mark.parametrize("annotations", [{}, {"ratelimit-sidecar/inject": "false"}, None])
def test_a_pod_that_does_not_ask_gets_nothing(annotations: dict[str, str] | None) -> None:
    """No inject annotation, or "false", or no annotations at all: no patch, object unchanged."""
    obj = manifest("Deployment", annotations or {})
    if annotations is None:
        del obj["spec"]["template"]["metadata"]["annotations"]
    assert patch(obj, SETTINGS) == []
    assert inject(obj, SETTINGS) is obj


# --- annotations the injector refuses --------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"ratelimit-sidecar/backend": "redis://cache:notaport"},
            "ratelimit-sidecar/backend: 'redis://cache:notaport': bad address 'cache:notaport' "
            "(want host:port, port from 1 to 65535)",
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
            {"ratelimit-sidecar/rules-configmap": None},
            "ratelimit-sidecar/rules-configmap: missing; name the ConfigMap, in the pod's "
            "namespace, whose *.yaml keys hold the rate limit rules",
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
            {"ratelimit-sidecar/backnd": "redis://redis:6379"},
            "unknown annotation 'ratelimit-sidecar/backnd' (did you mean "
            "'ratelimit-sidecar/backend'?); known: ratelimit-sidecar/inject, "
            "ratelimit-sidecar/backend, ratelimit-sidecar/rules-configmap, "
            "ratelimit-sidecar/failure-mode, ratelimit-sidecar/grpc-port, "
            "ratelimit-sidecar/http-port",
        ),
        (
            {"ratelimit-sidecar/grpc-port": "70000"},
            "ratelimit-sidecar/grpc-port: must be a port number from 1 to 65535, not '70000'",
        ),
        (
            {"ratelimit-sidecar/http-port": "10000"},
            "container 'envoy' already uses port 10000, which the sidecar needs; set "
            "ratelimit-sidecar/http-port to a free port",
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


def test_the_sidecars_volume_name_must_be_free() -> None:
    """A pod that already has a volume named ratelimit-sidecar-rules is refused."""
    obj = manifest("Pod")
    pod_spec(obj)["volumes"] = [{"name": "ratelimit-sidecar-rules", "emptyDir": {}}]
    assert failure(obj) == (
        "the pod already has a volume named 'ratelimit-sidecar-rules', which the sidecar needs"
    )


def test_other_kinds_cannot_be_patched_but_pass_through_inject() -> None:
    """patch() refuses a Service; inject() returns it unchanged."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gateway"}}
    assert failure(service) == (
        "cannot inject into kind 'Service': only Pod, Deployment, StatefulSet and DaemonSet"
    )
    assert inject(service, SETTINGS) is service


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
