"""Concurrency limits whose starts name their request (`request_id`): a refund closes its own
request's start, so a lost refund's place comes back within its lease however busy the limit
stays. On memory, Redis and Redis Cluster (real servers, started by the fixtures), through the
limiter. That the pure decision and the stores agree on named starts is test_concurrency.py's
generated sequences, which name some starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import BACKENDS
from support.callbacks import should_rate_limit
from support.clock import Clock
from support.servers import RedisServer

from sidecar.algorithms.concurrency import MAX_REQUEST_ID
from sidecar.decision.limiter import Limiter
from sidecar.errors import InvalidRequest
from sidecar.model import Code, Decision, Descriptor, Entry, Request

every_backend = pytest.mark.parametrize("backend_url", BACKENDS, indirect=True)

RULES = """
domain: inflight
descriptors:
  - key: client
    rate_limit: {algorithm: concurrency, requests_per_unit: 2, lease: 30s, request_id: request}
  - key: unnamed
    rate_limit: {algorithm: concurrency, requests_per_unit: 2, lease: 30s}
  - key: minute
    rate_limit: {unit: minute, requests_per_unit: 5}
"""


@pytest.fixture
def limiter(make_limiter: Callable[..., Limiter]) -> Limiter:
    """A limiter over the rules above on the backend under test, refunds taken."""
    return make_limiter(RULES, negative_hits=True)


def start(request_id: str = "", hits: int | None = None, pair: str = "client=a") -> Descriptor:
    entries = [Entry(*pair.split("=", 1))]
    if request_id:
        entries.append(Entry("request", request_id))
    return Descriptor(tuple(entries), hits)


def end(request_id: str = "", hits: int | None = None, pair: str = "client=a") -> Descriptor:
    named = start(request_id, hits, pair)
    return Descriptor(named.entries, hits, is_negative_hits=True)


async def ask(limiter: Limiter, *descriptors: Descriptor) -> Decision:
    return await should_rate_limit(limiter, Request("inflight", descriptors))


async def code(limiter: Limiter, descriptor: Descriptor) -> Code:
    return (await ask(limiter, descriptor)).overall_code


async def busy_traffic(limiter: Limiter, clock: Clock, pair: str, named: bool) -> list[Code]:
    """One request's place lost (its refund never comes), then a request a second for 70 s (two
    leases), each ending before the next starts. Each second, while one of them is in flight,
    a check asks whether one more fits. The checks' answers, one a second."""
    first = start("lost" if named else "", pair=pair)
    assert await code(limiter, first) is Code.OK
    answers = []
    for second in range(70):
        clock.now += 1
        running = f"r{second}" if named else ""
        assert await code(limiter, start(running, pair=pair)) is Code.OK
        answers.append(await code(limiter, start(hits=0, pair=pair)))
        await ask(limiter, end(running, pair=pair))
    return answers


@every_backend
async def test_a_lost_refunds_place_comes_back_within_its_lease_under_continuous_traffic(
    limiter: Limiter, clock: Clock
) -> None:
    """With request ids, each refund closes its own request's start: the lost one's place is
    held until its own lease ends (30 s), then, with traffic still running, two fit again."""
    answers = await busy_traffic(limiter, clock, "client=a", named=True)
    assert answers[:29] == [Code.OVER_LIMIT] * 29
    assert answers[29:] == [Code.OK] * 41
    # Two requests in flight again while the traffic goes on: the limit, no more.
    assert await code(limiter, start("s1")) is Code.OK
    assert await code(limiter, start("s2")) is Code.OK
    assert await code(limiter, start("s3")) is Code.OVER_LIMIT


@every_backend
async def test_without_ids_the_lost_place_is_passed_on_while_traffic_keeps_coming(
    limiter: Limiter, clock: Clock
) -> None:
    """The weakness request ids remove (README, "Concurrency limits"): without them each refund
    closes the oldest start, the lost one's, so its place moves to the newer start and is
    held as long as the traffic keeps coming, two leases here and more."""
    answers = await busy_traffic(limiter, clock, "unnamed=a", named=False)
    assert answers == [Code.OVER_LIMIT] * 70


@every_backend
async def test_a_refund_closes_its_own_start_not_the_oldest(limiter: Limiter, clock: Clock) -> None:
    """Two starts 10 s apart; the newer one's refund closes it, so what is left ends with the
    older one's lease, 20 s on (the oldest-first rule would leave the newer one, 30 s on)."""
    assert await code(limiter, start("older")) is Code.OK
    clock.now += 10
    assert await code(limiter, start("newer")) is Code.OK
    closed = await ask(limiter, end("newer"))
    assert (closed.overall_code, closed.statuses[0].limit_remaining) == (Code.OK, 1)
    assert closed.statuses[0].duration_until_reset == 20
    assert (await ask(limiter, end("older"))).statuses[0].limit_remaining == 2
    assert await stored(limiter, start()) == [None]


@every_backend
async def test_a_refund_whose_id_is_not_in_flight_changes_nothing(
    limiter: Limiter, clock: Clock
) -> None:
    """A refund of an id that never started, of a refused start, or of a start whose lease
    ended is answered OK with what is in flight, and closes nothing."""
    nothing = await ask(limiter, end("never"))
    assert (nothing.overall_code, nothing.statuses[0].limit_remaining) == (Code.OK, 2)
    assert await stored(limiter, start()) == [None]
    assert await code(limiter, start("a")) is Code.OK
    assert await code(limiter, start("b")) is Code.OK
    assert await code(limiter, start("c")) is Code.OVER_LIMIT
    refused = await ask(limiter, end("c"))
    assert (refused.overall_code, refused.statuses[0].limit_remaining) == (Code.OK, 0)
    assert (await ask(limiter, end("never"))).statuses[0].limit_remaining == 0
    clock.now += 31
    assert await code(limiter, start("d")) is Code.OK
    late = await ask(limiter, end("a"))  # its lease ended: it closes nothing else
    assert late.statuses[0].limit_remaining == 1
    assert (await ask(limiter, end("d"))).statuses[0].limit_remaining == 2


@every_backend
async def test_a_second_start_of_an_id_in_flight_is_refused_and_disputes_it(
    limiter: Limiter, clock: Clock
) -> None:
    """A start whose id is in flight is refused (its reset: the time left in that start's
    lease), and the start in flight is then closed by no refund, since either request's could
    come first: it holds its place until its lease ends, and its id is refused meanwhile."""
    assert await code(limiter, start("x")) is Code.OK
    clock.now += 10
    again = await ask(limiter, start("x"))
    assert (again.overall_code, again.statuses[0].limit_remaining) == (Code.OVER_LIMIT, 1)
    assert again.statuses[0].duration_until_reset == 20
    for _ in range(2):  # both requests' refunds
        assert (await ask(limiter, end("x"))).statuses[0].limit_remaining == 1
    assert await code(limiter, start("x")) is Code.OVER_LIMIT
    assert await code(limiter, start("y")) is Code.OK
    assert await code(limiter, start("z")) is Code.OVER_LIMIT
    clock.now += 20
    assert await code(limiter, start("x")) is Code.OK


@every_backend
async def test_named_and_unnamed_starts_share_the_limit_and_close_apart(
    limiter: Limiter,
) -> None:
    """A start without the id entry (or of more than one place) counts in the same limit, and
    a refund without an id closes the oldest start without one, never a named start."""
    assert await code(limiter, start("n")) is Code.OK
    assert await code(limiter, start()) is Code.OK
    assert await code(limiter, start("m")) is Code.OVER_LIMIT
    assert (await ask(limiter, end())).statuses[0].limit_remaining == 1
    assert (await ask(limiter, end())).statuses[0].limit_remaining == 1  # nothing unnamed left
    assert await code(limiter, start("several", hits=2)) is Code.OVER_LIMIT
    # Its refund closes the refused start (without an id), nothing in flight.
    assert (await ask(limiter, end("several", hits=2))).statuses[0].limit_remaining == 1
    assert (await ask(limiter, end("n"))).statuses[0].limit_remaining == 2
    assert await code(limiter, start("several", hits=2)) is Code.OK
    assert (await ask(limiter, end("several", hits=2))).statuses[0].limit_remaining == 2


@every_backend
async def test_an_id_over_its_bound_is_refused_and_changes_nothing(limiter: Limiter) -> None:
    """An id longer than MAX_REQUEST_ID characters is refused (INVALID_ARGUMENT) naming the
    entry and the bound, on a start and on a refund; nothing is counted or closed."""
    assert await code(limiter, start("a")) is Code.OK
    too_long = "i" * (MAX_REQUEST_ID + 1)
    for descriptor in (start(too_long), end(too_long)):
        with pytest.raises(InvalidRequest) as info:
            await ask(limiter, descriptor)
        assert str(info.value) == (
            f"descriptors[0]: request id (request) of {MAX_REQUEST_ID + 1} characters, at most "
            f"{MAX_REQUEST_ID} (a concurrency limit keeps it while the request is in flight)"
        )
    assert (await ask(limiter, start(hits=0))).statuses[0].limit_remaining == 1
    assert await code(limiter, start("i" * MAX_REQUEST_ID)) is Code.OK


@every_backend
async def test_an_id_entry_on_another_rule_matches_nothing_as_in_the_reference(
    limiter: Limiter,
) -> None:
    """A rule without `request_id` takes no id: a descriptor deeper than its rules gets no limit
    and counts nothing, as envoyproxy/ratelimit answers it."""
    for _ in range(6):
        answer = await ask(limiter, start("x", pair="minute=m"))
        assert (answer.overall_code, answer.statuses[0].limit) == (Code.OK, None)
    assert (await ask(limiter, start(pair="minute=m"))).statuses[0].limit_remaining == 4


async def stored(limiter: Limiter, descriptor: Descriptor) -> list[object]:
    """What the backend holds at the descriptor's counter (None: nothing)."""
    plan = limiter.prepare(Request("inflight", (descriptor,)))
    now_ms = int(limiter._clock() * 1000)
    keys = [hit.key for item in plan.counted for hit in item.windows.at(now_ms)]
    return list(await limiter.backend.read(keys, now_ms))


@pytest.mark.redis
@pytest.mark.parametrize("backend_url", ["redis"], indirect=True)
async def test_on_redis_a_named_start_is_a_member_named_by_its_id(
    limiter: Limiter, redis_server: RedisServer, redis_url: str
) -> None:
    """A named start is the member `=<id>` of the descriptor's sorted set (`!<id>` once a second
    start of its id disputes it); its refund removes exactly that member."""
    del redis_url  # the fixture empties the server
    key = "rl{inflight|client|a}|n"
    await ask(limiter, start("x"))
    await ask(limiter, start("y"))
    with redis_server.client() as client:
        assert sorted(client.zrange(key, 0, -1)) == [b"=x", b"=y"]
        await ask(limiter, start("x"))
        assert sorted(client.zrange(key, 0, -1)) == [b"!x", b"=y"]
        await ask(limiter, end("y"))
        assert client.zrange(key, 0, -1) == [b"!x"]
        assert client.keys("rl{inflight|client|a}*") == [key.encode()]
