"""Rules reload while the sidecar serves: on a change of the files (polled) and on SIGHUP; a bad
change keeps the previous rules, as the reference does."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from support.sidecars import client, request, running_app, serve_process

from sidecar.model import Code
from sidecar.runner.app import App

RULES = """\
domain: reload
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: {limit}}}
"""


def rules(limit: int) -> str:
    return RULES.format(limit=limit)


async def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until `condition()` holds (the poll runs every 0.05 s in these tests)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the change was never picked up"
        await asyncio.sleep(0.02)


async def rlconfig(app: App) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{app.http_port}/rlconfig") as response,
    ):
        return await response.text()


async def codes(app: App, user: str, calls: int) -> list[int]:
    async with client(app.grpc_port) as rls:
        return [
            (await rls.call(request("reload", [("user", user)]))).overall_code for _ in range(calls)
        ]


async def test_a_changed_file_is_served_without_a_restart(tmp_path: Path) -> None:
    """Raising a limit in the file takes effect while serving, and counters carry over."""
    path = tmp_path / "rules.yaml"
    path.write_text(rules(1))
    async with running_app(path, config_poll_seconds=0.05) as app:
        assert await codes(app, "u1", 2) == [Code.OK, Code.OVER_LIMIT]
        path.write_text(rules(5))
        await eventually(lambda: app.stats.config_load_success == 2)
        assert "requests_per_unit=5" in await rlconfig(app)
        # The counter kept its 2 hits: 3 more fit under the new limit of 5.
        assert await codes(app, "u1", 4) == [Code.OK] * 3 + [Code.OVER_LIMIT]


async def test_a_bad_change_keeps_the_previous_rules(tmp_path: Path) -> None:
    """A broken file is counted in config_load_error and the old rules go on serving; fixing it
    loads the new rules."""
    path = tmp_path / "rules.yaml"
    path.write_text(rules(1))
    async with running_app(path, config_poll_seconds=0.05) as app:
        before = await rlconfig(app)
        path.write_text("domain: reload\ndescriptors:\n  - key: user\n    ratelimit: {}\n")
        await eventually(lambda: app.stats.config_load_error == 1)
        assert await rlconfig(app) == before
        assert await codes(app, "u2", 2) == [Code.OK, Code.OVER_LIMIT]
        path.write_text(rules(3))
        await eventually(lambda: app.stats.config_load_success == 2)
        assert "requests_per_unit=3" in await rlconfig(app)


async def test_a_directory_swapped_under_a_symlink_is_reloaded(tmp_path: Path) -> None:
    """Kubernetes updates a mounted ConfigMap by pointing a symlink at a new directory: the
    sidecar sees it as a change."""
    for name, limit in (("v1", 1), ("v2", 7)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rules.yaml").write_text(rules(limit))
    (tmp_path / "current").symlink_to("v1")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    (mounted / "rules.yaml").symlink_to(tmp_path / "current" / "rules.yaml")
    async with running_app(mounted, config_poll_seconds=0.05) as app:
        assert "requests_per_unit=1" in await rlconfig(app)
        swap = tmp_path / "swap"
        swap.symlink_to("v2")
        swap.replace(tmp_path / "current")
        await eventually(lambda: app.stats.config_load_success == 2)
        assert "requests_per_unit=7" in await rlconfig(app)


async def more_full_collections(http: aiohttp.ClientSession, url: str, than: float) -> float:
    """The count of full collections (generation 2) on a sidecar's /metrics, once above `than`."""
    for _ in range(200):
        async with http.get(url) as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (
                    sample.name == "ratelimit_sidecar_gc_pause_seconds_count"
                    and sample.labels["generation"] == "2"
                    and sample.value > than
                ):
                    return float(sample.value)
        await asyncio.sleep(0.02)
    raise AssertionError(f"no more than {than} full collections in:\n{text}")


async def test_the_sidecar_collects_and_freezes_after_start_and_each_reload(
    tmp_path: Path,
) -> None:
    """Once started, and again after each reload, the sidecar collects and freezes what it
    keeps (`sidecar.telemetry.garbage.settle`): /metrics counts a full collection each time."""
    path = tmp_path / "rules.yaml"
    path.write_text(rules(1))
    args = ["--config", str(path), "--grpc-address", "127.0.0.1:0"]
    args += ["--http-address", "127.0.0.1:0", "--config-poll-seconds", "0"]
    async with serve_process(args) as served, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{served.http_port}/metrics"
        started = await more_full_collections(http, url, 0)
        path.write_text(rules(4))
        assert served.process.pid is not None
        os.kill(served.process.pid, signal.SIGHUP)
        await more_full_collections(http, url, started)


async def test_sighup_reloads_the_rules(tmp_path: Path) -> None:
    """With polling off, SIGHUP to the process reloads the rules."""
    path = tmp_path / "rules.yaml"
    path.write_text(rules(1))
    args = [
        "--config",
        str(path),
        "--grpc-address",
        "127.0.0.1:0",
        "--http-address",
        "127.0.0.1:0",
        "--config-poll-seconds",
        "0",
    ]
    async with serve_process(args) as served, client(served.grpc_port) as rls:
        calls = [(await rls.call(request("reload", [("user", "u3")]))).overall_code]
        calls.append((await rls.call(request("reload", [("user", "u3")]))).overall_code)
        assert calls == [Code.OK, Code.OVER_LIMIT]
        path.write_text(rules(4))
        assert served.process.pid is not None
        os.kill(served.process.pid, signal.SIGHUP)
        url = f"http://127.0.0.1:{served.http_port}/rlconfig"
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                async with http.get(url) as response:
                    if "requests_per_unit=4" in await response.text():
                        break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("SIGHUP did not reload the rules")
        third = await rls.call(request("reload", [("user", "u3")]))
        assert third.overall_code == Code.OK


async def test_a_warning_of_the_rules_is_logged_once(tmp_path: Path) -> None:
    """A likely mistake in the rules (here `unit` beside `rate_limit`) is logged when they load,
    and not again when a change of another rule reloads them."""
    import structlog

    path = tmp_path / "rules.yaml"
    mistake = "  - key: ip\n    unit: minute\n"
    path.write_text(rules(1) + mistake)
    with structlog.testing.capture_logs() as logs:
        async with running_app(path, config_poll_seconds=0.05) as app:
            path.write_text(rules(5) + mistake)
            await eventually(lambda: app.stats.config_load_success == 2)
    warnings = [entry["warning"] for entry in logs if entry["event"] == "config_warning"]
    assert warnings == [
        f"{path}: descriptors[1]: key 'unit' is ignored in a descriptor, as envoyproxy/ratelimit "
        "ignores it (it belongs in rate_limit: move it there, or remove it)"
    ]
