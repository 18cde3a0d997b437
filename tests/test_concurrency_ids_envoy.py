"""Concurrency limits with request ids through the real Envoy 1.40: envoy/concurrency.yaml with
the request's `x-request-id` as the last entry of its start and of its stream-done refund
(`test_concurrency_envoy.bootstrap`), and the sidecar's rule naming it (`request_id`). A request
whose refund is lost (its Envoy killed mid-stream) gives its place back within its lease while
traffic through another Envoy never stops. Nothing here waits on a clock except for a
condition, with a generous deadline."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_concurrency_envoy import (
    DEADLINE,
    Gateway,
    HeldUpstream,
    sending,
    status,
    until,
)
from test_gateway_e2e import unique


@pytest.fixture
def upstream() -> Iterator[HeldUpstream]:
    held = HeldUpstream()
    yield held
    held.stop()


@pytest.fixture
def gateway(tmp_path: Path, upstream: HeldUpstream, envoy_binary: str) -> Iterator[Gateway]:
    started = Gateway(tmp_path, upstream, envoy_binary, request_id=True)
    yield started
    started.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def test_a_lost_refunds_place_comes_back_within_its_lease_while_traffic_continues(
    gateway: Gateway, upstream: HeldUpstream, pool: ThreadPoolExecutor
) -> None:
    """On a limit of 2 with a 2 s lease: a request in flight through an Envoy then killed
    (SIGKILL, by its PID) never sends its refund. Through a second Envoy, requests keep coming
    one after another (each admitted and refunded); between them, two held in flight at once
    are tried. While the lost start lasts the second of the two is refused; once its lease has
    run out, both are admitted, the traffic still going. (Closing the oldest start instead, each
    refund would pass the lost place on to a newer start, and two would never fit again.)"""
    sidecar, doomed = gateway.start([], lease="2s")
    survivor = gateway.envoy(sidecar, "survivor")
    survivor.start()
    gateway.processes.append(survivor)
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
