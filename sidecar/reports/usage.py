"""`GET /v1/usage`, the usage command and the page read usage through here: a query's
parameters checked (each mistake a reason for a 400), then `usage.report` on the backend.

    GET /v1/usage?domain=D&by=app[,interface][&day=YYYY-MM-DD | &from=...&to=...][&top=N]

`day` defaults to today in the domain's usage time zone; `from` and `to` name a range of days,
both kept (at most `retention_days` of them); `top` (default 10, at most 1,000) keeps the keys
with the most calls. Also here: `dimensions` (what every domain counts, for the page) and
`Refusals` (which limits refused calls lately, from the stats the sidecar keeps), and `TopKeys`
(today's top keys of each dimension, for Prometheus).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

import structlog

from sidecar.core import usage
from sidecar.core.rules import Rules, describe
from sidecar.decision.stats import Stats
from sidecar.errors import StorageError

DEFAULT_TOP = 10

log = structlog.get_logger("sidecar.usage")


class QueryError(ValueError):
    """A query that cannot be answered; its message is the reason (a 400, or 404 `missing`)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Query:
    domain: str
    usage: usage.Usage
    by: tuple[str, ...]
    days: tuple[date, ...]
    top: int


def parse(rules: Rules, params: Mapping[str, str], now_ms: int) -> Query:
    """The query `params` ask for under `rules`; raises QueryError with the reason."""
    name = params.get("domain", "")
    if not name:
        raise QueryError("domain is required: ?domain=NAME&by=KEY[,KEY]")
    domain = rules.domains.get(name)
    if domain is None:
        raise QueryError(f"unknown domain '{name}'", missing=True)
    counted = domain.usage
    if counted is None:
        raise QueryError(
            f"domain '{name}' declares no usage (add 'usage' to its rules)", missing=True
        )
    by_text = params.get("by", "")
    declared = ", ".join(",".join(by) for by in counted.counted)
    by = counted.find(by_text.split(",")) if by_text else None
    if by is None:
        raise QueryError(f"by must be one of the domain's usage dimensions: {declared}")
    today = counted.today(now_ms)
    oldest = today - timedelta(days=counted.retention_days - 1)
    if "day" in params and ("from" in params or "to" in params):
        raise QueryError("give day, or from and to, not both")
    first = last = _day(params, "day", today)
    if "from" in params or "to" in params:
        first, last = _day(params, "from", oldest), _day(params, "to", today)
    if first > last:
        raise QueryError(f"from {first.isoformat()} is after to {last.isoformat()}")
    if first < oldest or last > today:
        raise QueryError(
            f"days from {oldest.isoformat()} to {today.isoformat()} are kept "
            f"(retention_days {counted.retention_days}, time zone {counted.timezone})"
        )
    top_text = params.get("top", str(DEFAULT_TOP))
    if not top_text.isdigit() or not 1 <= int(top_text) <= usage.MAX_TOP:
        raise QueryError(f"top must be a whole number from 1 to {usage.MAX_TOP}, got '{top_text}'")
    days = tuple(first + timedelta(days=n) for n in range((last - first).days + 1))
    return Query(name, counted, by, days, int(top_text))


def _day(params: Mapping[str, str], name: str, default: date) -> date:
    text = params.get(name)
    if text is None:
        return default
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise QueryError(f"{name} must be a date as YYYY-MM-DD, got '{text}'") from None


async def answer(reader: usage.Reader, query: Query) -> dict[str, Any]:
    """The JSON `/v1/usage` answers for a parsed query."""
    return await usage.report(reader, query.domain, query.usage, query.by, query.days, query.top)


def dimensions(rules: Rules, now_ms: int) -> dict[str, Any]:
    """What the page draws: every domain's rules (as `/rlconfig` lines) and its usage
    dimensions, with the days kept."""
    domains = []
    for domain in rules.domains.values():
        entry: dict[str, Any] = {
            "domain": domain.name,
            "rules": [describe(limit) for limit in domain.limits()],
        }
        counted = domain.usage
        if counted is not None:
            entry["usage"] = {
                "timezone": counted.timezone,
                "retention_days": counted.retention_days,
                "today": counted.today(now_ms).isoformat(),
                "days": [day.isoformat() for day in counted.days(now_ms)],
                "dimensions": [
                    {"by": list(by), "unique": list(counted.uniques[by])} for by in counted.counted
                ],
            }
        domains.append(entry)
    return {"domains": domains}


class Refusals:
    """Which limits are refusing now: each rule's `over_limit` hits over the last `span`
    seconds, from samples taken when asked (so it costs the decisions nothing). Holds at most
    one sample per `every` seconds of the span."""

    def __init__(
        self,
        stats: Stats,
        span: float = 60.0,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = stats
        self.span = span
        self.every = every
        self._clock = clock
        #: (when, each rule's over_limit then); from the start, when nothing was refused.
        self._samples: deque[tuple[float, dict[str, int]]] = deque([(clock(), {})])

    def now(self) -> dict[str, Any]:
        """Every rule that refused hits in the last span (oldest sample to now), most first,
        with its refused hits over that time and since start."""
        now = self._clock()
        current = {key: rule.over_limit for key, rule in self.stats.rules.items()}
        samples = self._samples
        while len(samples) > 1 and samples[1][0] <= now - self.span:
            samples.popleft()
        if not samples or now - samples[-1][0] >= self.every:
            samples.append((now, current))
        since, oldest = samples[0]
        rows: list[dict[str, Any]] = [
            {"rule": key, "refused": count - oldest.get(key, 0), "refused_total": count}
            for key, count in current.items()
            if count > oldest.get(key, 0)
        ]
        rows.sort(key=lambda row: (-row["refused"], row["rule"]))
        return {"seconds": round(now - since, 1), "limits": rows}


class TopKeys:
    """Today's top keys of every usage dimension, for Prometheus (`metrics.UsageCollector`):
    read from the backend every `interval` seconds by `watch`, never at scrape time, and only
    `n` keys per dimension, so the series stay bounded (dimensions × n × 2, plus n per unique
    key) however many apps or users there are."""

    def __init__(
        self,
        rules: Callable[[], Rules],
        reader: usage.Reader,
        n: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        self.reader = reader
        self.n = n
        self._clock = clock
        #: (domain, dimension name, key text, admitted, refused, {unique key: count}), per row.
        self.rows: list[tuple[str, str, str, int, int, dict[str, int]]] = []

    async def refresh(self) -> None:
        """Read today's top keys of every dimension (a failing backend keeps the last rows)."""
        now_ms = int(self._clock() * 1000)
        rows = []
        for domain in self.rules().domains.values():
            counted = domain.usage
            if counted is None:
                continue
            for by in counted.counted:
                report = await usage.report(
                    self.reader, domain.name, counted, by, [counted.today(now_ms)], self.n
                )
                for row in report["days"][0]["top"]:
                    key = ",".join(f"{k}={v}" for k, v in row["key"].items())
                    rows.append(
                        (
                            domain.name,
                            ",".join(by),
                            key,
                            row["admitted"],
                            row["refused"],
                            row.get("unique", {}),
                        )
                    )
        self.rows = rows

    async def watch(self, interval: float) -> None:
        while True:
            try:
                await self.refresh()
            except StorageError as exc:
                log.warning("usage_metrics_unavailable", error=str(exc))
            await asyncio.sleep(interval)
