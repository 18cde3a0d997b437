"""Counters the limiter keeps, named and accounted as the reference's statistics.

Per rule (`ratelimit.service.rate_limit.<metric key>.<stat>`): total_hits, over_limit,
near_limit, within_limit, shadow_mode, total_negative_hits, and a penalty's penalty_blocks and
over_limit_with_penalty. Per service: config loads, global
shadow mode, backend errors, service errors (`refused`: the one place a refused call is
counted), unknown domains, and requests an allow or deny list decided. Plain integers on the
hot path; `sidecar.telemetry.metrics` turns them into Prometheus series at scrape time, so a decision
pays no exporter cost.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Final

from sidecar.errors import InvalidRequest, Overloaded

#: Share of a limit above which hits count as near the limit (the reference's NEAR_LIMIT_RATIO).
NEAR_LIMIT_RATIO: Final = 0.8


@dataclass(slots=True)
class RuleStats:
    total_hits: int = 0
    over_limit: int = 0
    near_limit: int = 0
    within_limit: int = 0
    shadow_mode: int = 0
    over_limit_with_local_cache: int = 0
    #: Hits given back by refunds (`is_negative_hits`), counted in none of the others.
    total_negative_hits: int = 0
    #: Blocks a rule's `penalty` started (`sidecar.algorithms.penalty`).
    penalty_blocks: int = 0
    #: Hits refused by a block (counted in over_limit too; in shadow_mode, the hits a block
    #: would have refused, counted in shadow_mode too).
    over_limit_with_penalty: int = 0

    def record(self, limit: int, before: int, hits: int, over: bool, shadow: bool) -> None:
        """Account one descriptor's outcome the way the reference does (its near/over split);
        a refund (`hits` below 0) counts only in `total_negative_hits`, as the reference's."""
        if hits < 0:
            self.total_negative_hits -= hits
            return
        self.total_hits += hits
        near_threshold = int(limit * NEAR_LIMIT_RATIO)
        after = before + hits
        if over:
            if before >= limit:
                self.over_limit += hits
            else:
                self.over_limit += after - limit
                self.near_limit += limit - max(near_threshold, before)
            if shadow:
                self.shadow_mode += hits
            return
        self.within_limit += hits
        if after > near_threshold:
            self.near_limit += hits if before >= near_threshold else after - near_threshold


@dataclass(slots=True)
class Stats:
    """Every counter of one running sidecar."""

    rules: defaultdict[str, RuleStats] = field(default_factory=lambda: defaultdict(RuleStats))
    domain_not_found: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    config_load_success: int = 0
    config_load_error: int = 0
    global_shadow_mode: int = 0
    backend_error: int = 0
    service_error: int = 0
    #: Calls refused because the backend had as many in flight as it answers in time.
    overloaded: int = 0
    #: Calls decided on this process's own counters while the backend failed
    #: (`--failure-mode local`); each is a backend error too.
    local_decisions: int = 0
    total_requests: int = 0
    #: Requests a list decided (`sidecar.core.lists`), by `<domain>.<key>` of the list: denied
    #: (OVER_LIMIT) and allowed (OK), neither counted by any rule.
    denied_by_list: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    allowed_by_list: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def refused(self, exc: Exception) -> None:
        """Count a `ShouldRateLimit` call refused with `exc` (its status is
        `sidecar.rls.statuses`'): an InvalidRequest was never decided, so it counts as a
        request and a service error; Overloaded was counted as a request when the limiter took
        it, and counts as overloaded; anything else is a bug, a service error."""
        if isinstance(exc, InvalidRequest):
            self.total_requests += 1
            self.service_error += 1
        elif isinstance(exc, Overloaded):
            self.overloaded += 1
        else:
            self.service_error += 1
