"""Concurrency limits through the real Envoy 1.40: envoy/concurrency.yaml (its ports changed)
counts a request when it starts and gives it back when its stream ends, and the sidecar's
`algorithm: concurrency` rule admits at most N in flight. Requests are held in flight by an
upstream in this process that answers only when the test lets it; nothing here waits on a
clock except for a condition, with a generous deadline. With `request_id`, the starts and
refunds carry the request's `x-request-id`, so a lost refund's place comes back within its
lease while traffic continues."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.envoys import HOST, POLL, Envoy, Sidecar, free_port, get, start_together
from test_gateway_e2e import unique

EXAMPLE = Path(__file__).resolve().parent.parent / "envoy" / "concurrency.yaml"
#: Generous: this machine is shared, and a deadline only bounds a wait for a condition.
DEADLINE = 30.0


def rules(lease: str, request_id: bool = False) -> str:
    """The sidecar's rules: 2 in flight per client; with `request_id`, its starts named by the
    entry `x_request_id` (see `bootstrap`)."""
    named = ", request_id: x_request_id" if request_id else ""
    return (
        "domain: inflight\ndescriptors:\n  - key: client\n    rate_limit: "
        f"{{algorithm: concurrency, requests_per_unit: 2, lease: {lease}{named}}}\n"
    )


class HeldUpstream:
    """The service behind Envoy, in this process: each request waits until the test releases
    it (`release`), so it stays in flight as long as the test needs; `arrived` counts those
    that reached it."""

    def __init__(self) -> None:
        self.arrived = 0
        self._gate = threading.Event()
        self._changed = threading.Condition()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with outer._changed:
                    outer.arrived += 1
                    outer._changed.notify_all()
                outer._gate.wait(timeout=2 * DEADLINE)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        # Checks for `shutdown` every POLL, not the default 0.5 s each test would wait at its end.
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": POLL}, daemon=True
        )
        self._thread.start()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def wait_arrived(self, count: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.arrived >= count, timeout=DEADLINE):
                raise AssertionError(f"{self.arrived} requests reached the upstream, not {count}")

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


def bootstrap(
    sidecar_port: int, port: int, admin_port: int, upstream_port: int, request_id: bool = False
) -> str:
    """envoy/concurrency.yaml with these ports, and a 2 s rate limit timeout (this machine is
    shared; the example's 100 ms is for a gateway); with `request_id`, the start and the refund
    both end with the request's `x-request-id` as the entry `x_request_id` (README, "Concurrency
    limits")."""
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address=HOST, port_value=port)
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0]["typed_config"]["timeout"] = "2s"
    if request_id:
        route = manager["route_config"]["virtual_hosts"][0]["routes"][0]
        per_route = route["typed_per_filter_config"]["envoy.filters.http.ratelimit"]
        for limit in per_route["rate_limits"]:
            limit["actions"].append(
                {
                    "request_headers": {
                        "header_name": "x-request-id",
                        "descriptor_key": "x_request_id",
                    }
                }
            )
    for cluster in config["static_resources"]["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = (
            upstream_port if cluster["name"] == "upstream" else sidecar_port
        )
    return yaml.safe_dump(config)


class Front(Envoy):
    """An Envoy of envoy/concurrency.yaml, and the port of its listener."""

    def __init__(self, binary: str, config: Path, admin_port: int, log: Path, port: int) -> None:
        super().__init__(binary, config, admin_port, log)
        self.port = port


class Gateway:
    """Sidecars on one store, each with an Envoy of envoy/concurrency.yaml in front of it."""

    def __init__(
        self, tmp_path: Path, upstream: HeldUpstream, envoy_binary: str, request_id: bool = False
    ) -> None:
        self.tmp_path = tmp_path
        self.upstream = upstream
        self.envoy_binary = envoy_binary
        #: Starts and refunds name their request (`rules`, `bootstrap`).
        self.request_id = request_id
        self.processes: list[Sidecar | Front] = []
        self._count = 0

    def start(self, flags: list[str], lease: str) -> tuple[Sidecar, Front]:
        path = self.tmp_path / "rules.yaml"
        path.write_text(rules(lease, self.request_id))

        def make(attempt: int) -> tuple[Sidecar, Front]:
            self._count += 1
            name = f"{self._count}-{attempt}"
            sidecar = Sidecar(
                ["--config", str(path), "--negative-hits", *flags],
                free_port(), free_port(), self.tmp_path / f"sidecar-{name}.log",
            )  # fmt: skip
            return sidecar, self.envoy(sidecar, name)

        sidecar, envoy = start_together(make)
        assert isinstance(sidecar, Sidecar) and isinstance(envoy, Front)
        self.processes += [sidecar, envoy]
        return sidecar, envoy

    def envoy(self, sidecar: Sidecar, name: str) -> Front:
        """An Envoy in front of `sidecar`, not started."""
        port, admin_port = free_port(), free_port()
        config = self.tmp_path / f"envoy-{name}.yaml"
        config.write_text(
            bootstrap(sidecar.grpc_port, port, admin_port, self.upstream.port, self.request_id)
        )
        log = self.tmp_path / f"envoy-{name}.log"
        return Front(self.envoy_binary, config, admin_port, log, port)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture
def upstream() -> Iterator[HeldUpstream]:
    held = HeldUpstream()
    yield held
    held.stop()


@pytest.fixture
def gateway(tmp_path: Path, upstream: HeldUpstream, envoy_binary: str) -> Iterator[Gateway]:
    started = Gateway(tmp_path, upstream, envoy_binary)
    yield started
    started.stop()


@pytest.fixture
def named_gateway(tmp_path: Path, upstream: HeldUpstream, envoy_binary: str) -> Iterator[Gateway]:
    """The gateway whose starts and refunds carry the request's `x-request-id`, which the rule
    names (`request_id`)."""
    started = Gateway(tmp_path, upstream, envoy_binary, request_id=True)
    yield started
    started.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def sending(pool: ThreadPoolExecutor, envoy: Front, client: str) -> Future[int]:
    """A request of `client` through `envoy`, in the background: its status."""
    headers = {"x-client": client}
    return pool.submit(lambda: get(envoy.port, "/work", headers, timeout=2 * DEADLINE).status)


def status(envoy: Front, client: str) -> int:
    return get(envoy.port, "/work", {"x-client": client}, timeout=DEADLINE).status


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE:g} s: {what}")
        time.sleep(0.1)


def test_n_in_flight_are_admitted_the_next_refused_and_n_more_once_they_end(
    gateway: Gateway, upstream: HeldUpstream, pool: ThreadPoolExecutor
) -> None:
    """On a limit of 2: two slow requests in flight pass, a third gets 429, and so does a fourth
    sent after the third's stream-done refund (which closes the refused start, not one in
    flight); once the two end, two more are admitted."""
    sidecar, envoy = gateway.start([], lease="30s")
    client = unique("client")
    upstream.hold()
    first = [sending(pool, envoy, client) for _ in range(2)]
    upstream.wait_arrived(2)
    assert status(envoy, client) == 429
    sidecar.wait_for_calls(4)  # two starts, the third's start and its refund
    assert status(envoy, client) == 429
    upstream.release()
    assert [f.result(timeout=DEADLINE) for f in first] == [200, 200]
    sidecar.wait_for_calls(8)  # and the two refunds of the requests that ended
    upstream.hold()
    second = [sending(pool, envoy, client) for _ in range(2)]
    upstream.wait_arrived(4)
    assert status(envoy, client) == 429
    upstream.release()
    assert [f.result(timeout=DEADLINE) for f in second] == [200, 200]
    sidecar.wait_for_calls(14)
    labels = '{domain="inflight",key1="client"}'
    metrics = sidecar.metrics()
    assert metrics[f"ratelimit_service_rate_limit_over_limit{labels}"] == 3
    assert metrics[f"ratelimit_service_rate_limit_total_negative_hits{labels}"] == 7


@pytest.mark.redis
def test_two_sidecars_on_one_redis_share_the_limit(
    gateway: Gateway, upstream: HeldUpstream, pool: ThreadPoolExecutor, redis_url: str
) -> None:
    """One request in flight through each of two sidecars on one Redis fills the limit of 2: a
    third, through either, gets 429; once both end, two more pass through the second alone."""
    _, one = gateway.start(["--backend", redis_url], lease="30s")
    second_sidecar, two = gateway.start(["--backend", redis_url], lease="30s")
    client = unique("client")
    upstream.hold()
    held = [sending(pool, one, client)]
    upstream.wait_arrived(1)
    held.append(sending(pool, two, client))
    upstream.wait_arrived(2)
    assert status(one, client) == 429
    assert status(two, client) == 429
    upstream.release()
    assert [f.result(timeout=DEADLINE) for f in held] == [200, 200]
    # Each sidecar answered its refunds (the 429s' too) before the next starts.
    until(lambda: second_sidecar.calls() >= 4, "the second sidecar's four calls")
    upstream.hold()
    more = [sending(pool, two, client) for _ in range(2)]
    upstream.wait_arrived(4)
    assert status(two, client) == 429
    upstream.release()
    assert [f.result(timeout=DEADLINE) for f in more] == [200, 200]


def test_starts_of_an_envoy_killed_mid_stream_come_back_within_the_lease(
    gateway: Gateway, upstream: HeldUpstream, pool: ThreadPoolExecutor
) -> None:
    """Two requests in flight through an Envoy that is then killed (SIGKILL, by its PID) never
    send their refunds: through a second Envoy the client is refused while their starts last,
    and admitted again once their 2 s lease has run out."""
    sidecar, doomed = gateway.start([], lease="2s")
    survivor = gateway.envoy(sidecar, "survivor")
    survivor.start()
    gateway.processes.append(survivor)
    client = unique("client")
    upstream.hold()
    started = time.monotonic()
    lost = [sending(pool, doomed, client) for _ in range(2)]
    upstream.wait_arrived(2)
    doomed.kill()
    upstream.release()  # the upstream answers a gone Envoy, and what comes next at once
    for future in lost:
        with pytest.raises(OSError):
            future.result(timeout=DEADLINE)
    first = status(survivor, client)
    # Refused while the lost starts last; a machine this slow may have let the lease run out.
    assert first == 429 or time.monotonic() - started >= 2
    until(lambda: status(survivor, client) == 200, "a request admitted after the lease")


def test_a_lost_refunds_place_comes_back_within_its_lease_while_traffic_continues(
    named_gateway: Gateway, upstream: HeldUpstream, pool: ThreadPoolExecutor
) -> None:
    """On a limit of 2 with a 2 s lease: a request in flight through an Envoy then killed
    (SIGKILL, by its PID) never sends its refund. Through a second Envoy, requests keep coming
    one after another (each admitted and refunded); between them, two held in flight at once
    are tried. While the lost start lasts the second of the two is refused; once its lease has
    run out, both are admitted, the traffic still going. (Closing the oldest start instead, each
    refund would pass the lost place on to a newer start, and two would never fit again.)"""
    sidecar, doomed = named_gateway.start([], lease="2s")
    survivor = named_gateway.envoy(sidecar, "survivor")
    survivor.start()
    named_gateway.processes.append(survivor)
    client = unique("client")
    upstream.hold()
    lost = sending(pool, doomed, client)
    upstream.wait_arrived(1)
    doomed.kill()
    started = time.monotonic()
    upstream.release()
    with pytest.raises(OSError):
        lost.result(timeout=DEADLINE)

    rounds: list[tuple[int, int]] = []

    def two_fit() -> bool:
        """Traffic, then two requests held in flight at once: True when both were admitted."""
        for _ in range(3):
            assert status(survivor, client) == 200  # each refunded before the next starts
        upstream.hold()
        arrived = upstream.arrived
        first = sending(pool, survivor, client)
        upstream.wait_arrived(arrived + 1)
        second = sending(pool, survivor, client)
        until(lambda: second.done() or upstream.arrived >= arrived + 2, "the second's answer")
        upstream.release()
        rounds.append((first.result(timeout=DEADLINE), second.result(timeout=DEADLINE)))
        return rounds[-1] == (200, 200)

    until(two_fit, "two requests in flight admitted once the lost start's lease ended")
    # Refused while the lost start lasted; a machine this slow may have let the lease run out.
    assert rounds[0] == (200, 429) or time.monotonic() - started >= 2
    assert all(pair in ((200, 429), (200, 200)) for pair in rounds)
    labels = '{domain="inflight",key1="client"}'
    assert sidecar.metrics()[f"ratelimit_service_rate_limit_total_negative_hits{labels}"] > 0
