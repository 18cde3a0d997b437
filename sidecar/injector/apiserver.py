"""The Kubernetes version the webhook serves, read from its API server's ``GET /version``.

`webhook --native-sidecars auto` injects native sidecars only where the API server is 1.29 or
later. Inside a pod the API server is at ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``,
its CA and a token are in the service account directory; ``/version`` needs no Role (every
caller may read it), so the webhook's service account has none.
"""

from __future__ import annotations

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


async def server_version(
    environ: Mapping[str, str],
    account: Path = SERVICE_ACCOUNT,
    timeout: float = TIMEOUT_SECONDS,
) -> tuple[int, int]:
    """The API server's (major, minor); OSError or ValueError saying why it cannot be read."""
    host = environ.get("KUBERNETES_SERVICE_HOST")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise OSError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
    context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    headers = {}
    token = account / "token"
    if token.exists():
        # Read on every call: the kubelet renews the projected token file.
        headers["Authorization"] = f"Bearer {token.read_text().strip()}"
    address = f"[{host}]" if ":" in host else host
    url = f"https://{address}:{port}/version"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url, headers=headers, ssl=context) as response,
        ):
            if response.status != 200:
                raise OSError(f"GET {url}: HTTP {response.status}")
            document = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise OSError(f"GET {url}: {exc or type(exc).__name__}") from exc
    return version_of(document)
