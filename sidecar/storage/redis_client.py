"""A lean Redis client for the hot path: every command issued in one event-loop tick leaves in one
write on one connection, and replies are matched to callers in order.

redis-py spends more CPU per call than the whole decision (a connection checked out of a pool per
call, commands packed in Python, a task per call in places). Here a call packs its command with
hiredis's C packer, appends it to the tick's buffer and waits on a future; the buffer is written
once at the end of the tick, and `data_received` feeds hiredis's reader and resolves the futures
first in, first out. No task is created per call. `call_packed` goes one step further for the
hot path: no future and no coroutine, the reply is handed to a callback from `data_received`.
A call made while a protocol handles a read (the fast transport's request, this client's own
reply; see `sidecar.loop.batching`) ends its tick with that read: the write leaves before the loop
polls again, instead of one turn later.

A client keeps a few connections to its server and gives each tick to the next one in turn (see
`PipelinedRedis`). A call has a deadline: its own (`deadline=`, in the event loop's time), or
the caller's (`asyncio.timeout` around `execute`). Its own costs no timer per call: the
connection keeps the deadlines of its calls in a heap and one timer for the earliest, so under
load the timer fires about once per deadline's length instead of being set and cancelled on
every call. Either way a call that gives up leaves its future done (DeadlineExceeded, or
cancelled), and its reply, when it comes, is dropped without disturbing the order. A connection
that has not answered anything for a whole connect timeout while calls wait is closed, so a
hung server fails fast instead of piling up calls. A lost connection fails every
call waiting on it; it is reopened in the background while another connection serves, or by the
next call when none is open, at most once per `RECONNECT_BACKOFF` after a failed attempt (calls
in between fail at once, so the failure mode answers without waiting). AUTH and SELECT run first
on every new connection; TLS is the event loop's.

A server that says it no longer takes writes (an error reply in `reconnect_on`: READONLY, the
old master demoted to a replica by a failover; MASTERDOWN) makes the client drop its
connections, at most once per `RECONNECT_BACKOFF`: the next call dials again, which reaches the
new master where a failover repointed the address (a Kubernetes Service, DNS, a proxy), or asks
the `locator` where the master is now (`sentinel.py`). The call that met the reply fails as any
error reply does (envoyproxy/ratelimit kept such connections until it restarted: its PR #1191).

A server has a bound on the calls waiting for its replies (`in_flight_bound`: what it answers
within the deadline), so a flood of requests cannot queue more calls in Redis than it answers
in time; a call past it is refused at once with Overloaded, which is not a failure of Redis.
A call whose deadline passes while the server is answering others fails with Overloaded too
(see `_expire`): only a server silent for a whole timeout is a failure (DeadlineExceeded).

One module, past the usual size, because the connection (`_Protocol`) and the client that owns
it (`PipelinedRedis`) share one state: the reply queue, the deadline heap and its timer, the
tick's buffer; the client reads and writes them directly on the hot path, without calls, and
every change to one is a change to the other.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import ipaddress
import itertools
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, cast

import hiredis
import structlog
from mypy_extensions import mypyc_attr

from sidecar.errors import Overloaded
from sidecar.loop import batching

#: After a failed connection attempt, calls fail at once for this long before the next attempt.
RECONNECT_BACKOFF: Final = 0.1

#: Connections per server, unless told otherwise.
CONNECTIONS: Final = 2

#: What one call may cost Redis at most, to size how many a server may have in flight: the
#: decision script costs it 20-27 µs, the counting one 7-9 (README, Performance); twice the
#: larger leaves room for a server that is busy with others too.
WORST_CALL_SECONDS: Final = 50e-6
#: The fewest calls a server may have in flight, however short the deadline.
MIN_IN_FLIGHT: Final = 64

#: Error replies after which the client drops its connections and dials again (see the module's
#: docstring): the server is a replica now (READONLY), or a replica that lost its master
#: (MASTERDOWN). LOADING is not here: a standalone server loading its data answers again on the
#: same connection once it has loaded; a `locator`'s client adds it (its master may have moved).
NOT_MASTER: Final = ("READONLY", "MASTERDOWN")

_NEVER: Final = float("inf")

log = structlog.get_logger("sidecar.storage.redis_client")


def in_flight_bound(timeout: float) -> int:
    """How many calls one server may have waiting for their replies: as many as it answers
    within `timeout` at `WORST_CALL_SECONDS` each (at least MIN_IN_FLIGHT). Past that a
    call's deadline would expire in Redis's queue, behind our own calls, and the failure mode
    would answer a request Redis is healthy enough to decide: the call is refused instead
    (`Overloaded`). 1,000 for the default 50 ms."""
    return max(MIN_IN_FLIGHT, int(timeout / WORST_CALL_SECONDS))


def _unread(protocol: _Protocol) -> bool:
    """Whether bytes from the server wait in the connection's socket, not read yet (one
    non-blocking poll of its descriptor; only asked when a call has given up)."""
    transport = protocol.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):  # closed meanwhile
        return False
    return bool(readable)


def _running_loop_time() -> float:
    return asyncio.get_running_loop().time()


class RedisReplyError(Exception):
    """An error reply from Redis (`-ERR ...`, `-NOSCRIPT ...`, `-MOVED ...`): hiredis's reader
    makes these for error replies, so no call converts one."""


class Locator(Protocol):
    """Where a client's server is now, asked before each connection is opened (`sentinel.py`)."""

    async def locate(self) -> tuple[str, int]:
        """The master's host and port; raises ConnectionLost when none can be found."""
        ...

    async def close(self) -> None:
        """Stop whatever the locator runs (a later `locate` starts it again)."""
        ...


# Not native classes in the compiled build (sidecar.build): mypyc compiles a subclass of
# Exception, not of the other built-in exceptions.
@mypyc_attr(native_class=False)
class ConnectionLost(ConnectionError):
    """The connection closed, or could not be opened, before the reply came."""


@mypyc_attr(native_class=False)
class DeadlineExceeded(TimeoutError):
    """No reply came before the call's deadline."""


class Reply:
    """What a `call_packed` call waits on: it takes a future's place in a connection's queue and
    deadline heap, and hands the outcome to its callback at once, where a future would schedule
    its callbacks for the next turn of the loop. The callback runs exactly once: with the reply,
    or with the exception that ended the call (RedisReplyError for an error reply,
    DeadlineExceeded, ConnectionLost)."""

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: Callable[[Any], None]) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, reply: Any) -> None:
        if self._done:
            return
        self._done = True
        # Let go of the callback (and all it holds): a done entry may wait in the deadline heap
        # until its deadline comes up.
        callback, self._callback = self._callback, _settled
        try:
            callback(reply)
        except Exception as exc:  # a bug in the callback: the connection's other calls go on
            log.exception("redis_callback_failed", error=repr(exc))

    def set_exception(self, exc: BaseException) -> None:
        self.set_result(exc)


def _settled(outcome: Any) -> None:
    """A settled Reply's callback: never called."""


class _Replies:
    """The replies of `execute_packed_many`'s commands, gathered in order; `future` gets the
    list once the last has come, or the first exception that ended a call (whatever comes
    after is dropped)."""

    __slots__ = ("_future", "_replies", "_wanted")

    def __init__(self, wanted: int, future: asyncio.Future[list[Any]]) -> None:
        self._wanted = wanted
        self._future = future
        self._replies: list[Any] = []

    def add(self, outcome: Any) -> None:
        future = self._future
        if future.done():  # failed already, or its caller gave up
            return
        if isinstance(outcome, BaseException) and not isinstance(outcome, RedisReplyError):
            future.set_exception(outcome)
            return
        self._replies.append(outcome)
        if len(self._replies) == self._wanted:
            future.set_result(self._replies)


#: What waits for a reply in a connection's queue: a future, or a `Reply` for `call_packed`.
Waiter = asyncio.Future[Any] | Reply


class _Protocol(asyncio.Protocol):
    def __init__(self, error_reply: Callable[[RedisReplyError], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiters: collections.deque[Waiter] = collections.deque()
        self.reader = hiredis.Reader(replyError=RedisReplyError)
        # Told of every error reply (the client judges whether the server is still a master).
        self.error_reply = error_reply
        self.last_reply = time.monotonic()
        self.lost: Exception | None = None
        # Commands of the current tick, written together when it ends.
        self.buffer: list[bytes] = []
        self.flush_scheduled = False
        # (deadline, order, future, `reads` when sent) of the calls with a deadline of their
        # own, and the timer set for the earliest; entries whose future is done are dropped
        # when they come up, as a read answers them or as the timer fires.
        self.deadlines: list[tuple[float, int, Waiter, int]] = []
        # Reads of the server's replies so far.
        self.reads = 0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = _NEVER  # when `timer` fires (its `when()` is a call per call to read)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods without being its subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_reply = time.monotonic()
        self.reads += 1
        reader = self.reader
        reader.feed(data)
        waiters = self.waiters
        # The answers these replies complete leave when they are all handed out (see batching).
        held = batching.begin()
        try:
            while (reply := reader.gets()) is not False:
                future = waiters.popleft()
                # A Reply settles once on its own: it needs no `done()` asked first.
                if type(future) is Reply or not future.done():
                    future.set_result(reply)
                if type(reply) is RedisReplyError:
                    self.error_reply(reply)
            # Let go of the answered calls' deadlines now, not when the timer next comes up:
            # replies come in the order the calls were sent, whose deadlines are in the same
            # order when they share a timeout, so the answered ones are at the top of the heap.
            # Freed here by their reference counts, an entry and its Reply never outlive the
            # read that answered them, and no collection has them to walk (kept until the
            # timer, a deadline's worth of calls was always alive: about 1,000 objects at
            # 10,000 calls/s and a 50 ms deadline, each young collection walking and promoting
            # them).
            deadlines = self.deadlines
            while deadlines and deadlines[0][2].done():
                heapq.heappop(deadlines)
        except (hiredis.ProtocolError, IndexError) as exc:
            # A reply nobody asked for, or bytes that are not RESP: the stream is out of step.
            self.close(ConnectionLost(f"redis protocol error: {exc!r}"))
        finally:
            if held:
                batching.end()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionLost(f"connection lost: {exc}" if exc else "connection closed"))

    def fail(self, exc: Exception) -> None:
        self.lost = self.lost or exc
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.timer_at = _NEVER
        self.deadlines.clear()
        waiters = self.waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_exception(exc)

    def close(self, exc: Exception) -> None:
        self.fail(exc)
        if self.transport is not None:
            self.transport.abort()


class PipelinedRedis:
    """Pipelined connections to one Redis server (opened on first use, reopened when lost).

    Each tick's calls all go to one connection, and the next tick's to the next connection in
    turn. One connection per tick keeps the cost of a tick at one write (one system call), as
    with a single connection, and keeps replies first in, first out on each connection; taking
    turns spreads the ticks over the connections, so a slow reply (a large one, or one behind a
    lost packet) holds up the ticks of its own connection only, and a lost connection fails
    only the calls it carried. Round robin per call would cost one write per connection per
    tick instead, for no gain: the server runs the commands one at a time either way.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connections: int = CONNECTIONS,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
        connect_timeout: float = 1.0,
        max_in_flight: int | None = None,
        locator: Locator | None = None,
        reconnect_on: Sequence[str] = NOT_MASTER,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        if max_in_flight is None:
            max_in_flight = in_flight_bound(connect_timeout)
        #: Calls one connection may have waiting for replies (the server's share, `max_in_flight`
        #: split between the connections); a call past it is refused with Overloaded.
        self.max_pending = -(-max_in_flight // connections)
        self.host = host
        self.port = port
        self._db = db
        self._username = username
        self._password = password
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        #: Asked for the server's address before each connection (host and port follow it).
        self._locator = locator
        self._reconnect_on = frozenset(reconnect_on)
        self._dropped_at = -RECONNECT_BACKOFF
        self._drops = 0  # how many times `reconnect` dropped the connections
        self._connections: list[_Protocol | None] = [None] * connections
        self._opening: list[asyncio.Task[_Protocol] | None] = [None] * connections
        self._next = 0
        # The connection the current tick's calls go to; None until the tick's first call.
        self._tick: _Protocol | None = None
        self._failed_at = -RECONNECT_BACKOFF
        #: Why the last attempt to open a connection failed; None once one opens. Kept through
        #: the back-off, for health to say why the server is not reached (`failures.fault`).
        self.connect_error: Exception | None = None
        self._order = itertools.count()
        # Calls of `call_packed` waiting for a connection (kept: the loop holds tasks weakly).
        self._waiting: set[asyncio.Task[None]] = set()
        #: The event loop's time, which deadlines are in: the clock of the loop the connections
        #: run on, once one is opened. Asking `asyncio.get_running_loop()` costs a system call
        #: (getpid) on CPython 3.11, once per call on the hot path.
        self.time: Callable[[], float] = _running_loop_time

    async def execute(self, *args: Any, deadline: float | None = None) -> Any:
        """Send one command and wait for its reply; error replies raise RedisReplyError.

        `deadline` (the event loop's time): no reply by then raises DeadlineExceeded.
        """
        return await self.execute_packed(hiredis.pack_command(args), deadline)

    async def execute_packed(self, packed: bytes, deadline: float | None = None) -> Any:
        """Send one command already encoded in RESP (as `hiredis.pack_command` encodes it) and
        wait for its reply; error replies raise RedisReplyError (`deadline`: see `execute`)."""
        protocol = self._tick
        if protocol is None or protocol.lost is not None:
            protocol = await self._protocol(deadline)
        if len(protocol.waiters) >= self.max_pending:
            raise self._overloaded()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(protocol, packed, future)
        if deadline is not None:
            self._keep_deadline(protocol, deadline, future)
        try:
            reply = await future
        except asyncio.CancelledError:
            self._check_stalled(protocol)
            raise
        if isinstance(reply, RedisReplyError):
            raise reply
        return reply

    def call_packed(self, packed: bytes, deadline: float, callback: Callable[[Any], None]) -> None:
        """Send one encoded command (see `execute_packed`) and hand what comes back to
        `callback`, exactly once: the reply, or the exception that ended the call
        (RedisReplyError for an error reply, DeadlineExceeded by `deadline`, ConnectionLost,
        Overloaded at once when the connection already has `max_pending` calls waiting).

        No future and no coroutine: the callback runs from the connection's `data_received`
        (or the deadline's timer, or the connection's loss), so it must be quick and must not
        block; an exception it raises is logged and does not disturb the other calls. With no
        connection open, the call waits for one in a task, as `execute_packed` would.
        """
        reply = Reply(callback)
        protocol = self._tick
        if protocol is None or protocol.lost is not None:
            protocol = self._pick()
            if protocol is None:
                task = asyncio.get_running_loop().create_task(
                    self._call_when_open(packed, deadline, reply)
                )
                self._waiting.add(task)
                task.add_done_callback(functools.partial(self._call_ended, reply))
                return
        if len(protocol.waiters) >= self.max_pending:
            reply.set_exception(self._overloaded())
            return
        self._send(protocol, packed, reply)
        self._keep_deadline(protocol, deadline, reply)

    async def _call_when_open(self, packed: bytes, deadline: float, reply: Reply) -> None:
        try:
            protocol = await self._protocol(deadline)
        except Exception as exc:
            reply.set_exception(exc)
            return
        if len(protocol.waiters) >= self.max_pending:
            reply.set_exception(self._overloaded())
            return
        self._send(protocol, packed, reply)
        self._keep_deadline(protocol, deadline, reply)

    def _call_ended(self, reply: Reply, task: asyncio.Task[None]) -> None:
        self._waiting.discard(task)
        if task.cancelled():  # by `close`, perhaps before it began: the call ends with the client
            reply.set_exception(ConnectionLost("client closed"))

    async def execute_packed_many(
        self, packed: Sequence[bytes], deadline: float | None = None
    ) -> list[Any]:
        """Send encoded commands back to back on one connection, in one write, and wait for
        every reply. Error replies come back as RedisReplyError values, not raised: the caller
        judges them (ASKING and the command it prefixes, say). `deadline`: see `execute`.

        One future for them all, settled by the last reply (`_Replies`): a future per command
        gathered would cost the loop a turn per command, then another for the gathering, before
        the caller runs again; a frequency check's reads (an HMGET per identifier) are this.
        """
        if not packed:
            return []
        protocol = self._tick
        if protocol is None or protocol.lost is not None:
            protocol = await self._protocol(deadline)
        if len(protocol.waiters) + len(packed) > self.max_pending:
            raise self._overloaded()
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        replies = _Replies(len(packed), future)
        reply = None
        for command in packed:
            reply = Reply(replies.add)
            self._send(protocol, command, reply)
        if deadline is not None and reply is not None:
            # The last command's deadline is every command's: replies come in order on one
            # connection, so the last is answered after the others, and its failure is theirs.
            self._keep_deadline(protocol, deadline, reply)
        try:
            return await future
        except asyncio.CancelledError:
            self._check_stalled(protocol)
            raise

    async def _protocol(self, deadline: float | None) -> _Protocol:
        """The connection this tick's calls go to, opened if none is (by `deadline`)."""
        protocol = self._tick
        if protocol is not None and protocol.lost is None:
            return protocol
        protocol = self._pick()
        if protocol is not None:
            return protocol
        if deadline is None:
            return await self._connect()
        try:
            async with asyncio.timeout_at(deadline):
                return await self._connect()
        except TimeoutError:
            raise DeadlineExceeded("no connection to redis in time") from None

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"redis at {self.host}:{self.port} already has {self.max_pending} calls waiting on "
            "this connection; refused rather than left to miss its deadline"
        )

    def _keep_deadline(self, protocol: _Protocol, deadline: float, future: Waiter) -> None:
        """Fail `future` at `deadline` unless answered: the connection's heap, and its one timer
        moved earlier when this deadline is the earliest."""
        # The order breaks ties (futures do not compare); the connection's reads so far tell
        # `_expire` whether the server has sent anything since.
        entry = (deadline, next(self._order), future, protocol.reads)
        heapq.heappush(protocol.deadlines, entry)
        if deadline < protocol.timer_at:
            if protocol.timer is not None:
                protocol.timer.cancel()
            protocol.timer = asyncio.get_running_loop().call_at(
                deadline, self._deadline_due, protocol
            )
            protocol.timer_at = deadline

    def _send(self, protocol: _Protocol, packed: bytes, future: Waiter) -> None:
        protocol.waiters.append(future)
        protocol.buffer.append(packed)
        if not protocol.flush_scheduled:
            protocol.flush_scheduled = True
            self._tick = protocol
            if not batching.defer(self._flush, protocol):
                asyncio.get_running_loop().call_soon(self._flush, protocol)

    def _flush(self, protocol: _Protocol) -> None:
        protocol.flush_scheduled = False
        if self._tick is protocol:
            self._tick = None
        buffer, protocol.buffer = protocol.buffer, []
        if protocol.lost is None and protocol.transport is not None:
            protocol.transport.write(b"".join(buffer))

    def _pick(self) -> _Protocol | None:
        """The next open connection in turn, or None; lost ones are reopened meanwhile."""
        connections = self._connections
        for _ in range(len(connections)):
            index = self._next
            self._next = (index + 1) % len(connections)
            protocol = connections[index]
            if protocol is not None and protocol.lost is None:
                return protocol
            if self._opening[index] is None and not self._backing_off():
                self._open_later(index)
        return None

    def _deadline_due(self, protocol: _Protocol) -> None:
        """The earliest deadline has come: fail its calls once the loop has read its sockets
        again (`_expire`, two turns of the loop later).

        A timer comes due in the same turn as whatever else is ready, and under load that is
        the reads of many connections, taking milliseconds; a reply that reaches the socket
        meanwhile was in time, and is only waiting for the loop to look. One turn runs the
        callbacks of a poll that has already happened; the second comes after the next poll,
        which reads it. So the deadline measures Redis, not this process's own delay, and a busy
        sidecar does not turn its lateness into the failure mode's answers.

        Usually every call the timer was set for has been answered: the answered ones are
        dropped and the timer is set for the next deadline at once, without the two turns.
        """
        protocol.timer = None
        loop = asyncio.get_running_loop()
        deadlines = protocol.deadlines
        while deadlines and deadlines[0][2].done():
            heapq.heappop(deadlines)
        if deadlines and deadlines[0][0] <= loop.time():
            # timer_at stays as it is: no earlier timer is set meanwhile
            loop.call_soon(self._expire_next_turn, protocol)
            return
        protocol.timer_at = _NEVER
        if deadlines and protocol.lost is None:
            protocol.timer_at = deadlines[0][0]
            protocol.timer = loop.call_at(protocol.timer_at, self._deadline_due, protocol)

    def _expire_next_turn(self, protocol: _Protocol) -> None:
        asyncio.get_running_loop().call_soon(self._expire, protocol)

    def _expire(self, protocol: _Protocol) -> None:
        """Fail the calls whose deadline has passed; set the timer for the next one.

        How depends on whether the server is answering. If it has sent a reply since the call
        was sent (or one waits unread), it is alive and behind: our own calls queued ahead of
        this one took longer than the deadline (a flood, or a machine whose CPU the server
        shares). That is overload, not failure: the call fails with Overloaded, which is never
        answered by the failure mode (failing open there would let a flood admit past every
        limit). The server may still run the call later, counting it: a late call can only
        count too much, never too little. If the server has been silent since the call was
        sent, the call fails with DeadlineExceeded (the failure mode answers), and the
        connection is dropped when it has been silent for a whole timeout (`_check_stalled`).
        """
        protocol.timer = None
        protocol.timer_at = _NEVER
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines = protocol.deadlines
        unread: bool | None = None
        expired = False
        while deadlines:
            deadline, _, future, reads_when_sent = deadlines[0]
            if not future.done():
                if deadline > now:
                    break
                answering = protocol.reads > reads_when_sent
                if not answering and unread is None:
                    unread = _unread(protocol)
                if answering or unread:
                    future.set_exception(self._behind(protocol))
                else:
                    future.set_exception(DeadlineExceeded("no reply from redis in time"))
                    expired = True
            heapq.heappop(deadlines)
        if expired:
            self._check_stalled(protocol)
        if deadlines and protocol.lost is None:
            protocol.timer_at = deadlines[0][0]
            protocol.timer = loop.call_at(protocol.timer_at, self._deadline_due, protocol)

    def _behind(self, protocol: _Protocol) -> Overloaded:
        return Overloaded(
            f"redis at {self.host}:{self.port} is answering but {len(protocol.waiters)} calls "
            "behind, past this call's deadline; refused rather than answered by the failure mode"
        )

    def _check_stalled(self, protocol: _Protocol) -> None:
        """A call gave up: if the server has answered nothing for as long, drop the connection.

        Unless its answers are in the socket, unread: then the server is answering and this
        process is late (a loop busy with thousands of connections reads each socket once per
        turn, and a turn can take longer than the timeout). Dropping the connection there would
        fail every call on it, and the failure mode would answer them while Redis is healthy.
        """
        if (
            protocol.waiters
            and time.monotonic() - protocol.last_reply > self._connect_timeout
            and not _unread(protocol)
        ):
            protocol.close(ConnectionLost("no reply from redis; connection dropped"))

    def _error_reply(self, error: RedisReplyError) -> None:
        """An error reply came: when it says the server no longer takes writes, drop the
        connections (once the replies of this read are handed out) and dial again."""
        code = str(error).partition(" ")[0]
        if code in self._reconnect_on and time.monotonic() - self._dropped_at >= RECONNECT_BACKOFF:
            self._dropped_at = time.monotonic()
            asyncio.get_running_loop().call_soon(
                self.reconnect, f"redis at {self.host}:{self.port} answered {code}"
            )

    def reconnect(self, reason: str) -> None:
        """Drop every open connection (the calls waiting on them fail with ConnectionLost), so
        that the next call dials again, at once, at the address the locator names now if there
        is one. For a server that stopped being the master; a connection being opened is left
        to finish, then closed too (see `_open`)."""
        self._dropped_at = time.monotonic()
        self._drops += 1
        self._failed_at = -RECONNECT_BACKOFF  # a new master is worth trying at once
        open_ = [p for p in self._connections if p is not None and p.lost is None]
        if open_:
            log.info("redis_reconnect", reason=reason)
        for protocol in open_:
            protocol.close(ConnectionLost(reason))

    def _backing_off(self) -> bool:
        return time.monotonic() - self._failed_at < RECONNECT_BACKOFF

    async def _connect(self) -> _Protocol:
        """No connection is open: wait for one being opened, or open them all and wait for the
        next in turn."""
        index = self._next
        task = self._opening[index] or next((t for t in self._opening if t is not None), None)
        if task is None:
            if self._backing_off():
                raise ConnectionLost(
                    f"redis at {self.host}:{self.port} is unreachable (retrying soon)"
                )
            for other, protocol in enumerate(self._connections):
                if (protocol is None or protocol.lost is not None) and other != index:
                    self._open_later(other)
            task = self._open_later(index)
        # Shielded: a caller that gives up leaves the connection opening for the next ones.
        return await asyncio.shield(task)

    def _open_later(self, index: int) -> asyncio.Task[_Protocol]:
        task = asyncio.get_running_loop().create_task(self._open_at(index))
        # Retrieved here, so a failure nobody waited for is not logged as never retrieved.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._opening[index] = task
        return task

    async def _open_at(self, index: int) -> _Protocol:
        try:
            protocol = await self._open()
        except Exception as exc:
            self._failed_at = time.monotonic()
            self.connect_error = exc
            raise ConnectionLost(
                f"cannot connect to redis at {self.host}:{self.port}: {exc!r}"
            ) from exc
        finally:
            self._opening[index] = None
        self.connect_error = None
        self._connections[index] = protocol
        return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        self.time = loop.time
        drops = self._drops
        if self._locator is not None:
            # Bounded by the locator's own timeouts (it may ask several servers).
            self.host, self.port = await self._locator.locate()
        async with asyncio.timeout(self._connect_timeout):
            protocol = await self._dial(loop)
            try:
                await self._greet(protocol)
                if self._drops != drops:
                    # `reconnect` ran meanwhile: this may be the server it moved away from.
                    raise ConnectionLost(f"redis at {self.host}:{self.port} was left meanwhile")
            except BaseException:
                # Not handed to anyone: close it here, or the socket waits for the collector.
                protocol.close(ConnectionLost("connection setup failed"))
                raise
        return protocol

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        """A connection to the server's first address that takes one.

        The name is resolved here, not by `create_connection`: uvloop's resolves it in a future
        that a cancelled connect (a deadline, `close`) leaves behind, and its error is then
        logged as "Future exception was never retrieved" (a gaierror for a name that does not
        resolve). Awaited here, the resolution is cancelled with the connect. An address that is
        already an IP is not resolved: asyncio's loop would ask a thread of its executor (80 µs,
        and milliseconds on a busy machine), where `create_connection` takes it as it is."""
        addresses: list[tuple[int, str, int]]
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            addresses = [
                (int(family), str(address[0]), int(address[1]))
                for family, _, _, _, address in await loop.getaddrinfo(
                    self.host, self.port, type=socket.SOCK_STREAM
                )
            ]
        else:
            version = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            addresses = [(int(version), self.host, self.port)]
        error: OSError | None = None
        for family, host, port in addresses:
            try:
                _, protocol = await loop.create_connection(
                    functools.partial(_Protocol, self._error_reply),
                    host,
                    port,
                    family=family,
                    # Built at each connection: certificate files are read when they are needed
                    # (and read again after a rotation), not when the URL is parsed.
                    ssl=self._ssl() if self._ssl else None,
                    server_hostname=self.host if self._ssl else None,
                )
                return protocol
            except OSError as exc:
                error = exc
        raise error or OSError(f"{self.host}:{self.port} resolves to no address")

    async def _greet(self, protocol: _Protocol) -> None:
        """AUTH and SELECT, before the connection carries any call."""
        greetings: list[tuple[Any, ...]] = []
        if self._password is not None:
            if self._username:
                greetings.append(("AUTH", self._username, self._password))
            else:
                greetings.append(("AUTH", self._password))
        if self._db:
            greetings.append(("SELECT", self._db))
        loop = asyncio.get_running_loop()
        for command in greetings:
            future: asyncio.Future[Any] = loop.create_future()
            protocol.waiters.append(future)
            assert protocol.transport is not None
            protocol.transport.write(hiredis.pack_command(command))
            reply = await future
            if isinstance(reply, RedisReplyError):
                raise RedisReplyError(f"{command[0]}: {reply}")

    async def close(self) -> None:
        """Close every connection (waiting calls fail); a later call opens new ones."""
        tasks = [task for task in self._opening if task is not None] + list(self._waiting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A task cancelled before it started never ran the line that forgets it.
        self._opening = [None] * len(self._opening)
        connections, self._connections = self._connections, [None] * len(self._connections)
        self._tick = None
        self.time = _running_loop_time
        for protocol in connections:
            if protocol is not None and protocol.transport is not None:
                protocol.fail(ConnectionLost("client closed"))
                protocol.transport.close()
        if self._locator is not None:
            await self._locator.close()
        # Let the transports' close run, so no socket is left for the garbage collector.
        await asyncio.sleep(0)
