"""Counters in a Redis Cluster, through a pipelined cluster client: one script call per hash slot.

`PipelinedCluster` learns the slot map with CLUSTER SLOTS and keeps one `PipelinedRedis` per
master, so every master gets one write per tick (per connection) however many calls the tick
makes. A command goes to the master of its first key's slot. MOVED (the slot has a new master)
updates that slot's entry, retries there and reloads the whole map in the background; ASK (the
slot is being migrated and this key has left) sends ASKING and the command to the named node in
one write, and changes nothing in the map. A lost connection, a call that met its deadline in
silence, or a reply saying the cluster or the node cannot serve (CLUSTERDOWN, READONLY,
MASTERDOWN) reloads the map too, at most once per `REFRESH_INTERVAL`, so a dead master costs
four CLUSTER SLOTS a second, not one per call, and its replica, once promoted, is found within
a quarter of a second (at most once per interval after the previous reload).
A call's deadline (`deadline=`, the event loop's time) is kept by the masters' clients as in
`pipeline.py`, across redirections; a caller may also put `asyncio.timeout` around calls.

`RedisClusterBackend` runs `decide.lua` (its commands are built in `redis.py`) once per slot.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Self
from urllib.parse import unquote, urlsplit

import hiredis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from sidecar.algorithms import fixed_window
from sidecar.algorithms.decide import Address, State
from sidecar.errors import StorageError
from sidecar.model import Dedupe, Hit, Outcome, Role
from sidecar.storage import peers, usage_reads
from sidecar.storage.base import Applied
from sidecar.storage.pipeline import (
    CONNECTIONS,
    ConnectionLost,
    DeadlineExceeded,
    PipelinedRedis,
    RedisReplyError,
)
from sidecar.storage.redis import (
    MODE_ADD,
    MODE_ALL_OR_NOTHING,
    MODE_READ,
    ApplyPacker,
    Reply,
    _address,
    _command,
    _decide_command,
    _duplicates,
    _eval,
    _failure,
    _gather_all,
    _outcomes,
    _read_commands,
    _record_commands,
    _redact,
    _ssl_context,
    _timeout_seconds,
    _tls_options,
    _values,
    applied,
    counts,
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

#: Error replies that say a script call did not run where it was sent: it is sent again (by
#: `_apply`), where the cluster says, and counts once.
_NOT_RUN = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "NOSCRIPT"})

#: Error replies after which the slot map may be out of date: the cluster lost slots, or the node
#: is a replica now (a failover).
_STALE_MAP = frozenset({"CLUSTERDOWN", "READONLY", "MASTERDOWN"})

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
                if kind in _STALE_MAP:
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


def _stale_map(error: Exception) -> bool:
    """Whether a call's failure says the slot map may be out of date (see `_STALE_MAP`)."""
    if isinstance(error, RedisReplyError):
        return str(error).partition(" ")[0] in _STALE_MAP
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


class RedisClusterBackend:
    """A Redis Cluster: hits are grouped by hash slot, one script call per slot.

    Counters whose keys share a hash tag (see `keys.py`) share a slot, so a typical request
    still costs one call. A request over several slots is atomic per slot only: with
    all-or-nothing it is decided in two phases, see `_apply_across_slots`.
    """

    name = "redis-cluster"

    def __init__(self, client: PipelinedCluster, timeout_ms: int) -> None:
        self._client = client
        self._timeout_ms = timeout_ms
        self._timeout = timeout_ms / 1000
        self._packer = ApplyPacker()
        # `apply_then` calls running `_apply`'s coroutine (kept: the loop holds tasks weakly).
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_url(cls, url: str, timeout_ms: int = 50) -> Self:
        """A backend for ``redis+cluster://[user:password@]host:port[,host:port...]``, or
        ``rediss+cluster://`` for TLS to every node, with the TLS query parameters of
        ``rediss://`` (see `RedisBackend.from_url`).

        The nodes listed are only where discovery starts; the client learns the others. Over
        TLS the cluster announces its nodes' TLS ports, and each node's certificate is checked
        against the address the cluster announces for it (an IP address, unless the cluster
        announces host names). Nothing connects yet.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("redis+cluster", "rediss+cluster"):
            raise ValueError(
                f"{_redact(url)}: scheme must be redis+cluster:// or rediss+cluster://"
            )
        tls = parts.scheme == "rediss+cluster"
        timeout = _timeout_seconds(url, timeout_ms)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if not hosts:
            raise ValueError(f"{_redact(url)}: no host:port to start cluster discovery from")
        nodes = [_address(url, address) for address in hosts.split(",")]
        if parts.path not in ("", "/", "/0"):
            raise ValueError(
                f"{_redact(url)}: Redis Cluster has only database 0, not {parts.path!r}"
            )
        if parts.fragment or (parts.query and not tls):
            raise ValueError(f"{_redact(url)}: {parts.scheme}:// takes no query or fragment")
        options = _tls_options(url, parts.query, tls)
        username, has_password, password = userinfo.partition(":")
        client = PipelinedCluster(
            nodes,
            username=unquote(username) or None,
            password=unquote(password) if has_password else None,
            ssl_context=functools.partial(_ssl_context, options) if tls else None,
            connect_timeout=timeout,
        )
        return cls(client, timeout_ms)

    async def _apply(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, deadline: float
    ) -> list[Outcome]:
        if not hits:
            return []
        slots: dict[int, list[int]] = {}
        for index, hit in enumerate(hits):
            slots.setdefault(key_slot(hit.key), []).append(index)
        try:
            if len(slots) == 1:
                [slot] = slots
                mode = MODE_ALL_OR_NOTHING if all_or_nothing else MODE_ADD
                reply = await self._apply_slot(slot, hits, mode, now_ms, deadline)
                return _outcomes(hits, reply, now_ms, mode)
            if all_or_nothing:
                return await self._apply_across_slots(hits, slots, now_ms, deadline)
            return await self._apply_per_slot(hits, slots, MODE_ADD, now_ms, deadline)
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, self._timeout_ms, exc) from exc

    def apply_then(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied
    ) -> None:
        """See `Backend.apply_then`.

        The usual request, whose hits share one slot whose master the slot map knows, is one
        `call_packed` on that master's pipeline, with no coroutine. Anything else is `_apply`'s
        coroutine in a task, by the same deadline: hits over several slots, no slot map yet,
        and a reply saying the script did not run on that master (MOVED, ASK, TRYAGAIN,
        CLUSTERDOWN, NOSCRIPT), after which the coroutine sends the call again and follows
        the redirection. Nothing ran, so nothing is counted twice.
        """
        master = self._master_of_all(hits)
        if master is None:
            deadline = asyncio.get_running_loop().time() + self._timeout
            self._apply_in_task(hits, all_or_nothing, now_ms, deadline, done)
            return
        deadline = master.time() + self._timeout
        mode = MODE_ALL_OR_NOTHING if all_or_nothing else MODE_ADD

        def replied(reply: Any) -> None:
            if isinstance(reply, RedisReplyError) and str(reply).split(" ", 1)[0] in _NOT_RUN:
                self._apply_in_task(hits, all_or_nothing, now_ms, deadline, done)
                return
            if isinstance(reply, Exception) and _stale_map(reply):
                self._client.refresh_soon()  # as `PipelinedCluster.execute_packed` does
            applied(self.name, self._timeout_ms, hits, mode, now_ms, reply, done)

        master.call_packed(self._packer.command(hits, mode, now_ms), deadline, replied)

    def _master_of_all(self, hits: Sequence[Hit]) -> PipelinedRedis | None:
        """The master of the one slot all `hits` share, if the slot map names it; else None."""
        if not hits:
            return None
        slot = key_slot(hits[0].key)
        for hit in hits[1:]:
            if key_slot(hit.key) != slot:
                return None
        return self._client.master_of(slot)

    def _apply_in_task(
        self,
        hits: Sequence[Hit],
        all_or_nothing: bool,
        now_ms: int,
        deadline: float,
        done: Applied,
    ) -> None:
        """`_apply` in a task, its outcome handed to `done` (a StorageError once closed)."""

        async def run() -> None:
            try:
                outcomes = await self._apply(hits, all_or_nothing, now_ms, deadline)
            except Exception as exc:  # StorageError, or a bug: `done` judges
                done(exc)
                return
            done(outcomes)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_ended, done))

    def _task_ended(self, done: Applied, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():  # by `close`, perhaps before it began: the call ends with it
            done(StorageError(f"{self.name}: client closed"))

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        """Record each batch (one user's impressions, one slot) exactly once, concurrently."""
        if not batches:
            return []
        commands = _record_commands(batches, now_ms)
        try:
            async with asyncio.timeout(self._timeout):
                # A batch's keys share a slot: its first key (KEYS[1]) routes it.
                replies = await _gather_all(
                    self._run(key_slot(command[3]), command) for command in commands
                )
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, self._timeout_ms, exc) from exc
        return [_duplicates(reply) for reply in replies]

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        if not addresses:
            return []
        commands, positions = _read_commands(addresses)
        try:
            async with asyncio.timeout(self._timeout):
                replies = await _gather_all(self._client.execute(*command) for command in commands)
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, self._timeout_ms, exc) from exc
        return _values(len(addresses), positions, replies)

    async def _apply_across_slots(
        self, hits: Sequence[Hit], slots: dict[int, list[int]], now_ms: int, deadline: float
    ) -> list[Outcome]:
        """All-or-nothing over several slots: read every slot, decide, then add slot by slot.

        Phase 1 judges every hit (mode 2, nothing written) and decides the whole request with
        `fixed_window.request_is_over` over its descriptors, exactly as a single script would
        (a descriptor's windows share its hash tag, so they never straddle slots). When it is
        OVER_LIMIT, nothing is written anywhere. Otherwise phase 2 runs mode 1 on every slot.

        The race this leaves: between the phases another request may consume a counter, and
        then the slot holding it refuses its part in phase 2 while the other slots add theirs.
        The request's Counts then say, slot by slot, what was really added (applied False where
        refused, with the counters' fresh values, so the request comes out OVER_LIMIT), but
        the slots that accepted keep their hits. A blocking counter never passes its limit
        because of this. Quota counters are judged across slots in phase 1; in phase 2 they
        block only when they all live in one slot, since a slot cannot see the others'.
        """
        phase1 = await self._apply_per_slot(hits, slots, MODE_READ, now_ms, deadline)
        group_over: dict[int, bool] = {}
        group_role: dict[int, Role] = {}
        for outcome, hit in zip(phase1, hits, strict=True):
            group_over[hit.group] = group_over.get(hit.group, False) or outcome.over
            group_role[hit.group] = hit.role
        if fixed_window.request_is_over(
            list(group_over.values()), [group_role[g] for g in group_over]
        ):
            return phase1
        quota_slots = {
            slot for slot, group in slots.items() for i in group if hits[i].role is Role.QUOTA
        }
        return await self._apply_per_slot(
            hits,
            slots,
            MODE_ALL_OR_NOTHING,
            now_ms,
            deadline,
            quota_as_shadow=len(quota_slots) > 1,
        )

    async def _apply_per_slot(
        self,
        hits: Sequence[Hit],
        slots: dict[int, list[int]],
        mode: int,
        now_ms: int,
        deadline: float,
        quota_as_shadow: bool = False,
    ) -> list[Outcome]:
        """Run the script on every slot's hits concurrently; Outcomes in the hits' order."""
        calls = [
            self._apply_slot(
                slot, [hits[i] for i in group], mode, now_ms, deadline, quota_as_shadow
            )
            for slot, group in slots.items()
        ]
        replies = await _gather_all(calls)
        outcomes: list[Outcome | None] = [None] * len(hits)
        for group, reply in zip(slots.values(), replies, strict=True):
            slot_hits = [hits[i] for i in group]
            for index, outcome in zip(
                group, _outcomes(slot_hits, reply, now_ms, mode), strict=True
            ):
                outcomes[index] = outcome
        return [o for o in outcomes if o is not None]

    async def _apply_slot(
        self,
        slot: int,
        hits: Sequence[Hit],
        mode: int,
        now_ms: int,
        deadline: float,
        quota_as_shadow: bool = False,
    ) -> Reply:
        """Run the script on one slot's hits, packed by `ApplyPacker` (see `RedisBackend`)."""
        # The packer keeps each hit's own role (count.lua, which `_outcomes` reads when it
        # `counts` the hits, ignores roles).
        if quota_as_shadow and not counts(hits, mode):
            command = _decide_command(hits, mode, now_ms, quota_as_shadow)
            return await self._run(slot, command, deadline)
        client = self._client
        try:
            reply: Reply = await client.execute_packed(
                slot, self._packer.command(hits, mode, now_ms), deadline
            )
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            # The master lost its script cache (see _run): EVAL at once.
            command = _eval(_command(hits, mode, now_ms))
            reply = await client.execute_packed(
                slot, hiredis.pack_command(tuple(command)), deadline
            )
        return reply

    async def _run(self, slot: int, command: list[Any], deadline: float | None = None) -> Reply:
        """Run the script on the master of `slot`, sending its text only when it lost it."""
        client = self._client
        try:
            reply: Reply = await client.execute_packed(
                slot, hiredis.pack_command(tuple(command)), deadline
            )
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            # The master's script cache is empty (restart, failover, SCRIPT FLUSH, a new master).
            # EVAL runs the text and caches it there in one round trip.
            command = _eval(command)
            reply = await client.execute_packed(
                slot, hiredis.pack_command(tuple(command)), deadline
            )
        return reply

    @property
    def client(self) -> PipelinedCluster:
        """The pipelined client, for the quota service's own keys (`sidecar.quota.store`)."""
        return self._client

    async def peers(self, name: bytes) -> int:
        """Register this sidecar as `name` and count the sidecars sharing the counters
        (`sidecar.storage.peers`); raises StorageError."""
        failure = functools.partial(_failure, self.name, self._timeout_ms)
        return await peers.count_within(self._client.execute, name, self._timeout, failure)

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Every usage count hash matching `pattern`, scanned on every master (`sidecar.usage`);
        raises StorageError."""
        try:
            async with asyncio.timeout(usage_reads.READ_TIMEOUT):
                masters = await self._client.masters()
                found = await _gather_all(
                    usage_reads.hashes(node.execute, pattern) for node in masters
                )
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, int(usage_reads.READ_TIMEOUT * 1000), exc) from exc
        return [item for node in found for item in node]

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """PFCOUNT of each group of HyperLogLog keys, slot by slot (`sidecar.usage`); raises
        StorageError."""
        try:
            async with asyncio.timeout(usage_reads.READ_TIMEOUT):
                return await usage_reads.unique(self._client.execute, groups)
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, int(usage_reads.READ_TIMEOUT * 1000), exc) from exc

    async def leave(self, name: bytes) -> None:
        """Take this sidecar's name out of the count at once (a clean stop)."""
        await peers.leave_within(self._client.execute, name, self._timeout)

    async def ping(self) -> bool:
        """Whether every master answers PING."""
        try:
            async with asyncio.timeout(self._timeout):
                masters = await self._client.masters()
                replies = await _gather_all(node.execute("PING") for node in masters)
        except Exception:  # ping never raises
            return False
        return bool(masters) and all(reply == b"PONG" for reply in replies)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.close()
