"""The use case: decide one ShouldRateLimit request.

match each descriptor to a rule → drop replaced and unlimited rules → one `backend.apply` for all
remaining counters → per-descriptor statuses → `overall_code` (shadow and quota modes) → stats.
The clock is injected; nothing here knows about protobuf, gRPC or Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import structlog

from sidecar.algorithms import fixed_window
from sidecar.algorithms.windows import field_hit, window_hit
from sidecar.config import Rules
from sidecar.errors import InvalidRequest, StorageError
from sidecar.matching import Match, match, sanitize
from sidecar.model import (
    UNLIMITED_REMAINING,
    Code,
    Decision,
    Descriptor,
    DescriptorStatus,
    Hit,
    Request,
    Role,
    single,
)
from sidecar.over_limit_cache import OverLimitCache
from sidecar.stats import Stats
from sidecar.storage import Backend
from sidecar.storage.keys import descriptor_prefix, field_head, group_key

FailureMode = Literal["allow", "deny"]
RejectedHits = Literal["count", "skip"]

#: Bounds on what one request may carry; beyond them it is refused with INVALID_ARGUMENT.
MAX_HITS_ADDEND = 4_294_967_295
MAX_DESCRIPTORS = 128
MAX_ENTRIES = 32
MAX_KEY_LENGTH = 256
MAX_VALUE_LENGTH = 8_192

_OK = DescriptorStatus(Code.OK)
_UNLIMITED = DescriptorStatus(Code.OK, limit_remaining=UNLIMITED_REMAINING)

log = structlog.get_logger("sidecar.limiter")


@dataclass(frozen=True, slots=True)
class Settings:
    """How the limiter treats over-limit results and backend failures.

    shadow_mode: global shadow mode, an OVER_LIMIT request is answered OK (statuses unchanged).
    rejected_hits: "count" adds rejected hits like the reference; "skip" makes a request that
    ends OVER_LIMIT add nothing to any counter.
    failure_mode: on a backend error, "allow" answers OK with no limit; "deny" answers
    OVER_LIMIT for every limited descriptor.
    """

    shadow_mode: bool = False
    rejected_hits: RejectedHits = "count"
    failure_mode: FailureMode = "allow"


class Limiter:
    def __init__(
        self,
        rules: Rules,
        backend: Backend,
        *,
        settings: Settings | None = None,
        stats: Stats | None = None,
        clock: Callable[[], float] = time.time,
        over_limit_cache: int = 0,
    ) -> None:
        self.rules = rules
        self.backend = backend
        self.settings = settings or Settings()
        self.stats = stats or Stats()
        self._clock = clock
        self._backend_failing = False
        #: Plain windows known to be over, answered without the backend (None: off).
        self.over_limit_cache = (
            OverLimitCache(over_limit_cache)
            if over_limit_cache and backend.name != "memory"
            else None
        )

    async def should_rate_limit(self, request: Request) -> Decision:
        """Decide `request`; raises InvalidRequest for a request that breaks the protocol."""
        stats = self.stats
        stats.total_requests += 1
        descriptors = request.descriptors
        try:
            _validate(request)
        except InvalidRequest:
            stats.service_error += 1
            raise
        domain = self.rules.domains.get(request.domain)
        if domain is None:
            stats.domain_not_found[request.domain] += len(descriptors)
            return Decision(Code.OK, (_OK,) * len(descriptors))

        default_hits = request.hits_addend or 1
        matches: list[Match | None] = [
            _override(request.domain, d)
            if d.override is not None and d.entries
            else match(domain, d.entries)
            for d in descriptors
        ]
        replaced = {name for m in matches if m is not None for name in m.limit.replaces}

        now_ms = int(self._clock() * 1000)
        statuses: list[DescriptorStatus] = [_OK] * len(descriptors)
        hits: list[Hit] = []
        # (descriptor index, match, cost, index of its first hit): its windows follow in order.
        counted: list[tuple[int, Match, int, int]] = []
        judged: list[tuple[bool, Role]] = []  # (over, role) of every limited descriptor
        cache = self.over_limit_cache if self.settings.rejected_hits == "count" else None
        for index, (descriptor, found) in enumerate(zip(descriptors, matches, strict=True)):
            if found is None:
                continue
            limit = found.limit
            if limit.unlimited:
                statuses[index] = _UNLIMITED
                continue
            if replaced and any(n in replaced for n in limit.names):
                continue
            cost = descriptor.hits_addend if descriptor.hits_addend is not None else default_hits
            role = limit.role
            windows = descriptor_hits(request.domain, found, cost, index, now_ms)
            if cache is not None and (status := self._cached(cache, found, windows, now_ms)):
                statuses[index] = status
                judged.append((True, role))
                continue
            counted.append((index, found, cost, len(hits)))
            hits.extend(windows)

        if not hits:
            return self._overall(judged, statuses)

        settings = self.settings
        all_or_nothing = settings.rejected_hits == "skip" and not settings.shadow_mode
        try:
            outcomes = await self.backend.apply(hits, all_or_nothing, now_ms)
        except StorageError as exc:
            return self._on_backend_failure(exc, statuses, counted, hits, judged)
        if self._backend_failing:
            self._backend_failing = False
            log.info("backend_recovered", backend=self.backend.name)

        for index, found, cost, first in counted:
            limit = found.limit
            count = len(limit.windows)
            chosen = first
            if count > 1:
                chosen += most_restrictive(outcomes[first : first + count])
            outcome = outcomes[chosen]
            window = hits[chosen].window
            over = outcome.over
            judged.append((over, limit.role))
            allowed = window.requests_per_unit
            stats.rules[found.metric_key].record(
                allowed, max(0, allowed - outcome.left_before), cost, over, limit.shadow_mode
            )
            statuses[index] = DescriptorStatus(
                Code.OVER_LIMIT if over and not limit.shadow_mode else Code.OK,
                limit,
                outcome.remaining,
                -(-outcome.reset_ms // 1000),
                window,
            )
            if cache is not None and over:
                for position in range(first, first + count):
                    hit = hits[position]
                    if outcomes[position].over and hit.window.plain:
                        cache.put(_cache_key(hit), hit.limit, now_ms + hit.reset_ms, now_ms)
        return self._overall(judged, statuses)

    def _overall(
        self, judged: list[tuple[bool, Role]], statuses: list[DescriptorStatus]
    ) -> Decision:
        """`overall_code` from the descriptors' outcomes, then global shadow mode."""
        if fixed_window.request_is_over([o for o, _ in judged], [r for _, r in judged]):
            if self.settings.shadow_mode:
                self.stats.global_shadow_mode += 1
            else:
                return Decision(Code.OVER_LIMIT, tuple(statuses))
        return Decision(Code.OK, tuple(statuses))

    def _cached(
        self, cache: OverLimitCache, found: Match, windows: list[Hit], now_ms: int
    ) -> DescriptorStatus | None:
        """The status of a descriptor one of whose plain windows is known to be over, if any."""
        for hit in windows:
            if not hit.window.plain:
                continue
            end = cache.get(_cache_key(hit), hit.limit, now_ms)
            if end is None:
                continue
            limit = found.limit
            rule = self.stats.rules[found.metric_key]
            rule.record(hit.limit, hit.limit, hit.hits, True, limit.shadow_mode)
            rule.over_limit_with_local_cache += hit.hits
            return DescriptorStatus(
                Code.OK if limit.shadow_mode else Code.OVER_LIMIT,
                limit,
                0,
                -(-(end - now_ms) // 1000),
                hit.window,
            )
        return None

    def _on_backend_failure(
        self,
        exc: StorageError,
        statuses: list[DescriptorStatus],
        counted: list[tuple[int, Match, int, int]],
        hits: list[Hit],
        judged: list[tuple[bool, Role]],
    ) -> Decision:
        """Answer by the failure mode; log the first failure of a run, not every request.

        Descriptors already judged without the backend (known to be over) keep their answer.
        """
        self.stats.backend_error += 1
        if not self._backend_failing:
            self._backend_failing = True
            log.warning(
                "backend_failure",
                backend=self.backend.name,
                error=str(exc),
                failure_mode=self.settings.failure_mode,
            )
        if self.settings.failure_mode == "deny":
            for index, found, _, first in counted:
                limit = found.limit
                if limit.role is Role.SHADOW:
                    continue
                judged.append((True, Role.BLOCKING))
                hit = hits[first]
                statuses[index] = DescriptorStatus(
                    Code.OVER_LIMIT, limit, 0, -(-hit.reset_ms // 1000), hit.window
                )
        return self._overall(judged, statuses)


def descriptor_hits(domain: str, found: Match, cost: int, group: int, now_ms: int) -> list[Hit]:
    """The hits asking `cost` of every window of the rule `found`, in the layout its tree uses:
    a key per counter, or fields of its first entry's hash (`group_counters`)."""
    limit = found.limit
    role = limit.role
    parts = found.counter_parts
    if found.grouped:
        key = group_key(domain, parts)
        head = field_head(parts)
        return [field_hit(key, head, w, cost, group, role, now_ms) for w in limit.windows]
    prefix = descriptor_prefix(domain, parts)
    return [window_hit(prefix, w, cost, group, role, now_ms) for w in limit.windows]


class Judged(Protocol):
    """What `most_restrictive` compares: an Outcome, or a window a frequency-cap check judged."""

    @property
    def over(self) -> bool: ...

    @property
    def remaining(self) -> int: ...


def most_restrictive(outcomes: Sequence[Judged]) -> int:
    """The window a descriptor reports, by its position among the descriptor's `outcomes`: the
    first over its limit, else the one with least left."""
    chosen = 0
    for position, outcome in enumerate(outcomes):
        if outcome.over:
            return position
        if outcome.remaining < outcomes[chosen].remaining:
            chosen = position
    return chosen


def _cache_key(hit: Hit) -> bytes:
    """The over-limit cache's name for a hit's counter: its key, or hash key and field (a key
    never has a NUL right after its hash tag, so the two kinds cannot meet)."""
    return hit.key + b"\0" + hit.field if hit.field else hit.key


def _override(domain: str, descriptor: Descriptor) -> Match:
    """A rule from Envoy's per-descriptor `limit`, named by every entry as the reference does."""
    override = descriptor.override
    assert override is not None
    metric_key = domain + "".join(f".{e.key}_{sanitize(e.value)}" for e in descriptor.entries)
    limit = single(override.requests_per_unit, override.unit, rule_key=metric_key)
    parts = tuple((e.key, e.value) for e in descriptor.entries)
    return Match(limit, parts, metric_key)


def _validate(request: Request) -> None:
    if not request.domain:
        raise InvalidRequest("rate limit domain must not be empty")
    descriptors = request.descriptors
    if not descriptors:
        raise InvalidRequest("rate limit descriptor list must not be empty")
    if len(descriptors) > MAX_DESCRIPTORS:
        raise InvalidRequest(
            f"too many descriptors: {len(descriptors)} (at most {MAX_DESCRIPTORS})"
        )
    for index, descriptor in enumerate(descriptors):
        if descriptor.hits_addend is not None and descriptor.hits_addend > MAX_HITS_ADDEND:
            raise InvalidRequest(
                f"descriptors[{index}].hits_addend {descriptor.hits_addend} exceeds {MAX_HITS_ADDEND}"
            )
        entries = descriptor.entries
        if len(entries) > MAX_ENTRIES:
            raise InvalidRequest(
                f"descriptors[{index}] has {len(entries)} entries (at most {MAX_ENTRIES})"
            )
        for entry in entries:
            if len(entry.key) > MAX_KEY_LENGTH or len(entry.value) > MAX_VALUE_LENGTH:
                raise InvalidRequest(
                    f"descriptors[{index}]: entry too long (keys at most {MAX_KEY_LENGTH} "
                    f"characters, values at most {MAX_VALUE_LENGTH})"
                )
