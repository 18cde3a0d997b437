"""Reading usage back from Redis (`sidecar.core.usage`): the count hashes of a day by SCAN, and the
unique counts by PFCOUNT. Not on the decision path: `/v1/usage`, the `usage` command, the page
and the metrics' top keys read through here, each call with its own deadline (READ_TIMEOUT),
longer than a decision's, since a scan walks the whole keyspace of each master.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.crc import key_slot

from sidecar.storage.failures import failure

Execute = Callable[..., Awaitable[Any]]
T = TypeVar("T")

#: Seconds a usage read may take in all.
READ_TIMEOUT = 10.0
#: Keys SCAN is asked to look at per call.
SCAN_COUNT = 1_000
#: Count hashes one read collects at most per node (a day of a domain keyed by a million
#: first entries stops there: the answer covers what was found, and says so in the log).
MAX_HASHES = 200_000


async def hashes(execute: Execute, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
    """Every hash on one node whose key matches `pattern`, with its fields as integers."""
    keys: list[bytes] = []
    cursor = b"0"
    while True:
        cursor, batch = await execute(
            "SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT, "TYPE", "hash"
        )
        keys += batch
        if cursor in (b"0", 0) or len(keys) >= MAX_HASHES:
            break
    replies = await asyncio.gather(*(execute("HGETALL", key) for key in keys))
    found = []
    for key, reply in zip(keys, replies, strict=True):
        fields = dict(zip(reply[0::2], reply[1::2], strict=True))
        found.append((key, {name: int(value) for name, value in fields.items()}))
    return found


async def unique(execute: Execute, groups: Sequence[Sequence[bytes]]) -> list[int]:
    """For each group of HyperLogLog keys, PFCOUNT of their union. A group whose keys lie in
    several hash slots (a key counted under several first entries) cannot be counted as one
    union on a cluster: its slots' counts are added, an upper bound."""
    counts = []
    for keys in groups:
        by_slot: dict[int, list[bytes]] = {}
        for key in keys:
            by_slot.setdefault(key_slot(key), []).append(key)
        replies = await asyncio.gather(*(execute("PFCOUNT", *same) for same in by_slot.values()))
        counts.append(sum(int(reply) for reply in replies))
    return counts


async def bounded(backend: str, read: Awaitable[T]) -> T:
    """`read` within READ_TIMEOUT; whatever goes wrong is a StorageError (see `failure`)."""
    try:
        async with asyncio.timeout(READ_TIMEOUT):
            return await read
    except Exception as exc:  # every failure, see `failure`
        raise failure(backend, int(READ_TIMEOUT * 1000), exc) from exc
