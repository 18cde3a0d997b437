"""Redis over TLS: ``rediss://`` and ``rediss+cluster://`` against real redis-server processes
listening on TLS ports, with a self-signed certificate as their CA.

The sidecar verifies the server's certificate (and its address) unless told otherwise, sends a
client certificate when given one, and treats a server it cannot trust like an unreachable one:
every call fails with StorageError by its deadline (the failure mode answers), naming the reason,
and nothing is counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from conftest import require_binary
from support.callbacks import apply
from support.certs import write_certificate
from support.servers import (
    HOST,
    RedisCluster,
    RedisServer,
    SentinelServer,
    ServerError,
    free_port,
    start_cluster,
    start_server,
)

from sidecar.errors import StorageError
from sidecar.model import Hit, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

pytestmark = pytest.mark.redis

TIMEOUT_MS = 2_000
NOW_MS = (int(time.time()) // 60 * 60 + 5) * 1000
START_MS, END_MS = NOW_MS - 5_000, NOW_MS + 55_000
# Hash tags whose slots lie on three different masters of a 3-node cluster.
KEYS = (b"rl{b}|tls|60|0", b"rl{c}|tls|60|0", b"rl{a}|tls|60|0")


def hit(key: bytes, group: int = 0) -> Hit:
    """One hit on a plain window of 10 a minute, counted at `key`."""
    return Hit(key, 1, Window(10, Unit.MINUTE), group, previous=key, ttl=60, start_ms=START_MS,
               end_ms=END_MS)  # fmt: skip


def url(scheme: str, ports: list[int], **query: str) -> str:
    hosts = ",".join(f"{HOST}:{port}" for port in ports)
    return f"{scheme}://{hosts}?{urlencode(query)}"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The servers' certificate, its own CA (and the client certificate the tests send)."""
    return write_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(
    tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[RedisServer]:
    """A standalone server whose TLS port requires a client certificate (mutual TLS)."""
    require_binary("redis-server")
    try:
        server = start_server(
            tmp_path_factory.mktemp("redis-tls"), certificate=certificate, auth_clients="yes"
        )
    except ServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[RedisCluster]:
    """A 3-master cluster whose nodes and bus speak TLS."""
    require_binary("redis-server")
    require_binary("redis-cli")
    try:
        cluster = start_cluster(
            tmp_path_factory.mktemp("redis-tls-cluster"), certificate=certificate
        )
    except ServerError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


async def apply_and_close(backend: Backend, hits: list[Hit], calls: int = 1) -> list[int]:
    """Apply `hits` `calls` times; the remaining counts of the last call."""
    try:
        for _ in range(calls):
            outcomes = await apply(backend, hits, False, NOW_MS)
        return [outcome.remaining for outcome in outcomes]
    finally:
        await backend.close()


def with_client_certificate(
    server: RedisServer, ca: Path, certificate: tuple[Path, Path]
) -> Backend:
    """A rediss:// backend for `server`'s TLS port that trusts `ca` and sends `certificate`."""
    cert_file, key_file = certificate
    assert server.tls_port is not None
    return open_backend(
        url("rediss", [server.tls_port], ssl_ca_certs=str(ca), ssl_certfile=str(cert_file),
            ssl_keyfile=str(key_file)),
        timeout_ms=TIMEOUT_MS,
    )  # fmt: skip


def stored(server: RedisServer, key: bytes) -> int | None:
    """The counter at `key`, read over the server's plain port."""
    with server.client() as client:
        value = client.get(key)
    return None if value is None else int(value)


async def test_rediss_verifies_the_server_and_sends_a_client_certificate(
    tls_redis: RedisServer, certificate: tuple[Path, Path]
) -> None:
    """With the CA and a client certificate, calls go over TLS to a server that requires one,
    and count in Redis."""
    with tls_redis.client() as plain:  # the module's server: counts of earlier tests go
        plain.flushall()
    backend = with_client_certificate(tls_redis, certificate[0], certificate)
    key = b"rl{mutual}|tls|60|0"
    assert await apply_and_close(backend, [hit(key)], calls=3) == [7]
    assert stored(tls_redis, key) == 3


async def test_rediss_refuses_a_server_signed_by_another_ca(
    tls_redis: RedisServer, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    """A server whose certificate the given CA did not sign fails each call with StorageError
    that names the verification failure; nothing is counted."""
    other_ca, _ = write_certificate(tmp_path)
    backend = with_client_certificate(tls_redis, other_ca, certificate)
    key = b"rl{untrusted}|tls|60|0"
    with pytest.raises(StorageError, match="CERTIFICATE_VERIFY_FAILED"):
        await apply_and_close(backend, [hit(key)])
    assert stored(tls_redis, key) is None


async def test_rediss_without_a_client_certificate_fails_where_one_is_required(
    tls_redis: RedisServer, certificate: tuple[Path, Path]
) -> None:
    """A server that requires a client certificate refuses a sidecar that has none: the calls
    fail with StorageError, nothing is counted."""
    cert_file, _ = certificate
    assert tls_redis.tls_port is not None
    backend = open_backend(
        url("rediss", [tls_redis.tls_port], ssl_ca_certs=str(cert_file)), timeout_ms=TIMEOUT_MS
    )
    key = b"rl{anonymous}|tls|60|0"
    with pytest.raises(StorageError):
        await apply_and_close(backend, [hit(key)])
    assert stored(tls_redis, key) is None


async def test_plain_redis_on_a_tls_port_fails_by_its_deadline(tls_redis: RedisServer) -> None:
    """redis:// pointed at a TLS port gets no answer it can read: StorageError, by the deadline."""
    assert tls_redis.tls_port is not None
    backend = open_backend(f"redis://{HOST}:{tls_redis.tls_port}", timeout_ms=200)
    started = time.monotonic()
    with pytest.raises(StorageError):
        await apply_and_close(backend, [hit(b"rl{plain}|tls|60|0")])
    assert time.monotonic() - started < 2


@pytest.mark.cluster
async def test_rediss_cluster_reaches_every_master_over_tls(
    tls_cluster: RedisCluster, certificate: tuple[Path, Path]
) -> None:
    """rediss+cluster:// starts from one node's TLS port, learns the others' TLS ports from the
    cluster, verifies each node's certificate, and counts on all three masters."""
    cert_file, _ = certificate
    tls_cluster.flushall()  # the module's cluster: counts of earlier tests go
    first = tls_cluster.nodes[0].tls_port
    assert first is not None
    backend = open_backend(
        url("rediss+cluster", [first], ssl_ca_certs=str(cert_file)), timeout_ms=TIMEOUT_MS
    )
    hits = [hit(key, group) for group, key in enumerate(KEYS)]
    assert await apply_and_close(backend, hits, calls=2) == [8, 8, 8]
    with tls_cluster.client() as client:
        assert [int(client.get(key)) for key in KEYS] == [2, 2, 2]


@pytest.mark.cluster
async def test_rediss_cluster_refuses_nodes_signed_by_another_ca(
    tls_cluster: RedisCluster, tmp_path: Path
) -> None:
    """A cluster whose certificates the given CA did not sign: StorageError, nothing counted."""
    other_ca, _ = write_certificate(tmp_path)
    first = tls_cluster.nodes[0].tls_port
    assert first is not None
    backend = open_backend(
        url("rediss+cluster", [first], ssl_ca_certs=str(other_ca)), timeout_ms=TIMEOUT_MS
    )
    key = b"rl{b}|untrusted|60|0"
    with pytest.raises(StorageError):
        await apply_and_close(backend, [hit(key)])
    with tls_cluster.client() as client:
        assert client.get(key) is None


async def test_rediss_sentinel_speaks_tls_to_the_sentinel_and_the_master(
    tls_redis: RedisServer, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    """rediss+sentinel:// asks a Sentinel on its TLS port where the master is (the Sentinel
    watches the master over TLS), checks ROLE and counts on the master's TLS port, with the CA
    and client certificate of the query for both; `sentinel_password` authenticates to the
    Sentinel. With another CA, calls fail with StorageError and nothing is counted."""
    cert_file, key_file = certificate
    tls = (
        f"tls-port {free_port()}\ntls-cert-file {cert_file}\ntls-key-file {key_file}\n"
        f"tls-ca-cert-file {cert_file}\ntls-replication yes\n"
    )
    sentinel = SentinelServer(
        tmp_path / "sentinel", free_port(), "tls-master", tls_redis, 1,
        master_port=tls_redis.tls_port, extra_config=tls,
    )  # fmt: skip
    try:
        sentinel.start()
    except ServerError as exc:
        pytest.fail(str(exc))
    try:
        with sentinel.client() as client:
            client.execute_command("ACL", "SETUSER", "default", "on", ">s3ntinel")
        tls_port = int(tls.split()[1])
        query = {
            "ssl_ca_certs": str(cert_file), "ssl_certfile": str(cert_file),
            "ssl_keyfile": str(key_file), "sentinel_password": "s3ntinel",
        }  # fmt: skip
        good = open_backend(
            f"rediss+sentinel://{HOST}:{tls_port}/tls-master?{urlencode(query)}",
            timeout_ms=TIMEOUT_MS,
        )
        key = b"rl{sentinel}|tls|60|0"
        with tls_redis.client() as plain:
            plain.delete(key)
        assert await apply_and_close(good, [hit(key)], calls=2) == [8]
        assert stored(tls_redis, key) == 2

        (tmp_path / "other").mkdir()
        other_ca, _ = write_certificate(tmp_path / "other")
        untrusted = open_backend(
            f"rediss+sentinel://{HOST}:{tls_port}/tls-master?"
            + urlencode({**query, "ssl_ca_certs": str(other_ca)}),
            timeout_ms=TIMEOUT_MS,
        )
        with pytest.raises(StorageError):
            await apply_and_close(untrusted, [hit(key)])
        assert stored(tls_redis, key) == 2
    finally:
        sentinel.stop()
