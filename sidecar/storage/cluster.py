"""Counters in a Redis Cluster: hits grouped by hash slot, one script call per slot, through the
pipelined cluster client (`cluster_client.py`); the calls and their replies are `scripts.py`'s.

One module past the usual size because it is one class: the backend's two paths (callbacks for
a request on one slot whose master is known, a coroutine for several slots and redirections)
share its slot map, its clients and each call's deadline.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any, Self

import hiredis
import structlog
from redis.crc import key_slot

from sidecar.algorithms import fixed_window
from sidecar.algorithms.decide import Address, State
from sidecar.core.usage import as_refused
from sidecar.errors import StorageError
from sidecar.model import Dedupe, Hit, Outcome, Role
from sidecar.storage import peers, urls, usage_reads
from sidecar.storage.base import Applied
from sidecar.storage.cluster_client import PipelinedCluster, stale_map
from sidecar.storage.failures import failure, fault, gather_all
from sidecar.storage.redis_client import PipelinedRedis, RedisReplyError
from sidecar.storage.scripts import (
    MODE_ADD,
    MODE_ALL_OR_NOTHING,
    MODE_READ,
    MODE_REFUSED,
    Reply,
    applied,
    apply_command,
    counts,
    decide_command,
    duplicates,
    outcomes_of,
    packed_command,
    read_commands,
    read_values,
    record_commands,
    reset_commands,
    run_script,
)

#: Error replies that say a script call did not run where it was sent: it is sent again (by
#: `_apply`), where the cluster says, and counts once.
_NOT_RUN = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "NOSCRIPT"})
#: Seconds between two logs of usage counts lost (`_decide_then_count_usage`).
USAGE_LOG_INTERVAL = 60.0
#: A usage hit's outcome when its call failed: not counted.
_NOT_COUNTED = Outcome(over=False, remaining=0, reset_ms=0, applied=False)

log = structlog.get_logger("sidecar.storage.cluster")


def _slots_of(hits: Sequence[Hit]) -> dict[int, list[int]]:
    """The hits' indexes by hash slot."""
    slots: dict[int, list[int]] = {}
    for index, hit in enumerate(hits):
        slots.setdefault(key_slot(hit.key), []).append(index)
    return slots


class RedisClusterBackend:
    """A Redis Cluster: hits are grouped by hash slot, one script call per slot.

    Counters whose keys share a hash tag (see `sidecar.core.keys`) share a slot, so a typical request
    still costs one call. A request over several slots is atomic per slot only: with
    all-or-nothing it is decided in two phases, see `_apply_across_slots`.
    """

    name = "redis-cluster"

    def __init__(self, client: PipelinedCluster, timeout_ms: int) -> None:
        self._client = client
        self._timeout_ms = timeout_ms
        self._timeout = timeout_ms / 1000
        # `apply` calls running `_apply`'s coroutine (kept: the loop holds tasks weakly).
        self._tasks: set[asyncio.Task[None]] = set()
        # Requests whose usage counts were lost since the last `usage_not_counted`, and when.
        self._usage_lost = 0
        self._usage_logged_at = -USAGE_LOG_INTERVAL
        # What the last ping raised (None once one answers), for `fault`.
        self._ping_error: Exception | None = None

    @classmethod
    def from_url(cls, url: str, timeout_ms: int = 50) -> Self:
        """A backend for ``redis+cluster://[user:password@]host:port[,host:port...]``, or
        ``rediss+cluster://`` for TLS to every node, with the TLS query parameters of
        ``rediss://`` (see `sidecar.storage.urls`).

        The nodes listed are only where discovery starts; the client learns the others. Over
        TLS the cluster announces its nodes' TLS ports, and each node's certificate is checked
        against the address the cluster announces for it (an IP address, unless the cluster
        announces host names). Nothing connects yet.
        """
        location = urls.parse(url)
        if not isinstance(location, urls.ClusterURL):
            raise ValueError(
                f"{urls.redact(url)!r}: scheme must be redis+cluster:// or rediss+cluster://"
            )
        client = PipelinedCluster(
            location.nodes,
            username=location.username,
            password=location.password,
            ssl_context=location.tls.context if location.tls else None,
            connect_timeout=urls.timeout_seconds(url, timeout_ms),
        )
        return cls(client, timeout_ms)

    async def _apply(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, deadline: float
    ) -> list[Outcome]:
        if not hits:
            return []
        try:
            return await self._decide(hits, all_or_nothing, now_ms, deadline)
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc

    async def _decide(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, deadline: float
    ) -> list[Outcome]:
        slots = _slots_of(hits)
        if len(slots) == 1:
            [slot] = slots
            mode = MODE_ALL_OR_NOTHING if all_or_nothing else MODE_ADD
            reply = await self._apply_slot(slot, hits, mode, now_ms, deadline)
            return outcomes_of(hits, reply, now_ms, mode)
        if any(hit.role >= Role.USAGE for hit in hits):
            return await self._decide_then_count_usage(hits, all_or_nothing, now_ms, deadline)
        if all_or_nothing:
            return await self._apply_across_slots(hits, slots, now_ms, deadline)
        return await self._apply_per_slot(hits, slots, MODE_ADD, now_ms, deadline)

    async def _decide_then_count_usage(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, deadline: float
    ) -> list[Outcome]:
        """A request over several slots that counts usage (`sidecar.core.usage`): its usage hits go
        after its limits are decided, counted as the whole request's answer says.

        In one slot the script counts them with the request's answer; over several, each
        slot's script sees only its own limits, so a request refused by a limit in another
        slot would count as admitted. So the limits are decided first, without the usage
        hits, and the usage hits then go in one more call per slot holding them, as they are
        or `usage.as_refused`. That call failing loses the request's usage counts, not
        its answer: its limits are decided and counted already (`usage_not_counted`, logged
        at most once a minute with how many were lost since).
        """
        limits = [hit for hit in hits if hit.role < Role.USAGE]
        usage = [hit for hit in hits if hit.role >= Role.USAGE]
        decided = await self._decide(limits, all_or_nothing, now_ms, deadline) if limits else []
        if fixed_window.groups_over(limits, [outcome.over for outcome in decided])[1]:
            usage = [as_refused(hit) for hit in usage]
        try:
            counted = await self._apply_per_slot(
                usage, _slots_of(usage), MODE_ADD, now_ms, deadline
            )
        except Exception as exc:  # the answer stands; the counts are lost
            self._usage_lost += 1
            now = asyncio.get_running_loop().time()
            if now >= self._usage_logged_at + USAGE_LOG_INTERVAL:
                self._usage_logged_at = now
                log.warning(
                    "usage_not_counted",
                    backend=self.name,
                    error=repr(exc),
                    requests=self._usage_lost,
                )
                self._usage_lost = 0
            counted = [_NOT_COUNTED] * len(usage)
        outcomes = iter(decided)
        counts = iter(counted)
        return [next(counts) if hit.role >= Role.USAGE else next(outcomes) for hit in hits]

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        """See `Backend.apply`.

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
            if isinstance(reply, Exception) and stale_map(reply):
                self._client.refresh_soon()  # as `PipelinedCluster.execute_packed` does
            applied(self.name, self._timeout_ms, hits, mode, now_ms, reply, done)

        master.call_packed(packed_command(hits, mode, now_ms), deadline, replied)

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
        commands = record_commands(batches, now_ms)
        try:
            async with asyncio.timeout(self._timeout):
                # A batch's keys share a slot: its first key (KEYS[1]) routes it.
                replies = await gather_all(
                    self._run(key_slot(command[3]), command) for command in commands
                )
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc
        return [duplicates(reply) for reply in replies]

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        if not addresses:
            return []
        commands, positions = read_commands(addresses)
        try:
            async with asyncio.timeout(self._timeout):
                replies = await gather_all(self._client.execute(*command) for command in commands)
        except Exception as exc:  # every failure, see `failure`
            raise failure(self.name, self._timeout_ms, exc) from exc
        return read_values(len(addresses), positions, replies)

    async def _apply_across_slots(
        self, hits: Sequence[Hit], slots: dict[int, list[int]], now_ms: int, deadline: float
    ) -> list[Outcome]:
        """All-or-nothing over several slots: read every slot, decide, then add slot by slot.

        Phase 1 judges every hit (mode 2, nothing written) and decides the whole request with
        `fixed_window.request_is_over` over its descriptors, exactly as a single script would
        (a descriptor's windows share its hash tag, so they never straddle slots). When it is
        OVER_LIMIT, nothing is written anywhere, except the blocks of the penalties it trips
        (mode 4, refused, on every slot, whose answer replaces phase 1's). Otherwise phase 2
        runs mode 1 on every slot.

        The race this leaves: between the phases another request may consume a counter, and
        then the slot holding it refuses its part in phase 2 while the other slots add theirs.
        The request's Counts then say, slot by slot, what was really added (applied False where
        refused, with the counters' fresh values, so the request comes out OVER_LIMIT), but
        the slots that accepted keep their hits. A blocking counter never passes its limit
        because of this. Quota counters are judged across slots in phase 1; in phase 2 they
        block only when they all live in one slot, since a slot cannot see the others'.
        """
        phase1 = await self._apply_per_slot(hits, slots, MODE_READ, now_ms, deadline)
        if fixed_window.groups_over(hits, [outcome.over for outcome in phase1])[1]:
            if any(hit.window.penalty is not None for hit in hits):
                # Refused, it still trips its descriptors' penalties (`algorithms.penalty`),
                # as one script would: every slot judges it again as refused, and writes only
                # the blocks it starts.
                return await self._apply_per_slot(hits, slots, MODE_REFUSED, now_ms, deadline)
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
        replies = await gather_all(calls)
        outcomes: list[Outcome | None] = [None] * len(hits)
        for group, reply in zip(slots.values(), replies, strict=True):
            slot_hits = [hits[i] for i in group]
            for index, outcome in zip(
                group, outcomes_of(slot_hits, reply, now_ms, mode), strict=True
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
        """Run the script on one slot's hits, packed by `packed_command` (see `RedisBackend`)."""
        # The packer keeps each hit's own role (count.lua, which `outcomes_of` reads when it
        # `counts` the hits, ignores roles).
        if quota_as_shadow and not counts(hits, mode):
            command = decide_command(hits, mode, now_ms, quota_as_shadow)
            return await self._run(slot, command, deadline)
        send = functools.partial(self._client.execute_packed, slot, deadline=deadline)
        packed = packed_command(hits, mode, now_ms)
        reply: Reply = await run_script(send, packed, apply_command, hits, mode, now_ms)
        return reply

    async def _run(self, slot: int, command: list[Any], deadline: float | None = None) -> Reply:
        """Run the script on the master of `slot`, sending its text only when it lost it."""
        send = functools.partial(self._client.execute_packed, slot, deadline=deadline)
        packed = hiredis.pack_command(tuple(command))
        reply: Reply = await run_script(send, packed, list, command)
        return reply

    async def execute(self, *args: Any) -> Any:
        """Run one command on the master of its first key's slot and return its reply (error
        replies raise); for the quota service's own keys (`sidecar.quota.store`), whose caller
        keeps the deadline."""
        return await self._client.execute(*args)

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
        """Every usage count hash matching `pattern`, scanned on every master (`sidecar.core.usage`);
        raises StorageError."""

        async def every_master() -> list[tuple[bytes, dict[bytes, int]]]:
            masters = await self._client.masters()
            found = await gather_all(usage_reads.hashes(node.execute, pattern) for node in masters)
            return [item for node in found for item in node]

        return await usage_reads.bounded(self.name, every_master())

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """PFCOUNT of each group of HyperLogLog keys, slot by slot (`sidecar.core.usage`); raises
        StorageError."""
        return await usage_reads.bounded(
            self.name, usage_reads.unique(self._client.execute, groups)
        )

    async def ping(self) -> bool:
        """Whether every master answers PING."""
        try:
            async with asyncio.timeout(self._timeout):
                masters = await self._client.masters()
                replies = await gather_all(node.execute("PING") for node in masters)
        except Exception as exc:  # ping never raises
            self._ping_error = exc
            return False
        self._ping_error = None
        return bool(masters) and all(reply == b"PONG" for reply in replies)

    def fault(self) -> str | None:
        """A refused password or a name that does not resolve (`failures.fault`), as far as the
        last ping's error says."""
        return fault(self._ping_error, self.name)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.close()
