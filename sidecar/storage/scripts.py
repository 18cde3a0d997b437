"""The contract between the Redis backends and their Lua scripts: what a call sends (the EVALSHA
arguments each script's header lays out, packed once per hit by `packed_command`) and what its
reply means (Outcomes, record flags, read values).

The scripts are `decide.lua`, which knows every algorithm and mode, and `count.lua`, which only
adds: the usual request, whose hits only add to plain windows' counters (`Hit.adds_only`, not
all or nothing), runs it, and its answer is worked out here from what the counters come to, for
a third of the server's CPU (`counts` says which script a call runs). Both backends
(`redis.py`, `cluster.py`) build their calls and read their replies here, and only here; what
they do when the server has lost a script (NOSCRIPT) is here too, once: `lost` says so, and
`run_script` sends the call's EVAL form in its place (`as_eval`); `execute_script` does the
same for a script run through a backend's `execute` (`lease.lua`, `sidecar.storage.leases`).

One module past the usual size because it is one contract: every call the backends send a
script and every reply they read back, so that a change to a script's KEYS, ARGV or reply is
made in one place beside the script's header.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any, Final

import hiredis
from redis.crc import key_slot

from sidecar.algorithms import anchored, decide, penalty, windows
from sidecar.algorithms.anchored import Span
from sidecar.algorithms.decide import Address, State
from sidecar.algorithms.token_bucket import Bucket
from sidecar.algorithms.windows import FIELD_GRACE
from sidecar.model import Dedupe, Hit, Outcome, Role, new
from sidecar.storage.base import Applied
from sidecar.storage.failures import failure
from sidecar.storage.redis_client import RedisReplyError

_LUA: Final = files("sidecar.algorithms") / "lua"
SCRIPT: Final = (_LUA / "decide.lua").read_text(encoding="utf-8")
SHA: Final = hashlib.sha1(SCRIPT.encode()).hexdigest()
COUNT_SCRIPT: Final = (_LUA / "count.lua").read_text(encoding="utf-8")
COUNT_SHA: Final = hashlib.sha1(COUNT_SCRIPT.encode()).hexdigest()
#: Each script's text by its hash, for EVAL when the server has lost it.
_TEXTS: Final = {SHA: SCRIPT, COUNT_SHA: COUNT_SCRIPT}

# ARGV[1] of the script.
MODE_ADD: Final = 0
MODE_ALL_OR_NOTHING: Final = 1
MODE_READ: Final = 2
MODE_RECORD: Final = 3
#: A request refused in another slot: nothing applied, penalties tripped (`cluster.py`).
MODE_REFUSED: Final = 4

#: Enum members read through their class cost a Python-level descriptor call each on
#: Python 3.11; as finals they are static reads.
_QUOTA: Final = Role.QUOTA
_SHADOW: Final = Role.SHADOW
_USAGE: Final = Role.USAGE

#: What a script call answers: integers (see each script's header).
Reply = list[int]


def counts(hits: Sequence[Hit], mode: int) -> bool:
    """Whether `count.lua` decides `hits` in `mode`: every hit only adds (`Hit.adds_only`), and
    nothing makes one hit wait on another (mode 0, apply)."""
    if mode != MODE_ADD:
        return False
    for hit in hits:  # noqa: SIM110 (all() of a generator costs more, on every call)
        if not hit.adds_only:
            return False
    return True


def apply_command(hits: Sequence[Hit], mode: int, now_ms: int) -> list[Any]:
    """The EVALSHA arguments that apply (or read) `hits` in `mode`: `count.lua`'s when it
    `counts` them, else `decide.lua`'s."""
    if counts(hits, mode):
        return _count_command(hits)
    return decide_command(hits, mode, now_ms)


def decide_command(
    hits: Sequence[Hit],
    mode: int,
    now_ms: int,
    quota_as_shadow: bool = False,
    dedupe: Dedupe | None = None,
) -> list[Any]:
    """`decide.lua`'s arguments, as its header lays them out (the only script that records, or
    reads quota counters as shadow ones)."""
    args: list[Any] = ["EVALSHA", SHA, 2 * len(hits) + (2 if dedupe is not None else 0)]
    for hit in hits:
        args += _hit_keys(hit)
    if dedupe is not None:
        args += (dedupe.current, dedupe.previous)
    args += (mode, now_ms, len(hits), FIELD_GRACE * 1000)
    for hit in hits:
        args += _hit_args(hit, quota_as_shadow)
    if dedupe is not None:
        args += (dedupe.ttl_ms, *dedupe.ids)
    return args


def _count_command(hits: Sequence[Hit]) -> list[Any]:
    """`count.lua`'s arguments: each hit's key, then each hit's count and ttl."""
    args: list[Any] = ["EVALSHA", COUNT_SHA, len(hits)]
    args += [hit.key for hit in hits]
    for hit in hits:
        args += (hit.hits, hit.ttl)
    return args


def _hit_keys(hit: Hit) -> tuple[bytes, bytes]:
    return hit.key, hit.previous or hit.key


def _hit_args(hit: Hit, quota_as_shadow: bool = False) -> tuple[Any, ...]:
    """A hit's eleven script arguments (see the script's header)."""
    role = hit.role
    if quota_as_shadow and role is _QUOTA:
        role = _SHADOW
    window = hit.window
    algorithm = decide.code(window)
    if algorithm == decide.BUCKET:
        params: tuple[int | str, ...] = (
            window.requests_per_unit,
            window.seconds * 1000,
            window.capacity,
            window.borrow,
        )
    elif algorithm == decide.ANCHORED:
        params = anchored.parameters(window)
    elif algorithm == decide.IN_FLIGHT:
        params = (window.requests_per_unit, window.seconds * 1000, 0, 0)
    elif algorithm == decide.PENALTY:
        assert window.penalty is not None  # a penalty's window carries it
        params = penalty.parameters(window.penalty)
    elif role >= _USAGE:
        # A usage hit (`sidecar.core.usage`): p1 is when its hash or HyperLogLog expires, Unix ms.
        params = (hit.end_ms, 0, 0, 0)
    elif algorithm == decide.SLIDING:
        params = (window.requests_per_unit, 0, hit.start_ms, window.seconds * 1000)
    elif algorithm == decide.BORROWING:
        # Its end and the next window's length: a refused hit may have to wait for both.
        following = windows.next_length_ms(window, hit.end_ms)
        params = (window.requests_per_unit, hit.end_ms, window.borrow, following)
    elif hit.packed is not None:
        # A window sharing a packed field: its place in it, and the field's arithmetic.
        return (
            algorithm,
            hit.hits,
            hit.group,
            int(role),
            window.requests_per_unit,
            hit.packed.position + 1,
            0,
            0,
            hit.ttl,
            hit.field,
            hit.packed.argument(),
        )
    else:
        params = (window.requests_per_unit, 0, window.borrow, 0)
    # int(): an IntEnum must travel as its number.
    return (
        algorithm,
        hit.hits,
        hit.group,
        int(role),
        *params,
        hit.ttl,
        hit.field,
        hit.previous_field or hit.field,
    )


_EVALSHA: Final = b"$7\r\nEVALSHA\r\n$40\r\n" + SHA.encode() + b"\r\n"
_EVALSHA_COUNT: Final = b"$7\r\nEVALSHA\r\n$40\r\n" + COUNT_SHA.encode() + b"\r\n"


def packed_command(hits: Sequence[Hit], mode: int, now_ms: int) -> bytes:
    """The RESP bytes of an apply call (`apply_command`'s, as hiredis would pack them), each
    hit's part packed once.

    A request's hits are the same objects for every call in their window (`sidecar.decision.plan`), so
    their keys and arguments are packed on the first call and kept on the hit (`Hit.script_parts`);
    only `decide.lua`'s mode and time are packed per call. A call on one hit, the common
    request, is kept whole (`count.lua`'s) or whole around those two (`decide.lua`'s).

    Kept on the hit, the parts live as long as it does and no longer: a new body's hits and
    their parts are freed by their reference counts as its call ends, so the collector never
    sees them. (They were kept in a table by the hit's identity, which kept each hit alive
    until the table started over: most hits of real traffic never come back, and each call
    left two objects for the young collections to walk and promote; see README, "Garbage
    collection".)
    """
    if len(hits) == 1:
        hit = hits[0]
        parts = _parts(hit)
        if counts(hits, mode):
            return parts.count_alone
        decided = parts.decided(hit)
        return b"".join((decided.alone_head, _SMALL_BULKS[mode], _now(now_ms), decided.alone_tail))
    every = [_parts(hit) for hit in hits]
    n = len(hits)
    if counts(hits, mode):
        return b"".join(
            (
                _count_head(n),
                *[parts.count_key for parts in every],
                *[parts.count_args for parts in every],
            )
        )
    decided_every = [parts.decided(hit) for parts, hit in zip(every, hits, strict=True)]
    count = _SMALL_BULKS[n] if n < _SMALL else _bulk(n)
    return b"".join(
        (
            _head(n),
            *[decided.keys for decided in decided_every],
            _SMALL_BULKS[mode],
            _now(now_ms),
            count,
            _GRACE,
            *[decided.args for decided in decided_every],
        )
    )


def _parts(hit: Hit) -> _Parts:
    """The hit's packed parts, made on its first call."""
    parts: _Parts | None = hit.script_parts
    if parts is None:
        parts = hit.script_parts = _Parts(hit)
    return parts


class _Parts:
    """One hit's parts of either script's call, each packed once, when first needed (see
    `packed_command`).

    `count.lua`'s parts are packed at once for a hit that only adds (`Hit.adds_only`: the usual
    request, which never needs `decide.lua`'s), and never for another (`count.lua` cannot take
    it); `decide.lua`'s, the larger, only when a call asks for them. Most hits of a gateway's
    traffic are new and used once, so what they do not need is not packed. The parts do not
    refer to their hit, which refers to them: a reference back would make a cycle per hit.
    """

    def __init__(self, hit: Hit) -> None:
        self._decided: _DecideParts | None = None
        # count.lua: the hit's key, its two arguments, and a whole call on it alone.
        if hit.adds_only:
            self.count_key = _bulk_any(hit.key)
            self.count_args = _bulk(hit.hits) + _bulk(hit.ttl)
            self.count_alone = _COUNT_HEAD_ONE + self.count_key + self.count_args
        else:
            self.count_key = self.count_args = self.count_alone = b""

    def decided(self, hit: Hit) -> _DecideParts:
        """decide.lua's parts of `hit`, whose parts these are (packed on the first call)."""
        decided = self._decided
        if decided is None:
            decided = self._decided = _DecideParts(hit)
        return decided


class _DecideParts:
    """decide.lua's parts of one hit: its keys and its eleven arguments; a call on it alone, up
    to the mode, and from the hit count on."""

    def __init__(self, hit: Hit) -> None:
        self.keys = _bulk_any(hit.key) + _bulk_any(hit.previous or hit.key)
        self.args = b"".join([_bulk(arg) for arg in _hit_args(hit)])
        self.alone_head = _head(1) + self.keys
        self.alone_tail = _SMALL_BULKS[1] + _GRACE + self.args


def _now(now_ms: int) -> bytes:
    now = b"%d" % now_ms
    return b"$%d\r\n%s\r\n" % (len(now), now)


@functools.lru_cache(maxsize=256)
def _head(n: int) -> bytes:
    """The start of a call on `n` hits: the array's length, EVALSHA, the hash, the key count."""
    return b"*%d\r\n" % (7 + 13 * n) + _EVALSHA + _bulk(2 * n)


@functools.lru_cache(maxsize=256)
def _count_head(n: int) -> bytes:
    """The start of a `count.lua` call on `n` hits, up to its keys."""
    return b"*%d\r\n" % (3 + 3 * n) + _EVALSHA_COUNT + _bulk(n)


def _bulk(value: bytes | str | int) -> bytes:
    """One RESP bulk string, as hiredis packs a command argument."""
    if type(value) is int and 0 <= value < _SMALL:
        return _SMALL_BULKS[value]
    return _bulk_any(value)


def _bulk_any(value: bytes | str | int) -> bytes:
    if isinstance(value, int):
        value = b"%d" % value
    elif isinstance(value, str):
        value = value.encode()
    return b"$%d\r\n%s\r\n" % (len(value), value)


#: Modes, hit counts, groups and the like: small numbers, packed once.
_SMALL: Final = 256
_SMALL_BULKS: Final = tuple(_bulk_any(number) for number in range(_SMALL))
_GRACE: Final = _bulk(FIELD_GRACE * 1000)
_COUNT_HEAD_ONE: Final = _count_head(1)


def record_commands(batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int) -> list[Any]:
    return [decide_command(hits, MODE_RECORD, now_ms, dedupe=dedupe) for hits, dedupe in batches]


def read_commands(addresses: Sequence[Address]) -> tuple[list[list[Any]], list[list[int]]]:
    """The commands that read `addresses`: one HMGET per grouped hash, one MGET per slot's
    string keys; and for each command, the positions of the addresses it reads."""
    reads: dict[bytes | int, tuple[list[Any], list[int]]] = {}
    for index, where in enumerate(addresses):
        if isinstance(where, tuple):
            key, field = where
            read = reads.get(key)
            if read is None:
                read = reads[key] = (["HMGET", key], [])
            read[0].append(field)
        else:
            slot = key_slot(where)
            read = reads.get(slot)
            if read is None:
                read = reads[slot] = (["MGET"], [])
            read[0].append(where)
        read[1].append(index)
    return [command for command, _ in reads.values()], [indexes for _, indexes in reads.values()]


def reset_commands(addresses: Sequence[Address]) -> list[list[Any]]:
    """The commands that delete `addresses`: one HDEL per grouped hash, one DEL per slot's
    string keys (a DEL of keys in several slots is refused by a cluster). Each replies with
    how many it deleted."""
    commands: dict[bytes | int, list[Any]] = {}
    for where in dict.fromkeys(addresses):
        if isinstance(where, tuple):
            key, field = where
            commands.setdefault(key, ["HDEL", key]).append(field)
        else:
            commands.setdefault(key_slot(where), ["DEL"]).append(where)
    return list(commands.values())


def read_values(
    count: int, positions: list[list[int]], replies: Sequence[list[bytes | None]]
) -> list[State | None]:
    """The read replies as `decide` reads values: counts, buckets ("tokens stamp drawn
    [keep until]"), anchored windows ("count end") or penalties ("until:strikes"), None where
    nothing is stored."""
    values: list[State | None] = [None] * count
    for indexes, reply in zip(positions, replies, strict=True):
        for index, raw in zip(indexes, reply, strict=True):
            if raw is None:
                continue
            if b":" in raw:  # a penalty's state (`sidecar.algorithms.penalty`)
                values[index] = penalty.parse(raw)
                continue
            if b" " in raw:
                words = raw.split()
                if len(words) == 2:
                    values[index] = Span(int(words[0]), int(words[1]))
                    continue
                tokens, stamp, drawn = words[:3]
                values[index] = Bucket(float(tokens), int(float(stamp)), float(drawn))
            else:
                values[index] = int(raw)
    return values


def duplicates(reply: Reply) -> list[bool]:
    """The record mode's answer: one flag per impression, true when its id was seen before."""
    return [flag == 1 for flag in reply]


def outcomes_of(hits: Sequence[Hit], reply: Reply, now_ms: int, mode: int) -> list[Outcome]:
    """The reply of the script `apply_command` chose for `hits` in `mode`, as Outcomes."""
    if counts(hits, mode):
        return _counted(hits, reply, now_ms)
    return decide_outcomes(hits, reply, now_ms)


def _counted(hits: Sequence[Hit], reply: Reply, now_ms: int) -> list[Outcome]:
    """`count.lua`'s counters after the hits, as the Outcomes `decide.lua` gives."""
    if len(reply) != len(hits):
        raise ValueError(f"count.lua answered {len(reply)} values for {len(hits)} hits")
    if len(hits) == 1:  # the common call, without the loop
        return [_count_outcome(hits[0], reply[0], now_ms)]
    return [_count_outcome(hit, reply[index], now_ms) for index, hit in enumerate(hits)]


def _count_outcome(hit: Hit, count: int, now_ms: int) -> Outcome:
    """A plain window's hit whose counter came to `count`: over when that passes the limit, and
    applied either way (a plain window counts rejected hits)."""
    after = hit.window.requests_per_unit - count
    before = after + hit.hits
    return new(
        Outcome,
        (
            after < 0,
            after if after > 0 else 0,
            hit.end_ms - now_ms,
            True,
            before if before > 0 else 0,
        ),
    )


def decide_outcomes(hits: Sequence[Hit], reply: Reply, now_ms: int) -> list[Outcome]:
    """`decide.lua`'s five integers per hit, as Outcomes (a window's end comes from the hit)."""
    if len(hits) == 1:  # the common call, without the slicing
        over, remaining, reset_ms, applied, left_before = reply
        end_ms = hits[0].end_ms
        return [
            new(
                Outcome,
                (
                    over == 1,
                    remaining,
                    end_ms - now_ms if end_ms and not reset_ms else reset_ms,
                    applied == 1,
                    left_before,
                ),
            )
        ]
    outcomes = []
    for index, hit in enumerate(hits):
        over, remaining, reset_ms, applied, left_before = reply[5 * index : 5 * index + 5]
        if hit.end_ms and not reset_ms:
            # A window's end (a bucket has no end, and a refused hit on a sliding or borrowing
            # window its own wait: the script works those out).
            reset_ms = hit.end_ms - now_ms
        outcomes.append(new(Outcome, (over == 1, remaining, reset_ms, applied == 1, left_before)))
    return outcomes


def applied(
    backend: str,
    timeout_ms: int,
    hits: Sequence[Hit],
    mode: int,
    now_ms: int,
    reply: Any,
    done: Applied,
) -> None:
    """Hand `done` the outcomes of the reply to `apply_command(hits, mode, now_ms)`, or the
    failure it ended with (a StorageError whose cause is what the client raised)."""
    if isinstance(reply, Exception):
        error = failure(backend, timeout_ms, reply)
        error.__cause__ = reply
        done(error)
        return
    try:
        outcomes = outcomes_of(hits, reply, now_ms, mode)
    except Exception as exc:  # a reply of the wrong shape: a bug, not an outage
        done(exc)
        return
    done(outcomes)


def as_eval(command: list[Any]) -> list[Any]:
    """The EVAL form of an EVALSHA command: the script's text in place of its hash, for a
    server that has lost it (restart, failover, SCRIPT FLUSH). EVAL runs the text and caches it
    in one round trip, where SCRIPT LOAD + EVALSHA would take two."""
    return ["EVAL", _TEXTS[command[1]], *command[2:]]


def lost(reply: object) -> bool:
    """Whether `reply` (an error reply, raised or handed to a callback) says the server has lost
    the script: NOSCRIPT, after a restart, a failover, SCRIPT FLUSH or on a new master. Nothing
    ran; the call's EVAL form (`as_eval`) runs it and caches it again."""
    return isinstance(reply, RedisReplyError) and str(reply).startswith("NOSCRIPT")


async def run_script(
    send: Callable[[bytes], Awaitable[Any]],
    packed: bytes,
    command: Callable[..., list[Any]],
    *args: Any,
) -> Any:
    """Send `packed`, a script call (EVALSHA), through `send`, and its reply; when the server
    has lost the script (`lost`), send instead the EVAL form of `command(*args)`, the same call
    unpacked (built only then), through the same `send` and so by the same deadline."""
    try:
        return await send(packed)
    except RedisReplyError as exc:
        if not lost(exc):
            raise
    # Sent once the error is gone (out of the `except`): while it lives, its traceback and this
    # frame refer to each other, a cycle per call left to the collector (tests/test_garbage.py).
    return await send(hiredis.pack_command(tuple(as_eval(command(*args)))))


async def execute_script(
    execute: Callable[..., Awaitable[Any]], sha: str, text: str, *args: Any
) -> Any:
    """Run the script `text`, whose hash is `sha`, with `args` through `execute` (a backend's
    `RunsCommands.execute`, which routes a command by its first key): EVALSHA, or, when the
    server has lost the script (`lost`), EVAL, which runs it and caches it again, through the
    same `execute`. For the scripts off the decision path, whose calls are not packed."""
    try:
        return await execute("EVALSHA", sha, *args)
    except RedisReplyError as exc:
        if not lost(exc):
            raise
    # Out of the `except`, as in `run_script`: no traceback kept alive by this frame.
    return await execute("EVAL", text, *args)
