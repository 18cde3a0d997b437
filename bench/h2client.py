"""A lean HTTP/2 client that sends pre-serialized `ShouldRateLimit` calls, flat out or at a fixed
rate, and times each one: the load generator of bench/distinct.py.

h2load sends one body again and again; Python's h2 state machine costs more per call than the
servers it would measure. This client does only what a unary gRPC call needs. The request's
header block is encoded once (HPACK literals without indexing, so it depends on no table and
every stream reuses the same bytes); a call is one HEADERS and one DATA(END_STREAM) frame
carrying a body framed in advance. Responses are read just enough to see each stream end and
its grpc-status: the HEADERS that ends the stream (trailers after DATA, or trailers-only), an
RST_STREAM, or a GOAWAY past the stream. It honours the server's SETTINGS (concurrent streams,
initial window, frame size) and WINDOW_UPDATEs, answers PINGs, and opens its own receive
windows wide (a WINDOW_UPDATE whenever half the connection window is used).

Two modes (`Pace`):

- flat out (`rate` None): `connections` x `streams` calls in flight, each answer sending the
  next body;
- fixed rate: an open-loop schedule, call i due at start + i / rate, spread round robin over the
  connections, whether or not earlier calls were answered. Its latency runs from the time the
  call was due, not from when it left: a server that stalls makes the calls behind the stall
  late, and they count against it (no coordinated omission, which h2load --rps and wrk have).
  The generator's own lateness (sent minus due) is kept apart as `lag`, so a late generator
  shows as such.

Bounds: calls in flight per connection at most the server's MAX_CONCURRENT_STREAMS and
`streams` (past them, due calls wait in the connection's queue, their wait counted); one memo
of decoded header blocks per connection (MEMO_SIZE entries, emptied when full); every call of
a run is answered or counted as unanswered after `timeout` seconds.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import selectors
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc
import hpack
from hpack.hpack import encode_integer

from sidecar.rls.h2 import frames

PATH = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
#: gRPC status codes by number, for the report.
GRPC_STATUS = {code.value[0]: code.name for code in grpc.StatusCode}
#: Decoded response blocks kept per connection: a server sends a handful of distinct blocks.
MEMO_SIZE = 64
#: The receive window we announce, per stream and for the connection.
WINDOW = frames.MAX_WINDOW

_HEADER = frames.HEADER
_STATIC_NAMES = {b":authority": 1, b":method": 2, b":path": 4, b":scheme": 6}


def header_block(authority: str, path: bytes = PATH) -> bytes:
    """The request's header block: every field a literal without indexing (§6.2.2), the
    pseudo-headers' names by their static table index, no Huffman coding."""
    fields = (
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", authority.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    )
    block = bytearray()
    for name, value in fields:
        index = _STATIC_NAMES.get(name)
        block += (
            encode_integer(index, 4) if index else b"\x00" + encode_integer(len(name), 7) + name
        )
        block += encode_integer(len(value), 7) + value
    return bytes(block)


@dataclass
class Tally:
    """What one run measured: per-call latency (µs, from due or sent), outcomes by name, and
    in fixed-rate mode the generator's lag (µs, sent minus due)."""

    latencies_us: list[int] = field(default_factory=list)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    lags_us: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def calls(self) -> int:
        return sum(self.outcomes.values())


@dataclass(frozen=True)
class Pace:
    """How the calls go out: `connections` x `streams` in flight, at `rate` calls/s or flat out."""

    connections: int = 4
    streams: int = 8
    rate: float | None = None
    #: Seconds to wait for the last answers once every call is sent; the rest count unanswered.
    timeout: float = 10.0


class _Run:
    """The calls of one run, shared by its connections."""

    def __init__(self, bodies: Sequence[bytes], pace: Pace) -> None:
        self.bodies = bodies
        self.pace = pace
        self.next = 0  # the next body to send
        self.done = 0
        self.tally = Tally()
        self.finished = asyncio.get_running_loop().create_future()

    def answered(self, started: float, outcome: str) -> None:
        self.tally.latencies_us.append(int((time.perf_counter() - started) * 1e6))
        self.tally.outcomes[outcome] += 1
        self.done += 1
        if self.done == len(self.bodies) and not self.finished.done():
            self.finished.set_result(None)


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection of a run."""

    def __init__(self, run: _Run, block: bytes) -> None:
        self.run = run
        self.block = block
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.out: list[bytes] = []
        self.buffer = b""
        self.next_stream = 1
        self.started: dict[int, float] = {}  # stream id -> due (fixed rate) or sent (flat out)
        self.queue: collections.deque[tuple[bytes, float]] = collections.deque()
        self.max_streams = run.pace.streams
        self.send_window = frames.DEFAULT_WINDOW
        self.stream_window = frames.DEFAULT_WINDOW
        self.max_frame = frames.DEFAULT_MAX_FRAME_SIZE
        self.received = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self.decoder = hpack.Decoder()
        self.memo: dict[bytes, tuple[int | None, int | None]] = {}
        self.status: dict[int, int] = {}  # streams whose response headers were not :status 200
        self.partial: tuple[int, int, bytes] | None = None  # stream, flags, block so far
        self.closed = False

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(
            frames.PREFACE
            + frames.settings({frames.ENABLE_PUSH: 0, frames.INITIAL_WINDOW_SIZE: WINDOW})
            + frames.window_update(0, WINDOW - frames.DEFAULT_WINDOW)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.fail_all("connection lost")
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"connection lost before SETTINGS: {exc}"))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        at, end = 0, len(buffer)
        while end - at >= 9:
            high, low, kind, flags, stream_id = _HEADER.unpack_from(buffer, at)
            size = high << 16 | low
            if end - at - 9 < size:
                break
            payload = buffer[at + 9 : at + 9 + size]
            at += 9 + size
            self._frame(kind, flags, stream_id & frames.MAX_STREAM_ID, payload)
        self.buffer = buffer[at:]
        self.pump()
        self.flush()

    # --- sending ---

    def submit(self, body: bytes, started: float) -> None:
        """Send one call now if the server's limits allow, else queue it (its clock running)."""
        if self.queue or not self._can_send(body):
            self.queue.append((body, started))
        else:
            self._send(body, started)

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def _can_send(self, body: bytes) -> bool:
        return (
            not self.closed
            and len(self.started) < self.max_streams
            and len(body) <= self.send_window
            and len(body) <= self.stream_window
        )

    def _send(self, body: bytes, started: float) -> None:
        stream_id = self.next_stream
        if stream_id > frames.MAX_STREAM_ID:
            raise RuntimeError("stream ids exhausted on one connection")
        self.next_stream += 2
        self.send_window -= len(body)
        self.started[stream_id] = started
        self.out.append(frames.frame(frames.HEADERS, frames.END_HEADERS, stream_id, self.block))
        self.out.append(frames.frame(frames.DATA, frames.END_STREAM, stream_id, body))

    def pump(self) -> None:
        """Send what the server's limits now allow: the queue first, then (flat out) the run's
        next bodies."""
        run = self.run
        while self.queue and self._can_send(self.queue[0][0]):
            self._send(*self.queue.popleft())
        if run.pace.rate is None:  # flat out: every free stream takes the next body
            while run.next < len(run.bodies) and self._can_send(run.bodies[run.next]):
                self._send(run.bodies[run.next], time.perf_counter())
                run.next += 1

    # --- receiving ---

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == frames.HEADERS:
            block, _ = frames.header_block(payload, flags)
            if flags & frames.END_HEADERS:
                self._headers(stream_id, flags, block)
            else:
                self.partial = (stream_id, flags, block)
        elif kind == frames.DATA:
            self.received += len(payload)
            if self.received >= WINDOW // 2:
                self.out.append(frames.window_update(0, self.received))
                self.received = 0
            if flags & frames.END_STREAM:
                self._end(stream_id, "no trailers")
        elif kind == frames.CONTINUATION and self.partial is not None:
            first_id, first_flags, block = self.partial
            self.partial = None
            if flags & frames.END_HEADERS:
                self._headers(first_id, first_flags, block + payload)
            else:
                self.partial = (first_id, first_flags, block + payload)
        elif kind == frames.RST_STREAM:
            self._end(stream_id, f"RST_STREAM {frames.ErrorCode(frames.u32(payload)).name}")
        elif kind == frames.SETTINGS and not flags & frames.ACK:
            self._settings(payload)
        elif kind == frames.PING and not flags & frames.ACK:
            self.out.append(frames.ping(payload, ack=True))
        elif kind == frames.WINDOW_UPDATE and stream_id == 0:
            self.send_window += frames.u32(payload) & frames.MAX_STREAM_ID
        elif kind == frames.GOAWAY:
            last = frames.u32(payload) & frames.MAX_STREAM_ID
            self.closed = True
            for pending in [s for s in self.started if s > last]:
                self._end(pending, "GOAWAY")
            self._fail_queue("GOAWAY")

    def _settings(self, payload: bytes) -> None:
        for setting, value in frames.settings_values(payload):
            if setting == frames.MAX_CONCURRENT_STREAMS:
                self.max_streams = min(self.run.pace.streams, value)
            elif setting == frames.INITIAL_WINDOW_SIZE:
                self.stream_window = value
            elif setting == frames.MAX_FRAME_SIZE:
                self.max_frame = value
        if len(self.block) > self.max_frame:
            raise RuntimeError(f"header block of {len(self.block)} bytes over MAX_FRAME_SIZE")
        self.out.append(frames.SETTINGS_ACK)
        if not self.ready.done():
            self.ready.set_result(None)

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        http_status, grpc_status = self._decode(block)
        if http_status is not None and http_status != 200:
            self.status[stream_id] = http_status
        if not flags & frames.END_STREAM:
            return
        bad_http = self.status.pop(stream_id, None)
        if bad_http is not None:
            outcome = f"HTTP {bad_http}"
        elif grpc_status is None:
            outcome = "no grpc-status"
        else:
            outcome = GRPC_STATUS.get(grpc_status, f"grpc-status {grpc_status}")
        self._end(stream_id, outcome)

    def _decode(self, block: bytes) -> tuple[int | None, int | None]:
        """:status and grpc-status of a block. A block's meaning is kept by its bytes only while
        the decoder's dynamic table is as it was: a block that changed it empties the memo."""
        known = self.memo.get(block)
        if known is not None:
            return known
        before = self._table_state()
        http_status = grpc_status = None
        for name, value in self.decoder.decode(block, raw=True):
            if name == b":status":
                http_status = int(value)
            elif name == b"grpc-status":
                grpc_status = int(value)
        after = self._table_state()
        if before != after or len(self.memo) >= MEMO_SIZE:
            self.memo.clear()
        if before == after:
            self.memo[block] = (http_status, grpc_status)
        return http_status, grpc_status

    def _table_state(self) -> tuple[int, object]:
        """What changes whenever a block inserts into the dynamic table: an insertion puts a new
        entry first."""
        entries = self.decoder.header_table.dynamic_entries
        return len(entries), entries[0] if entries else None

    def _end(self, stream_id: int, outcome: str) -> None:
        self.status.pop(stream_id, None)
        started = self.started.pop(stream_id, None)
        if started is not None:
            self.run.answered(started, outcome)

    def fail_all(self, outcome: str) -> None:
        """Count every call in flight or queued on this connection as `outcome`."""
        for stream_id in list(self.started):
            self._end(stream_id, outcome)
        self._fail_queue(outcome)

    def _fail_queue(self, outcome: str) -> None:
        while self.queue:
            _body, started = self.queue.popleft()
            self.run.answered(started, outcome)


def event_loop() -> asyncio.AbstractEventLoop:
    """asyncio's loop on select(2), whose timeout is in microseconds: a fixed-rate call due in
    0.1 ms goes out then. epoll's timeout is in milliseconds (asyncio's default loop waits a
    whole one, about 0.5 ms late on average) and uvloop's timers round to milliseconds too. A
    run has a few sockets, far below select's FD_SETSIZE."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


async def run(
    host: str, port: int, bodies: Sequence[bytes], pace: Pace, path: bytes = PATH
) -> Tally:
    """Send every body in `bodies` to host:port as a call of `path` (ShouldRateLimit unless
    told otherwise), as `pace` says.

    Run it on `event_loop()`'s loop. The collector is off during the run (what the run allocates is freed by reference counting;
    the bodies are frozen out of its sight), so the generator's own pauses do not land on the
    server's latency.
    """
    loop = asyncio.get_running_loop()
    gc.collect()
    gc.freeze()
    gc.disable()
    calls = _Run(bodies, pace)
    block = header_block(f"{host}:{port}", path)
    connections: list[_Connection] = []
    try:
        for _ in range(pace.connections):
            _transport, connection = await loop.create_connection(
                lambda: _Connection(calls, block), host, port
            )
            connections.append(connection)
        await asyncio.gather(*(connection.ready for connection in connections))
        start = time.perf_counter()
        if pace.rate is None:
            for connection in connections:
                connection.pump()
                connection.flush()
        else:
            _Schedule(calls, connections, pace.rate, start).tick()
        await _finished(calls, connections, pace.timeout)
        calls.tally.seconds = time.perf_counter() - start
    finally:
        gc.enable()
        gc.unfreeze()
        for connection in connections:
            if connection.transport is not None:
                connection.transport.close()
    return calls.tally


async def _finished(calls: _Run, connections: list[_Connection], timeout: float) -> None:
    """Until every call is answered, or `timeout` seconds after the last was due; what is left
    then counts as unanswered."""
    while not calls.finished.done():
        sent = calls.next
        done = calls.done
        try:
            await asyncio.wait_for(asyncio.shield(calls.finished), timeout)
        except TimeoutError:
            if calls.next == sent and calls.done == done:  # no progress in `timeout` seconds
                for connection in connections:
                    connection.fail_all("unanswered")
                calls.tally.outcomes["unsent"] += len(calls.bodies) - calls.next
                return


class _Schedule:
    """The fixed-rate sender: every call due by now goes out, round robin over the
    connections, then a timer for the next one."""

    def __init__(
        self, calls: _Run, connections: list[_Connection], rate: float, start: float
    ) -> None:
        self.calls, self.connections, self.rate, self.start = calls, connections, rate, start
        self.loop = asyncio.get_running_loop()

    def tick(self) -> None:
        calls, connections = self.calls, self.connections
        now = time.perf_counter()
        due = min(len(calls.bodies), int((now - self.start) * self.rate) + 1)
        lags = calls.tally.lags_us
        count = len(connections)
        while calls.next < due:
            index = calls.next
            scheduled = self.start + index / self.rate
            lags.append(int((now - scheduled) * 1e6))
            connections[index % count].submit(calls.bodies[index], scheduled)
            calls.next += 1
        for connection in connections:
            connection.flush()
        if calls.next < len(calls.bodies):
            wake = self.start + calls.next / self.rate
            self.loop.call_later(max(0.0, wake - time.perf_counter()), self.tick)
