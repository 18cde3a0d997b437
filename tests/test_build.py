"""The two builds: the suite runs on the sources, then on the compiled build (`make test`), and
each run must test the build it says, in its own process and in the sidecars it starts."""

from __future__ import annotations

import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
from support import builds
from support.sidecars import serve_process, write_rules

import sidecar.rls.fast
import sidecar.storage.redis  # noqa: F401
from sidecar import build

EXPECTED = "compiled" if builds.BUILD else "source"


def test_the_suite_imports_the_build_it_tests() -> None:
    """Under SIDECAR_BUILD every module of the hot path is the compiled one from that directory;
    without it, none is compiled."""
    assert build.name() == EXPECTED
    if builds.BUILD:
        root = Path(builds.BUILD).resolve()
        for name in build.HOT_PATH:
            assert Path(sys.modules[name].__file__ or "").is_relative_to(root), name
        assert build.compiled() == list(build.HOT_PATH)
    else:
        assert build.compiled() == []


async def test_a_served_sidecar_logs_the_build_it_runs(tmp_path: Path) -> None:
    """`python -m sidecar serve` started by a test runs the same build as the test (the
    `started` event says which): the compiled one under SIDECAR_BUILD, else the sources."""
    rules = write_rules(tmp_path)
    args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]  # fmt: skip
    async with serve_process(args) as served:
        started = [event for event in served.events() if event["event"] == "started"]
    assert [event["build"] for event in started] == [EXPECTED]


def test_environ_names_a_compiled_build_first_and_keeps_the_working_directory_out(
    tmp_path: Path,
) -> None:
    """`environ` puts the build's directory first on PYTHONPATH, then what else is asked for,
    and sets PYTHONSAFEPATH, so that `python -m sidecar` in a checkout does not import its
    sources instead."""
    for name in build.HOT_PATH:
        module = tmp_path / (name.replace(".", "/") + EXTENSION_SUFFIXES[0])
        module.parent.mkdir(parents=True, exist_ok=True)
        module.touch()
    environ = build.environ(tmp_path, also=["/elsewhere"])
    assert environ == {"PYTHONPATH": f"{tmp_path}:/elsewhere", "PYTHONSAFEPATH": "1"}


def test_environ_refuses_a_directory_without_a_compiled_build(tmp_path: Path) -> None:
    """A directory missing a compiled module of the hot path is refused, with the fix: a
    benchmark or test run must not measure the sources while it says it measures the build."""
    (tmp_path / "sidecar").mkdir()
    (tmp_path / "sidecar" / "limiter.py").touch()
    with pytest.raises(
        ValueError, match=r"no compiled build of sidecar\.rls\.h2\.frames, .*make compiled"
    ):
        build.environ(tmp_path)
