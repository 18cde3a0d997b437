"""Frequency caps for ad servers: which candidate ads may a user still see, and impressions
counted exactly once, on the very counters Envoy's ShouldRateLimit moves.

Caps are ordinary rules. In a domain, `user` → `ad` carries the per-ad caps and `user` →
`campaign` the per-campaign caps, each with one or more windows. An ad's cap set is the rule
that matches ``[(user, U), (ad, A)]`` plus, when the ad names its campaign, the rule that matches
``[(user, U), (campaign, C)]``: matching is Envoy's, so a rule for one ad value (or a wildcard)
wins over the key-only rule, and a ShouldRateLimit with the same descriptor shares the counters.
With `group_counters: true` on `user`, all of a user's counters are one small Redis hash.
A call may name other identifiers than `user` (`identities`), each with caps of its own or
counted together across a person's identifiers: `sidecar.frequency.identities` says how.

`check` consumes nothing. An ad is allowed unless its cap set is over, as Envoy would judge a
request carrying both descriptors (a `shadow_mode` cap never blocks); `remaining` and
`reset_seconds` come from the most restrictive window that can block. An ad with no cap (no
rule, or only `unlimited` or shadow rules) is allowed with `remaining` 4294967295 and
`reset_seconds` 0, as Envoy's service reports an unlimited rule. Every counter of one user
shares the user's hash slot, so a check costs one backend call however many ads it holds (one
round trip per identifier's slot when it names several).

Events: a record carries an event, `impression` unless it says otherwise, and a check asks about
one event. An impression counts on the caps above; any other event `E` counts on the caps of
``[(user, U), (ad, A), (event, E)]`` and ``[(user, U), (campaign, C), (event, E)]``, rules one
level deeper (`key: event` below `ad` or `campaign`), so clicks and views have caps of their own
and Envoy's ShouldRateLimit with those three entries shares them. An event no `event`
descriptor of the domain matches is refused (InvalidRequest), as is an event named on a domain
that declares none.

`record` counts each impression once. An impression is a fact: its hits are added to every
window of its cap set even past the limit. Its id is remembered per user for the dedupe horizon
`H`, in buckets of `H` seconds: an id is looked up in the current and the previous bucket and
added to the current one, which is kept until its successor ends (plus a margin for skewed
clocks). So a repeat within `H` is always refused, and an id is forgotten between `H` and `2H`
after it was recorded. Ids are stored whole, never hashed: a collision would drop a real
impression. Ids are per event: an impression and a click may share the ad server's id (the id
of an event other than an impression is stored behind its event's name and a control
character, which no id holds). The look-up, the id and the hits go in one atomic call per user.

Limits: at most 100 ads per check and 1,000 impressions per record, 8 identifiers per call; ids
are 1 to 128 bytes of printable text. `replaces` between caps is not applied here.

One module past the usual size because `FrequencyCaps` is one class whose check and record share
its cap plans, hit templates and id rules; the docstring above is the feature's semantics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sidecar.core.counters import grouped_hits, window_hit
from sidecar.core.keys import dedupe_key, descriptor_prefix, escape, field_head
from sidecar.core.matching import counter_value, lookup, match
from sidecar.core.rules import Domain, Node, Rules
from sidecar.decision.plan import descriptor_hits
from sidecar.errors import InvalidRequest, UnknownDomain
from sidecar.frequency.checks import Check, Shape
from sidecar.frequency.identities import (
    AD_KEY,
    CAMPAIGN_KEY,
    USER_KEY,
    Layout,
    Scope,
    check_unicode,
    check_value,
    layout,
)
from sidecar.model import UNLIMITED_REMAINING, Dedupe, Entry, Hit, Limit
from sidecar.storage import Backend

EVENT_KEY = "event"
#: The event a record or a check is about unless it names another: counted by the caps on
#: `ad` and `campaign` themselves.
IMPRESSION = "impression"

MAX_ADS = 100
MAX_IMPRESSIONS = 1_000
MAX_ID_BYTES = 128
#: Seconds an impression id is remembered at least (the dedupe horizon's default).
DEDUPE_HORIZON = 86_400
#: Seconds an id bucket outlives its use, for sidecars whose clocks run a little ahead.
DEDUPE_MARGIN = 60
#: Ads (and campaigns) whose caps a sidecar remembers between checks, per set of rule nodes a
#: check names (about 400 bytes each: 40 MB at most), and events it knows per domain.
PLAN_CACHE_SIZE = 100_000

#: A descriptor's caps below one first-level rule node: the number of their limit (its place in
#: `FrequencyCaps._limits`), whether its tree groups counters, and the counters' head.
Template = tuple[int, bool, bytes]
#: A descriptor's caps below each first-level rule node a check names (None: no cap there).
Plan = tuple[Template | None, ...]
#: What a plan is kept by: the ids of the rule nodes, the descriptor's key and value, the event.
PlanKey = tuple[tuple[int, ...], str, str, str]

#: (kind, value) pairs naming who a call is about.
Identifiers = Sequence[tuple[str, str]]


class Candidate(NamedTuple):
    """An ad the auction considers, with its campaign when it has one."""

    ad: str
    campaign: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the user may still see `ad`, and what its most restrictive window has left.

    (A check makes one per ad: compiled, a dataclass is made by a native call, where a named
    tuple's is a Python call, about 15 µs a check of 50.)"""

    ad: str
    allowed: bool
    remaining: int
    reset_seconds: int


@dataclass(frozen=True, slots=True)
class Impression:
    """An event (an impression unless it says otherwise) of an ad served to a user, named by an
    id the ad server repeats on every retry. `identities` are identifiers beside `user` (or
    instead of it: `user` empty), as (kind, value) pairs."""

    id: str
    user: str
    ad: str
    campaign: str | None = None
    event: str = IMPRESSION
    identities: Identifiers = ()


@dataclass(frozen=True, slots=True)
class Recorded:
    """Whether an impression was counted now (False: its id was recorded before)."""

    id: str
    counted: bool


class FrequencyCaps:
    """Check and record frequency caps over `rules` and `backend`, on an injected clock."""

    def __init__(
        self,
        rules: Rules,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
        dedupe_horizon: int = DEDUPE_HORIZON,
        plan_cache_size: int = PLAN_CACHE_SIZE,
    ) -> None:
        if dedupe_horizon < 1:
            raise ValueError(f"dedupe horizon must be at least 1 second, not {dedupe_horizon}")
        if plan_cache_size < 2:
            raise ValueError(f"plan cache size must be at least 2, not {plan_cache_size}")
        self.rules = rules
        self.backend = backend
        self.dedupe_horizon = dedupe_horizon
        self.plan_cache_size = plan_cache_size
        self._clock = clock
        # (ids of first-level rule nodes, key, value, event) -> the caps below each (`_plan`),
        # those used lately and those used before; the rules (and so the nodes and limits) live
        # as long as this object, or until `set_rules` empties them. Plain tuples of numbers and
        # text, see `_plan` (20,006 objects in such a cache were a 3 ms pause with 10,000 ads).
        self._plans: dict[PlanKey, Plan] = {}
        self._older: dict[PlanKey, Plan] = {}
        # The limits templates name, by number; and the number of each, by its id.
        self._limits: list[Limit] = []
        self._numbers: dict[int, int] = {}
        # The Shapes of checks in `_second` (Unix seconds), by limit number and grouping
        # (`Check.add`): two per limit of the rules at most, made again each second.
        self._second = -1
        self._shapes: dict[int, Shape] = {}
        # (domain, event) -> whether the domain's rules declare the event.
        self._events: dict[tuple[str, str], bool] = {}
        # Domain -> its identifier kinds (None: it has no caps).
        self._layouts: dict[str, Layout | None] = {}

    def set_rules(self, rules: Rules) -> None:
        """Serve new rules from the next call on (a config reload)."""
        self.rules = rules
        self._plans = {}
        self._older = {}
        self._limits = []
        self._numbers = {}
        self._shapes = {}
        self._events = {}
        self._layouts = {}

    async def check(
        self,
        domain: str,
        user: str,
        ads: Sequence[tuple[str, str | None]],
        event: str = IMPRESSION,
        identities: Identifiers = (),
    ) -> list[Verdict]:
        """A verdict per candidate (a `Candidate`, or an (ad, campaign) pair), in order, for
        `event` and the identifiers named (`user` and `identities`); raises InvalidRequest,
        UnknownDomain or StorageError.

        Each identifier's own caps, and each scope's summed under the identifiers it names; one
        read for all of them (a round trip per hash slot)."""
        rules, kinds = self._domain(domain)
        named = kinds.named(user, identities, "")
        self._check_event(rules, kinds, "event", event)
        if len(ads) > MAX_ADS:
            raise InvalidRequest(f"too many ads: {len(ads)} (at most {MAX_ADS} per check)")
        for index, (ad, campaign) in enumerate(ads):
            check_value(f"ads[{index}].ad", ad)
            if campaign is not None:
                check_value(f"ads[{index}].campaign", campaign)
        now_ms = int(self._clock() * 1000)
        if now_ms // 1000 != self._second:
            self._second, self._shapes = now_ms // 1000, {}
        check = Check(rules.name, now_ms, self._shapes)
        # Whose caps the check holds, in the order an ad's caps are judged: each identifier's
        # own (its first-level rule node, which its value may choose), then each scope's.
        nodes: list[Node] = []
        members: list[tuple[int, ...]] = []
        positions: dict[str, int] = {}
        for kind, value in named:
            entry = Entry(kind, value)
            node = lookup(rules.root, entry) if kind in kinds.trees else None
            position = check.identifier(
                (kind, value if node is None else counter_value(node, entry))
            )
            positions[kind] = position
            if node is not None:
                nodes.append(node)
                members.append((position,))
        for scope in kinds.scopes:
            summed = tuple(positions[kind] for kind in scope.identifiers if kind in positions)
            if summed:
                nodes.append(scope.node)
                members.append(summed)
        if not nodes:
            return [Verdict(ad, True, UNLIMITED_REMAINING, 0) for ad, _ in ads]
        whose = tuple(id(node) for node in nodes)
        # Per descriptor of this check: its caps, named once however many ads share it.
        caps: dict[tuple[str, str], tuple[int, ...]] = {}
        held: list[tuple[int, ...]] = []
        for ad, campaign in ads:
            known = (AD_KEY, ad)
            mine = caps.get(known)
            if mine is None:
                mine = caps[known] = self._add(check, nodes, whose, members, known, event)
            if campaign is not None:
                known = (CAMPAIGN_KEY, campaign)
                theirs = caps.get(known)
                if theirs is None:
                    theirs = caps[known] = self._add(check, nodes, whose, members, known, event)
                mine += theirs
            held.append(mine)
        if check.addresses:
            check.judge(await self.backend.read(check.addresses, now_ms))
        verdicts = []
        for (ad, _), mine in zip(ads, held, strict=True):
            allowed, remaining, reset_seconds = check.verdict(mine)
            verdicts.append(Verdict(ad, allowed, remaining, reset_seconds))
        return verdicts

    def _add(
        self,
        check: Check,
        nodes: list[Node],
        whose: tuple[int, ...],
        members: list[tuple[int, ...]],
        descriptor: tuple[str, str],
        event: str,
    ) -> tuple[int, ...]:
        """Add the caps of `descriptor` below each of `nodes` (their ids `whose`) to `check`,
        each under its `members`; their positions in the check."""
        plan = self._plan(nodes, whose, descriptor, event)
        found = []
        for index in range(len(plan)):
            template = plan[index]
            if template is not None:
                number, grouped, head = template
                limit = self._limits[number]
                found.append(check.add(limit, number, grouped, head, members[index]))
        return tuple(found)

    def _plan(
        self, nodes: Sequence[Node], whose: tuple[int, ...], descriptor: tuple[str, str], event: str
    ) -> Plan:
        """The caps of `descriptor` (`(ad, A)` or `(campaign, C)`, and `(event, E)` after it
        for an event but an impression) below each first-level rule of `nodes`, as `_template`
        finds them. Kept across checks (ads come back again and again), in bounded memory; its
        entries name the limits by number (plain tuples of numbers and text: the collector
        stops tracking them, so its full collections do not walk a cache that holds an entry
        per ad of the catalog).

        The cache forgets what was not used lately, in two generations of plain dicts (a hit
        is one dict look-up; an ordered dict's costs a method call): plans go to the recent
        generation, which becomes the older one once it holds half of `plan_cache_size`; a plan
        found in the older one moves back to the recent one, and whatever the older one still
        holds at the next turn is forgotten. So at most `plan_cache_size` plans are kept, and
        one used within the last half of them made is never forgotten."""
        known = (whose, descriptor[0], descriptor[1], event)
        plans = self._plans
        plan = plans.get(known)
        if plan is not None:
            return plan
        plan = self._older.pop(known, None)
        if plan is None:
            # (Made from a list: the templates exist before the tuple holding them, so one pass
            # of the collector finds them untracked and stops tracking the plan too.)
            found = [self._template(node, descriptor[0], descriptor[1], event) for node in nodes]
            plan = tuple(found)
        if len(plans) >= self.plan_cache_size // 2:
            self._older, self._plans = plans, {}
            plans = self._plans
        plans[known] = plan
        return plan

    def cached(self) -> list[tuple[str, str, str]]:
        """The descriptors whose caps are kept between checks, as (key, value, event), the
        older generation first: at most `plan_cache_size`, none after `set_rules`."""
        return [(key, value, event) for _, key, value, event in [*self._older, *self._plans]]

    def _template(self, node: Node, key: str, value: str, event: str) -> Template | None:
        """The caps of `[(first, *), (key, value)]` (and `(event, E)` after it for an event but
        an impression) under the first-level rule `node`: the rule `match` finds for that
        descriptor (the id of its limit in `_limits`), whether its tree groups counters, and its
        entries after the first as counter names carry them (behind ``%`` and the scope's key
        for a scope, `sidecar.frequency.identities`)."""
        entry = Entry(key, value)
        leaf = lookup(node.children, entry)
        parts = [(USER_KEY, ""), (key, "" if leaf is None else counter_value(leaf, entry))]
        if leaf is not None and event != IMPRESSION:
            happened = Entry(EVENT_KEY, event)
            leaf = lookup(leaf.children, happened)
            if leaf is not None:
                parts.append((EVENT_KEY, counter_value(leaf, happened)))
        if leaf is None or leaf.limit is None or leaf.limit.unlimited:
            return None
        head = field_head(parts)
        if node.identifiers:
            head = f"%{escape(node.key)}|{head}"
        number = self._numbers.get(id(leaf.limit))
        if number is None:
            number = self._numbers[id(leaf.limit)] = len(self._limits)
            self._limits.append(leaf.limit)
        return number, node.group_counters, head.encode()

    async def record(self, domain: str, impressions: Sequence[Impression]) -> list[Recorded]:
        """Count each impression unless its id was recorded within the horizon; results in
        order. Raises InvalidRequest, UnknownDomain or StorageError (then nothing or part of
        the batch was counted: sending it again counts exactly what is missing)."""
        rules, kinds = self._domain(domain)
        if len(impressions) > MAX_IMPRESSIONS:
            raise InvalidRequest(
                f"too many impressions: {len(impressions)} (at most {MAX_IMPRESSIONS} per record)"
            )
        named: list[Identifiers] = []
        # Per identifier, in the order first named: the impressions naming it.
        by_first: dict[tuple[str, str], list[int]] = {}
        for index, impression in enumerate(impressions):
            where = f"impressions[{index}]."
            _check_id(f"{where}id", impression.id)
            identifiers = kinds.named(impression.user, impression.identities, where)
            named.append(identifiers)
            check_value(f"{where}ad", impression.ad)
            if impression.campaign is not None:
                check_value(f"{where}campaign", impression.campaign)
            if impression.event != IMPRESSION:
                self._check_event(rules, kinds, f"{where}event", impression.event)
            for first in identifiers:
                by_first.setdefault(first, []).append(index)
        if not impressions:
            return []

        now_ms = int(self._clock() * 1000)
        # Per identifier: its hits and the impressions whose ids it keeps, each impression's
        # hits carrying its position among them as their group. The first identifier an
        # impression names keeps its id in any case; another only when it counts something.
        slots: dict[tuple[str, str], tuple[list[Hit], list[int]]] = {}
        for first, indices in by_first.items():
            kind = first[0]
            first_entry = Entry(*first)
            own = kind in kinds.trees
            hits: list[Hit] = []
            kept: list[int] = []
            for index in indices:
                impression = impressions[index]
                event = impression.event
                group = len(kept)
                before = len(hits)
                for key, value in ((AD_KEY, impression.ad), (CAMPAIGN_KEY, impression.campaign)):
                    if value is None:
                        continue
                    if own:
                        entries = [first_entry, Entry(key, value)]
                        if event != IMPRESSION:
                            entries.append(Entry(EVENT_KEY, event))
                        found = match(rules, entries)
                        if found is not None and not found.limit.unlimited:
                            hits += descriptor_hits(domain, found, 1, group, now_ms)
                    if kinds.scopes:
                        for scope in _primary_of(kinds, kind, named[index]):
                            node = scope.node
                            plan = self._plan([node], (id(node),), (key, value), event)
                            if plan[0] is not None:
                                number, grouped, head = plan[0]
                                limit = self._limits[number]
                                hits += _scope_hits(
                                    rules, first, limit, grouped, head.decode(), group, now_ms
                                )
                if len(hits) > before or named[index][0] == first:
                    kept.append(index)
            if kept:
                slots[first] = (hits, kept)
        return await self._count(domain, slots, impressions, now_ms)

    async def _count(
        self,
        domain: str,
        slots: dict[tuple[str, str], tuple[list[Hit], list[int]]],
        impressions: Sequence[Impression],
        now_ms: int,
    ) -> list[Recorded]:
        """Record each identifier's part in one atomic call on its slot, with its ids; an
        impression was counted unless every part of it was a duplicate."""
        horizon = self.dedupe_horizon
        bucket = now_ms // 1000 // horizon
        ttl_ms = ((bucket + 2) * horizon + DEDUPE_MARGIN) * 1000 - now_ms
        batches = [
            (
                hits,
                Dedupe(
                    dedupe_key(domain, first, bucket),
                    dedupe_key(domain, first, bucket - 1),
                    tuple(
                        impressions[index].id
                        if impressions[index].event == IMPRESSION
                        else _stored_id(impressions[index])
                        for index in indices
                    ),
                    ttl_ms,
                ),
            )
            for first, (hits, indices) in slots.items()
        ]
        answers = await self.backend.record(batches, now_ms)
        results: list[Recorded | None] = [None] * len(impressions)
        for (_, indices), duplicates in zip(slots.values(), answers, strict=True):
            for index, duplicate in zip(indices, duplicates, strict=True):
                if not duplicate or results[index] is None:
                    results[index] = Recorded(impressions[index].id, not duplicate)
        return [result for result in results if result is not None]

    def _check_event(self, rules: Domain, kinds: Layout, name: str, event: object) -> None:
        """Refuse an event the domain's rules do not declare: an impression always is; any
        other must match a `key: event` descriptor below an `ad` or a `campaign`."""
        if event == IMPRESSION:
            return
        check_value(name, event)
        assert isinstance(event, str)
        known = (rules.name, event)
        declared = self._events.get(known)
        if declared is None:
            entry = Entry(EVENT_KEY, event)
            declared = any(
                lookup(node.children, entry) is not None
                for first in kinds.nodes()
                for node in first.children.nodes()
                if node.key in (AD_KEY, CAMPAIGN_KEY)
            )
            if len(self._events) >= PLAN_CACHE_SIZE:
                self._events.clear()
            self._events[known] = declared
        if not declared:
            raise InvalidRequest(
                f"{name}: event '{event}' is not declared by the rules of domain '{rules.name}' "
                f"(declare it with 'key: {EVENT_KEY}' below 'key: {AD_KEY}', or send "
                f"'{IMPRESSION}')"
            )

    def _domain(self, name: str) -> tuple[Domain, Layout]:
        domain = self.rules.domains.get(name)
        if domain is None:
            raise UnknownDomain(f"unknown domain '{name}'")
        if name not in self._layouts:
            self._layouts[name] = layout(domain)
        kinds = self._layouts[name]
        if kinds is None:
            raise UnknownDomain(
                f"domain '{name}' has no frequency caps (add 'key: {USER_KEY}' with "
                f"'key: {AD_KEY}' below it)"
            )
        return domain, kinds


def _primary_of(kinds: Layout, kind: str, named: Identifiers) -> list[Scope]:
    """The scopes whose primary identifier, among those `named`, is of `kind`: the first of
    their `identifiers` named."""
    names = [k for k, _ in named]
    return [
        scope
        for scope in kinds.scopes
        if next((k for k in scope.identifiers if k in names), None) == kind
    ]


def _scope_hits(
    rules: Domain,
    first: tuple[str, str],
    limit: Limit,
    grouped: bool,
    head: str,
    group: int,
    now_ms: int,
) -> list[Hit]:
    """The hits adding one to every window of a scope's caps (`limit`, on the counters `head`
    names) under identifier `first`."""
    prefix = descriptor_prefix(rules.name, [first])
    if grouped:
        return grouped_hits(prefix.encode(), head, limit, 1, group, limit.role, now_ms)
    return [
        window_hit(f"{prefix}|{head}", window, 1, group, limit.role, now_ms)
        for window in limit.windows
    ]


def _stored_id(impression: Impression) -> str:
    """The id of an event other than an impression as its dedupe hash keeps it (an
    impression's is kept whole): behind the event's name and a unit separator (ids are printable, so none holds one): a click and an
    impression sharing an id are two events, and no impression's id can pose as a click's."""
    return f"{impression.event}\x1f{impression.id}"


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    if not value.isprintable():
        raise InvalidRequest(f"{name} must be printable text (no control characters)")
    check_unicode(name, value)
    if len(value.encode()) > MAX_ID_BYTES:
        raise InvalidRequest(f"{name} is too long (at most {MAX_ID_BYTES} bytes)")
