"""A request prepared once: validated, judged by its domain's allow and deny lists
(`sidecar.core.lists`), matched to its rules, its counters named, so that every later call with the
same body only asks the backend and reads the answer (or, for a listed request, nothing).

Envoy sends the same few bodies again and again (one per route and client), and matching,
naming keys and building hits cost more than the rest of a decision. `prepare` does that work
once per body and rules; `Plan` keeps it. Nothing in a plan depends on the time except the
hits of its windows, which `WindowHits` rebuilds when the window (or, for windows whose ttl
counts down to their end, the second) changes. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sidecar.algorithms.concurrency import MAX_REQUEST_ID
from sidecar.core.counters import grouped_hits, in_flight_hit, window_hit
from sidecar.core.keys import descriptor_prefix, field_head, group_key, penalty_key
from sidecar.core.lists import Listed
from sidecar.core.matching import Match, entry_label, match
from sidecar.core.rules import Rules
from sidecar.core.usage import Tally, tally
from sidecar.errors import InvalidRequest
from sidecar.model import (
    UNLIMITED_REMAINING,
    Algorithm,
    Code,
    Descriptor,
    DescriptorStatus,
    Hit,
    Request,
    Role,
    single,
)

#: Bounds on what one request may carry; beyond them it is refused with INVALID_ARGUMENT.
MAX_HITS_ADDEND: Final = 4_294_967_295
MAX_DESCRIPTORS: Final = 128
MAX_ENTRIES: Final = 32
MAX_KEY_LENGTH: Final = 256
MAX_VALUE_LENGTH: Final = 8_192

#: Enum members read through their class cost a Python-level descriptor call each on
#: Python 3.11; as finals they are static reads.
_BLOCKING: Final = Role.BLOCKING
_TOKEN_BUCKET: Final = Algorithm.TOKEN_BUCKET

OK: Final = DescriptorStatus(Code.OK)
UNLIMITED: Final = DescriptorStatus(Code.OK, limit_remaining=UNLIMITED_REMAINING)
#: A descriptor a deny list refused: no rule, no limit, no counter (`sidecar.core.lists`).
DENIED: Final = DescriptorStatus(Code.OVER_LIMIT)


class WindowHits:
    """The hits of one descriptor's windows, rebuilt only when they change.

    A plain epoch window's hit changes when its window does; any other window's ttl counts
    down to its end, so its hit changes every second; a token bucket's never changes. The hits
    are kept with the span of time `[valid_from, valid_until)` over which they hold.
    """

    __slots__ = ("_cost", "_domain", "_from", "_group", "_hits", "_match", "_steady", "_until")

    def __init__(self, domain: str, found: Match, cost: int, group: int) -> None:
        self._domain = domain
        self._match = found
        self._cost = cost
        self._group = group
        windows = found.limit.windows
        #: Whether the hits hold until the shortest window ends (plain epoch windows under their
        #: own keys, whose ttl is a constant, and token buckets, which have no window).
        self._steady = all(
            w.algorithm is _TOKEN_BUCKET or (w.plain and not w.calendar and not found.grouped)
            for w in windows
        )
        self._hits: list[Hit] = []
        self._from = 1
        self._until = 0

    def at(self, now_ms: int) -> list[Hit]:
        """The hits for a call at `now_ms` (the same list object while they hold: do not change it)."""
        if self._from <= now_ms < self._until:
            return self._hits
        hits = descriptor_hits(self._domain, self._match, self._cost, self._group, now_ms)
        second = now_ms - now_ms % 1000
        if self._steady:
            # From the latest start to the earliest end of the windows (a bucket has neither).
            # A loop: generators and max()'s keyword cost more, and every new body comes here.
            latest, earliest = 0, _FOREVER
            for hit in hits:
                if hit.end_ms:
                    latest = max(latest, hit.start_ms)
                    earliest = min(earliest, hit.end_ms)
            self._from, self._until = latest, earliest
        else:
            self._from, self._until = second, second + 1000
        self._hits = hits
        return hits


_FOREVER: Final = 1 << 62


@dataclass(init=False, eq=True, unsafe_hash=True)
class Counted:
    """A descriptor the backend must decide: its position, rule, cost and windows' hits.
    Immutable by convention, as `sidecar.model`'s per-body values are, for the same reasons
    (its `__init__` written out too)."""

    index: int
    match: Match
    cost: int
    windows: WindowHits
    #: A refund (`Descriptor.is_negative_hits`): `cost` is the hits given back, negated.
    refund: bool = False

    def __init__(
        self, index: int, match: Match, cost: int, windows: WindowHits, refund: bool = False
    ) -> None:
        self.index = index
        self.match = match
        self.cost = cost
        self.windows = windows
        self.refund = refund

    @property
    def role(self) -> Role:
        return self.match.limit.role


@dataclass(init=False, eq=True, unsafe_hash=True)
class Plan:
    """What is known about a request before the backend is asked (immutable by convention,
    as `sidecar.model`'s per-body values are, for the same reason).

    `rules` are the rules it was prepared against (a reload makes it stale). `statuses` holds
    every descriptor's answer when no backend call decides it (OK for no rule or a replaced one,
    the unlimited answer); the `counted` descriptors overwrite theirs. `blocking_only`: every
    counted descriptor blocks, so the request is over exactly when one of them is. `positions`
    is empty unless the plan is `straight`.
    """

    rules: Rules
    request: Request
    known_domain: bool
    statuses: tuple[DescriptorStatus, ...]
    counted: tuple[Counted, ...]
    blocking_only: bool
    #: Of a straight plan: each counted descriptor with the position of its hit.
    positions: tuple[tuple[Counted, int], ...] = ()
    #: What the request counts in its domain's usage (`sidecar.core.usage`); None: nothing. A plan
    #: that counts usage is never straight: its usage hits follow its counters' hits.
    usage: Tally | None = None
    #: What an allow or deny list decided (`sidecar.core.lists`); then nothing is counted, not even
    #: usage, and `statuses` is the answer. None: no list names the request.
    listed: Listed | None = None
    #: Some descriptor of the request is a refund (`Descriptor.is_negative_hits`). Such a plan
    #: is never straight: its outcomes are read as refunds (`Limiter._refunded`).
    refunds: bool = False

    def __init__(
        self,
        rules: Rules,
        request: Request,
        known_domain: bool,
        statuses: tuple[DescriptorStatus, ...],
        counted: tuple[Counted, ...],
        blocking_only: bool,
        positions: tuple[tuple[Counted, int], ...] = (),
        usage: Tally | None = None,
        listed: Listed | None = None,
        refunds: bool = False,
    ) -> None:
        # Written out, not generated, for a native constructor (see `sidecar.model`).
        self.rules = rules
        self.request = request
        self.known_domain = known_domain
        self.statuses = statuses
        self.counted = counted
        self.blocking_only = blocking_only
        self.positions = positions
        self.usage = usage
        self.listed = listed
        self.refunds = refunds

    @property
    def straight(self) -> bool:
        """Some descriptor is counted, each counted one has one window and all block, so each
        hit's outcome is its status (the usual request, decided in one pass: see
        `Limiter.decide`)."""
        return bool(self.positions)


def prepare(rules: Rules, request: Request) -> Plan:
    """The plan of `request` under `rules`; raises InvalidRequest for a request that breaks the
    protocol (empty domain or descriptors, absurd sizes, an override it cannot honour)."""
    refunds = validate(request)
    descriptors = request.descriptors
    domain = rules.domains.get(request.domain)
    if domain is None:
        return Plan(rules, request, False, (OK,) * len(descriptors), (), True, refunds=refunds)

    if domain.lists is not None:
        listed = domain.lists.judge(descriptors)
        if listed is not None:
            statuses = [OK] * len(descriptors)
            if listed.denied:
                statuses[listed.index] = DENIED
            return Plan(rules, request, True, tuple(statuses), (), True, listed=listed)

    default_hits = request.hits_addend or 1
    matches: list[Match | None] = [
        _override(request.domain, d)
        if d.override is not None and d.entries
        else match(domain, d.entries)
        for d in descriptors
    ]
    replaced = {name for m in matches if m is not None for name in m.limit.replaces}
    statuses = [OK] * len(descriptors)
    counted: list[Counted] = []
    for index, (descriptor, found) in enumerate(zip(descriptors, matches, strict=True)):
        if found is None:
            continue
        limit = found.limit
        if limit.unlimited:
            statuses[index] = UNLIMITED
            continue
        if replaced and any(n in replaced for n in limit.names):
            continue
        cost = descriptor.hits_addend if descriptor.hits_addend is not None else default_hits
        if found.request_id and len(found.request_id) > MAX_REQUEST_ID:
            raise InvalidRequest(
                f"descriptors[{index}]: request id ({descriptor.entries[-1].key}) of "
                f"{len(found.request_id)} characters, at most {MAX_REQUEST_ID} (a concurrency "
                "limit keeps it while the request is in flight)"
            )
        refund = descriptor.is_negative_hits
        if refund:
            cost = -cost  # a refund's hits are given back (`Hit.hits < 0`)
        windows = WindowHits(request.domain, found, cost, index)
        counted.append(Counted(index, found, cost, windows, refund))
    blocking_only = all(c.role is _BLOCKING for c in counted)
    counts = None
    if domain.usage is not None:
        first = counted[0].match.counter_parts[0] if counted else None
        counts = tally(request.domain, domain.usage, request, first)
    straight = (
        bool(counted)
        and counts is None
        and not refunds
        and blocking_only
        and all(len(c.match.limit.windows) == 1 for c in counted)
        and not any(c.match.limit.penalty for c in counted)  # a penalty is one more hit
    )
    positions = tuple((item, position) for position, item in enumerate(counted)) if straight else ()
    return Plan(
        rules,
        request,
        True,
        tuple(statuses),
        tuple(counted),
        blocking_only,
        positions,
        counts,
        refunds=refunds,
    )


def descriptor_hits(domain: str, found: Match, cost: int, group: int, now_ms: int) -> list[Hit]:
    """The hits asking `cost` of every window of the rule `found`, in the layout its tree uses:
    a key per counter, or fields of its first entry's hash (`group_counters`)."""
    limit = found.limit
    role = limit.role
    parts = found.counter_parts
    if found.grouped:
        key = group_key(domain, parts)
        head = field_head(parts)
        hits = grouped_hits(key, head, limit, cost, group, role, now_ms)
    else:
        prefix = descriptor_prefix(domain, parts)
        hits = [window_hit(prefix, w, cost, group, role, now_ms) for w in limit.windows]
        if found.request_id and (cost == 1 or cost == -1):
            # A concurrency limit (alone in its descriptor) whose start or refund of one place
            # names its request; of several places, it is counted as without an id.
            hits = [in_flight_hit(hits[0], found.request_id)]
    if limit.penalty_window is not None:
        # Its state at a key of its own beside the counters (grouped ones too), in their slot.
        key = penalty_key(descriptor_prefix(domain, parts))
        hits.append(Hit(key, cost, limit.penalty_window, group, role))
    return hits


def _override(domain: str, descriptor: Descriptor) -> Match:
    """A rule from Envoy's per-descriptor `limit`, named by every entry as the reference does."""
    override = descriptor.override
    assert override is not None
    metric_key = domain + "".join(f".{entry_label(e)}" for e in descriptor.entries)
    limit = single(override.requests_per_unit, override.unit, rule_key=metric_key)
    parts = tuple((e.key, e.value) for e in descriptor.entries)
    return Match(limit, parts, metric_key)


def validate(request: Request) -> bool:
    """Raise InvalidRequest for a request the service refuses (INVALID_ARGUMENT); else say
    whether some descriptor is a refund (`Descriptor.is_negative_hits`)."""
    if not request.domain:
        raise InvalidRequest("rate limit domain must not be empty")
    descriptors = request.descriptors
    if not descriptors:
        raise InvalidRequest("rate limit descriptor list must not be empty")
    if len(descriptors) > MAX_DESCRIPTORS:
        raise InvalidRequest(
            f"too many descriptors: {len(descriptors)} (at most {MAX_DESCRIPTORS})"
        )
    refunds = False
    for index, descriptor in enumerate(descriptors):
        if descriptor.is_negative_hits:
            refunds = True
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
    return refunds
