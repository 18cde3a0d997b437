"""Frequency caps for ad servers: which candidate ads may a user still see, and impressions
counted exactly once, on the very counters Envoy's ShouldRateLimit moves.

Caps are ordinary rules. In a domain, `user` → `ad` carries the per-ad caps and `user` →
`campaign` the per-campaign caps, each with one or more windows. An ad's cap set is the rule
that matches ``[(user, U), (ad, A)]`` plus, when the ad names its campaign, the rule that matches
``[(user, U), (campaign, C)]``: matching is Envoy's, so a rule for one ad value (or a wildcard)
wins over the key-only rule, and a ShouldRateLimit with the same descriptor shares the counters.
With `group_counters: true` on `user`, all of a user's counters are one small Redis hash.

`check` consumes nothing. An ad is allowed unless its cap set is over, as Envoy would judge a
request carrying both descriptors (a `shadow_mode` cap never blocks); `remaining` and
`reset_seconds` come from the most restrictive window that can block. An ad with no cap (no
rule, or only `unlimited` or shadow rules) is allowed with `remaining` 4294967295 and
`reset_seconds` 0, as Envoy's service reports an unlimited rule. Every counter of one user
shares the user's hash slot, so a check costs one backend call however many ads it holds.

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

Limits: at most 100 ads per check and 1,000 impressions per record; ids are 1 to 128 bytes of
printable text. `replaces` between caps is not applied here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sidecar.errors import InvalidRequest, UnknownDomain
from sidecar.frequency.checks import Cap, Check, Template, verdict
from sidecar.matching import counter_value, lookup, match
from sidecar.model import UNLIMITED_REMAINING, Dedupe, Entry, Hit
from sidecar.plan import MAX_VALUE_LENGTH, descriptor_hits
from sidecar.rules import Domain, Level, Node, Rules
from sidecar.storage import Backend
from sidecar.storage.keys import dedupe_key, field_head

USER_KEY = "user"
AD_KEY = "ad"
CAMPAIGN_KEY = "campaign"
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
#: Ads (and campaigns) whose caps a sidecar remembers between checks.
TEMPLATE_CACHE_SIZE = 100_000


class Candidate(NamedTuple):
    """An ad the auction considers, with its campaign when it has one."""

    ad: str
    campaign: str | None = None


class Verdict(NamedTuple):
    """Whether the user may still see `ad`, and what its most restrictive window has left.

    (Candidates and verdicts are named tuples: a check makes a hundred of them.)"""

    ad: str
    allowed: bool
    remaining: int
    reset_seconds: int


@dataclass(frozen=True, slots=True)
class Impression:
    """An ad served to a user, named by an id the ad server repeats on every retry."""

    id: str
    user: str
    ad: str
    campaign: str | None = None
    event: str = IMPRESSION


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
    ) -> None:
        if dedupe_horizon < 1:
            raise ValueError(f"dedupe horizon must be at least 1 second, not {dedupe_horizon}")
        self.rules = rules
        self.backend = backend
        self.dedupe_horizon = dedupe_horizon
        self._clock = clock
        # (id of the user's rule node, key, value, event) -> the caps below it; the rules (and
        # so the nodes) live as long as this object.
        self._templates: dict[tuple[int, str, str, str], Template | None] = {}
        # (domain, event) -> whether the domain's rules declare the event.
        self._events: dict[tuple[str, str], bool] = {}

    def set_rules(self, rules: Rules) -> None:
        """Serve new rules from the next call on (a config reload)."""
        self.rules = rules
        self._templates = {}
        self._events = {}

    async def check(
        self, domain: str, user: str, ads: Sequence[Candidate], event: str = IMPRESSION
    ) -> list[Verdict]:
        """A verdict per candidate, in order, for `event`; raises InvalidRequest, UnknownDomain
        or StorageError."""
        rules = self._domain(domain)
        _check_value("user", user)
        self._check_event(rules, "event", event)
        if len(ads) > MAX_ADS:
            raise InvalidRequest(f"too many ads: {len(ads)} (at most {MAX_ADS} per check)")
        for index, candidate in enumerate(ads):
            _check_value(f"ads[{index}].ad", candidate.ad)
            if candidate.campaign is not None:
                _check_value(f"ads[{index}].campaign", candidate.campaign)

        now_ms = int(self._clock() * 1000)
        user_entry = Entry(USER_KEY, user)
        node = lookup(rules.root, user_entry)
        if node is None:
            return [Verdict(c.ad, True, UNLIMITED_REMAINING, 0) for c in ads]
        check = Check(domain, (USER_KEY, counter_value(node, user_entry)), now_ms)
        caps: dict[tuple[str, str], Cap | None] = {}
        template = self._template

        def cap(key: str, value: str | None) -> Cap | None:
            """One descriptor's windows, named once however many ads share it."""
            if value is None:
                return None
            known = (key, value)
            if known not in caps:
                found = template(node, key, value, event)
                caps[known] = None if found is None else check.add(found)
            return caps[known]

        pairs = [(cap(AD_KEY, c.ad), cap(CAMPAIGN_KEY, c.campaign)) for c in ads]
        if check.addresses:
            check.judge(await self.backend.read(check.addresses, now_ms))
        return [Verdict(c.ad, *verdict(*pair)) for c, pair in zip(ads, pairs, strict=True)]

    def _template(self, node: Node, key: str, value: str, event: str) -> Template | None:
        """The caps of `[(user, *), (key, value)]` (and `(event, E)` after it for an event but
        an impression) under the user's rule `node`: the rule `match` finds for that
        descriptor, and its entries after the user, as counters name them. Kept across checks
        (ads come back again and again), in bounded memory."""
        known = (id(node), key, value, event)
        if known in self._templates:
            return self._templates[known]
        entry = Entry(key, value)
        leaf = lookup(node.children, entry)
        parts = [(USER_KEY, ""), (key, "" if leaf is None else counter_value(leaf, entry))]
        if leaf is not None and event != IMPRESSION:
            happened = Entry(EVENT_KEY, event)
            leaf = lookup(leaf.children, happened)
            if leaf is not None:
                parts.append((EVENT_KEY, counter_value(leaf, happened)))
        template = None
        if leaf is not None and leaf.limit is not None and not leaf.limit.unlimited:
            template = Template(leaf.limit, node.group_counters, field_head(parts))
        if len(self._templates) >= TEMPLATE_CACHE_SIZE:
            self._templates.clear()
        self._templates[known] = template
        return template

    async def record(self, domain: str, impressions: Sequence[Impression]) -> list[Recorded]:
        """Count each impression unless its id was recorded within the horizon; results in
        order. Raises InvalidRequest, UnknownDomain or StorageError (then nothing or part of
        the batch was counted: sending it again counts exactly what is missing)."""
        rules = self._domain(domain)
        if len(impressions) > MAX_IMPRESSIONS:
            raise InvalidRequest(
                f"too many impressions: {len(impressions)} (at most {MAX_IMPRESSIONS} per record)"
            )
        by_user: dict[str, list[int]] = {}
        for index, impression in enumerate(impressions):
            _check_id(f"impressions[{index}].id", impression.id)
            _check_value(f"impressions[{index}].user", impression.user)
            _check_value(f"impressions[{index}].ad", impression.ad)
            if impression.campaign is not None:
                _check_value(f"impressions[{index}].campaign", impression.campaign)
            self._check_event(rules, f"impressions[{index}].event", impression.event)
            by_user.setdefault(impression.user, []).append(index)
        if not impressions:
            return []

        now_ms = int(self._clock() * 1000)
        horizon = self.dedupe_horizon
        bucket = now_ms // 1000 // horizon
        ttl_ms = ((bucket + 2) * horizon + DEDUPE_MARGIN) * 1000 - now_ms
        batches: list[tuple[list[Hit], Dedupe]] = []
        for user, indices in by_user.items():
            hits: list[Hit] = []
            user_entry = Entry(USER_KEY, user)
            for group, index in enumerate(indices):
                impression = impressions[index]
                event = impression.event
                for key, value in ((AD_KEY, impression.ad), (CAMPAIGN_KEY, impression.campaign)):
                    if value is None:
                        continue
                    entries = [user_entry, Entry(key, value)]
                    if event != IMPRESSION:
                        entries.append(Entry(EVENT_KEY, event))
                    found = match(rules, entries)
                    if found is not None and not found.limit.unlimited:
                        hits += descriptor_hits(domain, found, 1, group, now_ms)
            first = (USER_KEY, user)
            dedupe = Dedupe(
                dedupe_key(domain, first, bucket),
                dedupe_key(domain, first, bucket - 1),
                tuple(_stored_id(impressions[index]) for index in indices),
                ttl_ms,
            )
            batches.append((hits, dedupe))
        answers = await self.backend.record(batches, now_ms)

        results: list[Recorded | None] = [None] * len(impressions)
        for indices, duplicates in zip(by_user.values(), answers, strict=True):
            for index, duplicate in zip(indices, duplicates, strict=True):
                results[index] = Recorded(impressions[index].id, not duplicate)
        return [result for result in results if result is not None]

    def _check_event(self, rules: Domain, name: str, event: object) -> None:
        """Refuse an event the domain's rules do not declare: an impression always is; any
        other must match a `key: event` descriptor below a user's `ad` or `campaign`."""
        if event == IMPRESSION:
            return
        _check_value(name, event)
        assert isinstance(event, str)
        known = (rules.name, event)
        declared = self._events.get(known)
        if declared is None:
            entry = Entry(EVENT_KEY, event)
            user = rules.root.keys[USER_KEY]
            declared = any(
                lookup(node.children, entry) is not None
                for node in user.children.nodes()
                if node.key in (AD_KEY, CAMPAIGN_KEY)
            )
            if len(self._events) >= TEMPLATE_CACHE_SIZE:
                self._events.clear()
            self._events[known] = declared
        if not declared:
            raise InvalidRequest(
                f"{name}: event '{event}' is not declared by the rules of domain '{rules.name}' "
                f"(declare it with 'key: {EVENT_KEY}' below 'key: {AD_KEY}', or send "
                f"'{IMPRESSION}')"
            )

    def _domain(self, name: str) -> Domain:
        domain = self.rules.domains.get(name)
        if domain is None:
            raise UnknownDomain(f"unknown domain '{name}'")
        user = domain.root.keys.get(USER_KEY)
        if user is None or not _declares(user.children, AD_KEY):
            raise UnknownDomain(
                f"domain '{name}' has no frequency caps (add 'key: {USER_KEY}' with "
                f"'key: {AD_KEY}' below it)"
            )
        return domain


def _stored_id(impression: Impression) -> str:
    """The id as its dedupe hash keeps it: an impression's whole, another event's behind the
    event's name and a unit separator (ids are printable, so none holds one): a click and an
    impression sharing an id are two events, and no impression's id can pose as a click's."""
    if impression.event == IMPRESSION:
        return impression.id
    return f"{impression.event}\x1f{impression.id}"


def _declares(level: Level, key: str) -> bool:
    """Whether `level` has any descriptor for `key` (key-only, exact value or wildcard)."""
    return (
        key in level.keys
        or any(k == key for k, _ in level.exact)
        or any(k == key for k, _, _ in level.wildcards)
    )


def _check_value(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    if len(value) > MAX_VALUE_LENGTH:
        raise InvalidRequest(f"{name} is too long (at most {MAX_VALUE_LENGTH} characters)")
    _check_unicode(name, value)


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    if not value.isprintable():
        raise InvalidRequest(f"{name} must be printable text (no control characters)")
    _check_unicode(name, value)
    if len(value.encode()) > MAX_ID_BYTES:
        raise InvalidRequest(f"{name} is too long (at most {MAX_ID_BYTES} bytes)")


def _check_unicode(name: str, value: str) -> None:
    """Refuse lone surrogates (JSON lets them through), which no key can be made of."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid Unicode ({exc.reason})") from exc
