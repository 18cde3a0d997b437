"""The pipelined Redis client of the hot path, against real redis-server processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hiredis
import pytest
from conftest import require_binary
from support.servers import RedisServer, ServerError, start_server

from sidecar.errors import Overloaded, StorageError
from sidecar.loop import batching
from sidecar.storage.redis import RedisBackend
from sidecar.storage.redis_client import (
    MIN_IN_FLIGHT,
    ConnectionLost,
    DeadlineExceeded,
    PipelinedRedis,
    RedisReplyError,
    in_flight_bound,
)

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[PipelinedRedis]:
    redis_server.start()
    pipelined = PipelinedRedis("127.0.0.1", redis_server.port, connect_timeout=1.0)
    yield pipelined
    await pipelined.close()


async def connected(client: PipelinedRedis) -> None:
    """Wait until every connection of `client` is open."""
    await client.execute("PING")
    for _ in range(100):
        if all(p is not None and p.lost is None for p in client._connections):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the client's connections did not open")


class CountingTransport:
    """A connection's transport that counts its writes (uvloop's transports take no new
    attributes, so the protocol is handed this stand-in instead)."""

    def __init__(self, transport: Any, writes: dict[int, int], index: int) -> None:
        self._transport = transport
        self._writes = writes
        self._index = index

    def write(self, data: bytes) -> None:
        self._writes[self._index] += 1
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def count_writes(client: PipelinedRedis) -> dict[int, int]:
    """From now on, count the writes on each open connection of `client`, by its index."""
    writes = dict.fromkeys(range(len(client._connections)), 0)
    for index, protocol in enumerate(client._connections):
        assert protocol is not None and protocol.transport is not None
        protocol.transport = CountingTransport(protocol.transport, writes, index)  # type: ignore[assignment]
    return writes


async def test_calls_of_one_tick_leave_in_one_write(client: PipelinedRedis) -> None:
    """100 calls issued together share one write, and each gets its own reply, in order."""
    await connected(client)
    writes = count_writes(client)
    replies = await asyncio.gather(*(client.execute("ECHO", str(i)) for i in range(100)))
    assert replies == [str(i).encode() for i in range(100)]
    assert sum(writes.values()) == 1


async def test_ticks_take_turns_on_the_connections(client: PipelinedRedis) -> None:
    """Each tick's calls leave in one write on one connection, the next tick's on the next one."""
    await connected(client)
    writes = count_writes(client)
    for tick in range(4):
        replies = await asyncio.gather(*(client.execute("ECHO", f"{tick}-{i}") for i in range(10)))
        assert replies == [f"{tick}-{i}".encode() for i in range(10)]
    assert writes == {0: 2, 1: 2}


async def test_one_connection_when_asked(redis_server: RedisServer) -> None:
    """With `connections=1` every tick uses the same connection."""
    redis_server.start()
    single = PipelinedRedis("127.0.0.1", redis_server.port, connections=1)
    try:
        await connected(single)
        writes = count_writes(single)
        for tick in range(3):
            await asyncio.gather(*(single.execute("ECHO", str(tick)) for _ in range(5)))
        assert writes == {0: 3}
    finally:
        await single.close()


async def test_a_lost_connection_is_reopened_while_the_other_serves(
    client: PipelinedRedis,
) -> None:
    """Calls after one connection is lost go to the open one; the lost one is reopened."""
    await connected(client)
    lost: Any = client._connections[0]
    lost.transport.abort()
    await asyncio.sleep(0)  # the loop reports the loss
    for tick in range(4):
        assert await client.execute("ECHO", str(tick)) == str(tick).encode()
    await connected(client)
    assert client._connections[0] is not lost


async def test_a_packed_command_is_sent_as_it_is(client: PipelinedRedis) -> None:
    """execute_packed sends RESP bytes unchanged, in the same write as the tick's other calls,
    and an error reply raises."""
    await connected(client)
    writes = count_writes(client)
    replies = await asyncio.gather(
        client.execute_packed(hiredis.pack_command(("SET", "packed", "v"))),
        client.execute("GET", "packed"),
        client.execute_packed(b"*2\r\n$4\r\nECHO\r\n$2\r\nhi\r\n"),
    )
    assert replies == [b"OK", b"v", b"hi"]
    assert sum(writes.values()) == 1
    with pytest.raises(RedisReplyError, match="WRONGTYPE"):
        await client.execute_packed(hiredis.pack_command(("HGET", "packed", "field")))


async def test_commands_sent_together_stay_together(client: PipelinedRedis) -> None:
    """execute_packed_many sends its commands back to back on one connection (a MULTI block
    holds), and returns error replies as values."""
    await client.execute("DEL", "together")
    replies = await client.execute_packed_many(
        [
            hiredis.pack_command(("MULTI",)),
            hiredis.pack_command(("INCR", "together")),
            hiredis.pack_command(("INCR", "together")),
            hiredis.pack_command(("EXEC",)),
            hiredis.pack_command(("NOSUCHCOMMAND",)),
        ]
    )
    assert replies[:4] == [b"OK", b"QUEUED", b"QUEUED", [1, 2]]
    assert isinstance(replies[4], RedisReplyError)


async def test_an_error_reply_raises_and_leaves_the_others_in_step(client: PipelinedRedis) -> None:
    """An error reply fails its own call only; the calls around it get their own replies."""
    results = await asyncio.gather(
        client.execute("ECHO", "a"),
        client.execute("NOSUCHCOMMAND"),
        client.execute("ECHO", "b"),
        return_exceptions=True,
    )
    assert results[0] == b"a" and results[2] == b"b"
    assert isinstance(results[1], RedisReplyError)
    assert "unknown command" in str(results[1])


async def test_a_call_that_gives_up_does_not_shift_later_replies(client: PipelinedRedis) -> None:
    """A cancelled call's reply is dropped when it arrives; the next call gets its own."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await client.execute("BLPOP", "nothing-here", "0.2")
    assert await client.execute("ECHO", "next") == b"next"


async def test_a_call_past_its_own_deadline_fails_and_later_replies_stay_in_step(
    client: PipelinedRedis,
) -> None:
    """A call given a deadline fails with DeadlineExceeded once it passes (no task timeout
    needed); its late reply is dropped and the next call gets its own."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceeded):
        await client.execute("BLPOP", "nothing-here", "0.2", deadline=started + 0.05)
    assert loop.time() - started < 0.2  # before the reply, which comes at 0.2 s
    assert await client.execute("ECHO", "next", deadline=loop.time() + 1) == b"next"
    await asyncio.sleep(0.25)  # the late BLPOP reply arrives and is dropped
    assert await client.execute("ECHO", "after", deadline=loop.time() + 1) == b"after"


async def test_deadlines_expire_in_their_own_order(client: PipelinedRedis) -> None:
    """A call whose deadline comes first fails first, even behind a call with a later one on
    the same connection, and a call answered in time is not failed by the timer."""
    await connected(client)
    loop = asyncio.get_running_loop()
    now = loop.time()
    # The BLPOP would answer by itself after 1 s: well after its deadline, so a loaded
    # machine's late timer still ends it by the deadline, not by the reply (0.3 s was too close).
    late = asyncio.ensure_future(client.execute("BLPOP", "nothing-here", "1", deadline=now + 0.25))
    early = asyncio.ensure_future(client.execute("ECHO", "x", deadline=now + 0.05))
    quick = asyncio.ensure_future(client.execute("PING", deadline=now + 0.05))
    # All three left in one tick, on one connection: the ECHO and PING wait behind the BLPOP.
    with pytest.raises(DeadlineExceeded):
        await early
    assert not late.done()
    with pytest.raises(DeadlineExceeded):
        await quick
    with pytest.raises(DeadlineExceeded):
        await late
    assert loop.time() - now < 0.9
    answered = await client.execute("PING", deadline=loop.time() + 2)
    assert answered == b"PONG"


async def test_a_reply_that_came_while_the_loop_was_busy_is_taken(
    client: PipelinedRedis,
) -> None:
    """A reply that reached the socket before the loop got round to the call's deadline
    answers the call: when the deadline's timer fires, the loop polls its sockets once more
    before it fails a call. Under load the timer comes due in the same turn as a long run of
    other work (here a callback busy for 0.25 s, due just before it; in service, the reads of
    many connections), and the reply arrives during that work: the deadline measures Redis,
    not the time this process took to look."""
    await connected(client)
    loop = asyncio.get_running_loop()
    answered: list[Any] = []
    now = loop.time()
    # Redis answers the BLPOP with nil after 0.15 s: past the deadline of 0.05 s as the loop
    # sees it, but before the loop could look.
    command = hiredis.pack_command(("BLPOP", "nothing-here", "0.15"))
    client.call_packed(command, now + 0.05, answered.append)
    loop.call_at(now + 0.04, time.sleep, 0.25)
    await asyncio.sleep(0)  # the write leaves
    time.sleep(0.1)  # both timers come due while the loop is busy; they run in one turn
    await asyncio.sleep(0.3)
    assert answered == [None]


async def test_a_connection_whose_replies_wait_unread_is_not_dropped_as_stalled(
    redis_server: RedisServer,
) -> None:
    """A call that gives up on a connection that has heard nothing for a whole timeout drops
    it as stalled, unless the server's replies are already in its socket, unread: then the
    server is answering and this process is late (under a flood, one turn of the loop can
    take longer than the timeout). The connection stays, and the calls on it get their
    replies rather than ConnectionLost (which the failure mode would answer)."""
    redis_server.start()
    client = PipelinedRedis("127.0.0.1", redis_server.port, connections=1, connect_timeout=0.1)
    try:
        await connected(client)
        (protocol,) = client._connections
        assert protocol is not None
        answers = Answers()
        loop = asyncio.get_running_loop()
        client.call_packed(pack("PING"), loop.time() + 5, answers.callback)
        await asyncio.sleep(0)  # the write leaves
        time.sleep(0.3)  # the loop is held: the reply waits in the socket, unread
        client._check_stalled(protocol)
        assert protocol.lost is None
        assert await answers.wait(1) == [b"PONG"]
    finally:
        await client.close()


def test_a_server_may_have_in_flight_what_it_answers_within_the_deadline() -> None:
    """The bound on a server's calls in flight is what it answers within the deadline at 50 µs
    a call (1,000 for the default 50 ms), and never fewer than MIN_IN_FLIGHT."""
    assert in_flight_bound(0.05) == 1000
    assert in_flight_bound(1.0) == 20_000
    assert in_flight_bound(0.001) == MIN_IN_FLIGHT


async def test_calls_past_the_bound_in_flight_are_refused_at_once(
    redis_server: RedisServer,
) -> None:
    """With `max_in_flight` calls waiting for replies (split between the connections), the
    next call is refused at once with Overloaded, by callback or raised, without reaching
    Redis; once replies come back, calls are taken again."""
    redis_server.start()
    client = PipelinedRedis("127.0.0.1", redis_server.port, connections=2, max_in_flight=6)
    try:
        await connected(client)
        assert client.max_pending == 3
        await client.execute("DEL", "overloaded")
        answers = Answers()
        deadline = asyncio.get_running_loop().time() + 5
        for _ in range(4):  # one tick: all on one connection, the fourth past its share
            client.call_packed(pack("INCR", "overloaded"), deadline, answers.callback)
        got = await answers.wait(4)
        assert isinstance(got[0], Overloaded)  # refused at once, before any reply
        assert "3 calls waiting" in str(got[0])
        assert sorted(x for x in got[1:]) == [1, 2, 3]
        with pytest.raises(Overloaded):
            await asyncio.gather(*(client.execute("INCR", "overloaded") for _ in range(4)))
        await asyncio.sleep(0.1)
        assert await client.execute("GET", "overloaded") == b"6"
    finally:
        await client.close()


#: A script that keeps the server busy for ARGV[1] microseconds, then answers 1.
BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
return 1
"""


async def test_a_call_late_behind_calls_the_server_is_answering_is_overloaded_not_failed(
    redis_server: RedisServer,
) -> None:
    """A call whose deadline passes while the server keeps answering the calls queued ahead of
    it fails with Overloaded, which the limiter never answers by its failure mode: the server
    is alive and behind (a flood of our own calls), not failing. A call on a server that has
    answered nothing since it was sent fails with DeadlineExceeded, as before."""
    redis_server.start()
    client = PipelinedRedis("127.0.0.1", redis_server.port, connections=1, connect_timeout=1.0)
    try:
        await connected(client)
        loop = asyncio.get_running_loop()
        answers = Answers()
        deadline = loop.time() + 5
        # 0.3 s of work, answered every 10 ms: Redis answers what it has read after it has run
        # it all, and reads at most 16 KiB at a time, so each call is padded to more than that.
        padding = b"x" * 20_000
        for _ in range(30):
            client.call_packed(pack("EVAL", BUSY, 0, 10_000, padding), deadline, answers.callback)
        await asyncio.sleep(0.05)  # a few have been answered; the rest are queued
        late = Answers()
        client.call_packed(pack("PING"), loop.time() + 0.1, late.callback)
        (outcome,) = await late.wait(1)
        assert isinstance(outcome, Overloaded), outcome
        assert "calls behind" in str(outcome)
        assert await answers.wait(30) == [1] * 30
        silent = Answers()
        client.call_packed(pack("EVAL", BUSY, 0, 300_000), loop.time() + 5, silent.callback)
        client.call_packed(pack("PING"), loop.time() + 0.1, late.callback)
        got = await late.wait(2)
        assert isinstance(got[1], DeadlineExceeded), got[1]
        assert await silent.wait(1) == [1]
    finally:
        await client.close()


async def test_many_calls_with_deadlines_leave_no_pending_deadline(
    client: PipelinedRedis,
) -> None:
    """Deadlines of calls answered in time are dropped by the connection's one timer; none is
    left once it has fired."""
    await connected(client)  # the deadlines are for the calls, not for connecting
    loop = asyncio.get_running_loop()
    replies = await asyncio.gather(
        *(client.execute("ECHO", str(i), deadline=loop.time() + 0.5) for i in range(500))
    )
    assert replies == [str(i).encode() for i in range(500)]
    await asyncio.sleep(0.6)
    for protocol in client._connections:
        assert protocol is None or (protocol.deadlines == [] and protocol.timer is None)


async def test_the_clock_of_deadlines_is_the_loops_before_and_after_connecting(
    client: PipelinedRedis,
) -> None:
    """`time()`, which deadlines are in, reads the running loop's time before any connection
    and the connections' loop's clock after (no get_running_loop per call), on either loop;
    a closed client asks the running loop again."""
    loop = asyncio.get_running_loop()
    assert abs(client.time() - loop.time()) < 0.05
    await connected(client)
    assert abs(client.time() - loop.time()) < 0.05
    assert client.time in (time.monotonic, loop.time)  # asyncio's loop reads time.monotonic
    await client.close()
    assert abs(client.time() - loop.time()) < 0.05


@pytest.fixture
def protected(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own that wants a password."""
    require_binary("redis-server")
    try:
        server = start_server(tmp_path)
    except ServerError as exc:
        pytest.fail(str(exc))
    with server.client() as sync:
        sync.config_set("requirepass", "s3cret")
    yield server
    server.stop()


async def test_auth_and_database_are_sent_on_connect(protected: RedisServer) -> None:
    """A password and a database from the URL are used on every new connection."""
    backend_url = f"redis://:s3cret@127.0.0.1:{protected.port}/3"
    backend = RedisBackend.from_url(backend_url, timeout_ms=1000)
    try:
        assert await backend.ping()
        client: Any = backend._client
        await client.execute("SET", "k", "v")
    finally:
        await backend.close()
    with protected.client() as sync:
        sync.execute_command("AUTH", "s3cret")
        sync.execute_command("SELECT", "3")
        assert sync.get("k") == b"v"
    wrong = RedisBackend.from_url(f"redis://:wrong@127.0.0.1:{protected.port}", timeout_ms=1000)
    try:
        assert not await wrong.ping()
    finally:
        await wrong.close()


async def test_a_dead_server_fails_fast_and_a_restarted_one_serves_again(
    restartable_redis: RedisServer,
) -> None:
    """Calls to a stopped server fail at once (no waiting out the deadline), and the same client
    reconnects when the server is back."""
    client = PipelinedRedis("127.0.0.1", restartable_redis.port, connect_timeout=1.0)
    try:
        assert await client.execute("PING") == b"PONG"
        restartable_redis.stop()
        with pytest.raises(ConnectionLost):
            await client.execute("PING")
        started = time.monotonic()
        with pytest.raises(ConnectionLost):
            await client.execute("PING")
        assert time.monotonic() - started < 0.5
        restartable_redis.start()
        await asyncio.sleep(0.15)  # past the reconnect back-off
        assert await client.execute("PING") == b"PONG"
    finally:
        await client.close()


async def test_a_hung_server_drops_the_connection_and_recovers(
    restartable_redis: RedisServer,
) -> None:
    """A server that stops answering fails calls by their deadline; once it answers again, a new
    connection serves."""
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{restartable_redis.port}", timeout_ms=200)
    try:
        assert await backend.ping()
        restartable_redis.pause()
        await asyncio.sleep(0.25)
        client: Any = backend._client
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.execute("PING")
        # The connection that carried the call is dropped: nothing heard for a whole deadline.
        assert any(p is not None and p.lost is not None for p in client._connections)
        assert not await backend.ping()
        restartable_redis.resume()
        for _ in range(20):
            if await backend.ping():
                break
            await asyncio.sleep(0.1)
        assert await backend.ping()
    finally:
        restartable_redis.resume()
        await backend.close()


class Answers:
    """Collects what `call_packed` hands its callbacks, and when each came."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.at: list[float] = []
        self.arrived = asyncio.Event()

    def callback(self, outcome: Any) -> None:
        self.got.append(outcome)
        self.at.append(asyncio.get_running_loop().time())
        self.arrived.set()

    async def wait(self, count: int) -> list[Any]:
        while len(self.got) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)
        return self.got


def pack(*args: Any) -> bytes:
    return hiredis.pack_command(args)


async def test_call_packed_hands_each_reply_to_its_callback_in_one_write(
    client: PipelinedRedis,
) -> None:
    """Calls through callbacks leave in one write per tick like awaited ones, each callback gets
    its own reply once, and an error reply arrives as RedisReplyError without disturbing the
    others."""
    await connected(client)
    writes = count_writes(client)
    answers = Answers()
    deadline = asyncio.get_running_loop().time() + 1
    for i in range(50):
        client.call_packed(pack("ECHO", str(i)), deadline, answers.callback)
    client.call_packed(pack("NOSUCHCOMMAND"), deadline, answers.callback)
    client.call_packed(pack("ECHO", "last"), deadline, answers.callback)
    got = await answers.wait(52)
    assert got[:50] == [str(i).encode() for i in range(50)]
    assert isinstance(got[50], RedisReplyError) and "unknown command" in str(got[50])
    assert got[51] == b"last"
    assert sum(writes.values()) == 1
    await asyncio.sleep(0.05)
    assert len(answers.got) == 52  # nothing twice


async def test_calls_made_while_a_read_is_handled_leave_when_it_ends(
    client: PipelinedRedis,
) -> None:
    """Calls made while a protocol handles a read (inside batching's begin and end) leave in
    one write as the read ends, without waiting for the loop's next turn; a callback that calls
    again, run from the client's own read, sends at the end of that read too."""
    await connected(client)
    writes = count_writes(client)
    answers = Answers()
    deadline = asyncio.get_running_loop().time() + 1
    assert batching.begin()
    for i in range(3):
        client.call_packed(pack("ECHO", str(i)), deadline, answers.callback)
    assert sum(writes.values()) == 0
    batching.end()
    assert sum(writes.values()) == 1
    assert await answers.wait(3) == [b"0", b"1", b"2"]

    sent_by_callback: list[int] = []

    def again(outcome: Any) -> None:
        answers.callback(outcome)
        client.call_packed(pack("ECHO", "again"), deadline, answers.callback)
        sent_by_callback.append(sum(writes.values()))

    client.call_packed(pack("ECHO", "first"), deadline, again)
    await answers.wait(4)
    written_when_the_read_ended = sum(writes.values())
    assert sent_by_callback == [2] and written_when_the_read_ended == 3
    assert await answers.wait(5) == [b"0", b"1", b"2", b"first", b"again"]


async def test_call_packed_fails_by_its_deadline_and_later_replies_stay_in_step(
    client: PipelinedRedis,
) -> None:
    """A callback call past its deadline gets DeadlineExceeded then, not the late reply; the
    next call on the connection gets its own reply."""
    await connected(client)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = Answers()
    client.call_packed(pack("BLPOP", "nothing-here", "0.2"), started + 0.05, answers.callback)
    got = await answers.wait(1)
    assert isinstance(got[0], DeadlineExceeded)
    assert answers.at[0] - started < 0.2
    client.call_packed(pack("ECHO", "next"), loop.time() + 1, answers.callback)
    assert (await answers.wait(2))[1] == b"next"
    await asyncio.sleep(0.25)  # the BLPOP's late reply arrives and is dropped
    assert len(answers.got) == 2


async def test_call_packed_with_no_connection_open_waits_for_one(
    redis_server: RedisServer,
) -> None:
    """The first call of a new client opens a connection and gets its reply (not a failure)."""
    redis_server.start()
    fresh = PipelinedRedis("127.0.0.1", redis_server.port, connect_timeout=1.0)
    try:
        answers = Answers()
        deadline = asyncio.get_running_loop().time() + 1
        fresh.call_packed(pack("ECHO", "first"), deadline, answers.callback)
        fresh.call_packed(pack("ECHO", "second"), deadline, answers.callback)
        assert await answers.wait(2) == [b"first", b"second"]
    finally:
        await fresh.close()


async def test_call_packed_fails_when_the_server_is_gone_or_the_client_closes(
    restartable_redis: RedisServer,
) -> None:
    """A lost connection hands ConnectionLost to the calls it carried, a call with no server to
    reach gets ConnectionLost at once, and closing the client ends a call still waiting for a
    connection."""
    client = PipelinedRedis("127.0.0.1", restartable_redis.port, connect_timeout=1.0)
    loop = asyncio.get_running_loop()
    try:
        await connected(client)
        answers = Answers()
        client.call_packed(pack("BLPOP", "nothing-here", "5"), loop.time() + 5, answers.callback)
        await asyncio.sleep(0.05)
        restartable_redis.stop()
        assert isinstance((await answers.wait(1))[0], ConnectionLost)
        started = loop.time()
        client.call_packed(pack("PING"), loop.time() + 5, answers.callback)
        assert isinstance((await answers.wait(2))[1], ConnectionLost)
        # Well before connect_timeout (1 s): the refused connection fails the call, nothing waits.
        assert answers.at[1] - started < 0.9
        restartable_redis.start()
        await asyncio.sleep(0.15)  # past the reconnect back-off
        client.call_packed(pack("PING"), loop.time() + 5, answers.callback)
        await client.close()  # before the new connection is open
        assert isinstance((await answers.wait(3))[2], ConnectionLost)
    finally:
        await client.close()


async def test_a_failing_callback_does_not_disturb_the_other_calls(
    client: PipelinedRedis,
) -> None:
    """A callback that raises is logged; the calls behind it on the connection get their replies."""
    await connected(client)
    answers = Answers()

    def broken(outcome: Any) -> None:
        raise ZeroDivisionError("a bug in a callback")

    deadline = asyncio.get_running_loop().time() + 1
    client.call_packed(pack("ECHO", "a"), deadline, answers.callback)
    client.call_packed(pack("ECHO", "b"), deadline, broken)
    client.call_packed(pack("ECHO", "c"), deadline, answers.callback)
    assert await answers.wait(2) == [b"a", b"c"]
    assert await client.execute("ECHO", "d") == b"d"


def counting_tasks(started: list[int]) -> None:
    """From now on, count in `started` the tasks the running loop makes."""
    loop = asyncio.get_running_loop()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        started.append(1)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)


async def test_a_read_of_three_hashes_is_one_write_one_round_trip_and_no_task(
    redis_server: RedisServer,
) -> None:
    """A frequency check's read (an HMGET per identifier's hash) leaves in one write, which
    Redis takes in one read, and is awaited in the caller's own task: no task per command
    (each a turn of the loop before the caller runs again)."""
    redis_server.start()
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{redis_server.port}", timeout_ms=1000)
    try:
        for hash_key in (b"{u}", b"{d}", b"{k}"):
            await backend.execute("HSET", hash_key, "a1", "2", "a2", "5")
        await connected(backend._client)
        writes = count_writes(backend._client)
        before = await backend.execute("INFO", "stats")
        started: list[int] = []
        counting_tasks(started)
        try:
            values = await backend.read(
                [(b"{u}", b"a1"), (b"{d}", b"a2"), (b"{k}", b"a1"), (b"{k}", b"none")], 0
            )
        finally:
            asyncio.get_running_loop().set_task_factory(None)
        after = await backend.execute("INFO", "stats")
    finally:
        await backend.close()
    assert values == [2, 5, 2, None]
    # The INFO calls wrote too: one before the read, the read, one after.
    assert sum(writes.values()) == 3
    # Redis's read events between the two INFOs: the read's, and the second INFO's own.
    assert reads_processed(after) - reads_processed(before) == 2
    assert started == []


def reads_processed(info: bytes) -> int:
    """`total_reads_processed` (the read events Redis handled) from an INFO reply."""
    for line in info.decode().splitlines():
        if line.startswith("total_reads_processed:"):
            return int(line.split(":")[1])
    raise AssertionError("INFO stats has no total_reads_processed")


async def test_a_read_whose_server_stops_answering_fails_by_its_deadline(
    restartable_redis: RedisServer,
) -> None:
    """A read of several hashes from a server that stops answering fails with StorageError by
    the backend's deadline (no answer within its timeout); once the server answers again, a
    read gets its own replies, in step."""
    backend = RedisBackend.from_url(restartable_redis.url, timeout_ms=100)
    try:
        await backend.execute("HSET", b"{u}", "a1", "3")
        await connected(backend._client)
        restartable_redis.pause()
        try:
            with pytest.raises(StorageError, match="no answer within 100 ms"):
                await backend.read([(b"{u}", b"a1"), (b"{d}", b"a1")], 0)
        finally:
            restartable_redis.resume()
        assert await backend.read([(b"{u}", b"a1"), (b"{d}", b"a1")], 0) == [3, None]
    finally:
        await backend.close()
