"""Penalties that escalate (`penalty:` on a rule, `sidecar.algorithms.penalty`), on memory, Redis
and Redis Cluster (real servers the fixtures start) with a clock the tests set: a descriptor
that keeps tripping its limit is blocked 10, then 20, then 40 minutes; a block refuses without
counting and answers the time left; forget_after forgets the strikes; shadow mode reports a
block without enforcing it; the operator's reads show it and its resets lift it, through
`sidecar.operator.counter_admin` and through the operator port."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs
from support.callbacks import should_rate_limit
from support.clock import Clock
from support.sidecars import running_app, write_rules

from sidecar.decision.limiter import Limiter
from sidecar.decision.stats import Stats
from sidecar.model import Code, Descriptor, DescriptorStatus, Entry, Request
from sidecar.operator import counter_admin
from sidecar.operator.commands import render
from sidecar.operator.port import OperatorSettings
from sidecar.telemetry.metrics import Latency, StatsCollector
from sidecar.telemetry.statsd import Deltas

RULES = """\
domain: shop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
    penalty: {block: 10m, escalate: 2, max: 24h, forget_after: 7d}
  - key: quiet
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    penalty: {block: 10m}
  - key: tenant
    group_counters: true
    descriptors:
      - key: user
        rate_limits:
          - {unit: minute, requests_per_unit: 2}
          - {algorithm: token_bucket, unit: hour, requests_per_unit: 60, burst: 10}
        penalty: {block: 5m, escalate: 3, max: 30m, forget_after: 1h}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 2}
"""

MINUTE = 60


@pytest.fixture
def limiter(make_limiter: Callable[..., Limiter]) -> Limiter:
    return make_limiter(RULES)


def entries(pairs: str) -> tuple[Entry, ...]:
    return tuple(Entry(*pair.split("=", 1)) for pair in pairs.split(","))


async def ask(limiter: Limiter, pairs: str, hits: int = 1) -> DescriptorStatus:
    request = Request("shop", (Descriptor(entries(pairs), hits_addend=hits),))
    decision = await should_rate_limit(limiter, request)
    (status,) = decision.statuses
    assert decision.overall_code is status.code
    return status


async def state(limiter: Limiter, clock: Clock, pairs: str) -> dict[str, Any]:
    located = counter_admin.locate(limiter.rules, "shop", entries(pairs), int(clock() * 1000))
    return await counter_admin.state(limiter.backend, located)


async def trip(limiter: Limiter, pairs: str = "user=a", limit: int = 2) -> DescriptorStatus:
    """Use up the descriptor's window, then one more hit: the one that trips the penalty."""
    for _ in range(limit):
        assert (await ask(limiter, pairs)).code is Code.OK
    return await ask(limiter, pairs)


async def test_a_descriptor_that_keeps_tripping_is_blocked_10_then_20_then_40_minutes(
    limiter: Limiter, clock: Clock
) -> None:
    """Over its limit, a descriptor is refused for 10 minutes (its Retry-After the time left),
    admitted once they are over, refused 20 minutes when it trips again, then 40; an operator's
    reset lifts the block at once."""
    for blocked in (10 * MINUTE, 20 * MINUTE, 40 * MINUTE):
        tripped = await trip(limiter)
        assert (tripped.code, tripped.duration_until_reset) == (Code.OVER_LIMIT, blocked)
        clock.now += blocked - 1
        refused = await ask(limiter, "user=a")
        assert (refused.code, refused.limit_remaining) == (Code.OVER_LIMIT, 0)
        assert refused.duration_until_reset == 1
        clock.now += 1
        assert (await ask(limiter, "user=a")).code is Code.OK
        clock.now += MINUTE  # a fresh window for the next trip
    assert (await trip(limiter)).duration_until_reset == 80 * MINUTE
    seen = await state(limiter, clock, "user=a")
    assert seen["code"] == "OVER_LIMIT"
    assert seen["duration_until_reset"] == 80 * MINUTE
    assert (seen["penalty"]["blocked"], seen["penalty"]["strikes"]) == (True, 4)
    assert seen["penalty"]["level"] == 4
    assert seen["penalty"]["block_left_seconds"] == 80 * MINUTE

    located = counter_admin.locate(limiter.rules, "shop", entries("user=a"), int(clock() * 1000))
    assert await counter_admin.reset(limiter.backend, located) == 2  # the counter, the penalty
    assert (await ask(limiter, "user=a")).code is Code.OK
    penalty = (await state(limiter, clock, "user=a"))["penalty"]
    assert (penalty["blocked"], penalty["strikes"]) == (False, 0)
    rule = limiter.stats.rules["shop.user"]
    assert rule.penalty_blocks == 4


async def test_a_block_refuses_without_counting(limiter: Limiter, clock: Clock) -> None:
    """Hits during a block are refused and added to no counter: once the block is over, the
    window holds only what came after it."""
    await trip(limiter)
    clock.now += MINUTE  # a new window, still inside the block
    for _ in range(5):
        assert (await ask(limiter, "user=a")).code is Code.OVER_LIMIT
    seen = await state(limiter, clock, "user=a")
    assert seen["windows"][0]["count"] == 0
    rule = limiter.stats.rules["shop.user"]
    assert (rule.penalty_blocks, rule.over_limit_with_penalty) == (1, 5)
    clock.now += 10 * MINUTE
    assert (await ask(limiter, "user=a")).limit_remaining == 1


async def test_forget_after_forgets_the_strikes(limiter: Limiter, clock: Clock) -> None:
    """A descriptor that trips again within forget_after of its last block's end is blocked
    twice as long; one that stayed clear for forget_after starts again at the first block."""
    assert (await trip(limiter)).duration_until_reset == 10 * MINUTE
    clock.now += 10 * MINUTE + 7 * 86_400 - MINUTE  # a minute before the strikes are forgotten
    assert (await trip(limiter)).duration_until_reset == 20 * MINUTE
    clock.now += 20 * MINUTE + 7 * 86_400  # forgotten
    assert (await trip(limiter)).duration_until_reset == 10 * MINUTE
    assert (await state(limiter, clock, "user=a"))["penalty"]["strikes"] == 1


async def test_the_block_is_capped_at_max_and_a_check_never_trips(
    limiter: Limiter, clock: Clock
) -> None:
    """Blocks of 5 minutes growing threefold stop at the 30-minute max (5, 15, 30, 30), on a
    grouped tree of two windows; a check over the limit (hits_addend 0) answers OVER_LIMIT but
    starts no block."""
    pairs = "tenant=t,user=u"
    for _ in range(2):
        await ask(limiter, pairs)
    check = await ask(limiter, pairs, hits=0)
    assert check.code is Code.OVER_LIMIT
    assert (await state(limiter, clock, pairs))["penalty"]["strikes"] == 0
    clock.now += MINUTE
    for blocked in (5, 15, 30, 30):
        assert (await trip(limiter, pairs)).duration_until_reset == blocked * MINUTE
        clock.now += blocked * MINUTE + MINUTE
    assert (await state(limiter, clock, pairs))["penalty"]["level"] == 3


async def test_shadow_mode_reports_a_block_without_enforcing_it(
    limiter: Limiter, clock: Clock
) -> None:
    """A shadow rule's penalty trips and blocks in the stats only: every request is answered
    OK, and its hits are counted as without a penalty."""
    tripped = await trip(limiter, "quiet=a")
    assert tripped.code is Code.OK
    clock.now += MINUTE
    assert (await ask(limiter, "quiet=a")).code is Code.OK
    seen = await state(limiter, clock, "quiet=a")
    assert (seen["code"], seen["would_be_over"]) == ("OK", True)
    assert seen["penalty"]["blocked"] is True
    assert seen["windows"][0]["count"] == 1
    rule = limiter.stats.rules["shop.quiet"]
    assert (rule.penalty_blocks, rule.over_limit_with_penalty, rule.shadow_mode) == (1, 1, 2)


async def test_a_penalty_reset_lifts_the_block_and_leaves_the_counters(
    limiter: Limiter, clock: Clock
) -> None:
    """The operator's penalty reset deletes the block and its strikes only: the window's count
    stays (the descriptor is answered by its limit), and its next trip is a first block."""
    await trip(limiter)
    clock.now += 10 * MINUTE
    assert (await trip(limiter)).duration_until_reset == 20 * MINUTE
    located = counter_admin.locate(limiter.rules, "shop", entries("user=a"), int(clock() * 1000))
    assert await counter_admin.reset_penalty(limiter.backend, located) == 1
    seen = await state(limiter, clock, "user=a")
    assert (seen["penalty"]["blocked"], seen["penalty"]["strikes"]) == (False, 0)
    assert seen["windows"][0]["count"] == 3
    assert seen["code"] == "OVER_LIMIT"
    assert seen["duration_until_reset"] < MINUTE  # the window's end: no block
    assert (await ask(limiter, "user=a")).duration_until_reset == 10 * MINUTE


async def test_a_rule_without_a_penalty_is_not_blocked(limiter: Limiter, clock: Clock) -> None:
    """Without a penalty, a descriptor over its limit is admitted again in the next window."""
    assert (await trip(limiter, "plain=a")).code is Code.OVER_LIMIT
    clock.now += MINUTE
    assert (await ask(limiter, "plain=a")).code is Code.OK


@pytest.mark.parametrize("backend_url", ["memory"], indirect=True)
async def test_the_penalty_stats_are_exported_in_prometheus_and_statsd(
    limiter: Limiter, clock: Clock
) -> None:
    """Blocks started and hits refused by a block are the rule's `penalty_blocks` and
    `over_limit_with_penalty`, in Prometheus and statsd, named as the rule's other stats."""
    await trip(limiter)
    await ask(limiter, "user=a")
    stats: Stats = limiter.stats
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in StatsCollector(stats).collect()
        for sample in family.samples
    }
    labels = (("domain", "shop"), ("key1", "user"))
    assert samples[("ratelimit_service_rate_limit_penalty_blocks", labels)] == 1
    assert samples[("ratelimit_service_rate_limit_over_limit_with_penalty", labels)] == 1
    sent = {(s.name, s.value) for s in Deltas(stats, Latency()).take()}
    assert ("ratelimit.service.rate_limit.shop.user.penalty_blocks", 1) in sent
    assert ("ratelimit.service.rate_limit.shop.user.over_limit_with_penalty", 1) in sent


OPERATOR_RULES = """\
domain: gateway
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 2}
    penalty: {block: 10m, escalate: 2, max: 24h}
"""
TOKEN = "0b8e7d6c5a4f3e2d1c0b9a8f7e6d5c4b"
BODY = {"domain": "gateway", "entries": [{"key": "remote_address", "value": "10.0.0.1"}]}


async def test_the_operator_port_shows_a_block_and_a_penalty_reset_lifts_it(
    tmp_path: Path,
) -> None:
    """Through the operator port: GET shows the client OVER_LIMIT until its block ends, with
    the block (until when, level, strikes); POST /v1/penalties/reset, with the token (401
    without; 404 for a descriptor no penalty applies to, 400 for a bad body), lifts it and
    says so, logged as `penalty_reset` and counted as one reset; the client's next call is
    answered by its window, not the block."""
    clock = Clock()
    settings = OperatorSettings("127.0.0.1", 0, token=TOKEN)
    rules = write_rules(tmp_path, OPERATOR_RULES)
    async with (
        running_app(rules, clock=clock, operator=settings) as app,
        aiohttp.ClientSession() as http,
    ):
        json_url = f"http://127.0.0.1:{app.http_port}/json"
        calls = {"domain": "gateway", "descriptors": [{"entries": BODY["entries"]}]}
        answers = [await (await http.post(json_url, json=calls)).json() for _ in range(3)]
        assert answers[-1]["overallCode"] == "OVER_LIMIT"
        operator = f"http://127.0.0.1:{app.operator_port}"
        state_url = f"{operator}/v1/counters?domain=gateway&entry=remote_address=10.0.0.1"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        clock.now += MINUTE
        seen = await (await http.get(state_url, headers=bearer)).json()
        assert (seen["code"], seen["duration_until_reset"]) == ("OVER_LIMIT", 9 * MINUTE)
        penalty = seen["penalty"]
        assert (penalty["blocked"], penalty["level"], penalty["strikes"]) == (True, 1, 1)
        assert penalty["blocked_until"] == seen["reset_at"]
        assert (
            f"  penalty: blocked until {seen['reset_at']} (in 540 s), level 1, 1 strikes"
            in render(seen).splitlines()
        )

        reset_url = f"{operator}/v1/penalties/reset"
        refused = await http.post(reset_url, json=BODY)
        assert refused.status == 401
        unknown = {"domain": "gateway", "entries": [{"key": "nope", "value": "x"}]}
        missing = await http.post(reset_url, json=unknown, headers=bearer)
        assert (missing.status, await missing.json()) == (
            404,
            {"error": "no rule of domain 'gateway' has a penalty for nope=x"},
        )
        bad = await http.post(reset_url, data=b"{", headers=bearer)
        assert bad.status == 400
        with capture_logs() as logs:
            lifted = await (await http.post(reset_url, json=BODY, headers=bearer)).json()
        assert lifted["penalties_deleted"] == 1
        assert (lifted["code"], lifted["penalty"]["blocked"]) == ("OK", False)
        answer = await (await http.post(json_url, json=calls)).json()
        assert answer["overallCode"] == "OK"
        metrics = await (await http.get(f"http://127.0.0.1:{app.http_port}/metrics")).text()
    (event,) = [e for e in logs if e["event"] == "penalty_reset"]
    assert (event["rule"], event["penalties_deleted"]) == ("gateway.remote_address", 1)
    assert 'ratelimit_sidecar_counter_resets{domain="gateway"} 1' in metrics.splitlines()
