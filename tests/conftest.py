"""Shared fixtures. Each block belongs to one part of the sidecar; add new blocks below."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from servers import RedisCluster, RedisServer, ServerError, start_cluster, start_server

# ---------------------------------------------------------------------------------------------
# Real Redis servers (tests/servers.py): a standalone server and a 3-master cluster per session,
# flushed before every test that asks for their URL.
# ---------------------------------------------------------------------------------------------


def require_binary(name: str) -> None:
    """Skip a test whose server binary is missing, except under CI, where that is a failure."""
    if shutil.which(name) is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} not installed, and CI=true forbids skipping integration tests")
    pytest.skip(f"{name} not installed (under CI=true this fails)")


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


# --- end of Redis fixtures -------------------------------------------------------------------
