"""Counters in Redis and Redis Cluster: one script call per hash slot per request.

The script decides and increments atomically on the server, so any number of sidecars can share
the counters. A request whose hits share a hash slot costs one EVALSHA; on a cluster, hits are
grouped by slot and the groups run concurrently. The script is `decide.lua`, which knows every
algorithm and mode; the usual request, whose hits only add to plain windows' counters
(`Hit.adds_only`, not all or nothing), runs `count.lua` instead: it adds, and the answer is
worked out here from what the counters come to, for a third of the server's CPU.

Every call has a deadline: whatever goes wrong (refused connection, a server that never
answers, a full connection pool, an error reply) surfaces as StorageError by then, so the
service answers with its failure mode instead of making Envoy wait.

`record` runs `decide.lua` in its record mode, once per user (a batch is one hash slot); the
batches of one call run concurrently, which on a standalone Redis means one write and one round
trip.

The Redis Cluster backend lives in `cluster.py`, with its own pipelined client; it builds the same
commands with the helpers here.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ssl
from collections.abc import Awaitable, Iterable, Sequence
from importlib.resources import files
from typing import Any, Self
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from sidecar.algorithms import decide
from sidecar.algorithms.decide import Address, State
from sidecar.algorithms.token_bucket import Bucket
from sidecar.algorithms.windows import FIELD_GRACE
from sidecar.errors import Overloaded, StorageError
from sidecar.model import Dedupe, Hit, Outcome, Role, new
from sidecar.storage import peers, usage_reads
from sidecar.storage.base import Applied
from sidecar.storage.pipeline import PipelinedRedis, RedisReplyError

_LUA = files("sidecar.algorithms") / "lua"
_SCRIPT = (_LUA / "decide.lua").read_text(encoding="utf-8")
_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()
_COUNT_SCRIPT = (_LUA / "count.lua").read_text(encoding="utf-8")
_COUNT_SHA = hashlib.sha1(_COUNT_SCRIPT.encode()).hexdigest()
#: Each script's text by its hash, for EVAL when the server has lost it.
_TEXTS = {_SHA: _SCRIPT, _COUNT_SHA: _COUNT_SCRIPT}

# ARGV[1] of the script.
MODE_ADD = 0
MODE_ALL_OR_NOTHING = 1
MODE_READ = 2
MODE_RECORD = 3

DEFAULT_PORT = 6379


_TLS_OPTIONS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


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


def _command(hits: Sequence[Hit], mode: int, now_ms: int) -> list[Any]:
    """The EVALSHA arguments that apply (or read) `hits` in `mode`: `count.lua`'s when it
    `counts` them, else `decide.lua`'s."""
    if counts(hits, mode):
        return _count_command(hits)
    return _decide_command(hits, mode, now_ms)


def _decide_command(
    hits: Sequence[Hit],
    mode: int,
    now_ms: int,
    quota_as_shadow: bool = False,
    dedupe: Dedupe | None = None,
) -> list[Any]:
    """`decide.lua`'s arguments, as its header lays them out (the only script that records, or
    reads quota counters as shadow ones)."""
    args: list[Any] = ["EVALSHA", _SHA, 2 * len(hits) + (2 if dedupe is not None else 0)]
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
    args: list[Any] = ["EVALSHA", _COUNT_SHA, len(hits)]
    args += [hit.key for hit in hits]
    for hit in hits:
        args += (hit.hits, hit.ttl)
    return args


def _hit_keys(hit: Hit) -> tuple[bytes, bytes]:
    return hit.key, hit.previous or hit.key


def _hit_args(hit: Hit, quota_as_shadow: bool = False) -> tuple[Any, ...]:
    """A hit's eleven script arguments (see the script's header)."""
    role = hit.role
    if quota_as_shadow and role is Role.QUOTA:
        role = Role.SHADOW
    window = hit.window
    algorithm = decide.code(window)
    if algorithm == decide.BUCKET:
        params: tuple[int, ...] = (
            window.requests_per_unit,
            window.seconds * 1000,
            window.capacity,
            window.borrow,
        )
    elif role >= Role.USAGE:
        # A usage hit (`sidecar.usage`): p1 is when its hash or HyperLogLog expires, Unix ms.
        params = (hit.end_ms, 0, 0, 0)
    elif algorithm == decide.SLIDING:
        params = (window.requests_per_unit, 0, hit.start_ms, window.seconds * 1000)
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


#: How many hits' packed arguments `ApplyPacker` keeps before it starts over.
PACKED_HITS = 16_384
_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n" + _SHA.encode() + b"\r\n"
_EVALSHA_COUNT = b"$7\r\nEVALSHA\r\n$40\r\n" + _COUNT_SHA.encode() + b"\r\n"


class ApplyPacker:
    """The RESP bytes of an apply call, each hit's part packed once.

    A request's hits are the same objects for every call in their window (`sidecar.plan`), so
    their keys and arguments are packed the first time and kept by the hit's identity (the
    entry keeps the hit alive, so its id cannot be reused while the entry exists); only
    `decide.lua`'s mode and time are packed per call. A call on one hit, the common request, is
    kept whole (`count.lua`'s) or whole around those two (`decide.lua`'s). The bytes equal
    hiredis's packing of `_command`.
    """

    def __init__(self, size: int = PACKED_HITS) -> None:
        self._size = size
        self._parts: dict[int, _Parts] = {}

    def command(self, hits: Sequence[Hit], mode: int, now_ms: int) -> bytes:
        if len(hits) == 1:
            parts = self._parts.get(id(hits[0])) or self._pack(hits[0])
            if counts(hits, mode):
                return parts.count_alone
            return b"".join((parts.alone_head, _SMALL_BULKS[mode], _now(now_ms), parts.alone_tail))
        every = [self._parts.get(id(hit)) or self._pack(hit) for hit in hits]
        n = len(hits)
        if counts(hits, mode):
            return b"".join(
                (
                    _count_head(n),
                    *[parts.count_key for parts in every],
                    *[parts.count_args for parts in every],
                )
            )
        count = _SMALL_BULKS[n] if n < _SMALL else _bulk(n)
        return b"".join(
            (
                _head(n),
                *[parts.keys for parts in every],
                _SMALL_BULKS[mode],
                _now(now_ms),
                count,
                _GRACE,
                *[parts.args for parts in every],
            )
        )

    def _pack(self, hit: Hit) -> _Parts:
        if len(self._parts) >= self._size:
            self._parts.clear()
        parts = self._parts[id(hit)] = _Parts(hit)
        return parts


class _Parts:
    """One hit's parts of either script's call, packed once (see `ApplyPacker`)."""

    def __init__(self, hit: Hit) -> None:
        self.hit = hit
        # decide.lua: the hit's keys and its eleven arguments; a call on it alone, up to the
        # mode, and from the hit count on.
        self.keys = b"".join(map(_bulk, _hit_keys(hit)))
        self.args = b"".join(map(_bulk, _hit_args(hit)))
        self.alone_head = _head(1) + self.keys
        self.alone_tail = _bulk(1) + _GRACE + self.args
        # count.lua: the hit's key, its two arguments, and a whole call on it alone.
        self.count_key = _bulk(hit.key)
        self.count_args = _bulk(hit.hits) + _bulk(hit.ttl)
        self.count_alone = _count_head(1) + self.count_key + self.count_args


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
_SMALL = 256
_SMALL_BULKS = tuple(_bulk_any(number) for number in range(_SMALL))
_GRACE = _bulk(FIELD_GRACE * 1000)


def _record_commands(batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int) -> list[Any]:
    return [_decide_command(hits, MODE_RECORD, now_ms, dedupe=dedupe) for hits, dedupe in batches]


def _read_commands(addresses: Sequence[Address]) -> tuple[list[list[Any]], list[list[int]]]:
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


def _values(
    count: int, positions: list[list[int]], replies: Sequence[list[bytes | None]]
) -> list[State | None]:
    """The read replies as `decide` reads values: counts, or buckets ("tokens stamp drawn
    [keep until]"), None where nothing is stored."""
    values: list[State | None] = [None] * count
    for indexes, reply in zip(positions, replies, strict=True):
        for index, raw in zip(indexes, reply, strict=True):
            if raw is None:
                continue
            if b" " in raw:
                tokens, stamp, drawn = raw.split()[:3]
                values[index] = Bucket(float(tokens), int(float(stamp)), float(drawn))
            else:
                values[index] = int(raw)
    return values


def _duplicates(reply: Reply) -> list[bool]:
    """The record mode's answer: one flag per impression, true when its id was seen before."""
    return [flag == 1 for flag in reply]


def _outcomes(hits: Sequence[Hit], reply: Reply, now_ms: int, mode: int) -> list[Outcome]:
    """The reply of the script `_command` chose for `hits` in `mode`, as Outcomes."""
    if counts(hits, mode):
        return _counted(hits, reply, now_ms)
    return _decided(hits, reply, now_ms)


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


def _decided(hits: Sequence[Hit], reply: Reply, now_ms: int) -> list[Outcome]:
    """`decide.lua`'s five integers per hit, as Outcomes (window resets come from the hit)."""
    if len(hits) == 1:  # the common call, without the slicing
        over, remaining, reset_ms, applied, left_before = reply
        end_ms = hits[0].end_ms
        return [
            new(
                Outcome,
                (
                    over == 1,
                    remaining,
                    end_ms - now_ms if end_ms else reset_ms,
                    applied == 1,
                    left_before,
                ),
            )
        ]
    outcomes = []
    for index, hit in enumerate(hits):
        over, remaining, reset_ms, applied, left_before = reply[5 * index : 5 * index + 5]
        if hit.end_ms:  # a window (a bucket has no end: the script works out its reset)
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
    """Hand `done` the outcomes of the reply to `_command(hits, mode, now_ms)`, or the failure
    it ended with (a StorageError whose cause is what the client raised)."""
    if isinstance(reply, Exception):
        failure = _failure(backend, timeout_ms, reply)
        failure.__cause__ = reply
        done(failure)
        return
    try:
        outcomes = _outcomes(hits, reply, now_ms, mode)
    except Exception as exc:  # a reply of the wrong shape: a bug, not an outage
        done(exc)
        return
    done(outcomes)


async def _gather_all(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await every call, then raise the first failure.

    Waiting for all before raising leaves no call running unobserved after the caller returns;
    the caller's deadline still bounds the wait.
    """
    replies = await asyncio.gather(*calls, return_exceptions=True)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def _failure(backend: str, timeout_ms: int, exc: Exception) -> StorageError | Overloaded:
    """The StorageError for whatever a call raised, or Overloaded for a call the client refused
    because its server already had as many calls in flight as it answers in time.

    Mostly the pipelined clients' RedisReplyError and ConnectionLost, or the cluster client's
    ClusterError, and `asyncio.timeout` raises TimeoutError. The Backend contract promises
    StorageError only, so that the service answers with its failure mode rather than an
    internal error: callers catch every Exception and the original type stays in the message
    for the logs. Overloaded is kept apart: Redis is answering, so the failure mode (which
    would admit) must not.
    """
    if isinstance(exc, Overloaded):
        return Overloaded(f"{backend}: {exc}")
    if isinstance(exc, TimeoutError) and not isinstance(exc, RedisError):
        return StorageError(f"{backend}: no answer within {timeout_ms} ms")
    return StorageError(f"{backend}: {type(exc).__name__}: {exc}")


class RedisBackend:
    """A standalone Redis (or any single endpoint: a proxy, a managed primary).

    Calls go through the pipelined client (`pipeline.py`): every script call of an event-loop
    tick in one write, ticks taking turns on its connections, each call's script arguments
    packed once per window (`ApplyPacker`) and its deadline kept by the client.
    """

    name: str

    def __init__(self, client: PipelinedRedis, timeout_ms: int, name: str = "redis") -> None:
        #: "redis", or "redis-sentinel" for a master found through Sentinel (`sentinel.py`).
        self.name = name
        self._client = client
        self._timeout_ms = timeout_ms
        self._timeout = timeout_ms / 1000
        self._packer = ApplyPacker()

    @classmethod
    def from_url(cls, url: str, timeout_ms: int = 50) -> Self:
        """A backend for ``redis://[user:password@]host[:port][/db]`` or ``rediss://`` (TLS).

        TLS URLs accept ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and
        ``ssl_cert_reqs`` (none, optional, required) as query parameters. Nothing connects yet.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"{_redact(url)}: scheme must be redis:// or rediss://")
        timeout = _timeout_seconds(url, timeout_ms)
        host, port = _address(url, parts.netloc.rpartition("@")[2])
        tls = parts.scheme == "rediss"
        options = _tls_options(url, parts.query, tls)
        if parts.fragment:
            raise ValueError(f"{_redact(url)}: unexpected fragment '#{parts.fragment}'")
        client = PipelinedRedis(
            host,
            port,
            db=_database(url, parts.path),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            ssl_context=functools.partial(_ssl_context, options) if tls else None,
            connect_timeout=timeout,
        )
        return cls(client, timeout_ms)

    def apply_then(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied
    ) -> None:
        """One script call (see `Backend.apply_then`), its reply handed to
        `done` from the client's `data_received`, with no coroutine or future. The client keeps
        the deadline (one timer per connection, not one per call); a retry after NOSCRIPT keeps
        the same one."""
        if not hits:
            done([])
            return
        mode = MODE_ALL_OR_NOTHING if all_or_nothing else MODE_ADD
        deadline = self._client.time() + self._timeout

        def replied(reply: Any) -> None:
            if isinstance(reply, RedisReplyError) and str(reply).startswith("NOSCRIPT"):
                # The script cache is empty (see _run_pipelined): EVAL, by the same deadline.
                command = tuple(_eval(_command(hits, mode, now_ms)))
                self._client.call_packed(
                    hiredis.pack_command(command),
                    deadline,
                    lambda reply: applied(
                        self.name, self._timeout_ms, hits, mode, now_ms, reply, done
                    ),
                )
                return
            applied(self.name, self._timeout_ms, hits, mode, now_ms, reply, done)

        self._client.call_packed(self._packer.command(hits, mode, now_ms), deadline, replied)

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        """Record each batch (one user's impressions) exactly once; see `MemoryBackend.record`.

        The batches' script calls leave in one write (the pipelined client), each atomic.
        """
        if not batches:
            return []
        commands = _record_commands(batches, now_ms)
        try:
            async with asyncio.timeout(self._timeout):
                replies = await _gather_all(
                    _run_pipelined(self._client, command) for command in commands
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
                replies: list[Any]
                if len(commands) == 1:
                    replies = [await self._client.execute(*commands[0])]
                else:
                    # Issued in one tick: one write, one round trip.
                    replies = await _gather_all(
                        self._client.execute(*command) for command in commands
                    )
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, self._timeout_ms, exc) from exc
        return _values(len(addresses), positions, replies)

    async def peers(self, name: bytes) -> int:
        """Register this sidecar as `name` and count the sidecars sharing the counters
        (`sidecar.storage.peers`); raises StorageError."""
        failure = functools.partial(_failure, self.name, self._timeout_ms)
        return await peers.count_within(self._client.execute, name, self._timeout, failure)

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Every usage count hash matching `pattern` (`sidecar.usage`); raises StorageError."""
        try:
            async with asyncio.timeout(usage_reads.READ_TIMEOUT):
                return await usage_reads.hashes(self._client.execute, pattern)
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, int(usage_reads.READ_TIMEOUT * 1000), exc) from exc

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """PFCOUNT of each group of HyperLogLog keys (`sidecar.usage`); raises StorageError."""
        try:
            async with asyncio.timeout(usage_reads.READ_TIMEOUT):
                return await usage_reads.unique(self._client.execute, groups)
        except Exception as exc:  # every failure, see _failure
            raise _failure(self.name, int(usage_reads.READ_TIMEOUT * 1000), exc) from exc

    @property
    def client(self) -> PipelinedRedis:
        """The pipelined client, for the quota service's own keys (`sidecar.quota.store`)."""
        return self._client

    async def leave(self, name: bytes) -> None:
        """Take this sidecar's name out of the count at once (a clean stop)."""
        await peers.leave_within(self._client.execute, name, self._timeout)

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self._timeout):
                return bool(await self._client.execute("PING") == b"PONG")
        except Exception:  # ping never raises
            return False

    async def close(self) -> None:
        await self._client.close()


async def _run_pipelined(client: PipelinedRedis, command: list[Any]) -> Reply:
    """Run the script, sending its text only when the server has lost it."""
    try:
        reply: Reply = await client.execute(*command)
    except RedisReplyError as exc:
        if not str(exc).startswith("NOSCRIPT"):
            raise
        # The script cache is empty (restart, failover, SCRIPT FLUSH). EVAL runs the text and
        # caches it in one round trip, where SCRIPT LOAD + EVALSHA would take two.
        reply = await client.execute(*_eval(command))
    return reply


def _eval(command: list[Any]) -> list[Any]:
    """The EVAL form of an EVALSHA command: the script's text in place of its hash."""
    return ["EVAL", _TEXTS[command[1]], *command[2:]]


def _ssl_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The TLS context a rediss:// URL's query asks for (verification on unless told otherwise)."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    if "ssl_certfile" in options:
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    cert_reqs = options.get("ssl_cert_reqs", ssl.CERT_REQUIRED)
    if cert_reqs == ssl.CERT_NONE:
        context.check_hostname = False
    context.verify_mode = cert_reqs
    return context


def _timeout_seconds(url: str, timeout_ms: int) -> float:
    if timeout_ms <= 0:
        raise ValueError(
            f"{_redact(url)}: timeout must be a positive number of ms, not {timeout_ms}"
        )
    return timeout_ms / 1000


def _address(url: str, address: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) to a host and a port, `default_port` (6379) when none
    is given."""
    parts = urlsplit(f"//{address}")
    host = parts.hostname
    if not host:
        raise ValueError(f"{_redact(url)}: missing host in {address!r}")
    bad_port = f"{_redact(url)}: bad port in {address!r} (want a number from 1 to 65535)"
    try:
        port = parts.port
    except ValueError:
        raise ValueError(bad_port) from None
    if port == 0:
        raise ValueError(bad_port)
    return host, port if port is not None else default_port


def _database(url: str, path: str) -> int:
    name = path.lstrip("/")
    if not name:
        return 0
    if not (name.isascii() and name.isdigit()):
        raise ValueError(f"{_redact(url)}: database must be a number like /0, not {path!r}")
    return int(name)


def _tls_options(url: str, query: str, tls: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if not tls or name not in _TLS_OPTIONS:
            allowed = ", ".join(sorted(_TLS_OPTIONS)) if tls else "none"
            raise ValueError(
                f"{_redact(url)}: unknown query parameter {name!r} (allowed: {allowed})"
            )
        if name == "ssl_cert_reqs":
            if value not in _CERT_REQS:
                raise ValueError(
                    f"{_redact(url)}: ssl_cert_reqs must be none, optional or required, "
                    f"not {value!r}"
                )
            options[name] = _CERT_REQS[value]
        else:
            options[name] = value
    return options


def _redact(url: str) -> str:
    """The URL with its passwords hidden (the userinfo's, and a ``sentinel_password`` query
    parameter's), for error messages that end up in logs."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    hide_password = bool(at) and ":" in userinfo
    if not hide_password and "sentinel_password=" not in parts.query:
        return url
    if hide_password:
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hosts}")
    query = "&".join(
        "sentinel_password=***" if field.startswith("sentinel_password=") else field
        for field in parts.query.split("&")
    )
    return parts._replace(query=query).geturl()
