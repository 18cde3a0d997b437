"""A backend the sidecar's own configuration makes unusable, as an operator meets it: a Redis
that refuses our password (or wants one) and a host name that does not resolve. Each is logged
once at start with why, `/healthcheck` answers 500 saying so until the backend answers, the
failure mode answers every call meanwhile, and the stop is clean. Real redis-server processes
(the test's own, with `requirepass`) and a real `serve` process.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from support.servers import HOST, RedisServer
from support.sidecars import ServeProcess, serve_process

from sidecar.runner.app import HEALTH_INTERVAL

RULES = """\
domain: faults
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 1
"""
CALL = {"domain": "faults", "descriptors": [{"entries": [{"key": "user", "value": "u1"}]}]}
#: How long a test waits for the sidecar to see a change (its backend pings every 2 s).
SETTLE_TIMEOUT = 10.0


def args(tmp_path: Path, backend: str, *extra: str) -> list[str]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return ["--config", str(rules), "--backend", backend, "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0", *extra]  # fmt: skip


async def get(served: ServeProcess, path: str, body: Any = None) -> tuple[int, str]:
    url = f"http://127.0.0.1:{served.http_port}{path}"
    async with aiohttp.ClientSession() as http:
        if body is None:
            async with http.get(url) as answer:
                return answer.status, await answer.text()
        async with http.post(url, json=body) as answer:
            return answer.status, await answer.text()


async def healthcheck_until(served: ServeProcess, status: int) -> str:
    """/healthcheck polled until it answers `status`; its body."""
    async with asyncio.timeout(SETTLE_TIMEOUT):
        while True:
            got, text = await get(served, "/healthcheck")
            if got == status:
                return text
            await asyncio.sleep(0.1)


async def stop(served: ServeProcess) -> int:
    """SIGTERM, as Kubernetes and `docker stop` stop it; the exit status."""
    served.process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(SETTLE_TIMEOUT):
        return await served.process.wait()


def unhealthy(served: ServeProcess) -> list[dict[str, Any]]:
    return [e for e in served.events() if e.get("event") == "backend_unhealthy"]


def password_server(server: RedisServer, password: str) -> None:
    """Make `server` require `password` from now on (connections already open keep theirs)."""
    with server.client() as client:
        client.config_set("requirepass", password)


def client_with(server: RedisServer, password: str) -> redis.Redis:
    return redis.Redis(host=HOST, port=server.port, password=password, socket_timeout=5)


async def test_a_refused_password_is_logged_once_and_unhealthy_until_redis_takes_it(
    tmp_path: Path, restartable_redis: RedisServer
) -> None:
    """REDIS_AUTH (here the URL's password) that Redis refuses: logged once at start, with
    WRONGPASS; /healthcheck answers 500 naming it while the failure mode (allow) answers the
    calls; once Redis takes the password, healthy again."""
    password_server(restartable_redis, "right")
    backend = f"redis://:wrong@{HOST}:{restartable_redis.port}"
    async with serve_process(args(tmp_path, backend)) as served:
        body = await healthcheck_until(served, 500)
        assert "refuses the credentials given" in body and "WRONGPASS" in body
        for _ in range(2):  # a limit of 1 a minute, yet both admitted: the failure mode
            assert (await get(served, "/json", CALL))[0] == 200
        await asyncio.sleep(HEALTH_INTERVAL * 1.5)  # pings that must not log it again
        client = client_with(restartable_redis, "right")
        try:
            client.config_set("requirepass", "wrong")
        finally:
            client.close()
        assert await healthcheck_until(served, 200) == "OK"
        assert await stop(served) == 0
    [event] = unhealthy(served)
    assert "WRONGPASS" in event["fault"] and event["healthy"] is False
    assert "wrong" not in event["fault"].replace("WRONGPASS", "")
    assert [e["event"] for e in served.events()].index("backend_unhealthy") < [
        e["event"] for e in served.events()
    ].index("started")


async def test_no_password_where_redis_wants_one_says_so(
    tmp_path: Path, restartable_redis: RedisServer
) -> None:
    """A Redis with requirepass and a URL without a password: NOAUTH, named as such."""
    password_server(restartable_redis, "right")
    async with serve_process(args(tmp_path, f"redis://{HOST}:{restartable_redis.port}")) as served:
        body = await healthcheck_until(served, 500)
        assert "wants a password" in body and "NOAUTH" in body
        assert await stop(served) == 0


@pytest.mark.parametrize(
    "backend",
    [
        "redis://nonexistent.invalid:6379",
        "redis+cluster://nonexistent.invalid:7000",
        "redis+sentinel://nonexistent.invalid:26379/mymaster",
    ],
    ids=["redis", "cluster", "sentinel"],
)
async def test_an_unresolvable_host_is_logged_once_and_stops_cleanly(
    tmp_path: Path, backend: str
) -> None:
    """A host name that does not resolve, under --failure-mode local (whose registration of
    peers dials at the stop too): logged once at start, 500 naming it, calls answered by the
    failure mode, and a stop with no 'Future exception was never retrieved'."""
    async with serve_process(args(tmp_path, backend, "--failure-mode", "local")) as served:
        body = await healthcheck_until(served, 500)
        assert "does not resolve" in body and "nonexistent.invalid" in body
        status, answer = await get(served, "/json", CALL)
        assert status == 200 and '"OK"' in answer
        await asyncio.sleep(HEALTH_INTERVAL * 1.5)
        assert await stop(served) == 0
    [event] = unhealthy(served)
    assert "does not resolve" in event["fault"]
    assert "never retrieved" not in served.output()
    assert "Traceback" not in served.output()


async def test_a_password_rotated_after_the_start_is_an_outage_not_unhealthy(
    tmp_path: Path, restartable_redis: RedisServer
) -> None:
    """Once Redis has answered, its refusing our password later (rotated on the server) is
    logged with why but keeps the sidecar healthy under --failure-mode allow: pulling every
    pod out of its Service would make it the gateway's outage."""
    password_server(restartable_redis, "old")
    backend = f"redis://:old@{HOST}:{restartable_redis.port}"
    async with serve_process(args(tmp_path, backend)) as served:
        assert await healthcheck_until(served, 200) == "OK"
        client = client_with(restartable_redis, "old")
        try:
            client.config_set("requirepass", "new")
            client.client_kill_filter(_type="normal")  # the sidecar's connections, not ours
        finally:
            client.close()
        async with asyncio.timeout(SETTLE_TIMEOUT):
            while not unhealthy(served):
                await asyncio.sleep(0.1)
        assert (await get(served, "/healthcheck"))[0] == 200
        assert await stop(served) == 0
    [event] = unhealthy(served)
    assert "WRONGPASS" in event["fault"] and event["healthy"] is True
