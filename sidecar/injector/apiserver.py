"""The Kubernetes version the webhook serves, read from its API server's ``GET /version``.

`webhook --native-sidecars auto` injects native sidecars only where the API server is 1.29 or
later. Inside a pod the API server is at ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``,
its CA and a token are in the service account directory; ``/version`` needs no Role (every
caller may read it). `Client` makes the webhook's other calls (its own pod, its certificate's
Secret, its configurations' caBundle), each allowed by a Role of the manifests.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_SECONDS = 5.0

_MINOR = re.compile(r"(\d{1,4})\+?")  # managed clusters say "29+"
_VERSION = re.compile(r"v?(\d{1,4})\.(\d{1,4})(?:\.\d+)?(?:[-+].*)?")


def parse_version(text: str) -> tuple[int, int]:
    """``1.29``, ``v1.29.3`` or ``1.29.3-gke.1`` as (major, minor); ValueError otherwise."""
    found = _VERSION.fullmatch(text.strip()) if len(text) <= 64 else None
    if found is None:
        raise ValueError(f"expected a Kubernetes version like 1.29, not {text[:64]!r}")
    return int(found.group(1)), int(found.group(2))


def version_of(document: Any) -> tuple[int, int]:
    """(major, minor) from the JSON of ``GET /version``; ValueError if it has none."""
    major = document.get("major") if isinstance(document, dict) else None
    minor = document.get("minor") if isinstance(document, dict) else None
    if isinstance(major, str) and major.isdigit() and isinstance(minor, str):
        found = _MINOR.fullmatch(minor)
        if found is not None:
            return int(major), int(found.group(1))
    git = document.get("gitVersion") if isinstance(document, dict) else None
    if isinstance(git, str):
        return parse_version(git)
    raise ValueError(f"/version answered no major and minor version: {str(document)[:200]}")


class Client:
    """Calls to the API server as the pod's service account: its CA, its bearer token.

    Plain HTTPS with aiohttp, no Kubernetes client library: the webhook makes a handful of
    calls (its version, its own pod, one Secret, its webhook configurations).
    """

    def __init__(self, url: str, account: Path = SERVICE_ACCOUNT, timeout: float = TIMEOUT_SECONDS):
        self.url = url
        self.account = account
        self.timeout = timeout
        self._context = ssl.create_default_context(cafile=str(account / "ca.crt"))

    @classmethod
    def in_cluster(
        cls,
        environ: Mapping[str, str],
        account: Path = SERVICE_ACCOUNT,
        timeout: float = TIMEOUT_SECONDS,
    ) -> Client:
        """The API server a pod reaches (``KUBERNETES_SERVICE_HOST``); OSError outside a pod
        or without the service account's CA."""
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise OSError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
        address = f"[{host}]" if ":" in host else host
        try:
            return cls(f"https://{address}:{port}", account, timeout)
        except (OSError, ssl.SSLError) as exc:
            raise OSError(f"cannot load the service account's CA: {exc}") from exc

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """The HTTP status and the JSON answer (None if not JSON); OSError if no answer came."""
        headers = {"Accept": "application/json"}
        token = self.account / "token"
        if token.exists():
            # Read on every call: the kubelet renews the projected token file.
            headers["Authorization"] = f"Bearer {token.read_text().strip()}"
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = content_type
        url = self.url + path
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session,
                session.request(method, url, data=data, headers=headers, ssl=self._context) as r,
            ):
                try:
                    document = await r.json(content_type=None)
                except ValueError:
                    document = None
                return r.status, document
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OSError(f"{method} {url}: {exc or type(exc).__name__}") from exc


async def server_version(
    environ: Mapping[str, str],
    account: Path = SERVICE_ACCOUNT,
    timeout: float = TIMEOUT_SECONDS,
) -> tuple[int, int]:
    """The API server's (major, minor); OSError or ValueError saying why it cannot be read."""
    client = Client.in_cluster(environ, account, timeout)
    status, document = await client.call("GET", "/version")
    if status != 200:
        raise OSError(f"GET {client.url}/version: HTTP {status}")
    return version_of(document)


def status_message(status: int, document: Any) -> str:
    """``HTTP 403: the API server's message`` from a failed call's answer (a Status object)."""
    message = document.get("message") if isinstance(document, dict) else None
    return f"HTTP {status}: {message}" if isinstance(message, str) else f"HTTP {status}"


#: The webhook Deployment's container: the pod's image in it is the image the webhook injects
#: unless `--image` says otherwise, so a kustomize `images:` entry changes both at once.
WEBHOOK_CONTAINER = "webhook"


def pod_namespace(environ: Mapping[str, str], account: Path = SERVICE_ACCOUNT) -> str:
    """The pod's namespace: ``POD_NAMESPACE`` (the downward API), else the service account's."""
    namespace = environ.get("POD_NAMESPACE")
    if namespace:
        return namespace
    try:
        return (account / "namespace").read_text().strip()
    except OSError as exc:
        raise OSError(f"cannot tell the pod's namespace (set POD_NAMESPACE): {exc}") from exc


async def pod_image(client: Client, namespace: str, pod: str) -> str:
    """The image of the pod's `WEBHOOK_CONTAINER`, as the API server has it; OSError if not."""
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
    status, document = await client.call("GET", path)
    if status != 200:
        raise OSError(
            f"cannot read its own pod {namespace}/{pod} for the image to inject "
            f"({status_message(status, document)}): give --image, or let its service account "
            "get pods in its namespace"
        )
    for container in (document.get("spec") or {}).get("containers") or []:
        if container.get("name") == WEBHOOK_CONTAINER and isinstance(container.get("image"), str):
            image: str = container["image"]
            return image
    raise OSError(f"pod {namespace}/{pod} has no container {WEBHOOK_CONTAINER!r}: give --image")
