"""A lean Redis client for the hot path: every command issued in one event-loop tick leaves in one
write on one connection, and replies are matched to callers in order.

redis-py spends more CPU per call than the whole decision (a connection checked out of a pool per
call, commands packed in Python, a task per call in places). Here a call packs its command with
hiredis's C packer, appends it to the tick's buffer and waits on a future; the buffer is written
once at the end of the tick, and `data_received` feeds hiredis's reader and resolves the futures
first in, first out. No task is created per call.

Deadlines are the caller's (`asyncio.timeout` around `execute`): a call that gives up leaves its
future cancelled, and its reply, when it comes, is dropped without disturbing the order. A
connection that has not answered anything for a whole deadline while calls wait is closed, so a
hung server fails fast instead of piling up calls. A lost connection fails every waiting call;
the next call reconnects, at most once per `RECONNECT_BACKOFF` after a failed attempt (calls in
between fail at once, so the failure mode answers without waiting). AUTH and SELECT run first on
every new connection; TLS is the event loop's.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable
from typing import Any

import hiredis

#: After a failed connection attempt, calls fail at once for this long before the next attempt.
RECONNECT_BACKOFF = 0.1


class RedisReplyError(Exception):
    """An error reply from Redis (`-ERR ...`, `-NOSCRIPT ...`)."""


class ConnectionLost(ConnectionError):
    """The connection closed, or could not be opened, before the reply came."""


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.reader = hiredis.Reader()
        self.last_reply = time.monotonic()
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_reply = time.monotonic()
        reader = self.reader
        reader.feed(data)
        waiters = self.waiters
        try:
            while (reply := reader.gets()) is not False:
                future = waiters.popleft()
                if not future.done():
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            # A reply nobody asked for, or bytes that are not RESP: the stream is out of step.
            self.close(ConnectionLost(f"redis protocol error: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionLost(f"connection lost: {exc}" if exc else "connection closed"))

    def fail(self, exc: Exception) -> None:
        self.lost = self.lost or exc
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
    """One pipelined connection to one Redis server (opened on first use, reopened when lost)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
        connect_timeout: float = 1.0,
    ) -> None:
        self.host = host
        self.port = port
        self._db = db
        self._username = username
        self._password = password
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._failed_at = -RECONNECT_BACKOFF
        self._buffer: list[bytes] = []
        self._flush_scheduled = False

    async def execute(self, *args: Any) -> Any:
        """Send one command and wait for its reply; error replies raise RedisReplyError."""
        return await self.execute_packed(hiredis.pack_command(args))

    async def execute_packed(self, packed: bytes) -> Any:
        """Send one command already in RESP and wait for its reply (see `execute`)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(protocol, packed, future)
        try:
            reply = await future
        except asyncio.CancelledError:
            self._check_stalled(protocol)
            raise
        if isinstance(reply, hiredis.ReplyError):
            raise RedisReplyError(str(reply))
        return reply

    def _send(self, protocol: _Protocol, packed: bytes, future: asyncio.Future[Any]) -> None:
        protocol.waiters.append(future)
        self._buffer.append(packed)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush, protocol)

    def _flush(self, protocol: _Protocol) -> None:
        self._flush_scheduled = False
        buffer, self._buffer = self._buffer, []
        if protocol.lost is None and protocol.transport is not None:
            protocol.transport.write(b"".join(buffer))

    def _check_stalled(self, protocol: _Protocol) -> None:
        """A call gave up: if the server has answered nothing for as long, drop the connection."""
        if protocol.waiters and time.monotonic() - protocol.last_reply > self._connect_timeout:
            protocol.close(ConnectionLost("no reply from redis; connection dropped"))

    async def _connect(self) -> _Protocol:
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        if time.monotonic() - self._failed_at < RECONNECT_BACKOFF:
            raise ConnectionLost(f"redis at {self.host}:{self.port} is unreachable (retrying soon)")
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            protocol = await self._open()
        except BaseException as exc:
            self._failed_at = time.monotonic()
            failure = ConnectionLost(f"cannot connect to redis at {self.host}:{self.port}: {exc!r}")
            self._connecting.set_exception(failure)
            self._connecting.exception()  # retrieved: no "never retrieved" warning if unshared
            self._connecting = None
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise failure from exc
        self._connecting.set_result(protocol)
        self._connecting = None
        self._protocol = protocol
        return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            _, protocol = await loop.create_connection(
                _Protocol,
                self.host,
                self.port,
                # Built at each connection: certificate files are read when they are needed (and
                # read again after a rotation), not when the URL is parsed.
                ssl=self._ssl() if self._ssl else None,
                server_hostname=self.host if self._ssl else None,
            )
            greetings: list[tuple[Any, ...]] = []
            if self._password is not None:
                if self._username:
                    greetings.append(("AUTH", self._username, self._password))
                else:
                    greetings.append(("AUTH", self._password))
            if self._db:
                greetings.append(("SELECT", self._db))
            for command in greetings:
                future: asyncio.Future[Any] = loop.create_future()
                protocol.waiters.append(future)
                assert protocol.transport is not None
                protocol.transport.write(hiredis.pack_command(command))
                reply = await future
                if isinstance(reply, hiredis.ReplyError):
                    protocol.close(ConnectionLost(str(reply)))
                    raise RedisReplyError(f"{command[0]}: {reply}")
        return protocol

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.fail(ConnectionLost("client closed"))
            protocol.transport.close()
            # Let the transport's close run, so no socket is left for the garbage collector.
            await asyncio.sleep(0)
