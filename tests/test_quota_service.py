"""The Rate Limit Quota Service: bucket ids matched as descriptors, the shared store on every
backend, and the gRPC stream Envoy's rate_limit_quota filter opens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.rate_limit_quota.v3.rlqs_pb2 import (
    RateLimitQuotaResponse,
    RateLimitQuotaUsageReports,
)
from envoy.type.v3.ratelimit_strategy_pb2 import RateLimitStrategy
from support.sidecars import Clock, running_app, write_rules

from sidecar.core import config
from sidecar.quota import service
from sidecar.quota.allocator import Budget, Holder
from sidecar.quota.buckets import resolve, state_key
from sidecar.quota.service import SERVICE_NAME
from sidecar.quota.store import MemoryStore, QuotaStore, RedisStore, open_store
from sidecar.runner.app import App
from sidecar.storage.backends import open_backend

METHOD = f"/{SERVICE_NAME}/StreamRateLimitQuotas"

RULES = """\
domain: quota
descriptors:
  - key: tenant
    rate_limit:
      unit: minute
      requests_per_unit: 600
    descriptors:
      - key: path
        value: /search
        rate_limit:
          name: search
          algorithm: token_bucket
          unit: second
          requests_per_unit: 5
  - key: tenant_pattern
    value: "team-*"
    share_threshold: true
    rate_limit:
      unit: minute
      requests_per_unit: 60
  - key: paced
    pace: true
    rate_limit:
      unit: minute
      requests_per_unit: 600
  - key: health
    rate_limit:
      unlimited: true
  - key: shadowed
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: windows
    rate_limits:
      - unit: second
        requests_per_unit: 100
      - unit: minute
        requests_per_unit: 600
"""


def rules() -> config.Rules:
    return config.Rules({"quota": config.parse(RULES, "rules.yaml")})


# --- Bucket ids as descriptors ---------------------------------------------------------------


def test_a_bucket_id_is_matched_in_the_order_that_walks_the_rules() -> None:
    """A bucket id has no order: {path, tenant} finds tenant → path, the rule below tenant."""
    bucket = resolve(rules(), "quota", {"path": "/search", "tenant": "acme"})
    assert bucket is not None
    assert bucket.budget == Budget(5, 1_000)
    assert bucket.rule_key == "quota.tenant.path_/search"


def test_the_rules_limit_is_the_buckets_budget_per_window() -> None:
    """A one-entry bucket takes its rule's limit per its window, whatever its algorithm; leased
    unless its rule says `pace: true`."""
    bucket = resolve(rules(), "quota", {"tenant": "acme"})
    assert bucket is not None and bucket.budget == Budget(600, 60_000)
    paced = resolve(rules(), "quota", {"paced": "acme"})
    assert paced is not None and paced.budget == Budget(600, 60_000, pace=True)


def test_several_windows_give_the_lowest_rate() -> None:
    """Of 100 a second and 600 a minute, the minute's (10 a second) is the bucket's budget."""
    bucket = resolve(rules(), "quota", {"windows": "w"})
    assert bucket is not None and bucket.budget == Budget(600, 60_000)


def test_share_threshold_buckets_share_one_state() -> None:
    """Values matching a share_threshold pattern share one budget (one key in the store)."""
    first = resolve(rules(), "quota", {"tenant_pattern": "team-a"})
    second = resolve(rules(), "quota", {"tenant_pattern": "team-b"})
    assert first is not None and second is not None
    assert first.key == second.key


def test_unmatched_and_unknown_buckets_have_no_rule() -> None:
    """No rule for the entries, an entry left over, or an unknown domain: nothing limits it."""
    assert resolve(rules(), "quota", {"user": "u1"}) is None
    assert resolve(rules(), "quota", {"tenant": "acme", "path": "/other"}) is None
    assert resolve(rules(), "elsewhere", {"tenant": "acme"}) is None


def test_unlimited_and_shadow_rules() -> None:
    """An unlimited rule's budget has no limit; a shadow rule's (or global shadow mode's) is
    marked shadow."""
    health = resolve(rules(), "quota", {"health": "x"})
    shadowed = resolve(rules(), "quota", {"shadowed": "x"})
    global_shadow = resolve(rules(), "quota", {"tenant": "acme"}, shadow_mode=True)
    assert health is not None and health.budget.limit is None
    assert shadowed is not None and shadowed.budget.shadow_mode
    assert global_shadow is not None and global_shadow.budget.shadow_mode


def test_state_keys_cannot_collide_and_share_a_slot() -> None:
    """Every part is escaped inside one hash tag: ('a|b', 'c') and ('a', 'b|c') differ."""
    assert state_key("d", [("a|b", "c")]) != state_key("d", [("a", "b|c")])
    assert state_key("d", [("k", "v}")]).count(b"}") == 1


# --- The store, on every backend ---------------------------------------------------------------


@asynccontextmanager
async def store_on(backend_url: str) -> AsyncIterator[QuotaStore]:
    backend = open_backend(backend_url, timeout_ms=1_000)
    try:
        yield open_store(backend, 1_000)
    finally:
        await backend.close()


def a_holder(envoy: str, expires_ms: int = 10_000) -> Holder:
    return Holder(envoy, 2.5, 1_000, 1_000, 1.5, 2, expires_ms, 0.25)


async def test_the_store_adds_usage_and_reads_every_holder(backend_url: str) -> None:
    """Reports add up per window; holders written come back whole, with the version moved."""
    async with store_on(backend_url) as store:
        expected = MemoryStore if backend_url == "memory://" else RedisStore
        assert isinstance(store, expected)
        key = state_key("d", [("tenant", "acme")])
        first = await store.report(key, 60_000, 60_000, 3)
        assert (first.used, first.holders, first.version) == (3, {}, 0)
        assert await store.assign(key, a_holder("a"), first.version, [], 120_000)
        second = await store.report(key, 60_000, 60_000, 4)
        assert second.used == 7
        assert second.holders == {"a": a_holder("a")}
        assert second.version == 1
        other_window = await store.report(key, 120_000, 60_000, 1)
        assert other_window.used == 1


async def test_a_write_after_another_sidecars_is_refused(backend_url: str) -> None:
    """Two sidecars read version 0; the first assignment is written, the second is refused (its
    caller reads and allocates again), and a holder named to drop is gone."""
    async with store_on(backend_url) as store:
        key = state_key("d", [("tenant", "acme")])
        read = await store.report(key, 0, 60_000, 0)
        assert await store.assign(key, a_holder("a"), read.version, [], 120_000)
        assert not await store.assign(key, a_holder("b"), read.version, [], 120_000)
        again = await store.report(key, 0, 60_000, 0)
        assert await store.assign(key, a_holder("b"), again.version, ["a"], 120_000)
        assert set((await store.report(key, 0, 60_000, 0)).holders) == {"b"}


def test_the_memory_store_keeps_at_most_its_buckets() -> None:
    """Past max_buckets the least recently reported bucket is forgotten."""
    store = MemoryStore(max_buckets=2)

    async def run() -> None:
        for name in (b"a", b"b", b"c"):
            await store.report(name, 0, 60_000, 1)

    asyncio.run(run())
    assert len(store) == 2


# --- The stream ------------------------------------------------------------------------------


class Stream:
    """One Envoy's RLQS stream over a real channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = channel.stream_stream(
            METHOD,
            request_serializer=RateLimitQuotaUsageReports.SerializeToString,
            response_deserializer=RateLimitQuotaResponse.FromString,
        )()

    async def report(
        self, *lines: tuple[dict[str, str], int, int], domain: str = "quota"
    ) -> RateLimitQuotaResponse:
        await self.send(*lines, domain=domain)
        return await self.read()

    async def send(self, *lines: tuple[dict[str, str], int, int], domain: str = "quota") -> None:
        message = RateLimitQuotaUsageReports(domain=domain)
        for bucket, allowed, denied in lines:
            usage = message.bucket_quota_usages.add()
            for key, value in bucket.items():
                usage.bucket_id.bucket[key] = value
            usage.num_requests_allowed = allowed
            usage.num_requests_denied = denied
        await self.call.write(message)

    async def read(self, timeout: float = 10.0) -> RateLimitQuotaResponse:
        async with asyncio.timeout(timeout):
            response = await self.call.read()
        assert response is not grpc.aio.EOF
        return response


@asynccontextmanager
async def stream(app: App) -> AsyncIterator[Stream]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.rlqs_port}") as channel:
        yield Stream(channel)


def effective(response: RateLimitQuotaResponse) -> list[Any]:
    """Each bucket's action as Envoy ends up with it: a new lease block comes as a DENY_ALL and
    the block for the same bucket (a reset, see `convert.assignment_actions`), the last wins."""
    actions: list[Any] = []
    for action in response.bucket_action:
        if actions and actions[-1].bucket_id == action.bucket_id:
            actions[-1] = action
        else:
            actions.append(action)
    return actions


def strategy(response: RateLimitQuotaResponse, index: int = 0) -> Any:
    action = effective(response)[index]
    assert action.HasField("quota_assignment_action"), action
    return action.quota_assignment_action.rate_limit_strategy


@asynccontextmanager
async def quota_app(tmp_path: Path, backend_url: str, **options: Any) -> AsyncIterator[App]:
    path = write_rules(tmp_path, RULES)
    backend = open_backend(backend_url, timeout_ms=1_000)
    async with running_app(
        path, backend=backend, rlqs_address="127.0.0.1:0", clock=Clock(), **options
    ) as app:
        yield app


async def test_a_new_bucket_leases_what_is_left(tmp_path: Path, backend_url: str) -> None:
    """The first report of a limited bucket, its Envoy alone, is answered with a lease of what
    the window has left: 600 a minute, 1 reported, a token bucket of 599 that does not refill
    (a token every 10**8 s), living to the end of its TTL, sent as a reset (a DENY_ALL, then
    the block: Envoy starts it full). Reported spent, the bucket is DENY_ALL to the window's
    end."""
    async with quota_app(tmp_path, backend_url) as app, stream(app) as envoy:
        response = await envoy.report(({"tenant": "acme"}, 1, 0))
        kinds = [a.quota_assignment_action.rate_limit_strategy for a in response.bucket_action]
        assert [k.WhichOneof("strategy") for k in kinds] == ["blanket_rule", "token_bucket"]
        assert kinds[0].blanket_rule == RateLimitStrategy.DENY_ALL
        action = effective(response)[0]
        assert action.quota_assignment_action.assignment_time_to_live.ToMilliseconds() == 6_000
        bucket = strategy(response).token_bucket
        assert bucket.max_tokens == 599
        assert (bucket.tokens_per_fill.value, bucket.fill_interval.seconds) == (1, 10**8)
        spent = await envoy.report(({"tenant": "acme"}, 599, 400))
        assert strategy(spent).blanket_rule == RateLimitStrategy.DENY_ALL


async def test_a_paced_bucket_gets_its_share_of_the_pace(tmp_path: Path, backend_url: str) -> None:
    """With `pace: true`, the first report of a limited bucket is answered with a token bucket
    at the pace that spends the window's budget: 600 a minute, 30 s into it, 599 left, about 20
    a second."""
    async with quota_app(tmp_path, backend_url) as app, stream(app) as envoy:
        response = await envoy.report(({"paced": "acme"}, 1, 0))
        action = response.bucket_action[0]
        assert dict(action.bucket_id.bucket) == {"paced": "acme"}
        assert action.quota_assignment_action.assignment_time_to_live.ToMilliseconds() == 6_000
        bucket = strategy(response).token_bucket
        rate = bucket.tokens_per_fill.value / bucket.fill_interval.seconds
        assert 19 <= rate <= 599 / 30
        # A bucket holds 1% of the window's time at its rate (0.6 s here), two tokens at least.
        assert bucket.max_tokens == max(2, int(rate * 0.6))


async def test_blanket_rules(tmp_path: Path, backend_url: str) -> None:
    """Unlimited rules and buckets no rule limits get ALLOW_ALL; a spent budget DENY_ALL; a
    shadow rule ALLOW_ALL (counted as the DENY_ALL it would have been)."""
    async with quota_app(tmp_path, backend_url) as app, stream(app) as envoy:
        response = await envoy.report(
            ({"health": "x"}, 1, 0),
            ({"nobody": "x"}, 1, 0),
            ({"tenant": "spent"}, 600, 0),
            ({"shadowed": "x"}, 5, 0),
        )
        kinds = [strategy(response, i).blanket_rule for i in range(4)]
        allow, deny = RateLimitStrategy.ALLOW_ALL, RateLimitStrategy.DENY_ALL
        assert kinds == [allow, allow, deny, allow]
        deny_ttl = effective(response)[2].quota_assignment_action.assignment_time_to_live
        assert deny_ttl.ToMilliseconds() == 30_000 + 1_000  # to the minute's end, and a second
        metrics = app.registry.get_sample_value
        assert metrics("ratelimit_sidecar_quota_shadow", {"strategy": "deny_all"}) == 1
        assert metrics("ratelimit_sidecar_quota_assignments", {"strategy": "allow_all"}) == 3
        assert metrics("ratelimit_sidecar_quota_reports") == 1
        assert metrics("ratelimit_sidecar_quota_streams") == 1


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def shared_url(request: pytest.FixtureRequest) -> str:
    """A backend several sidecars share: a real Redis, a real 3-master Redis Cluster."""
    name = "redis_url" if request.param == "redis" else "cluster_url"
    return str(request.getfixturevalue(name))


def commitment(response: RateLimitQuotaResponse, seconds: float) -> float:
    """What a token bucket action lets its Envoy admit over `seconds`."""
    bucket = strategy(response).token_bucket
    return bucket.max_tokens + bucket.tokens_per_fill.value / bucket.fill_interval.seconds * seconds


async def test_two_sidecars_share_one_lease_budget(tmp_path: Path, shared_url: str) -> None:
    """Two sidecars on one Redis, an Envoy on each: the first Envoy's lease holds what is left,
    so the second is denied until the first reports; what the first's bucket may still hold
    stays its own (kept, not lent again); once the reports reach the limit both are denied."""
    async with (
        quota_app(tmp_path, shared_url) as first,
        quota_app(tmp_path, shared_url) as second,
        stream(first) as envoy_a,
        stream(second) as envoy_b,
    ):
        a = await envoy_a.report(({"tenant": "acme"}, 100, 0))
        assert strategy(a).token_bucket.max_tokens == 500
        b = await envoy_b.report(({"tenant": "acme"}, 0, 1))
        assert strategy(b).blanket_rule == RateLimitStrategy.DENY_ALL
        # 300 of its 500 spent: 200 may be left in its bucket, all that is left of the window.
        kept = await envoy_a.report(({"tenant": "acme"}, 300, 0))
        assert strategy(kept).token_bucket == strategy(a).token_bucket
        b = await envoy_b.report(({"tenant": "acme"}, 0, 5))
        assert strategy(b).blanket_rule == RateLimitStrategy.DENY_ALL
        spent = await envoy_a.report(({"tenant": "acme"}, 200, 0))
        assert strategy(spent).blanket_rule == RateLimitStrategy.DENY_ALL
        also = await envoy_b.report(({"tenant": "acme"}, 0, 5))
        assert strategy(also).blanket_rule == RateLimitStrategy.DENY_ALL


async def test_two_sidecars_share_one_paced_budget(tmp_path: Path, shared_url: str) -> None:
    """Two sidecars on one Redis, an Envoy on each, a `pace: true` rule: the second sees the
    first's report and assignment, so the two buckets together promise no more than is left,
    and once the reports reach the limit both Envoys are denied."""
    async with (
        quota_app(tmp_path, shared_url) as first,
        quota_app(tmp_path, shared_url) as second,
        stream(first) as envoy_a,
        stream(second) as envoy_b,
    ):
        a = await envoy_a.report(({"paced": "acme"}, 100, 0))
        b = await envoy_b.report(({"paced": "acme"}, 80, 0))
        # 180 of 600 used, 30 s left; each assignment lives 10 s, and both together fit.
        assert commitment(a, 10) + commitment(b, 10) <= 600 - 180
        # Neither demand known yet: the second gets half the pace, (600 - 180) / 30 s / 2, less
        # the buckets' bursts spread over the 30 s.
        bucket = strategy(b).token_bucket
        assert 6.5 <= bucket.tokens_per_fill.value / bucket.fill_interval.seconds <= 7
        spent = await envoy_a.report(({"paced": "acme"}, 420, 0))
        assert strategy(spent).blanket_rule == RateLimitStrategy.DENY_ALL
        also = await envoy_b.report(({"paced": "acme"}, 0, 0))
        assert strategy(also).blanket_rule == RateLimitStrategy.DENY_ALL


async def test_a_removed_rule_abandons_its_buckets(tmp_path: Path) -> None:
    """When the rules lose a bucket's rule, the stream pushes an abandon_action for it."""
    async with quota_app(tmp_path, "memory://", config_poll_seconds=0) as app, stream(app) as envoy:
        await envoy.report(({"tenant": "acme"}, 1, 0), ({"health": "x"}, 1, 0))
        (tmp_path / "rules.yaml").write_text(
            "domain: quota\ndescriptors:\n  - key: health\n    rate_limit:\n      unlimited: true\n"
        )
        assert app.reload()
        response = await envoy.read()
        assert len(response.bucket_action) == 1
        action = response.bucket_action[0]
        assert action.HasField("abandon_action")
        assert dict(action.bucket_id.bucket) == {"tenant": "acme"}


async def test_assignments_are_refreshed_before_they_expire(tmp_path: Path) -> None:
    """An Envoy that does not report gets its assignment again before the TTL ends."""
    path = write_rules(tmp_path, RULES)
    async with (
        running_app(
            path, rlqs_address="127.0.0.1:0", rlqs_assignment_ttl_ms=1_000, clock=_real_clock()
        ) as app,
        stream(app) as envoy,
    ):
        first = await envoy.report(({"tenant": "acme"}, 1, 0))
        assert first.bucket_action[0].HasField("quota_assignment_action")
        again = await envoy.read(timeout=5)
        assert dict(again.bucket_action[0].bucket_id.bucket) == {"tenant": "acme"}


def _real_clock() -> Clock:
    import time

    class Real(Clock):
        def __call__(self) -> float:
            return time.time()

    return Real()


async def test_a_stream_holds_at_most_its_buckets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_BUCKETS buckets (10,000; 2 here) the stream ends RESOURCE_EXHAUSTED, saying
    what to do."""
    monkeypatch.setattr(service, "MAX_BUCKETS", 2)
    async with quota_app(tmp_path, "memory://") as app, stream(app) as envoy:
        await envoy.report(({"tenant": "a"}, 1, 0), ({"tenant": "b"}, 1, 0))
        await envoy.send(({"tenant": "c"}, 1, 0))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await envoy.read()
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 2 buckets on one stream" in str(caught.value.details())


@pytest.mark.parametrize(
    ("lines", "domain", "message"),
    [
        ([({}, 1, 0)], "quota", "empty bucket_id"),
        ([({"tenant": "a"}, 1, 0)], "", "must name its domain"),
        ([({f"k{i}": "v" for i in range(9)}, 1, 0)], "quota", "at most 8"),
        ([({"k": "v" * 1_025}, 1, 0)], "quota", "longer than 1024"),
        ([({"tenant": "a"}, 2**48 + 1, 0)], "quota", "counts more than"),
    ],
)
async def test_invalid_reports_end_the_stream(
    tmp_path: Path, lines: list[tuple[dict[str, str], int, int]], domain: str, message: str
) -> None:
    """A report Envoy would never send ends the stream INVALID_ARGUMENT, saying why."""
    async with quota_app(tmp_path, "memory://") as app, stream(app) as envoy:
        await envoy.send(*lines, domain=domain)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await envoy.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(caught.value.details())
