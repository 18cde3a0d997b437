"""The injected gateway pod, run on this machine: the real Envoy with the sample's generated
config calls the injected sidecar through its Unix socket, as they do inside the pod.

What the pod shares becomes a temporary directory: the socket's emptyDir (the pipe address and
the sidecar's --grpc-address both move there, nothing else), the rules ConfigMap's files; the
ports that are the pod's own become free loopback ports. The sidecar runs with the very
arguments the injector gave it (--grpc-socket-mode included), Envoy with the ConfigMap's
bootstrap, so a mismatch between `envoy-config` and the injector fails here.
"""

from __future__ import annotations

import stat
import uuid
from pathlib import Path
from typing import Any

import yaml
from support.envoys import Envoy, Sidecar, Upstream, free_port, get
from support.kube import K8S, build, find

from sidecar.cli import parse_args
from sidecar.injector.container import CONTAINER_NAME, RULES_PATH, SOCKET_DIR, SOCKET_PATH
from sidecar.injector.patch import inject
from sidecar.injector.settings import Settings

#: Envoy's deadline for one rate limit call here: this machine is shared, and a late answer
#: would let the request through (failure_mode_deny is false) where the test wants a 429.
ENVOY_TIMEOUT = "2s"


def injected_gateway(native: bool) -> dict[str, Any]:
    """The sample gateway Deployment as the webhook injects it, on the memory backend."""
    gateway = find(build(K8S / "base"), "Deployment", "gateway")
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    del annotations["ratelimit-sidecar/backend"]  # no Redis in this pod: memory://
    annotations["ratelimit-sidecar/native-sidecar"] = str(native).lower()
    injected: dict[str, Any] = inject(gateway, Settings())
    return injected


def sidecar_args(pod: dict[str, Any], rules: Path) -> list[str]:
    """The injected container's `serve` arguments, with the pod's paths moved to this machine
    and the addresses left to the Sidecar process (which puts them back, moved)."""
    spec = pod["spec"]["template"]["spec"]
    (container,) = [
        c
        for c in spec.get("initContainers", []) + spec["containers"]
        if c["name"] == CONTAINER_NAME
    ]
    args = list(container["args"])
    assert args[0] == "serve"
    args[args.index(RULES_PATH)] = str(rules)
    for flag in ("--grpc-address", "--http-address"):
        index = args.index(flag)
        del args[index : index + 2]
    return args[1:]


def envoy_config(workdir: Path, socket: Path, listen: int, admin: int, upstream: int) -> Path:
    """The ConfigMap's Envoy bootstrap with the pod's addresses moved to this machine."""
    objects = build(K8S / "base")
    text = find(objects, "ConfigMap", "envoy-gateway")["data"]["envoy.yaml"]
    assert text.count(SOCKET_PATH) == 2  # the header's command and the pipe
    bootstrap = yaml.safe_load(text.replace(SOCKET_PATH, str(socket)))
    (listener,) = bootstrap["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    bootstrap["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == "upstream":
            cluster["type"] = "STATIC"
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": upstream}
    for chain in listener["filter_chains"]:
        for network_filter in chain["filters"]:
            for http_filter in network_filter["typed_config"].get("http_filters", []):
                if http_filter["name"] == "envoy.filters.http.ratelimit":
                    http_filter["typed_config"]["timeout"] = ENVOY_TIMEOUT
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    return path


def test_envoy_calls_the_injected_sidecar_through_the_pods_unix_socket(
    envoy_binary: str, tmp_path: Path
) -> None:
    """Envoy with the sample's config reaches the injected sidecar (started with its injected
    arguments) on the socket in the shared directory: the ad cap's 6th ad is refused (429), the
    sidecar answered every check, and the socket lets Envoy's user connect (mode 0666)."""
    for native in (True, False):
        workdir = tmp_path / ("native" if native else "ordinary")
        shared = workdir / SOCKET_DIR.strip("/").replace("/", "-")  # the emptyDir
        rules = workdir / "rules"
        shared.mkdir(parents=True)
        rules.mkdir()
        socket = shared / Path(SOCKET_PATH).name
        objects = build(K8S / "base")
        for key, text in find(objects, "ConfigMap", "ratelimit-rules")["data"].items():
            (rules / key).write_text(text)
        pod = injected_gateway(native)
        args = sidecar_args(pod, rules)
        assert parse_args(["serve", *args], environ={}).grpc_socket_mode == 0o666
        upstream = Upstream()
        upstream.start()
        listen, admin = free_port(), free_port()
        sidecar = Sidecar(
            args, 0, free_port(), workdir / "sidecar.log",
            grpc_address=f"unix:{socket}", log_level="info",
        )  # fmt: skip
        envoy = Envoy(
            envoy_binary,
            envoy_config(workdir, socket, listen, admin, upstream.port),
            admin,
            workdir / "envoy.log",
        )
        try:
            sidecar.start()
            assert stat.S_ISSOCK(socket.stat().st_mode)
            assert stat.S_IMODE(socket.stat().st_mode) == 0o666
            envoy.start()
            headers = {"x-user-id": f"user-{uuid.uuid4().hex[:8]}", "x-ad-id": "a1"}
            statuses = [get(listen, "/ads/slot", headers).status for _ in range(6)]
            sidecar.wait_for_calls(6)
            assert envoy.stat("cluster.ratelimit.upstream_cx_total") >= 1
            assert envoy.stat("cluster.ratelimit.upstream_cx_connect_fail") == 0
        finally:
            envoy.stop()
            sidecar.stop()
            upstream.stop()
        assert statuses == [200] * 5 + [429], (statuses, sidecar.log_tail(), envoy.log_tail())
        assert not socket.exists(), "the sidecar removes its socket when it stops"
