"""The webhook's own certificate authority and serving certificate, made with the `openssl` command.

Only for clusters without cert-manager (`webhook --certificate-secret`, see `bootstrap`). The
`cryptography` package is not one of the sidecar's dependencies (only the tests use it), so the
keys and certificates are made by the OpenSSL that Python's `ssl` module already links, through
its command: the image's Debian base has it (its `ca-certificates` package depends on it). Keys
are ECDSA P-256, which every Kubernetes API server (Go's TLS) verifies.

The authority lasts `CA_DAYS` and signs only serving certificates (``pathlen:0``); a serving
certificate lasts `SERVING_DAYS`, names the webhook Service's DNS names and is renewed from the
same authority when `RENEW_SECONDS` or less of it remain, so the API server's ``caBundle`` stays
as it is across renewals.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: Ten years: the authority is in every webhook configuration's caBundle, which only the
#: webhook changes; replacing it means deleting its Secret (see k8s/README.md).
CA_DAYS = 3650
SERVING_DAYS = 365
#: Renew a serving certificate with 30 days left: a webhook restarted or refreshed (every 10
#: minutes) within that month replaces it long before the API server would refuse it.
RENEW_SECONDS = 30 * 24 * 3600
#: openssl makes a key and signs in milliseconds; this bounds a wedged process.
OPENSSL_SECONDS = 30.0
#: A Service name and namespace are DNS labels, so its longest name fits well under this.
MAX_NAMES = 8

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[authority]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[serving]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = {names}
authorityKeyIdentifier = keyid
subjectKeyIdentifier = hash
"""
_NEW_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True, slots=True)
class Pair:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes


def service_names(service: str, namespace: str) -> tuple[str, ...]:
    """The names a Service answers to inside the cluster; the API server calls a webhook at
    ``SERVICE.NAMESPACE.svc``, the others are for anyone calling it by hand."""
    return (
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        f"{service}.{namespace}",
        service,
    )


def new_authority(common_name: str, workdir: Path, days: int = CA_DAYS) -> Pair:
    """A self-signed certificate authority, for signing serving certificates only."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        d = Path(tmp)
        config = _config(d, ())
        _openssl(
            *("req", "-x509", "-new", *_NEW_KEY, "-config", str(config)),
            *("-extensions", "authority", "-subj", f"/CN={common_name}", "-days", str(days)),
            *("-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt")),
        )
        return Pair((d / "ca.crt").read_bytes(), (d / "ca.key").read_bytes())


def issue_serving(authority: Pair, names: tuple[str, ...], workdir: Path, days: int) -> Pair:
    """A serving certificate for `names` (DNS names; the first is its common name too),
    signed by `authority`, valid from now for `days`."""
    if not names or len(names) > MAX_NAMES:
        raise ValueError(f"a serving certificate names 1 to {MAX_NAMES} DNS names, not {names}")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        d = Path(tmp)
        config = _config(d, names)
        (d / "ca.crt").write_bytes(authority.cert)
        (d / "ca.key").write_bytes(authority.key)
        _openssl(
            *("req", "-new", *_NEW_KEY, "-config", str(config), "-subj", f"/CN={names[0]}"),
            *("-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr")),
        )
        # A random 63-bit serial, as RFC 5280 wants serials unique per issuer.
        serial = f"0x{secrets.randbits(63) | 1 << 62:x}"
        _openssl(
            *("x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt")),
            *("-CAkey", str(d / "ca.key"), "-set_serial", serial, "-days", str(days)),
            *("-extfile", str(config), "-extensions", "serving", "-out", str(d / "tls.crt")),
        )
        return Pair((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes())


def expires_within(cert: bytes, seconds: int) -> bool:
    """Whether the PEM certificate is no longer valid `seconds` from now (or cannot be read)."""
    result = subprocess.run(
        [_binary(), "x509", "-noout", "-checkend", str(seconds)],
        input=cert,
        capture_output=True,
        timeout=OPENSSL_SECONDS,
        check=False,
    )
    return result.returncode != 0


def _config(directory: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        # Names go into an OpenSSL config line: nothing but a DNS name may get there.
        if not name or not all(c.isalnum() or c in "-." for c in name) or len(name) > 253:
            raise ValueError(f"{name[:64]!r} is not a DNS name")
    path = directory / "openssl.cnf"
    path.write_text(_CONFIG.format(names=", ".join(f"DNS:{n}" for n in names) or "DNS:unused"))
    return path


def _openssl(*args: str) -> None:
    try:
        result = subprocess.run(
            [_binary(), *args], capture_output=True, timeout=OPENSSL_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        raise OSError(f"openssl {args[0]} took more than {OPENSSL_SECONDS:.0f} s") from None
    if result.returncode != 0:
        detail = result.stderr.decode(errors="replace").strip()[-500:]
        raise OSError(f"openssl {args[0]} failed (exit status {result.returncode}): {detail}")


def _binary() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise OSError(
            "the openssl command is not on PATH: it makes the webhook's own certificate "
            "(install openssl, or give the webhook a certificate, e.g. from cert-manager)"
        )
    return found
