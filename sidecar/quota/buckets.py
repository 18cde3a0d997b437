"""From an RLQS bucket id to the rule that limits it: the bucket id is matched as a descriptor.

Envoy's filter builds a bucket id (`bucket_id_builder`) as a `map<string, string>`, which has no
order; a descriptor walks the domain's tree in order. The entries are put in the order that
walks the tree using all of them (at each level, an entry the level has a descriptor for: its
exact value, a wildcard, or its key alone, as `sidecar.core.matching.lookup` decides), trying the
entries by key name where several could go first. That order is then matched exactly as a
ShouldRateLimit descriptor would be, so `share_threshold`, wildcards and `shadow_mode` mean the
same here. The rule's limit is the bucket's global budget, whatever algorithm it names: the
window with the lowest rate (`requests_per_unit` per its length), epoch-aligned.

A bucket id has at most `MAX_ENTRIES` entries (a search over their orders is bounded by it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar.core.keys import escape
from sidecar.core.matching import lookup, match
from sidecar.core.rules import Level, Rules
from sidecar.model import Entry, Limit
from sidecar.quota.allocator import Budget

#: Entries a bucket id may have (Envoy's are usually one to three).
MAX_ENTRIES = 8


@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket id's rule: its budget, the key naming its shared state, and its rule key."""

    budget: Budget
    key: bytes
    rule_key: str


def resolve(
    rules: Rules, domain: str, bucket_id: Mapping[str, str], shadow_mode: bool = False
) -> Bucket | None:
    """The rule limiting `bucket_id` in `domain`, or None when no rule does (then nothing limits
    the bucket). `shadow_mode`: the sidecar's global shadow mode."""
    rules_domain = rules.domains.get(domain)
    if rules_domain is None or not bucket_id or len(bucket_id) > MAX_ENTRIES:
        return None
    entries = [Entry(key, value) for key, value in sorted(bucket_id.items())]
    ordered = _order(rules_domain.root, entries)
    if ordered is None:
        return None
    found = match(rules_domain, ordered)
    if found is None:
        return None
    budget = budget_of(found.limit, shadow_mode)
    return Bucket(budget, state_key(domain, found.counter_parts), found.metric_key)


def budget_of(limit: Limit, shadow_mode: bool = False) -> Budget:
    """A rule's budget: unlimited, or the window with the lowest rate; leased unless the rule
    asks for `pace`."""
    shadow = shadow_mode or limit.shadow_mode
    if limit.unlimited:
        return Budget(None, 1_000, shadow)
    window = min(limit.windows, key=lambda w: w.requests_per_unit / w.seconds)
    return Budget(window.requests_per_unit, window.seconds * 1_000, shadow, limit.pace)


def state_key(domain: str, parts: Sequence[tuple[str, str]]) -> bytes:
    """The head of a bucket's keys in a shared store: ``rq{<domain>|<key>|<value>|...}``, the
    whole bucket in the hash tag (its keys share a slot) and every part escaped as counter keys
    are (`sidecar.core.keys`), so no two buckets share it."""
    inner = "|".join([escape(domain), *(f"{escape(k)}|{escape(v)}" for k, v in parts)])
    return f"rq{{{inner}}}".encode()


def _order(level: Level, entries: list[Entry]) -> list[Entry] | None:
    """`entries` in an order that walks the tree from `level` to a rule, using all of them."""
    for index, entry in enumerate(entries):
        node = lookup(level, entry)
        if node is None:
            continue
        rest = entries[:index] + entries[index + 1 :]
        if not rest:
            if node.limit is not None:
                return [entry]
            continue
        below = _order(node.children, rest)
        if below is not None:
            return [entry, *below]
    return None
