"""statsd and DogStatsD: the reference's stats, sent as its sinks send them, in batches.

Nothing is counted here and nothing runs per request: every `flush_interval` seconds (the
reference's STATS_FLUSH_INTERVAL, 10 s) `StatsdReporter` reads `sidecar.decision.stats.Stats` and the
transport's `Latency`, and sends what grew since the last flush, packed into as few writes as
fit (one TCP write, or UDP datagrams of at most 1,432 bytes), on the event loop.

Names are the reference's (its `src/stats/manager_impl.go` and `src/metrics/metrics.go`):

- `ratelimit.service.rate_limit.<metric key>.total_hits|over_limit|near_limit|within_limit|
  shadow_mode|over_limit_with_local_cache|total_negative_hits` (and, ours, a penalty's
  `penalty_blocks|over_limit_with_penalty`) and
  `ratelimit.service.rate_limit.<domain>.domain_not_found` (and, ours,
  `ratelimit.service.rate_limit.<domain>.<key>.denied_by_list|allowed_by_list`: requests an
  allow or deny list decided, `sidecar.core.lists`);
- `ratelimit.service.config_load_success|config_load_error|global_shadow_mode` and
  `ratelimit.service.call.should_rate_limit.redis_error|service_error` (and `overloaded`, ours:
  calls refused UNAVAILABLE);
- `ratelimit_server.ShouldRateLimit.total_requests` and the timer
  `ratelimit_server.ShouldRateLimit.response_time` in milliseconds.

Counters are sent as the reference's stats library (lyft/gostats) sends them: the increase
since the last flush, only when it is not zero. The timer is sent from the latency histogram
rather than one line per call: each bucket that saw calls in the interval is one line, its
upper bound in ms, with the sample rate 1/calls (`|@0.01` for 100 calls), so a statsd server
counts every call and sees each at the histogram's resolution.

Formats:

- statsd (`USE_STATSD`, TCP unless STATSD_PROTOCOL=udp): `name:value|c` lines, the tags
  (EXTRA_TAGS) folded into the name as gostats does, `.__key=value` sorted by key, the
  characters `.:|` of a value turned into `_`;
- DogStatsD (`USE_DOG_STATSD`, UDP): `name:value|c|#key:value,...`, the tags as tags, and
  mogrifiers (`DOG_STATSD_MOGRIFIER_<NAME>_PATTERN`, `_NAME`, `_TAGS`) that rewrite a name into
  a shorter one with tags: the first whose pattern matches the name wins, `$1` in its NAME and
  TAGS standing for the pattern's first group.

A statsd server that is down costs nothing but the lost stats: a TCP connection is tried again
at the next flush, and what could not be sent is dropped (logged once until a send works).

One module past the usual size because it is one protocol written once: the names, both wire
formats and the mogrifiers above are read by the one reporter that sends them, and a tenth of
its length is this description of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import structlog

from sidecar.decision.stats import Stats
from sidecar.telemetry.metrics import Latency

#: The largest UDP payload sent: what fits a 1,500-byte Ethernet frame, as datadog-go and
#: gostats size theirs, so no datagram is fragmented.
MAX_DATAGRAM = 1_432
#: Seconds to connect to, or write to, a TCP statsd before this flush's stats are dropped.
TCP_TIMEOUT = 5.0
#: The reference's STATS_FLUSH_INTERVAL.
FLUSH_INTERVAL = 10.0
DEFAULT_PORT = 8125

_RULE_STATS = (
    "total_hits",
    "over_limit",
    "near_limit",
    "within_limit",
    "shadow_mode",
    "over_limit_with_local_cache",
    "total_negative_hits",
    "penalty_blocks",
    "over_limit_with_penalty",
)
_UNSAFE_NAME = re.compile(r"[:|@#\n\r,]")
_UNSAFE_TAG_VALUE = re.compile(r"[.:|\n\r,#]")
_PLACEHOLDER = re.compile(r"\$(\d+)")

log = structlog.get_logger("sidecar.statsd")

Protocol = Literal["tcp", "udp"]
Format = Literal["statsd", "dogstatsd"]


class StatsdError(ValueError):
    """A statsd setting that cannot be used; the message names the variable or flag."""


@dataclass(frozen=True)
class Mogrifier:
    """DogStatsD: a name that matches `pattern` is sent as `name` with `tags` ($N: group N)."""

    pattern: re.Pattern[str]
    name: str
    tags: tuple[tuple[str, str], ...] = ()

    def apply(self, metric: str) -> tuple[str, list[str]] | None:
        found = self.pattern.search(metric)
        if found is None:
            return None
        groups = [found.group(0), *found.groups(default="")]

        def fill(template: str) -> str:
            return _PLACEHOLDER.sub(
                lambda m: groups[int(m[1])] if int(m[1]) < len(groups) else m[0], template
            )

        return fill(self.name), [f"{key}:{fill(value)}" for key, value in self.tags]


@dataclass(frozen=True)
class StatsdSettings:
    host: str = "localhost"
    port: int = DEFAULT_PORT
    protocol: Protocol = "tcp"
    format: Format = "statsd"
    flush_interval: float = FLUSH_INTERVAL
    #: EXTRA_TAGS: on every stat.
    tags: tuple[tuple[str, str], ...] = ()
    mogrifiers: tuple[Mogrifier, ...] = field(default=())


# --- settings from text (the CLI and the reference's variables) ---------------------------------


def parse_duration(text: str) -> float:
    """Seconds from a Go duration (`10s`, `500ms`, `1m30s`) or a plain number of seconds."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
        parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
        if not parts or "".join(a + b for a, b in parts) != text:
            raise StatsdError(f"expected a duration such as 10s or 500ms, got {text!r}") from None
        seconds = sum(float(amount) * units[unit] for amount, unit in parts)
    if not seconds > 0:
        raise StatsdError(f"must be more than 0, got {text!r}")
    return seconds


def parse_tags(text: str) -> tuple[tuple[str, str], ...]:
    """`key:value,key2:value2` (EXTRA_TAGS) as pairs, in the order given."""
    pairs = []
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition(":")
        if not sep or not key.strip():
            raise StatsdError(f"expected key:value pairs separated by ',', got {part!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def mogrifiers_from_env(names: Sequence[str], environ: Mapping[str, str]) -> tuple[Mogrifier, ...]:
    """The mogrifiers USE_DOG_STATSD_MOGRIFIERS names, from DOG_STATSD_MOGRIFIER_<NAME>_*."""
    found = []
    for name in names:
        prefix = f"DOG_STATSD_MOGRIFIER_{name}"
        pattern = environ.get(f"{prefix}_PATTERN", "")
        if not pattern:
            raise StatsdError(f"{prefix}_PATTERN: no pattern for mogrifier {name}")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise StatsdError(f"{prefix}_PATTERN={pattern!r}: {exc}") from exc
        renamed = environ.get(f"{prefix}_NAME", "")
        if not renamed:
            raise StatsdError(f"{prefix}_NAME: no name for mogrifier {name}")
        tags = parse_tags(environ.get(f"{prefix}_TAGS", ""))
        for key, value in tags:
            if not value:
                raise StatsdError(f"{prefix}_TAGS: tag {key!r} has no value")
        found.append(Mogrifier(compiled, renamed, tags))
    return tuple(found)


# --- what is sent -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """One line: a name, a value, its kind (`c`, `ms`) and a sample rate below 1 if any."""

    name: str
    value: float
    kind: str
    rate: float = 1.0


class Encoder:
    """Stat lines in the chosen format (see the module docstring)."""

    def __init__(self, settings: StatsdSettings) -> None:
        self.format = settings.format
        self.mogrifiers = settings.mogrifiers
        ordered = sorted(settings.tags)
        # gostats folds tags into the name; DogStatsD's sink unfolds them again into tags.
        self._suffix = "".join(f".__{k}={_UNSAFE_TAG_VALUE.sub('_', v)}" for k, v in ordered)
        self._tags = [f"{k}:{_UNSAFE_TAG_VALUE.sub('_', v)}" for k, v in ordered]

    def encode(self, stat: Stat) -> bytes:
        name = _UNSAFE_NAME.sub("_", stat.name)
        value = _number(stat.value)
        rate = f"|@{stat.rate:.6g}" if stat.rate < 1.0 else ""
        if self.format == "statsd":
            return f"{name}{self._suffix}:{value}|{stat.kind}{rate}\n".encode()
        tags = list(self._tags)
        for mogrifier in self.mogrifiers:
            applied = mogrifier.apply(name)
            if applied is not None:
                name, more = applied
                tags += more
                break
        tagged = f"|#{','.join(tags)}" if tags else ""
        return f"{name}:{value}|{stat.kind}{rate}{tagged}\n".encode()


def _number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


class Deltas:
    """What grew since the last call of `take`: the counters as gostats latches them."""

    def __init__(self, stats: Stats, latency: Latency | None) -> None:
        self.stats = stats
        self.latency = latency
        self._sent: dict[str, int] = {}
        # From the instance: in the compiled build a class attribute of Latency is not a tuple.
        self._latency_sent = [0] * (len(latency.counts) if latency is not None else 0)

    def take(self) -> list[Stat]:
        found = []
        for name, value in self._counters():
            delta = value - self._sent.get(name, 0)
            if delta:
                self._sent[name] = value
                found.append(Stat(name, delta, "c"))
        found += self._timer()
        return found

    def _counters(self) -> Iterator[tuple[str, int]]:
        stats = self.stats
        prefix = "ratelimit.service."
        for key, rule in list(stats.rules.items()):
            for stat in _RULE_STATS:
                yield f"{prefix}rate_limit.{key}.{stat}", getattr(rule, stat)
        for domain, count in list(stats.domain_not_found.items()):
            yield f"{prefix}rate_limit.{domain}.domain_not_found", count
        for key, count in list(stats.denied_by_list.items()):
            yield f"{prefix}rate_limit.{key}.denied_by_list", count
        for key, count in list(stats.allowed_by_list.items()):
            yield f"{prefix}rate_limit.{key}.allowed_by_list", count
        yield f"{prefix}config_load_success", stats.config_load_success
        yield f"{prefix}config_load_error", stats.config_load_error
        yield f"{prefix}global_shadow_mode", stats.global_shadow_mode
        yield f"{prefix}call.should_rate_limit.redis_error", stats.backend_error
        yield f"{prefix}call.should_rate_limit.service_error", stats.service_error
        yield f"{prefix}call.should_rate_limit.overloaded", stats.overloaded
        yield "ratelimit_server.ShouldRateLimit.total_requests", stats.total_requests

    def _timer(self) -> list[Stat]:
        if self.latency is None:
            return []
        found = []
        counts = list(self.latency.counts)
        buckets = self.latency.BUCKETS
        bounds = (*buckets, buckets[-1])  # past the last bound: the last bound
        for index, (count, sent) in enumerate(zip(counts, self._latency_sent, strict=True)):
            calls = count - sent
            if calls > 0:
                found.append(
                    Stat(
                        "ratelimit_server.ShouldRateLimit.response_time",
                        bounds[index] * 1000,
                        "ms",
                        rate=1.0 / calls,
                    )
                )
        self._latency_sent = counts
        return found


def pack(lines: Sequence[bytes], limit: int) -> list[bytes]:
    """Lines joined into payloads of at most `limit` bytes (a longer line goes alone)."""
    payloads: list[bytes] = []
    current = bytearray()
    for line in lines:
        if current and len(current) + len(line) > limit:
            payloads.append(bytes(current))
            current.clear()
        current += line
    if current:
        payloads.append(bytes(current))
    return payloads


# --- sending ------------------------------------------------------------------------------------------


class StatsdReporter:
    """Flushes one sidecar's stats to statsd every `settings.flush_interval` seconds."""

    def __init__(
        self, settings: StatsdSettings, stats: Stats, latency: Latency | None = None
    ) -> None:
        if settings.format == "dogstatsd" and settings.protocol != "udp":
            raise StatsdError("DogStatsD is sent over UDP (STATSD_PROTOCOL=udp)")
        self.settings = settings
        self.encoder = Encoder(settings)
        self.deltas = Deltas(stats, latency)
        self._writer: asyncio.StreamWriter | None = None
        self._datagrams: asyncio.DatagramTransport | None = None
        self._failing: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: Payloads (TCP writes or UDP datagrams) sent, and stats dropped, since the start.
        self.sent = 0
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval)
            await self.flush()

    async def flush(self) -> None:
        """Send what grew since the last flush (nothing when nothing did)."""
        stats = self.deltas.take()
        if not stats:
            return
        lines = [self.encoder.encode(stat) for stat in stats]
        try:
            if self.settings.protocol == "udp":
                await self._send_udp(pack(lines, MAX_DATAGRAM))
            else:
                await self._send_tcp(b"".join(lines))
        except (OSError, TimeoutError) as exc:
            self.dropped += len(stats)
            self._fail(exc)
            return
        if self._failing is not None:
            log.info("statsd_recovered", address=self._address())
            self._failing = None

    async def _send_udp(self, payloads: list[bytes]) -> None:
        if self._datagrams is None:
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_datagram_endpoint(
                asyncio.DatagramProtocol, remote_addr=(self.settings.host, self.settings.port)
            )
            self._datagrams = transport
        for payload in payloads:
            self._datagrams.sendto(payload)
            self.sent += 1

    async def _send_tcp(self, payload: bytes) -> None:
        async with asyncio.timeout(TCP_TIMEOUT):
            if self._writer is None or self._writer.is_closing():
                _, self._writer = await asyncio.open_connection(
                    self.settings.host, self.settings.port
                )
            self._writer.write(payload)
            try:
                await self._writer.drain()
            except (OSError, TimeoutError):
                self._close_tcp()
                raise
        self.sent += 1

    def _fail(self, exc: BaseException) -> None:
        self._close_tcp()
        reason = f"{type(exc).__name__}: {exc}"
        if self._failing is None:
            log.warning("statsd_unreachable", address=self._address(), error=reason)
        self._failing = reason

    def _close_tcp(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _address(self) -> str:
        return f"{self.settings.protocol}://{self.settings.host}:{self.settings.port}"

    async def stop(self) -> None:
        """Stop flushing, send what is left, and close."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._datagrams is not None:
            self._datagrams.close()
            self._datagrams = None
