"""TLS and mTLS on the gRPC port, on both transports, with certificates the tests make.

A grpcio client calls through TLS and mTLS; clients without a certificate, with one from
another CA, or without the pinned SAN are refused; ALPN is h2 and TLS 1.1 is refused; the
certificate rotates on disk under load without a call lost; the reference's variables set it
all as the flags do.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitResponse
from support.certs import Authority
from support.sidecars import Client, request, running_app, serve_process, write_rules

from sidecar import cli
from sidecar.rls.tls import ServerTls, TlsError, TlsFiles, san_matches
from sidecar.runner.app import TRANSPORTS, App, InvalidOption

OK = RateLimitResponse.OK
RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000000}
"""


@dataclass
class Pki:
    """A CA, the server's certificate from it, a client's from it, and a stranger CA's client."""

    directory: Path
    authority: Authority
    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    stranger: tuple[Path, Path]

    def files(self, *, mtls: bool = False, san: str | None = None) -> TlsFiles:
        return TlsFiles(*self.server, client_ca=self.ca if mtls else None, client_san=san)

    def credentials(self, client: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
        cert, key = client if client is not None else (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None,
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    authority = Authority()
    stranger = Authority("stranger CA")
    folder = tmp_path / "pki"
    folder.mkdir()
    return Pki(
        folder,
        authority,
        authority.write(folder / "ca.crt"),
        authority.issue(folder, "server"),
        authority.issue(folder, "envoy", dns=("envoy.gateway.local",), ips=(), client=True),
        stranger.issue(folder, "stranger", dns=("envoy.gateway.local",), ips=(), client=True),
    )


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    return write_rules(tmp_path, RULES)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@asynccontextmanager
async def tls_client(port: int, credentials: grpc.ChannelCredentials) -> AsyncIterator[Client]:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        yield Client(channel)


async def call(port: int, credentials: grpc.ChannelCredentials, user: str = "alice") -> int:
    async with tls_client(port, credentials) as rls:
        answer = await rls.should_rate_limit(request("test", [("user", user)]))
    return int(answer.overall_code)


async def refused(port: int, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(port, credentials)
    code: grpc.StatusCode = caught.value.code()
    return code


def served_serial(port: int, client: tuple[Path, Path] | None, ca: Path) -> int:
    """The serial number of the certificate a new TLS connection to `port` is shown."""
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(*client)
    import socket

    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


# --- TLS and mTLS ---------------------------------------------------------------------------------


async def test_a_grpc_client_calls_through_tls_and_a_cleartext_one_is_refused(
    rules: Path, pki: Pki, transport: str
) -> None:
    """With a certificate and key, the gRPC port speaks only TLS: a client that trusts the CA
    is answered, one that speaks cleartext is not."""
    async with running_app(rules, transport=transport, tls=pki.files()) as app:
        assert await call(app.grpc_port, pki.credentials()) == OK
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await Client(channel).call(request("test", [("user", "a")]), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_negotiates_h2_with_tls_1_2_or_later_and_refuses_tls_1_1(
    rules: Path, pki: Pki, transport: str
) -> None:
    """ALPN picks h2, the version is TLS 1.2 or later, and a client that offers at most
    TLS 1.1 gets no handshake."""
    async with running_app(rules, transport=transport, tls=pki.files()) as app:
        context = ssl.create_default_context(cafile=pki.ca)
        context.set_alpn_protocols(["h2"])
        _, writer = await asyncio.open_connection(
            "127.0.0.1", app.grpc_port, ssl=context, server_hostname="localhost"
        )
        tls = writer.get_extra_info("ssl_object")
        assert tls.selected_alpn_protocol() == "h2"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        writer.close()
        old = ssl.create_default_context(cafile=pki.ca)
        old.set_ciphers("DEFAULT:@SECLEVEL=0")
        with warnings.catch_warnings():  # TLS 1.1 is deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            old.minimum_version = ssl.TLSVersion.TLSv1_1
            old.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.open_connection(
                "127.0.0.1", app.grpc_port, ssl=old, server_hostname="localhost"
            )


async def test_mtls_answers_a_client_of_the_ca_and_refuses_one_without_or_from_another_ca(
    rules: Path, pki: Pki, transport: str
) -> None:
    """With a client CA, a client certificate it signed is answered; a client without a
    certificate, or with one another CA signed, is refused (UNAVAILABLE: no connection)."""
    async with running_app(rules, transport=transport, tls=pki.files(mtls=True)) as app:
        assert await call(app.grpc_port, pki.credentials(pki.client)) == OK
        assert await refused(app.grpc_port, pki.credentials()) == grpc.StatusCode.UNAVAILABLE
        assert (
            await refused(app.grpc_port, pki.credentials(pki.stranger))
            == grpc.StatusCode.UNAVAILABLE
        )
        # Still answering the right client after the refusals.
        assert await call(app.grpc_port, pki.credentials(pki.client)) == OK


async def test_a_pinned_client_san_refuses_a_certificate_of_the_ca_without_it(
    rules: Path, pki: Pki, transport: str
) -> None:
    """GRPC_CLIENT_TLS_SAN: a client certificate of the right CA is refused unless it carries
    the SAN; one that does is answered (the fast transport closes the connection, grpcio
    answers UNAUTHENTICATED)."""
    other = pki.authority.issue(
        pki.directory, "other", dns=("intruder.local",), ips=(), client=True
    )
    files = pki.files(mtls=True, san="envoy.gateway.local")
    async with running_app(rules, transport=transport, tls=files) as app:
        assert await call(app.grpc_port, pki.credentials(pki.client)) == OK
        code = await refused(app.grpc_port, pki.credentials(other))
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
        assert code == (
            grpc.StatusCode.UNAVAILABLE if transport == "fast" else grpc.StatusCode.UNAUTHENTICATED
        )
        assert app.assembly.tls is not None and app.assembly.tls.refused >= 1
        assert await call(app.grpc_port, pki.credentials(pki.client)) == OK


# --- rotation ---------------------------------------------------------------------------------------


def install(directory: Path, cert: Path, key: Path) -> None:
    """Put a certificate and key in place as a Kubernetes secret volume does: the files are
    links through `..data`, a link swapped in one rename to a new folder."""
    version = directory / f"..{os.urandom(4).hex()}"
    version.mkdir()
    (version / "tls.crt").write_bytes(cert.read_bytes())
    (version / "tls.key").write_bytes(key.read_bytes())
    link = directory / "..data_tmp"
    link.symlink_to(version.name)
    link.rename(directory / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


async def test_a_rotation_under_load_loses_no_call_and_new_connections_get_the_new_certificate(
    rules: Path, pki: Pki, transport: str, tmp_path: Path
) -> None:
    """The certificate and key are swapped on disk (as cert-manager does) while clients call
    without pause on open connections and on new ones: every call is answered OK, and the
    connections made after the reload are shown the new certificate."""
    secret = tmp_path / "secret"
    secret.mkdir()
    install(secret, *pki.server)
    files = TlsFiles(secret / "tls.crt", secret / "tls.key", client_ca=pki.ca)
    rotated = pki.authority.issue(pki.directory, "server-next")
    calls, failures = 0, []
    stop = asyncio.Event()

    async def steady(user: str) -> None:  # one connection for the whole test
        nonlocal calls
        async with tls_client(app.grpc_port, pki.credentials(pki.client)) as rls:
            while not stop.is_set():
                try:
                    answer = await rls.should_rate_limit(request("test", [("user", user)]))
                    assert answer.overall_code == OK
                    calls += 1
                except Exception as exc:
                    failures.append(exc)

    async def fresh() -> None:  # a new connection for each call
        nonlocal calls
        while not stop.is_set():
            try:
                assert await call(app.grpc_port, pki.credentials(pki.client), "fresh") == OK
                calls += 1
            except Exception as exc:
                failures.append(exc)

    async with running_app(rules, transport=transport, tls=files, config_poll_seconds=0.05) as app:
        assert await asyncio.to_thread(served_serial, app.grpc_port, pki.client, pki.ca) == serial(
            pki.server[0]
        )
        workers = [asyncio.create_task(steady(f"u{i}")) for i in range(3)]
        workers.append(asyncio.create_task(fresh()))
        await asyncio.sleep(0.5)
        before = calls
        install(secret, *rotated)
        async with asyncio.timeout(10):
            while app.assembly.tls is None or app.assembly.tls.generation == 0:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*workers)
        shown = await asyncio.to_thread(served_serial, app.grpc_port, pki.client, pki.ca)

    assert failures == []
    assert before > 0 and calls > before
    assert shown == serial(rotated[0])


def test_a_rotation_to_files_that_do_not_load_keeps_the_previous_certificate(pki: Pki) -> None:
    """A key that does not match the new certificate (half a rotation) is not served: the
    previous context stays, and the reload succeeds once the files agree again."""
    secret = pki.directory / "secret"
    secret.mkdir()
    install(secret, *pki.server)
    tls = ServerTls(TlsFiles(secret / "tls.crt", secret / "tls.key"))
    first = tls.current
    other_cert, other_key = pki.authority.issue(pki.directory, "other")
    install(secret, other_cert, pki.server[1])  # the old key beside the new certificate
    assert tls.reload() is False
    assert tls.current is first and tls.generation == 0
    install(secret, other_cert, other_key)
    assert tls.reload() is True
    assert tls.current is not first and tls.generation == 1
    assert tls.reload() is False  # nothing changed since


# --- configuration ---------------------------------------------------------------------------------


async def test_files_that_cannot_be_used_stop_the_start_with_the_file_named(
    rules: Path, pki: Pki, tmp_path: Path
) -> None:
    """A missing certificate, a key that is not the certificate's, and a SAN without a CA each
    stop the start (InvalidOption, exit status 2) with a message naming what is wrong."""
    cases = {
        "missing.crt: No such file": TlsFiles(tmp_path / "missing.crt", pki.server[1]),
        "key values mismatch": TlsFiles(pki.server[0], pki.client[1]),
        "needs a client CA": TlsFiles(*pki.server, client_san="x"),
    }
    for expected, files in cases.items():
        with pytest.raises((InvalidOption, TlsError)) as caught:
            app = App(cli_options(rules, tls=files))
            try:
                await app.start()
            finally:
                await app.stop()
        assert expected in str(caught.value)


def cli_options(rules: Path, **extra: object) -> object:
    from sidecar.runner.app import Options

    return Options(config=[rules], grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", **extra)  # type: ignore[arg-type]


def test_the_reference_variables_set_tls_as_the_flags_do(pki: Pki) -> None:
    """GRPC_SERVER_USE_TLS with GRPC_SERVER_TLS_CERT/KEY, GRPC_CLIENT_TLS_CACERT and
    GRPC_CLIENT_TLS_SAN give the same files as --grpc-tls-cert, --grpc-tls-key,
    --grpc-tls-client-ca and --grpc-tls-client-san; without GRPC_SERVER_USE_TLS=true they are
    ignored, as the reference ignores them; flags win over variables."""
    cert, key = (str(path) for path in pki.server)
    env = {
        "RLS_REFERENCE_ENV": "true",  # serve reads the reference's variables when asked
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": cert,
        "GRPC_SERVER_TLS_KEY": key,
        "GRPC_CLIENT_TLS_CACERT": str(pki.ca),
        "GRPC_CLIENT_TLS_SAN": "envoy.gateway.local",
    }
    from_env = cli.serve.tls_files(cli.parse_args(["serve", "--config", "r"], env))
    from_flags = cli.serve.tls_files(
        cli.parse_args(
            ["serve", "--config", "r", "--grpc-tls-cert", cert, "--grpc-tls-key", key,
             "--grpc-tls-client-ca", str(pki.ca), "--grpc-tls-client-san", "envoy.gateway.local"],
            {},
        )
    )  # fmt: skip
    assert from_env == from_flags == pki.files(mtls=True, san="envoy.gateway.local")
    off = cli.parse_args(["serve", "--config", "r"], {**env, "GRPC_SERVER_USE_TLS": "false"})
    assert cli.serve.tls_files(off) is None
    ours = cli.parse_args(
        ["serve", "--config", "r"], {**env, "RLS_GRPC_TLS_CLIENT_SAN": "mine.local"}
    )
    files = cli.serve.tls_files(ours)
    assert files is not None and files.client_san == "mine.local"


def test_a_certificate_without_a_key_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--grpc-tls-cert needs --grpc-tls-key (and the reverse), and GRPC_SERVER_USE_TLS=true
    needs both files: exit status 2 with what is missing."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--config", "r", "--grpc-tls-cert", "a.crt"], {})
    assert caught.value.code == 2
    assert "--grpc-tls-cert needs --grpc-tls-key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(
            ["serve", "--config", "r"], {"RLS_REFERENCE_ENV": "true", "GRPC_SERVER_USE_TLS": "true"}
        )
    assert "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT" in capsys.readouterr().err


async def test_serve_with_the_reference_variables_answers_over_mtls(
    rules: Path, pki: Pki, transport: str
) -> None:
    """`serve` started with only the reference's variables (and RLS_REFERENCE_ENV, which asks
    it to read them) serves mTLS on both transports."""
    env = {
        "RLS_REFERENCE_ENV": "true",
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": str(pki.server[0]),
        "GRPC_SERVER_TLS_KEY": str(pki.server[1]),
        "GRPC_CLIENT_TLS_CACERT": str(pki.ca),
        "GRPC_CLIENT_TLS_SAN": "envoy.gateway.local",
    }
    args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0", "--http-address",
            "127.0.0.1:0", "--transport", transport]  # fmt: skip
    async with serve_process(args, env) as served:
        assert await call(served.grpc_port, pki.credentials(pki.client)) == OK
        assert await refused(served.grpc_port, pki.credentials()) == grpc.StatusCode.UNAVAILABLE
    started = next(e for e in served.events() if e.get("event") == "started")
    assert started["tls"] == "mtls"


# --- the SAN match -------------------------------------------------------------------------------


def test_a_pinned_san_matches_as_a_host_name_does() -> None:
    """A name matches a DNS SAN exactly (any case, a trailing dot ignored) or through a
    left-most wildcard label; an IP address matches only an IP SAN."""
    assert san_matches("envoy.gateway.local", ["Envoy.Gateway.Local."], [])
    assert san_matches("a.gateway.local", ["*.gateway.local"], [])
    assert not san_matches("a.b.gateway.local", ["*.gateway.local"], [])
    assert not san_matches("gateway.local", ["*.gateway.local"], [])
    assert not san_matches("envoy.gateway.local", ["other.local"], [])
    assert san_matches("10.0.0.1", [], ["10.0.0.1"])
    assert san_matches("::1", [], ["0:0:0:0:0:0:0:1"])
    assert not san_matches("10.0.0.1", ["10.0.0.1"], [])
