"""Usage: who called what, per calendar day, counted in the decision's own backend call.

A domain declares what to count (`usage` in its rules file)::

    usage:
      - by: [app]                  # calls per app per day
      - by: [app, interface]       # calls per app and interface per day
      - by: [app]
        unique: user               # and distinct users per app per day
        timezone: Asia/Shanghai    # days run midnight to midnight there (default UTC)
        retention_days: 30         # today and the 29 days before stay readable (default 7)

Every ShouldRateLimit request of the domain that carries each `by` key (in any descriptor:
the first entry with that key gives its value) counts, per dimension, its hits (its largest
`hits_addend`, 1 for most requests) as admitted or refused: refused when its limits refused it
(in shadow mode too: what they would have refused). A check (every `hits_addend` 0) counts
nothing. `unique` adds the request's value of that key to a HyperLogLog of the dimension's key
(see `sidecar.algorithms.hyperloglog`: standard error 0.81%, 12 KB at most each in Redis).

The counts ride along with the decision: the plan (`sidecar.decision.plan`) adds hits of role USAGE and
UNIQUE (`model.Role`) after the request's counters, and the backend applies them in the same
script call (Redis) or the same step (memory), judged with nothing, counted as the call's
answer says. Their keys share the hash slot of the request's first counter (its first entry's
hash tag), so a Redis Cluster needs no other call either, unless the request's counters span
several slots: then no one slot's script sees all its limits, and the usage hits go in a call
after the decision, counted as the whole request's answer says
(`RedisClusterBackend._decide_then_count_usage`)::

    rl{<domain>|<key1>|<value1>}|%u|<YYYYMMDD>   field <k>|<v>|...|a (admitted), ...|r (refused)
    rl{<domain>|<key1>|<value1>}|%h|<YYYYMMDD>|<k>|<v>|...|<unique key>   a HyperLogLog

So a day's counts of one dimension lie in one small hash per first entry (per app, when `app`
leads the descriptors), which a reader finds by scanning (`report`). Each expires
`retention_days` after its day began. Cost: one hash field per distinct key and outcome per
day, and one HyperLogLog per distinct key per day (`make bench` measures both).

One module past the usual size because it is one key layout: the rules' declaration, the keys
and fields a request counts into, and the report that reads them back all spell the layout
above, and a change to it changes the three together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from typing import Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo

from sidecar.algorithms.windows import check_zone, midnight
from sidecar.core.keys import descriptor_prefix, escape
from sidecar.errors import ConfigError
from sidecar.model import Hit, Request, Role, Unit, Window

#: Bounds on what a domain may declare.
MAX_DIMENSIONS = 16
MAX_BY = 8
MAX_RETENTION_DAYS = 366
DEFAULT_RETENTION_DAYS = 7
#: The window every usage hit names (a usage hit is judged by nothing: see `Role.USAGE`).
USAGE_WINDOW = Window(0, Unit.DAY, name="usage")
_KEYS = ("by", "unique", "timezone", "retention_days")
#: The markers that follow a hash tag in usage keys; `keys.escape` never writes `%u` or `%h`.
COUNTS, UNIQUES = "%u", "%h"
ADMITTED, REFUSED = "a", "r"


@dataclass(frozen=True, slots=True)
class Dimension:
    """What one `usage` entry counts: calls per value of the `by` keys, and with `unique` the
    distinct values of that key per value of the `by` keys."""

    by: tuple[str, ...]
    unique: str | None = None

    @property
    def name(self) -> str:
        """How `/v1/usage?by=` and the metrics name it: the keys joined by commas."""
        return ",".join(self.by)


@dataclass(frozen=True, slots=True)
class Usage:
    """A domain's usage dimensions, and the day they count by and how long they keep it."""

    dimensions: tuple[Dimension, ...]
    timezone: str = "UTC"
    retention_days: int = DEFAULT_RETENTION_DAYS
    #: Each distinct `by`, in declaration order (what is counted), and the unique keys of each.
    counted: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)
    uniques: Mapping[tuple[str, ...], tuple[str, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        uniques: dict[tuple[str, ...], list[str]] = {}
        for dimension in self.dimensions:
            kept = uniques.setdefault(dimension.by, [])
            if dimension.unique is not None and dimension.unique not in kept:
                kept.append(dimension.unique)
        object.__setattr__(self, "counted", tuple(uniques))
        object.__setattr__(self, "uniques", {by: tuple(u) for by, u in uniques.items()})

    def find(self, by: Sequence[str]) -> tuple[str, ...] | None:
        """The counted `by` equal to `by`, or None when the domain does not count it."""
        wanted = tuple(by)
        return wanted if wanted in self.uniques else None

    def today(self, now_ms: int) -> date:
        return day_at(now_ms, self.timezone)

    def days(self, now_ms: int) -> list[date]:
        """The days still kept, oldest first, today last."""
        today = self.today(now_ms)
        return [today - timedelta(days=n) for n in range(self.retention_days - 1, -1, -1)]


def parse(raw: object, source: str, path: str = "usage") -> Usage:
    """The `usage` list of a rules file; raises ConfigError naming the file, path and fix."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(
            source, path, "usage must be a list of maps like {by: [app]} (or remove 'usage')"
        )
    if len(raw) > MAX_DIMENSIONS:
        raise ConfigError(
            source, path, f"at most {MAX_DIMENSIONS} usage dimensions, got {len(raw)}"
        )
    dimensions = []
    zones: set[str] = set()
    retentions: set[int] = set()
    for index, item in enumerate(raw):
        here = f"{path}[{index}]"
        if not isinstance(item, dict):
            raise ConfigError(
                source, here, f"a usage dimension is a map like {{by: [app]}}, got {item!r}"
            )
        for key in item:
            if key not in _KEYS:
                raise ConfigError(
                    source,
                    here,
                    f"unknown key '{key}' in a usage dimension (allowed: {', '.join(_KEYS)})",
                )
        by = item.get("by")
        if isinstance(by, str):
            by = [by]
        if (
            not isinstance(by, list)
            or not by
            or not all(isinstance(k, str) and k for k in by)
            or len(set(by)) != len(by)
        ):
            raise ConfigError(
                source,
                f"{here}.by",
                "by must be a list of distinct descriptor keys, like [app, interface]",
            )
        if len(by) > MAX_BY:
            raise ConfigError(source, f"{here}.by", f"at most {MAX_BY} keys in by, got {len(by)}")
        unique = item.get("unique")
        if unique is not None and (not isinstance(unique, str) or not unique):
            raise ConfigError(
                source, f"{here}.unique", "unique must be one descriptor key, like user"
            )
        if unique in by:
            raise ConfigError(
                source,
                f"{here}.unique",
                f"'{unique}' is in by: count the distinct values of another key",
            )
        zone = item.get("timezone", "UTC")
        if not isinstance(zone, str):
            raise ConfigError(
                source, f"{here}.timezone", "timezone must be an IANA name like 'Asia/Shanghai'"
            )
        try:
            check_zone(zone)
        except ValueError as exc:
            raise ConfigError(source, f"{here}.timezone", str(exc)) from exc
        days = item.get("retention_days", DEFAULT_RETENTION_DAYS)
        if (
            isinstance(days, bool)
            or not isinstance(days, int)
            or not 1 <= days <= MAX_RETENTION_DAYS
        ):
            raise ConfigError(
                source,
                f"{here}.retention_days",
                f"retention_days must be a whole number from 1 to {MAX_RETENTION_DAYS}, got {days!r}",
            )
        zones.add(zone)
        retentions.add(days)
        if len(zones) > 1 or len(retentions) > 1:
            raise ConfigError(
                source,
                here,
                "every usage dimension of a domain counts by the same days: give all the same "
                "timezone and retention_days",
            )
        dimension = Dimension(tuple(by), unique)
        if dimension in dimensions:
            raise ConfigError(source, here, f"usage dimension by [{dimension.name}] declared twice")
        dimensions.append(dimension)
    return Usage(tuple(dimensions), zones.pop(), retentions.pop())


# --- Days ------------------------------------------------------------------------------------


def day_at(now_ms: int, zone: str) -> date:
    """The calendar day in `zone` holding `now_ms`."""
    return datetime.fromtimestamp(now_ms // 1000, ZoneInfo(zone)).date()


def day_id(day: date) -> str:
    """A day as usage keys name it: YYYYMMDD."""
    return f"{day.year:04d}{day.month:02d}{day.day:02d}"


def day_bounds_ms(day: date, zone: str) -> tuple[int, int]:
    """(first instant, first instant of the next day) of `day` in `zone`, Unix ms."""
    return midnight(day, zone) * 1000, midnight(day + timedelta(days=1), zone) * 1000


def expires_ms(day: date, usage: Usage) -> int:
    """When a day's usage is dropped: `retention_days` after the day began, in its zone."""
    return midnight(day + timedelta(days=usage.retention_days), usage.timezone) * 1000


# --- Keys --------------------------------------------------------------------------------------


def pairs(by: Sequence[str], values: Sequence[str]) -> str:
    """`k1|v1|k2|v2`, each part escaped as counter keys escape them."""
    return "|".join(f"{escape(k)}|{escape(v)}" for k, v in zip(by, values, strict=True))


def count_key(head: str, day: date) -> bytes:
    """The hash of a day's counts beside the counters whose hash tag opens `head` (`rl{...}`)."""
    return f"{head}|{COUNTS}|{day_id(day)}".encode()


def unique_key(
    head: str, day: date, by: Sequence[str], values: Sequence[str], unique: str
) -> bytes:
    """The HyperLogLog of the distinct values of `unique` for one key of a dimension and day."""
    return f"{head}|{UNIQUES}|{day_id(day)}|{pairs(by, values)}|{escape(unique)}".encode()


def _unescape(part: str) -> str:
    if "%" not in part:
        return part
    return part.replace("%7C", "|").replace("%7B", "{").replace("%7D", "}").replace("%25", "%")


def domain_of(key: bytes) -> str | None:
    """The domain in a usage key's hash tag (`rl{domain|...}`), None for another key."""
    text = key.decode(errors="replace")
    if not text.startswith("rl{"):
        return None
    return _unescape(text[3:].split("|", 1)[0])


def read_count_field(name: bytes) -> tuple[tuple[str, ...], tuple[str, ...], bool] | None:
    """(by, values, refused) of a count hash's field, None for a field that is not one."""
    parts = name.decode(errors="replace").split("|")
    if len(parts) < 3 or len(parts) % 2 == 0 or parts[-1] not in (ADMITTED, REFUSED):
        return None
    named = [_unescape(p) for p in parts[:-1]]
    return tuple(named[0::2]), tuple(named[1::2]), parts[-1] == REFUSED


def count_pattern(domain: str, day: date) -> str:
    """A glob (Redis SCAN MATCH) that finds every count hash of `domain` on `day`."""
    return f"rl{{{_glob(escape(domain))}|*}}|{COUNTS}|{day_id(day)}"


def is_count_key(key: bytes, domain: str, day: date) -> bool:
    """Whether `key` is a count hash of `domain` on `day` (what `count_pattern` matches)."""
    return key.endswith(f"}}|{COUNTS}|{day_id(day)}".encode()) and domain_of(key) == domain


def _glob(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# --- What a request counts -------------------------------------------------------------------


class Tally:
    """The usage hits of one prepared request: its count fields and unique members, turned into
    hits for the day at hand (rebuilt when the day changes, as `plan.WindowHits` rebuilds)."""

    __slots__ = (
        "_cost",
        "_counts",
        "_from",
        "_head",
        "_hits",
        "_refused",
        "_uniques",
        "_until",
        "usage",
    )

    def __init__(
        self,
        usage: Usage,
        head: str,
        cost: int,
        counts: Sequence[tuple[tuple[str, ...], tuple[str, ...]]],
        uniques: Sequence[tuple[tuple[str, ...], tuple[str, ...], str, str]],
    ) -> None:
        self.usage = usage
        self._head = head
        self._cost = cost
        self._counts = counts
        self._uniques = uniques
        self._from = 1
        self._until = 0
        self._hits: list[Hit] = []
        self._refused: list[Hit] = []

    def at(self, now_ms: int, refused: bool = False) -> list[Hit]:
        """The usage hits of a call at `now_ms` (the same list while the day holds: do not
        change it); `refused`: the request is known refused already (from the over-limit cache),
        so every count goes to its refused field whatever the call finds."""
        if not self._from <= now_ms < self._until:
            self._build(now_ms)
        return self._refused if refused else self._hits

    def _build(self, now_ms: int) -> None:
        usage = self.usage
        day = usage.today(now_ms)
        self._from, self._until = day_bounds_ms(day, usage.timezone)
        end = expires_ms(day, usage)
        key = count_key(self._head, day)
        hits, refused = [], []
        for by, values in self._counts:
            head = pairs(by, values)
            admitted_field = f"{head}|{ADMITTED}".encode()
            refused_field = f"{head}|{REFUSED}".encode()
            hits.append(_usage_hit(key, self._cost, Role.USAGE, end, admitted_field, refused_field))
            refused.append(
                _usage_hit(key, self._cost, Role.USAGE, end, refused_field, refused_field)
            )
        for by, values, unique, member in self._uniques:
            hll = unique_key(self._head, day, by, values, unique)
            hit = _usage_hit(hll, self._cost, Role.UNIQUE, end, member.encode(), b"")
            hits.append(hit)
            refused.append(hit)
        self._hits, self._refused = hits, refused


def as_refused(hit: Hit) -> Hit:
    """A usage hit counting its request as refused: a count's hits go to its refused field
    (`previous_field`), whatever the call's answer says; a unique count is the same either way.
    For a request whose answer the call counting its usage cannot see (local aggregation, a
    Redis Cluster's other slots)."""
    if hit.role is Role.USAGE:
        return replace(hit, field=hit.previous_field)
    return hit


def _usage_hit(
    key: bytes, cost: int, role: Role, end_ms: int, field: bytes, previous: bytes
) -> Hit:
    return Hit(
        key, cost, USAGE_WINDOW, role=role, end_ms=end_ms, field=field, previous_field=previous
    )


def tally(
    domain: str, usage: Usage, request: Request, first: tuple[str, str] | None
) -> Tally | None:
    """What `request` counts under `usage`, or None when it counts nothing (a check, or no
    dimension's keys all present). `first` is the first entry of the request's first counter
    (its hash tag, where the usage keys go), None when no descriptor is counted."""
    values: dict[str, str] = {}
    cost = 0
    default = request.hits_addend or 1
    for descriptor in request.descriptors:
        hits = descriptor.hits_addend if descriptor.hits_addend is not None else default
        cost = max(cost, hits)
        for entry in descriptor.entries:
            values.setdefault(entry.key, entry.value)
    if cost == 0:
        return None
    counts = []
    uniques = []
    for by in usage.counted:
        if not all(k in values for k in by):
            continue
        keyed = tuple(values[k] for k in by)
        counts.append((by, keyed))
        for unique in usage.uniques[by]:
            if unique in values:
                uniques.append((by, keyed, unique, values[unique]))
    if not counts:
        return None
    if first is None:
        by, keyed = counts[0]
        first = (by[0], keyed[0])
    return Tally(usage, descriptor_prefix(domain, [first]), cost, counts, uniques)


# --- Reading ----------------------------------------------------------------------------------


@dataclass(slots=True)
class KeyUsage:
    """One key's usage on one day."""

    values: tuple[str, ...]
    admitted: int = 0
    refused: int = 0
    unique: dict[str, int] = field(default_factory=dict)
    #: Where its unique counts are (one HyperLogLog per hash tag it was counted under).
    unique_keys: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.admitted + self.refused


def tabulate(
    hashes: Iterable[tuple[bytes, Mapping[bytes, int]]],
    by: tuple[str, ...],
    domain: str,
    day: date,
    uniques: Sequence[str],
) -> dict[tuple[str, ...], KeyUsage]:
    """Every key of dimension `by` in a day's count hashes (`count_key`), summed across hashes
    (a key counted under several hash tags lies in several), with the HyperLogLog keys of its
    `uniques` named."""
    keys: dict[tuple[str, ...], KeyUsage] = {}
    for key, fields in hashes:
        if not is_count_key(key, domain, day):
            continue
        head = key.decode()[: -len(f"|{COUNTS}|{day_id(day)}")]
        for name, value in fields.items():
            read = read_count_field(name)
            if read is None or read[0] != by:
                continue
            _, values, refused = read
            found = keys.get(values)
            if found is None:
                found = keys[values] = KeyUsage(values)
            if refused:
                found.refused += int(value)
            else:
                found.admitted += int(value)
            for unique in uniques:
                hll = unique_key(head, day, by, values, unique)
                kept = found.unique_keys.setdefault(unique, [])
                if hll not in kept:
                    kept.append(hll)
    return keys


def top(keys: Mapping[tuple[str, ...], KeyUsage], n: int) -> list[KeyUsage]:
    """The `n` keys with the most calls (admitted and refused), ties by their values."""
    return sorted(keys.values(), key=lambda k: (-k.total, k.values))[:n]


@runtime_checkable
class Reader(Protocol):
    """What a backend offers `report` (each backend reads its own store)."""

    async def usage_hashes(self, pattern: str) -> list[tuple[bytes, dict[bytes, int]]]:
        """Every hash whose key matches the glob `pattern` (`count_pattern`), with its fields."""
        ...

    async def usage_unique(self, groups: Sequence[Sequence[bytes]]) -> list[int]:
        """For each group of HyperLogLog keys, the distinct members of their union."""
        ...


#: Keys `/v1/usage` answers with per day at most.
MAX_TOP = 1_000


async def report(
    reader: Reader,
    domain: str,
    usage: Usage,
    by: tuple[str, ...],
    days: Sequence[date],
    n: int,
) -> dict[str, Any]:
    """`/v1/usage`'s answer: for each day, the day's totals over every key of dimension `by`
    and its `n` keys with the most calls, each with its admitted, refused and (where declared)
    unique counts."""
    uniques = usage.uniques[by]
    answer_days = []
    for day in days:
        hashes = await reader.usage_hashes(count_pattern(domain, day))
        keys = tabulate(hashes, by, domain, day, uniques)
        kept = top(keys, n)
        groups = [(k, u, k.unique_keys.get(u, [])) for k in kept for u in uniques]
        counted = await reader.usage_unique([g for _, _, g in groups]) if groups else []
        for (k, unique, _), value in zip(groups, counted, strict=True):
            k.unique[unique] = value
        answer_days.append(
            {
                "day": day.isoformat(),
                "keys": len(keys),
                "admitted": sum(k.admitted for k in keys.values()),
                "refused": sum(k.refused for k in keys.values()),
                "top": [
                    {
                        "key": dict(zip(by, k.values, strict=True)),
                        "admitted": k.admitted,
                        "refused": k.refused,
                        "total": k.total,
                        **({"unique": dict(k.unique)} if uniques else {}),
                    }
                    for k in kept
                ],
            }
        )
    return {
        "domain": domain,
        "by": list(by),
        "unique": list(uniques),
        "timezone": usage.timezone,
        "retention_days": usage.retention_days,
        "days": answer_days,
    }
