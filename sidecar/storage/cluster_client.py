"""A pipelined client of a Redis Cluster: each command goes to the master that serves its slot.

`PipelinedCluster` learns the slot map with CLUSTER SLOTS and keeps one `PipelinedRedis`
(`redis_client.py`) per master, so every master gets one write per tick (per connection) however
many calls the tick makes. A command goes to the master of its first key's slot. MOVED (the slot
has a new master) updates that slot's entry, retries there and reloads the whole map in the
background; ASK (the slot is being migrated and this key has left) sends ASKING and the command
to the named node in one write, and changes nothing in the map. A lost connection, a call that
met its deadline in silence, or a reply saying the cluster or the node cannot serve
(CLUSTERDOWN, READONLY, MASTERDOWN) reloads the map too, at most once per `REFRESH_INTERVAL`, so
a dead master costs four CLUSTER SLOTS a second, not one per call, and its replica, once
promoted, is found within a quarter of a second (at most once per interval after the previous
reload). A call's deadline (`deadline=`, the event loop's time) is kept by the masters' clients
as in `redis_client.py`, across redirections; a caller may also put `asyncio.timeout` around
calls.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from sidecar.storage.redis_client import (
    CONNECTIONS,
    ConnectionLost,
    DeadlineExceeded,
    PipelinedRedis,
    RedisReplyError,
)

#: Redirections (MOVED, ASK, TRYAGAIN) one call follows before it fails: a slot that keeps
#: moving is a cluster in trouble, and the deadline would not allow many more round trips anyway.
MAX_REDIRECTS = 5

#: The slot map is reloaded at most once per this many seconds, however many calls fail: while a
#: dead master's slots are called, the map is asked for this often, so the replica that takes
#: them over is found this soon after the cluster promotes it (a map that still names the dead
#: master is simply asked again next time). 4 a second per sidecar worker costs the cluster
#: little (CLUSTER SLOTS takes microseconds on a small cluster), as go-redis's reload pace does.
REFRESH_INTERVAL = 0.25

#: The pause before a call answered TRYAGAIN (its keys are split by a migration) is sent again.
TRYAGAIN_DELAY = 0.005

#: Error replies after which the slot map may be out of date: the cluster lost slots, or the node
#: is a replica now (a failover).
STALE_MAP = frozenset({"CLUSTERDOWN", "READONLY", "MASTERDOWN"})

_ASKING = hiredis.pack_command(("ASKING",))
_SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})


class ClusterError(Exception):
    """The cluster cannot take a call: no slot map, no master for the slot, or no end to the
    redirections."""


class PipelinedCluster:
    """Pipelined connections to every master of a Redis Cluster, each command sent to the master
    that serves its slot. Nothing connects before the first call, which loads the slot map."""

    def __init__(
        self,
        startup: Sequence[tuple[str, int]],
        *,
        username: str | None = None,
        password: str | None = None,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
        connect_timeout: float = 1.0,
        connections: int = CONNECTIONS,
    ) -> None:
        self._startup = list(startup)
        self._node_options: dict[str, Any] = {
            "connections": connections,
            "username": username,
            "password": password,
            "ssl_context": ssl_context,
            "connect_timeout": connect_timeout,
        }
        self._connect_timeout = connect_timeout
        self._slots: list[PipelinedRedis | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        # The masters of the current map (and any a MOVED named since it was loaded).
        self._nodes: dict[tuple[str, int], PipelinedRedis] = {}
        # Masters the last reload left out: closed at the next one, once no call can be on them.
        self._retired: dict[tuple[str, int], PipelinedRedis] = {}
        self._loaded = False
        self._load_error = "not loaded yet"
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -REFRESH_INTERVAL

    async def execute(self, *args: Any) -> Any:
        """Send one command to the master of its first key's slot (for a script, its first
        KEYS entry) and wait for the reply; error replies raise RedisReplyError."""
        return await self.execute_packed(key_slot(_first_key(args)), hiredis.pack_command(args))

    async def execute_packed(self, slot: int, packed: bytes, deadline: float | None = None) -> Any:
        """Send one RESP-encoded command to the master of `slot` and wait for the reply,
        following redirections; error replies raise RedisReplyError. `deadline` (the event
        loop's time): no reply by then raises DeadlineExceeded."""
        node = self._slots[slot]
        if node is None:
            if deadline is None:
                node = await self._master(slot)
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        node = await self._master(slot)
                except TimeoutError:
                    raise DeadlineExceeded("no slot map from the cluster in time") from None
        try:
            return await node.execute_packed(packed, deadline)
        except RedisReplyError as exc:
            return await self._redirected(slot, packed, node, exc, deadline)
        except (ConnectionLost, DeadlineExceeded):
            self.refresh_soon()
            raise

    async def _redirected(
        self,
        slot: int,
        packed: bytes,
        node: PipelinedRedis,
        error: RedisReplyError,
        deadline: float | None,
    ) -> Any:
        """Follow MOVED, ASK and TRYAGAIN replies, up to MAX_REDIRECTS; raise any other error."""
        asking = False
        for _ in range(MAX_REDIRECTS):
            kind, _, where = str(error).partition(" ")
            if kind == "MOVED":
                node = self._node_at(where, node)
                self._slots[slot] = node
                self.refresh_soon()
                asking = False
            elif kind == "ASK":
                node = self._node_at(where, node)
                asking = True
            elif kind == "TRYAGAIN":
                loop = asyncio.get_running_loop()
                if deadline is not None and loop.time() + TRYAGAIN_DELAY >= deadline:
                    raise DeadlineExceeded(f"slot {slot}: TRYAGAIN until the deadline")
                await asyncio.sleep(TRYAGAIN_DELAY)
            else:
                if kind in STALE_MAP:
                    self.refresh_soon()
                raise error
            try:
                if not asking:
                    return await node.execute_packed(packed, deadline)
                # ASKING holds for the next command on its connection only: both go together.
                _, reply = await node.execute_packed_many((_ASKING, packed), deadline)
                if isinstance(reply, RedisReplyError):
                    raise reply
                return reply
            except RedisReplyError as exc:
                error = exc
            except (ConnectionLost, DeadlineExceeded):
                self.refresh_soon()
                raise
        raise ClusterError(f"slot {slot}: still redirected after {MAX_REDIRECTS} tries ({error})")

    def master_of(self, slot: int) -> PipelinedRedis | None:
        """The master the slot map names for `slot`; None before the map is loaded."""
        return self._slots[slot]

    async def masters(self) -> list[PipelinedRedis]:
        """The clients of every master, once the slot map is loaded."""
        if not self._loaded:
            await self._first_load()
        return list(self._nodes.values())

    def refresh_soon(self) -> None:
        """Reload the slot map in the background, at most once per REFRESH_INTERVAL."""
        if self._refreshing is None:
            delay = self._refreshed_at + REFRESH_INTERVAL - time.monotonic()
            self._start_refresh(max(0.0, delay))

    async def _master(self, slot: int) -> PipelinedRedis:
        """The master of a slot the map does not name yet: the first calls load the map."""
        if not self._loaded:
            await self._first_load()
        node = self._slots[slot]
        if node is None:
            self.refresh_soon()
            raise ClusterError(f"no master serves slot {slot}")
        return node

    async def _first_load(self) -> None:
        task = self._refreshing
        if task is None:
            if time.monotonic() - self._refreshed_at < REFRESH_INTERVAL:
                # Calls while the cluster is unreachable fail at once, not one load each.
                raise ClusterError(f"no slot map ({self._load_error})")
            task = self._start_refresh(0.0)
        # Shielded: a caller that gives up leaves the load running for the next ones.
        await asyncio.shield(task)
        if not self._loaded:
            raise ClusterError(f"no slot map ({self._load_error})")

    def _start_refresh(self, delay: float) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._refresh(delay))
        # Retrieved here, so a failure nobody waited for is not logged as never retrieved.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._refreshing = task
        return task

    async def _refresh(self, delay: float) -> None:
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            self._refreshed_at = time.monotonic()
            await self._load()
        finally:
            self._refreshing = None

    async def _load(self) -> None:
        """Ask the known masters, then the startup nodes, for the slot map; the first answer is
        used. A node that does not answer within the connect timeout is passed over."""
        errors = []
        for host, port in dict.fromkeys([*self._nodes, *self._startup]):
            node = self._node(host, port)
            try:
                async with asyncio.timeout(self._connect_timeout):
                    reply = await node.execute("CLUSTER", "SLOTS")
            except (ConnectionLost, RedisReplyError, TimeoutError) as exc:
                errors.append(f"{host}:{port}: {exc or 'no answer'}")
                continue
            await self._use(reply, node)
            return
        self._load_error = "; ".join(errors)

    async def _use(self, reply: list[list[Any]], asked: PipelinedRedis) -> None:
        """Make CLUSTER SLOTS's answer the map: ranges of slots, each with its master first."""
        slots: list[PipelinedRedis | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        masters: dict[tuple[str, int], PipelinedRedis] = {}
        for start, end, master, *_replicas in reply:
            # An empty or unknown endpoint means the node that answered.
            host = master[0].decode() if master[0] not in (b"", b"?") else asked.host
            address = (host, int(master[1]))
            node = masters[address] = self._node(*address)
            slots[start : end + 1] = [node] * (end + 1 - start)
        self._slots = slots
        self._loaded = True
        retired = {address: n for address, n in self._nodes.items() if address not in masters}
        self._nodes = masters
        closing, self._retired = self._retired, retired
        for node in closing.values():
            await node.close()

    def _node(self, host: str, port: int) -> PipelinedRedis:
        """The client of the node at host:port, made on first use."""
        node = self._nodes.get((host, port))
        if node is None:
            node = self._retired.pop((host, port), None)
            if node is None:
                node = PipelinedRedis(host, port, **self._node_options)
            self._nodes[host, port] = node
        return node

    def _node_at(self, where: str, near: PipelinedRedis) -> PipelinedRedis:
        """The node a redirection names (``slot host:port``); an empty host is `near`'s."""
        host, _, port = where.rpartition(" ")[2].rpartition(":")
        return self._node(host or near.host, int(port))

    async def close(self) -> None:
        # Forgotten here: a task cancelled before it starts never runs its own `finally`.
        task, self._refreshing = self._refreshing, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        nodes = [*self._nodes.values(), *self._retired.values()]
        self._nodes, self._retired = {}, {}
        self._slots = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._loaded = False
        for node in nodes:
            await node.close()


def stale_map(error: Exception) -> bool:
    """Whether a call's failure says the slot map may be out of date (see `STALE_MAP`)."""
    if isinstance(error, RedisReplyError):
        return str(error).partition(" ")[0] in STALE_MAP
    return isinstance(error, ConnectionLost | DeadlineExceeded)


def _first_key(args: Sequence[Any]) -> bytes:
    """The key that routes a command: the first argument, or a script's first KEYS entry."""
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    if name.upper() in _SCRIPT_COMMANDS:
        if int(args[2]) == 0:
            raise ClusterError(f"{name} with no keys has no slot to route it by")
        key = args[3]
    elif len(args) > 1:
        key = args[1]
    else:
        raise ClusterError(f"{name} names no key; send it to a node of `masters()`")
    return key if isinstance(key, bytes) else str(key).encode()
