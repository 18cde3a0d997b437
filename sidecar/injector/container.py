"""The sidecar's container spec, native (an init container that runs beside the pod's
containers) or ordinary, from a checked `Request` and the ports chosen for it. Pure.

What the native form buys, from the kubelet's rules for init containers with
``restartPolicy: Always`` (Kubernetes 1.29 and later):
- start: the pod's containers are started only once the sidecar's startupProbe has passed,
  so Envoy's first call finds a sidecar that answers;
- stop: the sidecar gets SIGTERM only after every ordinary container has exited, so it
  outlives Envoy's drain with no preStop sleep;
- a Job's pod completes when its containers do: the sidecar does not keep it running.
The ordinary form gets none of this: it starts beside Envoy in no order, and sleeps in preStop
so that it stops after Envoy.
"""

from __future__ import annotations

from typing import Any

from sidecar.injector.annotations import Request
from sidecar.injector.settings import Settings

CONTAINER_NAME = "ratelimit-sidecar"
RULES_VOLUME = "ratelimit-sidecar-rules"
SOCKET_VOLUME = "ratelimit-sidecar-socket"
PORT_NAME = "rls-http"
RULES_PATH = "/etc/ratelimit-sidecar/rules"
#: The shared emptyDir where the sidecar serves gRPC, mounted in every container of the pod.
SOCKET_DIR = "/var/run/ratelimit-sidecar"
SOCKET_PATH = f"{SOCKET_DIR}/rls.sock"
GRPC_SOCKET = f"unix:{SOCKET_PATH}"
#: Any container of the pod may connect (Envoy runs as its own user): the directory is the
#: pod's own emptyDir, which nothing outside the pod sees.
SOCKET_MODE = "666"
#: How long a native sidecar may take to answer its first health check before the kubelet
#: restarts it: 1 s apart, 120 tries, so a slow image start or a slow first Redis still fits.
STARTUP_PERIOD_SECONDS = 1
STARTUP_FAILURES = 120


def grpc_address(request: Request) -> str:
    """Where the sidecar serves gRPC: the pod's socket, or loopback at an annotated port."""
    return GRPC_SOCKET if request.grpc_port is None else f"127.0.0.1:{request.grpc_port}"


def container(request: Request, settings: Settings, http_port: int, native: bool) -> dict[str, Any]:
    """The sidecar's container: for `initContainers` when `native`, else for `containers`."""
    args = ["serve", "--config", RULES_PATH]
    if request.backend is not None:
        args += ["--backend", request.backend]
    if request.failure_mode is not None:
        args += ["--failure-mode", request.failure_mode]
    # gRPC on the pod's socket (or loopback): only the Envoy beside it should call this
    # sidecar. HTTP on every address: the kubelet probes it on the pod's IP, and Prometheus
    # scrapes /metrics there.
    args += ["--grpc-address", grpc_address(request)]
    if request.grpc_port is None:
        args += ["--grpc-socket-mode", SOCKET_MODE]
    args += ["--http-address", f"0.0.0.0:{http_port}", "--log-format", "json"]
    mounts = [{"name": RULES_VOLUME, "mountPath": RULES_PATH, "readOnly": True}]
    if request.grpc_port is None:
        mounts.append({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR})

    def probe() -> dict[str, Any]:
        return {"httpGet": {"path": "/healthcheck", "port": http_port}, "timeoutSeconds": 3}

    spec: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": request.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["ratelimit-sidecar"],
        "args": args,
        "ports": [{"name": PORT_NAME, "containerPort": http_port, "protocol": "TCP"}],
    }
    if native:
        # What makes it a native sidecar: restarted whenever it exits, started before the
        # pod's containers, stopped after them.
        spec["restartPolicy"] = "Always"
        # The pod's containers start once this passes.
        spec["startupProbe"] = {
            **probe(),
            "timeoutSeconds": 1,
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": STARTUP_FAILURES,
        }
    # Ready takes the pod out of its Service while the sidecar drains or its backend is down
    # (a native sidecar's readiness counts toward the pod's too).
    spec["readinessProbe"] = {**probe(), "periodSeconds": 5, "failureThreshold": 2}
    # /healthcheck also fails while the backend is down, which a restart cannot fix: give a
    # minute before the kubelet concludes the process itself is stuck.
    spec["livenessProbe"] = {
        **probe(),
        "initialDelaySeconds": 0 if native else 10,  # a startupProbe already holds it back
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    if not native:
        # Every ordinary container of the pod is told to stop at once. Sleeping first keeps
        # the sidecar answering while Envoy finishes its requests and exits; then SIGTERM
        # makes the sidecar report unhealthy, finish the calls in flight and exit 0.
        sleep = ["sleep", str(settings.pre_stop_seconds)]
        spec["lifecycle"] = {"preStop": {"exec": {"command": sleep}}}
    spec["resources"] = {
        "requests": {"cpu": request.cpu[0], "memory": request.memory[0]},
        "limits": {"cpu": request.cpu[1], "memory": request.memory[1]},
    }
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": request.run_as_user,
        "runAsGroup": request.run_as_group,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    spec["volumeMounts"] = mounts
    spec["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return spec
