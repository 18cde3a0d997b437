"""Prometheus metrics, named and labelled as the reference's statsd_exporter mapping names them.

Nothing is counted here: a `StatsCollector` reads `sidecar.decision.stats.Stats` (and the transport's
`Latency`) when Prometheus scrapes, so a decision pays no exporter cost.
Names follow envoyproxy/ratelimit's `src/stats/prom/default_mapper.yaml`, so dashboards built for
the reference keep working:

- per rule, `ratelimit_service_rate_limit_<stat>{domain, key1[, key2]}` for total_hits,
  over_limit, near_limit, within_limit, shadow_mode, over_limit_with_local_cache,
  total_negative_hits, and (ours) a penalty's penalty_blocks and over_limit_with_penalty. The labels are the rule's metric key
  split on '.': `domain.key1` gives {domain, key1}; three or more parts give {domain, key1,
  key2}, and, as in the mapper, every level after the third folds into the same series.
- `ratelimit_service_should_rate_limit_error{err_type="redis_error"|"service_error"|"overloaded"}`
  (a failing backend counts as `redis_error`, whatever the backend; `overloaded`, which the
  reference does not have, counts calls refused UNAVAILABLE because the backend already had as
  many in flight as it answers in time).
- `ratelimit_sidecar_local_decisions`: calls decided on the sidecar's own counters while the
  backend failed (`--failure-mode local`; ours, not the reference's).
- `ratelimit_service_total_requests{grpc_method="ShouldRateLimit"}` and the call latency
  histogram `ratelimit_service_response_time_seconds{grpc_method="ShouldRateLimit"}`.
- `ratelimit_service_rate_limit_denied_by_list{domain, key1}` and `..._allowed_by_list` (ours):
  requests an allow or deny list decided (`sidecar.core.lists`), by the list's domain and key.
- `ratelimit_service_config_load_success`, `ratelimit_service_config_load_error`,
  `ratelimit_service_global_shadow_mode` and
  `ratelimit_service_rate_limit_domain_not_found{domain}`.
- the cycle collector's pauses (ours): the histogram `ratelimit_sidecar_gc_pause_seconds{generation}`
  and the gauge `ratelimit_sidecar_gc_pause_max_seconds`, the longest since start
  (`sidecar.telemetry.garbage`, registered by the app).
- each rule's configured limit (ours; the reference has no such stat, its PR #1138 proposing
  one was closed): the gauge `ratelimit_sidecar_rate_limit_requests_per_unit{domain, key1[,
  key2], unit}`, read from the rules served when scraped (`LimitsCollector`).

Counters are exposed under exactly these names, without the `_total` suffix prometheus_client
would add, because that is what the reference's exporter serves (`render`).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.core.rules import Rules
from sidecar.decision.stats import RuleStats, Stats

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_RULE_STATS: Final = {
    "total_hits": "Hits on the rule: the hits_addend of every descriptor it limited.",
    "over_limit": "Hits on the rule beyond its limit.",
    "near_limit": "Hits on the rule above 80% of its limit (NEAR_LIMIT_RATIO) but within it.",
    "within_limit": "Hits on the rule within its limit.",
    "shadow_mode": "Hits over the rule's limit answered OK because the rule is in shadow_mode.",
    "over_limit_with_local_cache": "Hits over the rule's limit answered from the over-limit cache.",
    "total_negative_hits": "Hits given back to the rule's counters by refunds (is_negative_hits).",
    "penalty_blocks": "Blocks the rule's penalty started (a descriptor over its limit).",
    "over_limit_with_penalty": "Hits refused by the rule's penalty while it blocked their descriptor.",
}
_METHOD: Final = {"grpc_method": "ShouldRateLimit"}


class Latency:
    """ShouldRateLimit call durations in seconds (and the collector's pauses, `garbage.GcPauses`);
    `observe` costs a bisect and two additions."""

    #: Upper bounds in seconds: a decision takes tens of microseconds to a few milliseconds.
    BUCKETS = (
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
        0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    )  # fmt: skip

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BUCKETS, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """`(le, count)` pairs as Prometheus wants them, ending with `+Inf`."""
        buckets = []
        total = 0
        for bound, count in zip((*self.BUCKETS, float("inf")), self.counts, strict=True):
            total += count
            buckets.append((_number(bound), float(total)))
        return buckets


class StatsCollector(Collector):
    """Reads one sidecar's Stats at scrape time."""

    def __init__(self, stats: Stats, latency: Latency | None = None) -> None:
        self.stats = stats
        self.latency = latency

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield from _rule_metrics(stats.rules.items())
        yield _counter(
            "ratelimit_service_should_rate_limit_error",
            "ShouldRateLimit calls that failed, by cause (redis_error: the backend failed; "
            "overloaded: refused UNAVAILABLE, the backend having as many calls in flight as it "
            "answers in time).",
            [
                ({"err_type": "redis_error"}, stats.backend_error),
                ({"err_type": "service_error"}, stats.service_error),
                ({"err_type": "overloaded"}, stats.overloaded),
            ],
        )
        yield _counter(
            "ratelimit_sidecar_local_decisions",
            "ShouldRateLimit calls decided on this sidecar's own counters, at its share of each "
            "limit, while the backend failed (--failure-mode local).",
            [({}, stats.local_decisions)],
        )
        yield _counter(
            "ratelimit_service_total_requests",
            "ShouldRateLimit calls received.",
            [(_METHOD, stats.total_requests)],
        )
        yield _counter(
            "ratelimit_service_config_load_success",
            "Rules loaded successfully.",
            [({}, stats.config_load_success)],
        )
        yield _counter(
            "ratelimit_service_config_load_error",
            "Rules that failed to load.",
            [({}, stats.config_load_error)],
        )
        yield _counter(
            "ratelimit_service_global_shadow_mode",
            "OVER_LIMIT requests answered OK by the global shadow mode.",
            [({}, stats.global_shadow_mode)],
        )
        yield _counter(
            "ratelimit_service_rate_limit_domain_not_found",
            "Descriptors sent for a domain no rules file declares.",
            [({"domain": domain}, count) for domain, count in stats.domain_not_found.items()],
        )
        yield from _list_metrics(stats)
        if self.latency is not None:
            histogram = HistogramMetricFamily(
                "ratelimit_service_response_time_seconds",
                "ShouldRateLimit call duration, from request bytes to response bytes.",
                labels=list(_METHOD),
            )
            histogram.add_metric(
                list(_METHOD.values()), self.latency.cumulative(), self.latency.sum
            )
            yield histogram


def _rule_metrics(rules: Iterable[tuple[str, RuleStats]]) -> Iterator[Metric]:
    """One family per rule stat; rules whose keys fold into the same labels are summed."""
    folded: defaultdict[tuple[str, ...], list[int]] = defaultdict(lambda: [0] * len(_RULE_STATS))
    for metric_key, rule in rules:
        totals = folded[_rule_labels(metric_key)]
        for index, name in enumerate(_RULE_STATS):
            totals[index] += getattr(rule, name)
    for index, (name, documentation) in enumerate(_RULE_STATS.items()):
        samples = []
        for labels, totals in folded.items():
            names = ("domain", "key1", "key2")[: len(labels)]
            samples.append((dict(zip(names, labels, strict=True)), totals[index]))
        yield _counter(f"ratelimit_service_rate_limit_{name}", documentation, samples)


def _list_metrics(stats: Stats) -> Iterator[Metric]:
    """Requests each list decided, denied and allowed, labelled as rules are (`domain.key`
    gives {domain, key1}); a list seen in either has both series."""
    seen = sorted({*stats.denied_by_list, *stats.allowed_by_list})
    for name, counts, documentation in (
        ("denied", stats.denied_by_list, "Requests answered OVER_LIMIT by a deny list."),
        ("allowed", stats.allowed_by_list, "Requests answered OK by an allow list, uncounted."),
    ):
        yield _counter(
            f"ratelimit_service_rate_limit_{name}_by_list",
            documentation,
            [
                (dict(zip(("domain", "key1"), _rule_labels(key), strict=False)), counts.get(key, 0))
                for key in seen
            ],
        )


def _rule_labels(metric_key: str) -> tuple[str, ...]:
    parts = metric_key.split(".", 3)
    if len(parts) == 1:
        return (parts[0], "")
    return tuple(parts[:3])


def _counter(
    name: str, documentation: str, samples: Iterable[tuple[dict[str, str], int]]
) -> Metric:
    # A plain Metric keeps the name as given; CounterMetricFamily would expose `<name>_total`.
    metric = Metric(name, documentation, "counter")
    for labels, value in samples:
        metric.add_sample(name, labels, float(value))
    return metric


class LimitsCollector(Collector):
    """Each rule's configured limit, `ratelimit_sidecar_rate_limit_requests_per_unit`, so a
    dashboard can draw a rule's `total_hits` against it: read from the rules served (`rules()`,
    whatever reloads and xDS pushes made them) when Prometheus scrapes, so a decision pays
    nothing for it, and its series are as many as the rules' windows.

    Labels: the rule's `domain`, `key1[, key2]`, as the per-rule counters have them (its rule
    key split on '.'); `unit` (second ... year); `unit_multiplier` where it is not 1; and
    `window`, the window's place in `rate_limits`, for a rule with several. Unlimited rules
    have no limit and no series. Rules whose keys fold into the same labels (those deeper than
    the third level, as the counters fold) are one series, with the smallest of their limits:
    the one a dashboard sees reached first.
    """

    NAME = "ratelimit_sidecar_rate_limit_requests_per_unit"

    def __init__(self, rules: Callable[[], Rules]) -> None:
        self.rules = rules

    def collect(self) -> Iterator[Metric]:
        smallest: dict[tuple[tuple[str, str], ...], int] = {}
        for domain in self.rules().domains.values():
            for limit in domain.limits():
                if limit.unlimited:
                    continue
                keys = _rule_labels(limit.rule_key)
                base = dict(zip(("domain", "key1", "key2"), keys, strict=False))
                several = len(limit.windows) > 1
                for index, window in enumerate(limit.windows):
                    labels = {**base, "unit": window.unit.name.lower()}
                    if window.unit_multiplier != 1:
                        labels["unit_multiplier"] = str(window.unit_multiplier)
                    if several:
                        labels["window"] = str(index)
                    series = tuple(labels.items())
                    known = smallest.get(series)
                    if known is None or window.requests_per_unit < known:
                        smallest[series] = window.requests_per_unit
        gauge = Metric(
            self.NAME,
            "The requests_per_unit each rule is configured with, per window (window: its place "
            "in rate_limits), from the rules served now.",
            "gauge",
        )
        for series, value in smallest.items():
            gauge.add_sample(self.NAME, dict(series), float(value))
        yield gauge


class MemoryCollector(Collector):
    """The memory backend's size and evictions (`ratelimit_sidecar_memory_counters`,
    `ratelimit_sidecar_memory_evictions`), read at scrape time."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        backend = self.backend
        gauge = Metric(
            "ratelimit_sidecar_memory_counters",
            f"Values the memory backend holds (at most {backend.max_counters}).",
            "gauge",
        )
        gauge.add_sample("ratelimit_sidecar_memory_counters", {}, float(len(backend)))
        yield gauge
        yield _counter(
            "ratelimit_sidecar_memory_evictions",
            "Values the memory backend evicted before their window ended, to stay within its "
            "max_counters.",
            [({}, backend.evicted)],
        )


def registry(stats: Stats, latency: Latency | None = None) -> CollectorRegistry:
    """A registry of its own for one sidecar (tests run many side by side in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, latency))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format (0.0.4), with every family under the name it was given."""
    lines: list[str] = []
    for metric in registry.collect():
        kind = "untyped" if metric.type == "unknown" else metric.type
        lines.append(f"# HELP {metric.name} {_escape_help(metric.documentation)}")
        lines.append(f"# TYPE {metric.name} {kind}")
        for sample in metric.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items())
                lines.append(f"{sample.name}{{{labels}}} {_number(sample.value)}")
            else:
                lines.append(f"{sample.name} {_number(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode("utf-8")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value.is_integer():
        return str(int(value))
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class UsageCollector(Collector):
    """Today's top keys of each usage dimension (`sidecar.reports.usage.TopKeys`, read from the backend in
    the background): `ratelimit_sidecar_usage_calls{domain,by,key,outcome}` and
    `ratelimit_sidecar_usage_unique{domain,by,key,unique}`. Only the top keys: never a series
    per user, so the series stay bounded."""

    def __init__(self, top: Any) -> None:
        self.top = top

    def collect(self) -> Iterator[Metric]:
        calls = Metric(
            "ratelimit_sidecar_usage_calls",
            f"Calls today of the {self.top.n} keys with the most calls, per usage dimension, "
            "admitted or refused.",
            "gauge",
        )
        unique = Metric(
            "ratelimit_sidecar_usage_unique",
            f"Distinct values today of a usage dimension's unique key, for its top {self.top.n} "
            "keys (HyperLogLog, 0.81% standard error).",
            "gauge",
        )
        for domain, by, key, admitted, refused, uniques in self.top.rows:
            labels = {"domain": domain, "by": by, "key": key}
            calls.add_sample(calls.name, {**labels, "outcome": "admitted"}, float(admitted))
            calls.add_sample(calls.name, {**labels, "outcome": "refused"}, float(refused))
            for name, count in uniques.items():
                unique.add_sample(unique.name, {**labels, "unique": name}, float(count))
        yield calls
        yield unique
