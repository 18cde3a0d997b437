"""Backend URLs checked without opening anything, so a bad one is refused at admission time.

The rules are the sidecar's own (`sidecar.storage.urls.parse`, which `open_backend` uses when
the sidecar starts): a URL that passes here starts a sidecar, so a typo becomes an admission
error instead of a pod in CrashLoopBackOff. Admission adds two checks of its own, a length bound
and no whitespace or control characters, because the value comes from a pod's annotations and
its message ends up in events. Messages never show a password (`redact`), because they end up
in events and `kubectl` output.
"""

from __future__ import annotations

from sidecar.storage import urls
from sidecar.storage.urls import redact

#: Longer than any real backend URL, short enough that an error message stays readable.
MAX_URL_LENGTH = 2048


def validate_url(url: str) -> None:
    """Raise ValueError, naming the fault, for a backend URL the sidecar would refuse."""
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(
            f"backend URL is {len(url)} characters long; the limit is {MAX_URL_LENGTH}"
        )
    if any(char.isspace() or not char.isprintable() for char in url):
        raise ValueError(f"{redact(url)!r}: backend URL contains whitespace or control characters")
    urls.parse(url)
