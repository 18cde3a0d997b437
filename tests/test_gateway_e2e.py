"""The gateway end to end: a real Envoy enforcing the sidecar's answers, with Redis behind it.

One set of processes serves the whole module: redis-server, the sidecar (`--failure-mode
deny`, so its own failure mode is visible through Envoy), a small upstream and Envoy, whose
bootstrap is envoy/gateway.yaml's own command run again with these rules, these ports and a
2 s rate limit timeout (this machine is shared; envoy/gateway.yaml's 100 ms is for a gateway
with CPU of its own).
Each test uses its own app, user and client address (127.0.0.x) so counters never mix; the
tests that kill a process come last and leave it running again.
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support.envoys import Envoy, ProcessError, Response, Sidecar, Upstream, free_port, get
from support.servers import RedisServer

from sidecar import cli
from sidecar.envoy_config import commands

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / "envoy" / "gateway.yaml"
#: Envoy's deadline for one ShouldRateLimit call in these tests.
ENVOY_TIMEOUT = 2.0
#: The sidecar's deadline for one Redis call.
REDIS_TIMEOUT = 0.25

# The shipped rules' key paths, with small limits, plus two app patterns on the same path.
RULES = """\
domain: gateway
descriptors:
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 10}
      - key: user
        descriptors:
          - key: interface
            rate_limit: {unit: hour, requests_per_unit: 3}
  - key: app
    value: shadow-*
    descriptors:
      - key: remote_address
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 2}
  - key: app
    value: burst-*
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 100}
  - key: user
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 5}
"""


@dataclass
class Gateway:
    envoy: Envoy
    sidecar: Sidecar
    redis: RedisServer
    upstream: Upstream
    port: int
    config: Path

    def get(
        self, path: str, headers: Mapping[str, str] | None = None, source: str = "127.0.0.1"
    ) -> Response:
        return get(self.port, path, headers, source=source)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def inside_one_window(seconds: int, needed: float = 20.0) -> int:
    """Wait, if need be, until at least `needed` seconds of the current wall-clock window of
    `seconds` are left (the sidecar's fixed windows start on the clock); returns its number."""
    left = seconds - time.time() % seconds
    if left < needed:
        time.sleep(left + 0.05)
    return int(time.time() // seconds)


def generating_command() -> list[str]:
    """envoy/gateway.yaml's own `envoy-config` arguments, from its header."""
    argv = shlex.split(GATEWAY.read_text().splitlines()[1].removeprefix("#"))
    return argv[1:]


def bootstrap(
    rules: Path,
    sidecar_port: int,
    port: int,
    admin_port: int,
    upstream_port: int,
    timeout: float = ENVOY_TIMEOUT,
) -> str:
    """envoy/gateway.yaml's own command run again with these rules, ports and timeout."""
    argv = generating_command()
    args = cli.parse_args(argv)
    args.rules = [str(rules)]
    args.sidecar = ("127.0.0.1", sidecar_port)
    args.listen = ("127.0.0.1", port)
    args.upstream = ("127.0.0.1", upstream_port)
    args.admin = ("127.0.0.1", admin_port)
    args.timeout_ms = int(timeout * 1000)
    return commands.generate(args, argv)


@pytest.fixture(scope="module")
def gateway(
    envoy_binary: str, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """Redis, the sidecar, the upstream and Envoy, started once for the module."""
    workdir = tmp_path_factory.mktemp("gateway")
    redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    rules = workdir / "rules.yaml"
    rules.write_text(RULES)
    upstream = Upstream()
    upstream.start()
    # Ports are picked free, then bound by the processes a moment later; in between an outgoing
    # connection of this busy suite can take one as its ephemeral port. So a start that fails
    # is tried again on fresh ports (twice at most) before the module gives up.
    for attempt in range(3):
        sidecar = Sidecar(
            ["--config", str(rules), "--backend", redis_server.url, "--failure-mode", "deny",
             "--redis-timeout-ms", str(int(REDIS_TIMEOUT * 1000))],
            free_port(), free_port(), workdir / "sidecar.log",
        )  # fmt: skip
        port, admin_port = free_port(), free_port()
        config = workdir / "envoy.yaml"
        config.write_text(
            bootstrap(rules, sidecar.grpc_port, port, admin_port, upstream.port, ENVOY_TIMEOUT)
        )
        envoy = Envoy(envoy_binary, config, admin_port, workdir / "envoy.log")
        try:
            sidecar.start()
            envoy.start()
            break
        except ProcessError:
            envoy.stop()
            sidecar.stop()
            if attempt == 2:
                upstream.stop()
                raise
    try:
        yield Gateway(envoy, sidecar, redis_server, upstream, port, config)
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.stop()
        redis_server.resume()
        redis_server.start()


def routes(config: Mapping[str, object]) -> object:
    listener = config["static_resources"]["listeners"][0]  # type: ignore[index]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]


def test_envoy_under_test_routes_exactly_like_envoy_gateway_yaml(gateway: Gateway) -> None:
    """The tests' Envoy sends the very route rate_limits of envoy/gateway.yaml."""
    tested = yaml.safe_load(gateway.config.read_text())
    shipped = yaml.safe_load(GATEWAY.read_text())
    assert routes(tested) == routes(shipped)


def test_per_app_per_ip_limit_answers_429_with_rate_limit_headers(gateway: Gateway) -> None:
    """Request 11 of one app from one address gets 429 with x-envoy-ratelimited; every answer
    carries the limit, what remains and the seconds until the hour's window resets; another
    address of the same app is not limited."""
    inside_one_window(3600)
    app = unique("app")
    responses = []
    resets = []  # (longest, shortest) reset each answer may carry, from the clock around it
    for _ in range(11):
        before = int(time.time())
        responses.append(gateway.get(f"/api/orders/{app}", {"x-app-id": app}, source="127.0.0.2"))
        after = int(time.time())
        resets.append((3600 - before % 3600, 3600 - after % 3600))
    assert [r.status for r in responses] == [200] * 10 + [429]
    for sent, (response, (longest, shortest)) in enumerate(
        zip(responses, resets, strict=True), start=1
    ):
        assert response.headers["x-ratelimit-limit"] == "10, 10;w=3600"
        assert response.headers["x-ratelimit-remaining"] == str(max(10 - sent, 0))
        assert shortest <= int(response.headers["x-ratelimit-reset"]) <= longest
    assert "x-envoy-ratelimited" not in responses[9].headers
    assert responses[10].headers["x-envoy-ratelimited"] == "true"
    assert gateway.upstream.hits[f"/api/orders/{app}"] == 10
    other = gateway.get(f"/api/orders/{app}", {"x-app-id": app}, source="127.0.0.3")
    assert other.status == 200
    assert other.headers["x-ratelimit-remaining"] == "9"


def test_users_and_interfaces_are_limited_independently(gateway: Gateway) -> None:
    """3 calls an hour per app, user and interface: user 1's 4th call on orders is refused,
    while user 2 on orders and user 1 on search still pass."""
    inside_one_window(3600)
    app, first, second = unique("app"), unique("user"), unique("user")

    def call(user: str, interface: str) -> int:
        headers = {"x-app-id": app, "x-user-id": user}
        return gateway.get(f"/api/{interface}", headers, source="127.0.0.4").status

    assert [call(first, "orders") for _ in range(4)] == [200, 200, 200, 429]
    assert call(second, "orders") == 200
    assert call(first, "search") == 200


def test_ad_cap_counts_only_served_ads(gateway: Gateway) -> None:
    """5 ads a day per user and ad: failed upstream calls are not counted, the 6th served
    request is refused, another ad for the same user still passes. Each request is checked on
    arrival (remaining shows what was left before it) and counted when its response is done."""
    inside_one_window(86400)
    user, path = unique("user"), f"/ads/{unique('slot')}"
    headers = {"x-user-id": user, "x-ad-id": "a1"}
    calls = gateway.sidecar.calls()

    def call(extra: Mapping[str, str] | None = None) -> Response:
        nonlocal calls
        response = gateway.get(path, {**headers, **(extra or {})})
        # A check on the request, a count when the stream is done, landing just after.
        calls += 2
        gateway.sidecar.wait_for_calls(calls)
        return response

    failed = [call({"x-upstream-status": "503"}) for _ in range(2)]
    assert [r.status for r in failed] == [503, 503]
    served = [call() for _ in range(5)]
    assert [r.status for r in served] == [200] * 5
    assert [r.headers["x-ratelimit-remaining"] for r in served] == ["5", "4", "3", "2", "1"]
    refused = call()
    assert refused.status == 429
    assert refused.headers["x-envoy-ratelimited"] == "true"
    assert gateway.upstream.hits[path] == 7
    assert gateway.get(path, {"x-user-id": user, "x-ad-id": "a2"}).status == 200


def test_shadow_mode_rule_never_refuses_but_counts(gateway: Gateway) -> None:
    """A shadow_mode rule of 2 an hour lets all 5 requests through; its hit and shadow_mode
    counters still move (3 of the 5 were over its limit)."""
    app = unique("shadow")
    labels = {"domain": "gateway", "key1": "app_shadow-*", "key2": "remote_address"}
    before = {
        stat: gateway.sidecar.metric(f"ratelimit_service_rate_limit_{stat}", labels)
        for stat in ("total_hits", "shadow_mode")
    }
    statuses = [
        gateway.get("/api/orders", {"x-app-id": app}, source="127.0.0.5").status for _ in range(5)
    ]
    assert statuses == [200] * 5
    after = {
        stat: gateway.sidecar.metric(f"ratelimit_service_rate_limit_{stat}", labels)
        for stat in before
    }
    assert after["total_hits"] - before["total_hits"] == 5
    assert after["shadow_mode"] - before["shadow_mode"] == 3


def test_500_requests_from_50_clients_admit_exactly_the_limit(gateway: Gateway) -> None:
    """50 concurrent clients send 10 requests each on a limit of 100 an hour: exactly 100
    pass and the other 400 get 429, inside one hour window (a minute's would have the test
    wait up to 20 s for a fresh one)."""
    for _ in range(2):
        hour = inside_one_window(3600)
        app = unique("burst")

        def client(index: int, app: str = app) -> list[int]:
            return [gateway.get("/api/orders", {"x-app-id": app}).status for _ in range(10)]

        with ThreadPoolExecutor(max_workers=50) as pool:
            statuses = Counter(s for batch in pool.map(client, range(50)) for s in batch)
        if int(time.time() // 3600) == hour:
            break
    else:
        pytest.fail("two bursts in a row straddled an hour boundary")
    assert statuses == {200: 100, 429: 400}


def test_sidecar_down_lets_requests_through_and_restart_keeps_counters(gateway: Gateway) -> None:
    """With the sidecar killed, Envoy lets requests through within its timeout (failure mode
    allow); started again, the sidecar finds its counters in Redis and refuses again."""
    inside_one_window(3600)
    app = unique("app")

    def call() -> Response:
        return gateway.get("/api/orders", {"x-app-id": app}, source="127.0.0.7")

    assert [call().status for _ in range(11)] == [200] * 10 + [429]
    allowed = gateway.envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed")
    gateway.sidecar.kill()
    try:
        passed = call()
        assert passed.status == 200
        assert passed.seconds < ENVOY_TIMEOUT
        assert "x-ratelimit-limit" not in passed.headers
        assert gateway.envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed") > allowed
    finally:
        gateway.sidecar.start()
    deadline = time.monotonic() + 15
    while (response := call()).status != 429:
        assert time.monotonic() < deadline, f"still {response.status} after the restart"
        time.sleep(0.1)
    assert response.headers["x-ratelimit-remaining"] == "0"


def test_redis_down_answers_with_the_sidecars_failure_mode_and_recovers(gateway: Gateway) -> None:
    """Redis frozen or stopped: the sidecar's deny answers 429 within its deadline, before
    Envoy's timeout. Redis started again (empty): enforcement resumes from zero."""
    inside_one_window(3600)
    app = unique("app")

    def call() -> Response:
        return gateway.get("/api/orders", {"x-app-id": app}, source="127.0.0.8")

    assert call().status == 200
    try:
        gateway.redis.pause()
        frozen = call()
        assert frozen.status == 429
        assert REDIS_TIMEOUT <= frozen.seconds < ENVOY_TIMEOUT
        gateway.redis.resume()
        gateway.redis.stop()
        stopped = call()
        assert stopped.status == 429
        assert stopped.seconds < ENVOY_TIMEOUT
    finally:
        gateway.redis.resume()
        gateway.redis.start()
    deadline = time.monotonic() + 15
    while (response := call()).status != 200:
        assert time.monotonic() < deadline, f"still {response.status} after Redis came back"
        time.sleep(0.1)
    assert [call().status for _ in range(10)] == [200] * 9 + [429]
