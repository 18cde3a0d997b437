"""Counters in a standalone Redis (or behind Sentinel, `sentinel.py`): one script call per request.

The script decides and increments atomically on the server, so any number of sidecars can share
the counters. A request costs one EVALSHA of `decide.lua` or, for the usual request, of
`count.lua` (`scripts.py` builds the calls and reads the replies), through the pipelined client
of `redis_client.py`.

Every call has a deadline: whatever goes wrong (refused connection, a server that never
answers, a full connection pool, an error reply) surfaces as StorageError by then, so the
service answers with its failure mode instead of making Envoy wait.

`record` runs `decide.lua` in its record mode, once per user (a batch is one hash slot); the
batches of one call run concurrently, which on a standalone Redis means one write and one round
trip.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any, Self

import hiredis

from sidecar.algorithms.decide import Address, State
from sidecar.model import Dedupe, Hit
from sidecar.storage import peers, urls, usage_reads
from sidecar.storage.base import Applied
from sidecar.storage.failures import failure, fault, gather_all
from sidecar.storage.redis_client import PipelinedRedis, RedisReplyError
from sidecar.storage.scripts import (
    MODE_ADD,
    MODE_ALL_OR_NOTHING,
    Reply,
    applied,
    apply_command,
    as_eval,
    duplicates,
    lost,
    packed_command,
    read_commands,
    read_values,
    record_commands,
    reset_commands,
    run_script,
)


class RedisBackend:
    """A standalone Redis (or any single endpoint: a proxy, a managed primary).

    Calls go through the pipelined client (`redis_client.py`): every script call of an event-loop
    tick in one write, ticks taking turns on its connections, each call's script arguments
    packed once per window (`packed_command`) and its deadline kept by the client.
    """

    name: str

    def __init__(self, client: PipelinedRedis, timeout_ms: int, name: str = "redis") -> None:
        #: "redis", or "redis-sentinel" for a master found through Sentinel (`sentinel.py`).
        self.name = name
        self._client = client
        self._timeout_ms = timeout_ms
        self._timeout = timeout_ms / 1000
        # What the last ping raised (None once one answers), for `fault`.
        self._ping_error: Exception | None = None

    @classmethod
    def from_url(cls, url: str, timeout_ms: int = 50) -> Self:
        """A backend for ``redis://[user:password@]host[:port][/db]`` or ``rediss://`` (TLS,
        with the query parameters of `sidecar.storage.urls`). Nothing connects yet."""
        location = urls.parse(url)
        if not isinstance(location, urls.RedisURL):
            raise ValueError(f"{urls.redact(url)!r}: scheme must be redis:// or rediss://")
        client = PipelinedRedis(
            location.host,
            location.port,
            db=location.db,
            username=location.username,
            password=location.password,
            ssl_context=location.tls.context if location.tls else None,
            connect_timeout=urls.timeout_seconds(url, timeout_ms),
        )
        return cls(client, timeout_ms)

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """One script call (see `Backend.apply`), its reply handed to
        `done` from the client's `data_received`, with no coroutine or future. The client keeps
        the deadline (one timer per connection, not one per call); a retry after NOSCRIPT keeps
        the same one."""
        if not hits:
            done([])
            return
        mode = MODE_ALL_OR_NOTHING if all_or_nothing else MODE_ADD
        deadline = self._client.time() + self._timeout
        replied = _Replied(self, hits, mode, now_ms, deadline, done)
        self._client.call_packed(packed_command(hits, mode, now_ms), deadline, replied)

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        """Record each batch (one user's impressions) exactly once; see `MemoryBackend.record`.

        The batches' script calls leave in one write (the pipelined client), each atomic.
        """
        if not batches:
            return []
        commands = record_commands(batches, now_ms)
        try:
            async with asyncio.timeout(self._timeout):
                replies = await gather_all(
                    _run_script(self._client, command) for command in commands
                )
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc
        return [duplicates(reply) for reply in replies]

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        """Read `addresses` (see `Backend.read`): an HMGET per hash and an MGET per slot's
        keys, sent in one write and awaited on one future (`execute_packed_many`), the deadline
        kept by the client; a gather of a task per command under `asyncio.timeout` cost a
        frequency check (three HMGETs) three more turns of the loop, and a timer."""
        if not addresses:
            return []
        commands, positions = read_commands(addresses)
        client = self._client
        try:
            replies = await client.execute_packed_many(
                [hiredis.pack_command(tuple(command)) for command in commands],
                client.time() + self._timeout,
            )
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc
        for reply in replies:
            if isinstance(reply, RedisReplyError):
                raise failure(self.name, self._timeout_ms, reply) from reply
        return read_values(len(addresses), positions, replies)

    async def reset(self, addresses: Sequence[Address]) -> int:
        """Delete `addresses` (see `Backend.reset`): a DEL per hash slot, an HDEL per hash."""
        commands = reset_commands(addresses)
        try:
            async with asyncio.timeout(self._timeout):
                replies = await gather_all(self._client.execute(*command) for command in commands)
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc
        return sum(int(reply) for reply in replies)

    async def peers(self, name: bytes) -> int:
        """Register this sidecar as `name` and count the sidecars sharing the counters
        (`sidecar.storage.peers`); raises StorageError."""
        error = functools.partial(failure, self.name, self._timeout_ms)
        return await peers.count_within(self._client.execute, name, self._timeout, error)

    async def leave(self, name: bytes) -> None:
        """Take this sidecar's name out of the count at once (a clean stop)."""
        await peers.leave_within(self._client.execute, name, self._timeout)

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Every usage count hash matching `pattern` (`sidecar.core.usage`); raises StorageError."""
        return await usage_reads.bounded(
            self.name, usage_reads.hashes(self._client.execute, pattern)
        )

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """PFCOUNT of each group of HyperLogLog keys (`sidecar.core.usage`); raises StorageError."""
        return await usage_reads.bounded(
            self.name, usage_reads.unique(self._client.execute, groups)
        )

    async def execute(self, *args: Any) -> Any:
        """Run one command on the server and return its reply (error replies raise); for the
        quota service's own keys (`sidecar.quota.store`), whose caller keeps the deadline."""
        return await self._client.execute(*args)

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self._timeout):
                answered = await self._client.execute("PING") == b"PONG"
        except Exception as exc:  # ping never raises
            self._ping_error = exc
            return False
        self._ping_error = None
        return bool(answered)

    def fault(self) -> str | None:
        """A refused password or a name that does not resolve (`failures.fault`): from the last
        connection attempt, which the client keeps through its back-off, or the last ping's
        reply (NOAUTH, when the server wants a password and none was given)."""
        if self._ping_error is None:
            return None
        server = self.name  # behind Sentinel the address is the master's, once found
        if self.name == "redis":
            server = f"redis at {self._client.host}:{self._client.port}"
        return fault(self._client.connect_error, server) or fault(self._ping_error, server)

    async def close(self) -> None:
        await self._client.close()


class _Replied:
    """What `RedisBackend.apply` hands the client to call with the script call's reply: it
    reads the reply into `done`'s outcomes, or, when the server has lost the script (NOSCRIPT,
    see `scripts.lost`), sends it again as EVAL by the same deadline and reads that reply.

    An object rather than a closure: compiled, a closure and its environment refer to each
    other, so every call left a cycle of ten objects (the call's hits and the limiter's
    `_Waiting` with them) for the collector to find (see `sidecar.decision.limiter._Waiting`).
    """

    __slots__ = ("backend", "deadline", "done", "hits", "mode", "now_ms")

    def __init__(
        self,
        backend: RedisBackend,
        hits: Sequence[Hit],
        mode: int,
        now_ms: int,
        deadline: float,
        done: Applied,
    ) -> None:
        self.backend = backend
        self.hits = hits
        self.mode = mode
        self.now_ms = now_ms
        self.deadline = deadline
        self.done = done

    def __call__(self, reply: Any) -> None:
        if lost(reply):
            # As `scripts.run_script` does, from a callback: EVAL, by the same deadline.
            command = tuple(as_eval(apply_command(self.hits, self.mode, self.now_ms)))
            self.backend._client.call_packed(
                hiredis.pack_command(command), self.deadline, self.evaluated
            )
            return
        self.evaluated(reply)

    def evaluated(self, reply: Any) -> None:
        """Read the reply of the script call (or of its EVAL after NOSCRIPT) into `done`."""
        backend = self.backend
        applied(
            backend.name, backend._timeout_ms, self.hits, self.mode, self.now_ms, reply, self.done
        )


async def _run_script(client: PipelinedRedis, command: list[Any]) -> Reply:
    """Run the script, sending its text only when the server has lost it."""
    packed = hiredis.pack_command(tuple(command))
    reply: Reply = await run_script(client.execute_packed, packed, list, command)
    return reply
