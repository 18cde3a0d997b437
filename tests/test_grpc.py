"""The gRPC transports end to end: a real grpc.aio client over a loopback socket to the app.

Every test runs on both transports, the sidecar's own HTTP/2 server (`fast`) and grpc.aio.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.servers import RedisServer
from support.sidecars import NOW, Clock, client, request, running_app, serve_process, write_rules

from sidecar.model import Hit
from sidecar.rls.messages import RateLimitRequest as RefundRequest
from sidecar.storage.base import Applied
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.redis import RedisBackend
from sidecar.storage.redis_client import PipelinedRedis

OK = RateLimitResponse.OK
OVER_LIMIT = RateLimitResponse.OVER_LIMIT
USER = [("user", "alice")]


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    return write_rules(tmp_path)


async def test_a_rule_answers_ok_until_its_limit_then_over_limit(
    rules: Path, transport: str
) -> None:
    """Each call reports the rule, what is left of it and when the window resets; the call past
    the limit is OVER_LIMIT with nothing left."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        answers = [await rls.should_rate_limit(request("test", USER)) for _ in range(4)]

    assert [a.overall_code for a in answers] == [OK, OK, OK, OVER_LIMIT]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 1, 0, 0]
    for answer in answers:
        (status,) = answer.statuses
        assert status.current_limit == RateLimitResponse.RateLimit(
            name="per-user", requests_per_unit=3, unit=RateLimitResponse.RateLimit.MINUTE
        )
        assert status.HasField("duration_until_reset")
        assert status.duration_until_reset.seconds == 30
    assert answers[-1].statuses[0].code == OVER_LIMIT


async def test_statuses_follow_the_request_descriptors_in_order(
    rules: Path, transport: str
) -> None:
    """One status per descriptor, in request order: a nested rule, an unmatched descriptor and an
    unlimited rule each answer for themselves."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        answer = await rls.should_rate_limit(
            request(
                "test", [("app", "web"), ("path", "/a")], [("nothing", "here")], [("health", "x")]
            )
        )

    assert answer.overall_code == OK
    nested, unmatched, unlimited = answer.statuses
    assert nested.current_limit.requests_per_unit == 10
    assert nested.current_limit.unit == RateLimitResponse.RateLimit.HOUR
    assert nested.limit_remaining == 9
    assert nested.duration_until_reset.seconds == 3600 - int(NOW) % 3600
    assert unmatched == RateLimitResponse.DescriptorStatus(code=OK)
    assert unlimited.code == OK
    assert not unlimited.HasField("current_limit")
    assert unlimited.limit_remaining == 4_294_967_295


async def test_a_per_descriptor_hits_addend_of_zero_checks_without_consuming(
    rules: Path, transport: str
) -> None:
    """`hits_addend: 0` on a descriptor is honoured (not read as 1): the counter does not move."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        check = request("test", USER)
        check.descriptors[0].hits_addend.value = 0
        first = await rls.should_rate_limit(check)
        second = await rls.should_rate_limit(check)
        spent = await rls.should_rate_limit(request("test", USER))

    assert [a.statuses[0].limit_remaining for a in (first, second, spent)] == [3, 3, 2]


async def test_an_override_sets_the_limit_sent_by_envoy(rules: Path, transport: str) -> None:
    """A descriptor's `limit` replaces the rule: its requests_per_unit and unit are reported."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        message = request("test", USER)
        message.descriptors[0].limit.requests_per_unit = 1
        message.descriptors[0].limit.unit = 1  # SECOND
        answers = [await rls.should_rate_limit(message) for _ in range(2)]

    assert [a.overall_code for a in answers] == [OK, OVER_LIMIT]
    assert answers[0].statuses[0].current_limit.requests_per_unit == 1
    assert answers[0].statuses[0].current_limit.unit == RateLimitResponse.RateLimit.SECOND


async def test_an_unknown_domain_is_ok_with_one_bare_status_per_descriptor(
    rules: Path, transport: str
) -> None:
    """As the reference: no error, and each status carries only its code."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        answer = await rls.should_rate_limit(request("nope", USER, [("a", "b"), ("c", "d")]))

    bare = RateLimitResponse.DescriptorStatus(code=OK)
    assert answer == RateLimitResponse(overall_code=OK, statuses=[bare, bare])
    assert app.stats.domain_not_found["nope"] == 2


@pytest.mark.parametrize(
    ("message", "details"),
    [
        (request("", USER), "rate limit domain must not be empty"),
        (request("test"), "rate limit descriptor list must not be empty"),
    ],
    ids=["empty-domain", "no-descriptors"],
)
async def test_the_reference_errors_are_invalid_argument(
    rules: Path, transport: str, message: object, details: str
) -> None:
    """An empty domain or descriptor list is refused with the reference's own message."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.call(message, timeout=10)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == details
    assert app.stats.service_error == 1


async def test_a_refund_is_unimplemented_unless_negative_hits_is_on(
    rules: Path, transport: str
) -> None:
    """A descriptor with `is_negative_hits` is refused UNIMPLEMENTED, with the flag to turn on
    in the message, by a sidecar without `--negative-hits`; with it, the refund is answered OK
    and gives the hit back."""
    refund = RefundRequest(domain="test")
    descriptor = refund.descriptors.add(is_negative_hits=True)
    descriptor.entries.add(key="user", value="alice")
    body = refund.SerializeToString()
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        await rls.should_rate_limit(request("test", USER))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.raw(body, timeout=10)
        after = await rls.should_rate_limit(request("test", USER))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--negative-hits (ENABLE_NEGATIVE_HITS=true)" in caught.value.details()
    assert after.statuses[0].limit_remaining == 1  # 3 a minute: the refund took nothing back
    async with (
        running_app(rules, transport=transport, negative_hits=True) as app,
        client(app.grpc_port) as rls,
    ):
        await rls.should_rate_limit(request("test", USER))
        answer = RateLimitResponse.FromString(await rls.raw(body, timeout=10))
    assert answer.overall_code == RateLimitResponse.OK
    assert answer.statuses[0].limit_remaining == 3


async def test_malformed_bytes_are_invalid_argument(rules: Path, transport: str) -> None:
    """Bytes that are not a RateLimitRequest are refused, and the server keeps serving."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.raw(b"\xff\xff\xff\xff", timeout=10)
        after = await rls.should_rate_limit(request("test", USER))

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("malformed RateLimitRequest")
    assert after.overall_code == OK


async def test_an_override_with_unit_unknown_is_invalid_argument(
    rules: Path, transport: str
) -> None:
    """The reference panics on this; here the call is refused and the server keeps serving."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        message = request("test", USER)
        message.descriptors[0].limit.requests_per_unit = 5  # unit left at UNKNOWN (0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.call(message, timeout=10)
        message.descriptors[0].limit.unit = 42
        with pytest.raises(grpc.aio.AioRpcError) as unknown_number:
            await rls.call(message, timeout=10)
        after = await rls.should_rate_limit(request("test", USER))

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "descriptors[0].limit.unit must be one of SECOND (1), MINUTE (2), HOUR (3), DAY (4), "
        "MONTH (5), YEAR (6), WEEK (7), got UNKNOWN (0)"
    )
    assert unknown_number.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unknown_number.value.details().endswith("got 42")
    assert after.overall_code == OK


async def test_a_huge_entry_value_is_invalid_argument(rules: Path, transport: str) -> None:
    """A 100 KB value is refused before it reaches a counter key."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.call(request("test", [("user", "x" * 100_000)]), timeout=10)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "too long" in caught.value.details()


async def test_an_absurd_hits_addend_is_invalid_argument(rules: Path, transport: str) -> None:
    """A per-descriptor hits_addend of 2**64 - 1 is refused rather than added."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        message = request("test", USER)
        message.descriptors[0].hits_addend.value = 2**64 - 1
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.call(message, timeout=10)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hits_addend" in caught.value.details()


class _BrokenOnce(MemoryBackend):
    """A backend with a bug: its first apply raises something no layer expects."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.broken = True

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        if self.broken:
            self.broken = False
            raise ZeroDivisionError("a bug")
        super().apply(hits, all_or_nothing, now_ms, done)


async def test_an_unexpected_error_is_internal_and_the_server_goes_on(
    rules: Path, transport: str
) -> None:
    """A bug behind the service fails that call with INTERNAL; the next call is answered."""
    clock = Clock()
    async with (
        running_app(rules, backend=_BrokenOnce(clock), clock=clock, transport=transport) as app,
        client(app.grpc_port) as rls,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rls.call(request("test", USER), timeout=10)
        after = await rls.should_rate_limit(request("test", USER))

    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "ZeroDivisionError" in caught.value.details()
    assert after.overall_code == OK


@pytest.mark.redis
async def test_a_call_refused_as_overloaded_is_unavailable_never_the_failure_mode(
    rules: Path, transport: str, restartable_redis: RedisServer
) -> None:
    """A call that finds its Redis server with as many calls in flight as it may have is
    answered UNAVAILABLE at once (Envoy's own failure_mode_deny decides what its client sees)
    and counted as overloaded: the sidecar's failure mode ("allow" here) is for a Redis that
    fails, and answering OK there would let a flood admit past every limit. The call already in
    flight, on a Redis that does not answer, still gets the failure mode by its deadline."""
    client_of_redis = PipelinedRedis(
        "127.0.0.1", restartable_redis.port, connections=1, connect_timeout=0.3, max_in_flight=1
    )
    backend = RedisBackend(client_of_redis, timeout_ms=300)
    assert await backend.ping()  # the one connection is open
    async with (
        running_app(rules, backend=backend, transport=transport, failure_mode="allow") as app,
        client(app.grpc_port) as rls,
    ):
        restartable_redis.pause()
        try:
            first = asyncio.ensure_future(rls.should_rate_limit(request("test", USER)))
            (connection,) = client_of_redis._connections
            assert connection is not None
            for _ in range(500):  # until the first call waits on Redis
                if connection.waiters:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await rls.call(request("test", USER), timeout=10)
            answered = await first
        finally:
            restartable_redis.resume()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refused" in caught.value.details()
        assert answered.overall_code == OK  # the failure mode, for the call Redis never answered
        assert app.stats.overloaded == 1
        assert app.stats.backend_error == 1
        after = await rls.should_rate_limit(request("test", USER))
        assert after.overall_code == OK and after.statuses[0].limit_remaining == 2
    await backend.close()


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    status: int = answer.status
    return status


async def test_health_is_serving_overall_and_for_ratelimit_until_draining(
    rules: Path, transport: str
) -> None:
    """Both "" and "ratelimit" report SERVING once started, and NOT_SERVING once draining."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        before = [await _health(rls.channel, name) for name in ("", "ratelimit")]
        await app.health.drain()
        after = [await _health(rls.channel, name) for name in ("", "ratelimit")]

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert before == [serving, serving]
    assert after == [not_serving, not_serving]


async def test_an_unknown_method_or_health_service_is_refused(rules: Path, transport: str) -> None:
    """An unknown method is UNIMPLEMENTED and an unknown health service NOT_FOUND, as grpc says."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        with pytest.raises(grpc.aio.AioRpcError) as unknown_method:
            await rls.channel.unary_unary("/envoy.service.ratelimit.v3.Nope/Nope")(b"", timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as unknown_service:
            await _health(rls.channel, "nope")
        after = await rls.should_rate_limit(request("test", USER))

    assert unknown_method.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert unknown_service.value.code() == grpc.StatusCode.NOT_FOUND
    assert after.overall_code == OK


async def test_many_concurrent_calls_on_one_channel_are_all_answered(
    rules: Path, transport: str
) -> None:
    """300 calls at once over one connection, each for its own user: every one answered OK."""
    async with running_app(rules, transport=transport) as app, client(app.grpc_port) as rls:
        answers = await asyncio.gather(
            *(rls.should_rate_limit(request("test", [("user", str(n))])) for n in range(300))
        )

    assert [a.overall_code for a in answers] == [OK] * 300
    assert app.latency.counts and sum(app.latency.counts) == 300


class _Gate(MemoryBackend):
    """A backend that holds every apply until the test opens the gate."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0
        self.held: set[asyncio.Task[bool]] = set()

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        self.waiting += 1
        held = asyncio.ensure_future(self.gate.wait())
        self.held.add(held)
        held.add_done_callback(
            lambda _: MemoryBackend.apply(self, hits, all_or_nothing, now_ms, done)
        )


async def test_stopping_lets_calls_in_flight_finish_and_refuses_new_ones(
    rules: Path, transport: str
) -> None:
    """Shutdown (what SIGTERM triggers) answers the calls already in the backend, then closes."""
    clock = Clock()
    backend = _Gate(clock)
    async with (
        running_app(rules, backend=backend, clock=clock, transport=transport) as app,
        client(app.grpc_port) as rls,
    ):
        calls = [
            asyncio.create_task(rls.should_rate_limit(request("test", [("user", str(n))])))
            for n in range(5)
        ]
        while backend.waiting < 5:
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(app.stop(grace=5.0))
        await asyncio.sleep(0.2)
        assert not stopping.done()
        backend.gate.set()
        answers = await asyncio.gather(*calls)
        await stopping
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rls.call(request("test", USER), timeout=2)

    assert [a.overall_code for a in answers] == [OK] * 5
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_sigterm_drains_and_exits_zero(rules: Path, transport: str, loop: str) -> None:
    """`python -m sidecar serve` on SIGTERM, on either event loop: every call the server decided
    is answered (calls that race the signal may be refused, never cut off), it logs `stopped`
    and exits 0."""
    args = [
        "--config",
        str(rules),
        "--grpc-address",
        "127.0.0.1:0",
        "--http-address",
        "127.0.0.1:0",
        "--transport",
        transport,
        "--loop",
        loop,
    ]
    async with serve_process(args) as served, client(served.grpc_port) as rls:
        first = await rls.should_rate_limit(request("test", USER))

        async def call(n: int) -> grpc.StatusCode:
            try:
                await rls.call(request("test", [("user", str(n))]), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        calls = [asyncio.create_task(call(n)) for n in range(200)]
        await asyncio.sleep(0.001)
        served.process.send_signal(signal.SIGTERM)
        codes = await asyncio.gather(*calls)
        status = await asyncio.wait_for(served.process.wait(), 15)

    assert first.overall_code == OK
    assert status == 0, served.output()
    events = served.events()
    assert len(events) == len(served.lines), "every line on stderr is a JSON log event"
    assert [e["loop"] for e in events if e["event"] == "started"] == [loop]
    assert [e["event"] for e in events][-2:] == ["stopping", "stopped"]
    answered = 1 + codes.count(grpc.StatusCode.OK)
    assert events[-1]["total_requests"] == answered
    assert set(codes) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    }
