"""The asyncio side of the HTTP/2 server: listening sockets, one Protocol per connection, each
call started at once without a Task (`sidecar.rls.h2.calls`), write back-pressure, and graceful
shutdown.

Methods are looked up by `:path`; an unknown path is answered UNIMPLEMENTED. Every call is
answered through a callback (`CallbackMethod`, the hot path's form); a coroutine method is
turned into one when the server is made (`H2Server.driven`: its coroutine is stepped by
`Calls`, with no Task). A method's CallError becomes its status; any other exception is a bug,
answered INTERNAL and logged.

Shutdown follows RFC 9113 §6.8: GOAWAY with the largest stream id and a PING, then, once the
PING comes back (or after SHUTDOWN_PING_TIMEOUT), GOAWAY with the last stream taken. Calls
taken are answered; the connection closes when none is left, or when the grace period ends.
Over TLS (`listen(tls=...)`, the event loop's own SSL support) the handshake is bounded by the
same HANDSHAKE_TIMEOUT as the HTTP/2 preface that follows it, and a connection counts toward
MAX_CONNECTIONS from the end of its handshake, when `admit` (if given) decides whether its
peer may stay. A Unix socket's file is removed on the way out only if it is still this server's: a
replacement started on the same path has put its own there.

Bounds across connections: at most MAX_CONNECTIONS open (one more is closed at once); request
bodies buffered by all of them within `Limits.max_buffered_bytes_all` (given back when a
connection closes); calls in flight over all connections: at MAX_CALLS_IN_FLIGHT no call is
started, what connections send is put aside (within the same budget; past it they stop reading
and TCP holds the clients) until the calls in flight are down to RESUME_CALLS_IN_FLIGHT, then
started, the connections taking their turns oldest first (`H2Server._round`). A
connection whose read holds more than `Limits.max_calls_per_read` calls has the rest started on
the next turns of the loop, and stops reading meanwhile, so one busy connection cannot hold the
others' calls for a whole read. A connection that has sent
nothing for FRAME_TIMEOUT in the middle of something (a frame, a header block, a request body),
or nothing at all for IDLE_TIMEOUT with no stream open, is closed (an idle one with GOAWAY
NO_ERROR first).

One module past the usual size because the bounds across connections are one state: the server
counts connections, buffered bytes and calls in flight, and each connection's protocol pauses
and resumes against those counts, so the server and its Protocol change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter
from typing import Any, Final, cast

import structlog

from sidecar.loop import batching
from sidecar.rls.h2.calls import Calls
from sidecar.rls.h2.connection import DEFAULT_LIMITS, Connection, Limits
from sidecar.rls.h2.streams import BufferBudget
from sidecar.rls.h2.unary import Answer, CallbackMethod, CallError, Method, Status

#: Seconds to wait for the PING ACK between the two GOAWAY frames of a shutdown.
SHUTDOWN_PING_TIMEOUT: Final = 1.0
#: Seconds a new connection has to finish its TLS handshake, if any, and again to send its
#: preface and SETTINGS, before it is closed.
HANDSHAKE_TIMEOUT: Final = 10.0
#: Pending connections the kernel queues per listening socket.
BACKLOG: Final = 1_024
#: Open connections at most: a sidecar has its Envoy's few, a shared deployment a few per
#: Envoy; each costs about 10 KB idle, so this bounds idle connections to tens of MB.
MAX_CONNECTIONS: Final = 4_096
#: Calls in flight over all connections at which no more are started, and the number they
#: must come down to before what was put aside meanwhile is started. What a call waits for in a
#: flood is about the calls ahead of it: on this 2-core machine (compiled, a 1,000-connection
#: h2load flood, `make chaos`'s overload probe, 5 runs each) a legitimate client's p99 was
#: 30-40 ms at 512/256, 19-23 ms at 256/128 and 16-18 ms at 128/64, with the same flood decided
#: (180k-235k calls in 3 s) and none shed. Redis stays busy while the calls in flight cover its
#: round trip: 128 calls at the sidecar's ~60k calls/s is 2 ms, a Redis in the same zone;
#: past that round trip the bound, not the sidecar, sets the throughput (128-256 / RTT).
MAX_CALLS_IN_FLIGHT: Final = 256
RESUME_CALLS_IN_FLIGHT: Final = 128
#: Seconds between two looks at every connection for the timeouts below.
SWEEP_INTERVAL: Final = 5.0
#: A connection that sends nothing for this long in the middle of a frame, a header block or a
#: request body is closed (Envoy's stream_idle_timeout is 5 minutes for whole streams; a unary
#: request is sent at once, so a pause of seconds inside one is an attack or a dead peer).
FRAME_TIMEOUT: Final = 10.0
#: A connection with no stream open and nothing read for this long is closed (Envoy opens a
#: new one when it needs one).
IDLE_TIMEOUT: Final = 600.0

log = structlog.get_logger("sidecar.rls.h2")

#: Answers a CallbackMethod's `errors` leaves alone (a tuple: `bytes | CallError` is built anew
#: at every call).
_AS_THEY_ARE: Final = (bytes, CallError)


class H2Server:
    """Serves `methods` ({":path": method}) on any number of listening sockets."""

    def __init__(
        self,
        methods: Mapping[str, Method | CallbackMethod],
        limits: Limits = DEFAULT_LIMITS,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_calls_in_flight: int = MAX_CALLS_IN_FLIGHT,
        resume_calls_in_flight: int = RESUME_CALLS_IN_FLIGHT,
        sweep_interval: float = SWEEP_INTERVAL,
        frame_timeout: float = FRAME_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        admit: Callable[[asyncio.BaseTransport], bool] | None = None,
        kept_fields: frozenset[bytes] = frozenset(),
    ) -> None:
        """`admit`, when given, sees every connection as it is made (over TLS: its handshake
        done) and closes it by answering False. With `kept_fields` (request field names, lower
        case), `request_fields` holds those of the call being started, as a method starts."""
        self.calls = Calls()
        #: Every method in the callback form.
        self.methods = {
            path: method if isinstance(method, CallbackMethod) else self.driven(method)
            for path, method in methods.items()
        }
        self.limits = limits
        self.max_connections = max_connections
        self.max_calls_in_flight = max_calls_in_flight
        self.resume_calls_in_flight = resume_calls_in_flight
        self.sweep_interval = sweep_interval
        self.frame_timeout = frame_timeout
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.admit = admit
        self.kept_fields = kept_fields
        self.request_fields: tuple[tuple[bytes, bytes], ...] = ()
        self.stopping = False
        self.protocols: set[_Protocol] = set()
        #: Request bytes buffered by all connections (Limits.max_buffered_bytes_all).
        self.budget = BufferBudget(limits.max_buffered_bytes_all)
        #: Connections waiting for the calls in flight to come down (see `_round`).
        self.held: dict[_Protocol, None] = {}
        #: The same as a heap by age (`serial`), with entries of connections closed meanwhile.
        self._held_order: list[tuple[int, _Protocol]] = []
        #: A round of turns is due or running (`calls_answered` to `_round`): a read meanwhile
        #: waits behind the held connections.
        self.resuming = False
        self.accepted = 0  # connections so far: each one's `serial`, its age
        self._refusing = False  # at MAX_CONNECTIONS (said once per episode)
        self._sweeper: asyncio.TimerHandle | None = None
        self._listeners: list[asyncio.Server] = []
        self._unix_paths: list[tuple[str, SocketFile]] = []

    async def listen(
        self,
        address: str,
        *,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> int:
        """Listen on `HOST:PORT` or `unix:PATH` (or on `sock`), over TLS with `tls`; returns the
        TCP port, else 0."""
        loop = asyncio.get_running_loop()
        path = unix_path(address)
        options: dict[str, Any] = {"backlog": BACKLOG}
        if tls is not None:
            options.update(ssl=tls, ssl_handshake_timeout=self.handshake_timeout)
        try:
            if sock is not None and sock.family == socket.AF_UNIX:
                listener = await loop.create_unix_server(self._protocol, sock=sock, **options)
            elif sock is not None:
                listener = await loop.create_server(self._protocol, sock=sock, **options)
            elif path is not None:
                listener = await loop.create_unix_server(self._protocol, path, **options)
                self._unix_paths.append((path, socket_file(path)))
            else:
                host, _, port = address.rpartition(":")
                listener = await loop.create_server(
                    self._protocol,
                    host.strip("[]") or None,
                    int(port),
                    reuse_port=reuse_port,
                    **options,
                )
        except OSError as exc:
            raise OSError(f"cannot listen for gRPC on {address}: {exc.strerror or exc}") from exc
        self._listeners.append(listener)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.sweep_interval, self._sweep)
        # Any: `sockets` is a list on uvloop where the stubs say tuple, and the compiled build
        # checks what a value's declared type says (sidecar.build).
        sockets = cast(Any, listener).sockets
        bound = sockets[0].getsockname()
        return bound[1] if isinstance(bound, tuple) else 0

    def _protocol(self) -> _Protocol:
        return _Protocol(self)

    def _sweep(self) -> None:
        """Close the connections stuck mid-frame or idle too long (see the timeouts)."""
        self._sweeper = asyncio.get_running_loop().call_later(self.sweep_interval, self._sweep)
        for protocol in list(self.protocols):
            protocol.sweep()

    def calls_answered(self) -> None:
        """A call answered: below RESUME_CALLS_IN_FLIGHT, a round of turns is due (`_round`),
        run a turn of the loop later, outside the answer's callback; every read meanwhile
        waits behind the held connections."""
        if self.held and not self.resuming and self.in_flight() <= self.resume_calls_in_flight:
            self.resuming = True
            asyncio.get_running_loop().call_soon(self._round)

    def _round(self) -> None:
        """The held connections take their turns, oldest connection first, until the calls in
        flight are back at the bound; the others keep their places for the next round.

        Oldest first: a gateway's connections to its sidecar are made once and kept, so a
        flood of new connections, however many, cannot push an established client back; and
        a held connection keeps its place from round to round. Ordering by calls in flight or
        by time held did not: a client sending more than each flood connection was pushed back
        by those that read in the same turn as a round, every round, until the flood ended.

        Only the connections whose turn it is are touched. Letting every held connection go
        each round, to be held again as the bound filled, cost a callback per held connection
        per round (hundreds in a flood), which made a lower bound cost throughput. Each turn's
        calls go to Redis as that turn's batch, as a read's do: one batch for the whole round
        would be sent to one Redis connection, past its share of calls waiting (refused as
        Overloaded).
        """
        held, order = self.held, self._held_order
        try:
            while held and not self.too_many_calls():
                protocol = heapq.heappop(order)[1]
                if protocol not in held:
                    continue  # closed while held
                del held[protocol]
                try:
                    protocol.take_turn()
                except Exception as exc:  # a bug: that connection goes, the round goes on
                    log.exception("turn_failed", error=repr(exc))
                    protocol.abort()
        finally:
            if not held:
                order.clear()
            self.resuming = False
        if held:
            self.calls_answered()  # the turns started no call: the next round now

    def hold(self, protocol: _Protocol) -> None:
        """`protocol` waits for a round (`_round`), in its place by age."""
        self.held[protocol] = None
        heapq.heappush(self._held_order, (protocol.serial, protocol))
        self._compact()

    def drop(self, protocol: _Protocol) -> None:
        """`protocol`'s connection is gone: it waits no more."""
        if protocol in self.held:
            del self.held[protocol]
            self._compact()

    def _compact(self) -> None:
        """Entries of connections closed while held stay in the heap until popped; past twice
        the held connections plus 64 it is built again from them, so it never holds more
        (each rebuild paid for by as many closes or holds)."""
        held, order = self.held, self._held_order
        if len(order) > 2 * len(held) + 64:
            order[:] = [(each.serial, each) for each in held]
            heapq.heapify(order)

    def in_flight(self) -> int:
        """Calls started and not answered yet, over all connections."""
        return self.calls.answering

    def too_many_calls(self) -> bool:
        return self.calls.answering >= self.max_calls_in_flight

    def driven(self, method: Method) -> CallbackMethod:
        """A coroutine method in the callback form: each call's coroutine is started at once
        and stepped by `calls` (no Task), and answers when it returns or raises."""
        calls = self.calls

        def handle(message: bytes, answer: Answer) -> None:
            calls.start(_answer_when_done(method(message), answer))

        return CallbackMethod(handle)

    async def stop(self, grace: float) -> None:
        """Take no new connection, drain the open ones, and give calls `grace` seconds."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for listener in self._listeners:
            listener.close()
        for protocol in list(self.protocols):
            protocol.shut_down()
        waiting = [protocol.finished for protocol in self.protocols] + [self.calls.idle()]
        await asyncio.wait(waiting, timeout=grace)
        for protocol in list(self.protocols):
            protocol.abort()
        self.calls.cancel_all()
        await self.calls.idle()
        for listener in self._listeners:
            await listener.wait_closed()
        self._listeners.clear()
        for path, bound in self._unix_paths:
            unlink_socket(path, bound)
        self._unix_paths.clear()


async def _answer_when_done(call: Awaitable[bytes], answer: Answer) -> None:
    """Hand `answer` what a coroutine method's call ends with: its response or its exception.
    Cancelled (by a stop whose grace has run out, the connection already gone), it answers
    CANCELLED, so that the call is counted as answered."""
    try:
        response = await call
    except asyncio.CancelledError:
        answer(CallError(Status.CANCELLED, "the server stopped"))
        raise
    except Exception as exc:
        answer(exc)
        return
    answer(response)


def unix_path(address: str) -> str | None:
    """The socket path of a gRPC-style `unix:PATH` or `unix:///ABSOLUTE/PATH`; None for TCP."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None


#: What tells one socket file from another at the same path: its device and inode.
SocketFile = tuple[int, int]


def socket_file(path: str) -> SocketFile:
    """The file a Unix socket was just bound to, to recognise it when it is time to remove it."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


def unlink_socket(path: str, bound: SocketFile) -> None:
    """Remove the socket file at `path` if it is still the one bound (`socket_file`).

    A replacement started on the same path before this server stopped has removed that file
    and bound a new one (as asyncio and `serve --workers` do with a socket file they find):
    unlinking it would leave the replacement listening on a socket nobody can reach.
    """
    with contextlib.suppress(OSError):
        if socket_file(path) == bound:
            os.unlink(path)


class _Protocol(asyncio.Protocol):
    """One connection: feeds bytes to its Connection and writes what it answers."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        server.accepted += 1
        self.serial = server.accepted
        self.methods = server.methods
        self.loop = asyncio.get_running_loop()
        # Without kept fields (no tracing), calls go straight to _on_call: nothing per call.
        on_call = self._on_call_with_fields if server.kept_fields else self._on_call
        self.conn = Connection(on_call, server.limits, server.budget, server.kept_fields)
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self._flush_scheduled = False
        # Why reading is paused, if it is: the peer not reading our answers, the server's calls
        # in flight, calls of a read left for the next turn. It resumes when none is left.
        self._writing_paused = False
        self._held = False
        self._backlogged = False
        self.reads = 0  # reads so far, and as the last sweep saw them
        self._swept_reads = 0
        self._quiet_sweeps = 0
        self._shutdown_timer: asyncio.TimerHandle | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods without being its subclasses.
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if len(server.protocols) >= server.max_connections:
            if not server._refusing:
                server._refusing = True
                log.warning("too_many_connections", limit=server.max_connections)
            self.transport.abort()
            return
        server._refusing = False
        if server.admit is not None and not server.admit(transport):
            self.transport.abort()
            return
        server.protocols.add(self)
        self.conn.initiate()
        self._handshake_timer = self.loop.call_later(
            server.handshake_timeout, self._handshake_expired
        )
        if self.server.stopping:
            self.conn.start_shutdown()
            self.conn.finish_shutdown()
        self._flush()

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        server = self.server
        if (server.held or server.resuming or server.too_many_calls()) and self.conn.stash(data):
            # As many calls in flight as the server takes, or connections waiting for them to
            # come down: this read waits, put aside (within the budget of buffered bytes), for
            # its turn; the connection goes on reading into it, so that what waits is taken in
            # the server's order (`_round`), not in the order the sockets happen to be
            # polled. Past the budget it stops reading.
            self._hold(pause=False)
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Start the calls of `data` and of what waited before it, and write what they answer."""
        conn = self.conn
        # What the calls of this read answered and sent to Redis leaves as the read ends (see
        # batching), before the loop polls again; the write below takes what is left.
        held = batching.begin()
        try:
            conn.receive(data)
        finally:
            if held:
                batching.end()
        out = conn.data_to_send()
        transport = self.transport
        assert transport is not None
        if out:
            transport.write(out)
        if conn.done:
            transport.close()
        elif conn.backlog or self.server.too_many_calls():
            self._pause_after_read()

    def _pause_after_read(self) -> None:
        """Stop reading: the read left calls for the next turn, or the server has as many calls
        in flight as it takes."""
        transport = self.transport
        assert transport is not None
        if self.conn.backlog and not self._backlogged:
            self._backlogged = True
            self.loop.call_soon(self._go_on)
        if self.server.too_many_calls():
            self._hold()
        transport.pause_reading()

    def _hold(self, pause: bool = True) -> None:
        """Wait for the server's calls in flight to come down (`take_turn`); with `pause`, stop
        reading meanwhile."""
        if not self._held:
            self._held = True
            self.server.hold(self)
        if pause and self.transport is not None:
            self.transport.pause_reading()

    def _go_on(self) -> None:
        """Start the calls a read left for later (a turn of the loop after it)."""
        self._backlogged = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.server.too_many_calls():
            self._hold(pause=False)  # what waits stays put aside, for the next round
        else:
            self._take(b"")
        if not self._backlogged:
            self._resume_if_free()

    def take_turn(self) -> None:
        """The server's round (`H2Server._round`): start what was put aside (up to a read's
        bound of calls; the rest on the next turns of the loop), and read again once nothing
        is left."""
        self._held = False
        if self._backlogged:
            return  # its `_go_on` is queued and takes it
        if self.conn.unread:
            self._go_on()
        else:
            self._resume_if_free()

    def _resume_if_free(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not (self._writing_paused or self._held or self._backlogged):
            transport.resume_reading()

    def sweep(self) -> None:
        """Every SWEEP_INTERVAL: close the connection if it has been stuck mid-frame for
        FRAME_TIMEOUT in the middle of something, or idle (nothing open, nothing read) for
        IDLE_TIMEOUT."""
        if self.reads != self._swept_reads:
            self._swept_reads, self._quiet_sweeps = self.reads, 0
            return
        if self._writing_paused or self._held or self._backlogged:
            return  # quiet because we stopped reading, not the peer
        self._quiet_sweeps += 1
        server = self.server
        quiet = self._quiet_sweeps * server.sweep_interval
        conn = self.conn
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if quiet >= server.frame_timeout and conn.unfinished:
            transport.abort()
        elif not conn.streams and not conn.calls and quiet >= server.idle_timeout:
            conn.finish_shutdown()
            self._flush()
            transport.close()

    def eof_received(self) -> bool:
        return False  # a peer that stops sending is gone: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.release()  # answers still on their way are dropped; bodies given back
        self.server.protocols.discard(self)
        self.server.drop(self)
        for timer in (self._shutdown_timer, self._handshake_timer):
            if timer is not None:
                timer.cancel()
        if not self.finished.done():
            self.finished.set_result(None)

    def pause_writing(self) -> None:
        # The peer is not reading: stop reading too, so its requests cannot grow our buffers.
        self._writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._resume_if_free()

    def _handshake_expired(self) -> None:
        # A socket that never speaks HTTP/2 must not hold a connection forever.
        if not self.conn.settings_received and self.transport is not None:
            self.transport.close()

    def shut_down(self) -> None:
        self.conn.start_shutdown()
        self._flush()
        self._shutdown_timer = self.loop.call_later(SHUTDOWN_PING_TIMEOUT, self._finish_shutdown)

    def _finish_shutdown(self) -> None:
        self.conn.finish_shutdown()
        self._flush()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _on_call_with_fields(self, stream_id: int, path: str, message: bytes) -> None:
        stream = self.conn.streams.get(stream_id)
        self.server.request_fields = () if stream is None else stream.head.kept
        self._on_call(stream_id, path, message)

    def _on_call(self, stream_id: int, path: str, message: bytes) -> None:
        method = self.methods.get(path)
        if method is None:
            self.conn.respond_error(stream_id, Status.UNIMPLEMENTED, f"unknown method {path}")
            return
        self.server.calls.opened()
        answer = _Answer(self, stream_id, path, method, perf_counter())
        try:
            method.handle(message, answer)
        except Exception as exc:
            answer(exc)

    def _answer(self, stream_id: int, path: str, result: bytes | Exception) -> None:
        """Answer a call with its response, or the status its exception stands for."""
        if isinstance(result, bytes):
            self.conn.respond(stream_id, result)
        elif isinstance(result, CallError):
            self.conn.respond_error(stream_id, result.status, result.message)
        else:
            log.error("unexpected_error", method=path, error=repr(result), exc_info=result)
            self.conn.respond_error(
                stream_id, Status.INTERNAL, f"internal error: {type(result).__name__}: {result}"
            )
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if not batching.defer(self._flush):
                self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what the connection queued; close it once it has nothing left to do."""
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        out = self.conn.data_to_send()
        if out:
            transport.write(out)
        if self.conn.done:
            transport.close()


class _Answer:
    """How one call answers: the `answer` its method's `handle` is given (see `CallbackMethod`).

    The first answer counts the call as answered, times it, turns an exception into its
    status (the method's `errors`) and queues the response on the connection; a second is
    ignored. An object rather than a closure: compiled, a closure and its environment refer
    to each other, so every call left a cycle of two objects, holding whatever the call held
    until the collector came (see `sidecar.decision.limiter._Waiting`).
    """

    __slots__ = ("answered", "method", "path", "protocol", "started", "stream_id")

    def __init__(
        self,
        protocol: _Protocol,
        stream_id: int,
        path: str,
        method: CallbackMethod,
        started: float,
    ) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.path = path
        self.method = method
        self.started = started
        self.answered = False

    def __call__(self, result: bytes | Exception) -> None:
        if self.answered:
            return
        self.answered = True
        protocol = self.protocol
        server = protocol.server
        server.calls.answered()
        if server.held:
            server.calls_answered()
        method = self.method
        if method.observe is not None:
            method.observe(perf_counter() - self.started)
        errors = method.errors
        if errors is not None and not isinstance(result, _AS_THEY_ARE):
            result = errors(result)
        protocol._answer(self.stream_id, self.path, result)
