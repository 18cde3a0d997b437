"""TLS and mutual TLS on the gRPC port, for both transports, with certificates kept current.

`ServerTls` holds the files (`TlsFiles`: server certificate and key, optionally the CA that
signs client certificates and a SAN every client certificate must carry) and what each
transport needs from them: an `ssl.SSLContext` for the fast transport's event loop
(`create_server(ssl=...)`), and grpc server credentials for grpcio. TLS 1.2 is the least
accepted, ALPN offers `h2`, and with a client CA a client must present a certificate it signs.

Rotation: `reload` (run every few seconds, and on SIGHUP) builds a new context when a file's
identity changed, which is how cert-manager and Kubernetes secret volumes swap them. The fast
transport's listening context chooses the current one in its server-name callback, which
OpenSSL calls early in every handshake whether the client sent SNI or not; grpcio asks
`_fetch_certificates` before each handshake. Either way connections already open keep the
session they have, so nothing in flight is dropped. A rotation that fails to load (a key
that does not match its certificate, half a file) keeps the previous certificate, is logged
once per distinct error, and is tried again at the next change.

A pinned client SAN (the reference's `GRPC_CLIENT_TLS_SAN`) is matched as the reference's
Go verifier matches a host name: an IP address against the certificate's IP SANs, anything
else against its DNS SANs, where `*.example.com` covers one left-most label. Python's ssl
has no verification callback, so the fast transport checks it as the connection is made
(after the handshake) and closes one that fails; grpcio checks it per call (UNAUTHENTICATED).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("sidecar.rls.tls")

#: RFC 9113 §9.2.2: HTTP/2 over TLS 1.2 must use an AEAD suite with ephemeral key exchange
#: (TLS 1.3 suites all qualify and are not set by this string).
HTTP2_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
#: Distinct refused client SAN sets logged (each once); past it refusals are counted only.
MAX_LOGGED_REFUSALS = 64


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """What TLS on the gRPC port is made of: PEM files, and the SAN clients must carry."""

    cert: Path
    key: Path
    #: The CA that signs client certificates: with it, clients must present one (mTLS).
    client_ca: Path | None = None
    #: A DNS name or IP address every client certificate must carry as a SAN (needs client_ca).
    client_san: str | None = None

    def paths(self) -> tuple[Path, ...]:
        return (
            (self.cert, self.key)
            if self.client_ca is None
            else (self.cert, self.key, self.client_ca)
        )


#: What tells one version of a file from the next: device, inode, size and modification time
#: (a symlink swap changes the inode, a rewrite the time or the size).
_Mark = tuple[int, int, int, int]


def _marks(paths: Sequence[Path]) -> tuple[_Mark, ...]:
    found = []
    for path in paths:
        stat = os.stat(path)
        found.append((stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(found)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsError(f"{what} {path}: {exc.strerror or exc}") from exc


def san_matches(pinned: str, dns_names: Sequence[str], ip_addresses: Sequence[str]) -> bool:
    """Whether a certificate with these SANs is one for `pinned` (see the module docstring)."""
    try:
        wanted_ip = ipaddress.ip_address(pinned)
    except ValueError:
        wanted = pinned.lower().rstrip(".")
        return any(_dns_matches(name.lower().rstrip("."), wanted) for name in dns_names)
    for text in ip_addresses:
        try:
            if ipaddress.ip_address(text) == wanted_ip:
                return True
        except ValueError:
            continue
    return False


def _dns_matches(pattern: str, host: str) -> bool:
    if pattern == host:
        return True
    if not pattern.startswith("*."):
        return False
    label, dot, rest = host.partition(".")
    return bool(label and dot and rest == pattern[2:])


def peer_sans(peercert: Any) -> tuple[list[str], list[str]]:
    """The DNS and IP SANs of a certificate as `SSLObject.getpeercert()` gives it."""
    dns: list[str] = []
    ips: list[str] = []
    for kind, value in (peercert or {}).get("subjectAltName", ()):
        if kind == "DNS":
            dns.append(value)
        elif kind == "IP Address":
            ips.append(value.strip())
    return dns, ips


class ServerTls:
    """The gRPC port's TLS: the current context and credentials, reloaded when files change.

    Raises TlsError at construction when the files cannot be used.
    """

    def __init__(self, files: TlsFiles, alpn: Sequence[str] = ("h2",)) -> None:
        if files.client_san and files.client_ca is None:
            raise TlsError("a client SAN to pin needs a client CA (mTLS) to verify clients with")
        self.files = files
        #: The protocols offered by ALPN: `h2` on the gRPC port, `http/1.1` on the operator
        #: port (`sidecar.operator.port`), whose server speaks only that.
        self._alpn = list(alpn)
        self._marks = _marks_or_error(files)
        self.current = self._context()
        self._pem = self._pem_files()
        #: Bumped by every successful reload; grpcio's fetcher compares it with what it sent.
        self.generation = 0
        self._fetched = 0
        self._last_error: str | None = None
        self._logged_refusals: set[tuple[str, ...]] = set()
        #: Connections (fast) or calls (grpcio) refused for a client certificate without the SAN.
        self.refused = 0
        # The context the listener is made with: it never changes, and only hands each new
        # handshake the current one.
        self.listening = self._context()
        self.listening.sni_callback = self._choose

    # --- loading ------------------------------------------------------------------------------

    def _context(self) -> ssl.SSLContext:
        files = self.files
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(HTTP2_CIPHERS)
        context.set_alpn_protocols(self._alpn)
        context.options |= ssl.OP_NO_RENEGOTIATION
        try:
            context.load_cert_chain(files.cert, files.key)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(
                f"certificate {files.cert} with key {files.key}: {_reason(exc)} "
                "(expected PEM files, the key matching the certificate)"
            ) from exc
        if files.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(cafile=files.client_ca)
            except (OSError, ssl.SSLError) as exc:
                raise TlsError(
                    f"client CA {files.client_ca}: {_reason(exc)} (expected PEM certificates)"
                ) from exc
        return context

    def _pem_files(self) -> tuple[bytes, bytes, bytes | None]:
        files = self.files
        ca = None if files.client_ca is None else _read(files.client_ca, "client CA")
        return _read(files.key, "key"), _read(files.cert, "certificate"), ca

    def reload(self) -> bool:
        """Load the files again if they changed; True when a new certificate is now served."""
        try:
            marks = _marks_or_error(self.files)
            if marks == self._marks:
                return False
            context, pem = self._context(), self._pem_files()
        except TlsError as exc:
            if str(exc) != self._last_error:
                self._last_error = str(exc)
                log.warning("tls_reload_error", error=str(exc), kept="previous certificate")
            return False
        self._marks, self.current, self._pem = marks, context, pem
        self._last_error = None
        self.generation += 1
        log.info("tls_reloaded", cert=str(self.files.cert), generation=self.generation)
        return True

    async def watch(self, interval: float, sleep: Callable[[float], Awaitable[None]]) -> None:
        """Reload every `interval` seconds, for good (cancel to stop)."""
        while True:
            await sleep(interval)
            self.reload()

    def _choose(self, ssl_object: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        # OpenSSL's server-name callback, early in every handshake: serve the current files.
        ssl_object.context = self.current

    # --- clients --------------------------------------------------------------------------------

    def admits(self, peercert: Any) -> bool:
        """Whether a verified client certificate carries the pinned SAN (True when none is)."""
        pinned = self.files.client_san
        if not pinned:
            return True
        dns, ips = peer_sans(peercert)
        if san_matches(pinned, dns, ips):
            return True
        self._refuse(tuple(dns + ips))
        return False

    def admits_transport(self, transport: Any) -> bool:
        """`admits` for a connection made on the fast transport (its peer's certificate)."""
        return self.admits(transport.get_extra_info("peercert"))

    def _refuse(self, sans: tuple[str, ...]) -> None:
        self.refused += 1
        if sans not in self._logged_refusals and len(self._logged_refusals) < MAX_LOGGED_REFUSALS:
            self._logged_refusals.add(sans)
            log.warning(
                "tls_client_refused",
                reason=f"client certificate has no SAN {self.files.client_san!r}",
                client_sans=list(sans),
            )

    # --- grpcio ---------------------------------------------------------------------------------

    def grpc_credentials(self) -> Any:
        """grpc server credentials that ask `_fetch_certificates` before every handshake."""
        import grpc  # type: ignore[import-untyped]

        self._fetched = self.generation
        return grpc.dynamic_ssl_server_credentials(
            self._certificate_configuration(),
            self._fetch_certificates,
            require_client_authentication=self.files.client_ca is not None,
        )

    def _certificate_configuration(self) -> Any:
        import grpc

        key, cert, ca = self._pem
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _fetch_certificates(self) -> Any:
        # Called by grpc's core before a handshake: a configuration when the files changed
        # since the last one it was given, None to keep that one.
        if self._fetched == self.generation:
            return None
        self._fetched = self.generation
        return self._certificate_configuration()

    def grpc_interceptors(self) -> list[Any]:
        """With a pinned client SAN, the interceptor that refuses calls from other clients."""
        if not self.files.client_san:
            return []
        return [_san_interceptor(self)]


def _marks_or_error(files: TlsFiles) -> tuple[_Mark, ...]:
    try:
        return _marks(files.paths())
    except OSError as exc:
        raise TlsError(f"{exc.filename}: {exc.strerror or exc}") from exc


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _grpc_sans(auth_context: dict[str, list[bytes]]) -> tuple[list[str], list[str]]:
    names = [
        value.decode(errors="replace")
        for value in auth_context.get("x509_subject_alternative_name", [])
    ]
    ips = []
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            continue
        ips.append(name)
    return [name for name in names if name not in ips], ips


def _san_interceptor(tls: ServerTls) -> Any:
    """grpc.aio: a call whose client certificate lacks the pinned SAN gets UNAUTHENTICATED."""
    import grpc

    pinned = tls.files.client_san or ""

    class SanInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None or handler.unary_unary is None:
                return handler
            inner = handler.unary_unary

            async def checked(request: Any, context: Any) -> Any:
                dns, ips = _grpc_sans(context.auth_context())
                if not san_matches(pinned, dns, ips):
                    tls._refuse(tuple(dns + ips))
                    await context.abort(
                        grpc.StatusCode.UNAUTHENTICATED, f"client certificate has no SAN {pinned!r}"
                    )
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                checked,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return SanInterceptor()
