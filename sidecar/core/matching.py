"""Finds the rule that applies to one descriptor, exactly as envoyproxy/ratelimit does.

The request's entries walk the domain's tree from the root. At each level the lookup tries the
exact `key_value`, then the wildcard patterns in declaration order, then the `key` alone; a miss
ends the walk with no limit, and a hit is never revisited (no backtracking). The limit is the one
on the node matched by the last entry; a request deeper than the rules gets none, except for
one entry: a concurrency limit's `request_id` (`sidecar.algorithms.concurrency`), the last entry
of its descriptor, names the request, not a counter, and is matched past the node of its limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from sidecar.core.rules import Domain, Level, Node
from sidecar.model import Entry, Limit


@dataclass(init=False, eq=True, unsafe_hash=True)
class Match:
    """A rule that applies to a descriptor.

    `counter_parts` are the `(key, value)` pairs that name its counter: the request's values,
    except where a `share_threshold` wildcard makes every matching value share the pattern's.
    `metric_key` names its statistics, as in the reference (`domain.key_value.subkey`).
    `grouped`: its counters live in the hash of its first entry (`group_counters`).
    `request_id` is the request's id when the descriptor's last entry is its concurrency
    limit's `request_id` ("" otherwise): no part of the counter, nor of its metric key.
    Immutable by convention, as `sidecar.model`'s per-body values are, for the same reason.
    """

    limit: Limit
    counter_parts: tuple[tuple[str, str], ...]
    metric_key: str
    grouped: bool = False
    request_id: str = ""

    def __init__(
        self,
        limit: Limit,
        counter_parts: tuple[tuple[str, str], ...],
        metric_key: str,
        grouped: bool = False,
        request_id: str = "",
    ) -> None:
        # Written out, not generated, for a native constructor (see `sidecar.model`).
        self.limit = limit
        self.counter_parts = counter_parts
        self.metric_key = metric_key
        self.grouped = grouped
        self.request_id = request_id


def match(domain: Domain, entries: Sequence[Entry]) -> Match | None:
    """The rule for `entries` in `domain`, or None when no rule applies."""
    if not entries:
        return None
    level = domain.root
    path: list[Node] = []
    for entry in entries:
        node = lookup(level, entry)
        if node is None:
            return _named(domain, path, entries) if path and entry is entries[-1] else None
        path.append(node)
        level = node.children
    leaf = path[-1]
    if leaf.limit is None:
        return None
    return Match(
        leaf.limit,
        _counter_parts(path, entries),
        _metric_key(domain.name, path, entries),
        path[0].group_counters,
    )


def _named(domain: Domain, path: list[Node], entries: Sequence[Entry]) -> Match | None:
    """The match of a descriptor whose last entry found no rule, when that entry is the
    request id of the concurrency limit its other entries match (None otherwise)."""
    limit = path[-1].limit
    last = entries[-1]
    request_id = limit.windows[0].request_id if limit is not None else ""
    if not request_id or request_id != last.key:
        return None
    assert limit is not None  # a request_id is a limit's
    named = entries[:-1]
    return Match(
        limit,
        _counter_parts(path, named),
        _metric_key(domain.name, path, named),
        path[0].group_counters,
        last.value,
    )


def lookup(level: Level, entry: Entry) -> Node | None:
    """The descriptor of `level` that `entry` matches: its exact value, else the first wildcard
    that matches, else its key alone."""
    node = level.exact.get((entry.key, entry.value))
    if node is not None:
        return node
    for key, pattern, candidate in level.wildcards:
        if key == entry.key and pattern.fullmatch(entry.value):
            return candidate
    return level.keys.get(entry.key)


def counter_value(node: Node, entry: Entry) -> str:
    """The value naming `entry`'s part of a counter matched by `node`: the request's, or under
    `share_threshold` the pattern's, so that every matching value shares one counter."""
    return node.value if node.share_threshold and node.value is not None else entry.value


def _counter_parts(path: Sequence[Node], entries: Sequence[Entry]) -> tuple[tuple[str, str], ...]:
    """Each entry's key and counter value (`path` holds one node per entry). A loop: a new body
    comes here, and a generator over `zip` costs the compiled build several times as much."""
    parts = []
    for index, node in enumerate(path):
        entry = entries[index]
        parts.append((entry.key, counter_value(node, entry)))
    return tuple(parts)


def _metric_key(domain: str, path: Sequence[Node], entries: Sequence[Entry]) -> str:
    """The reference's stats key: the rule key, with request values where the rules ask for them.

    `detailed_metric` on the matched rule names every level by its request value;
    `value_to_metric` names its own level by the request value (except under share_threshold).
    """
    leaf = path[-1]
    if leaf.detailed_metric:
        if not any(node.share_threshold for node in path):
            return domain + "".join(f".{e.key}_{sanitize(e.value)}" for e in entries)
        # As the reference: a share_threshold level by its pattern, the others by their value.
        return ".".join(
            [domain]
            + [
                node.label if node.share_threshold else entry_label(entry)
                for node, entry in zip(path, entries, strict=True)
            ]
        )
    if not any(node.value_to_metric for node in path):
        return leaf.rule_key
    parts = [domain]
    for node, entry in zip(path, entries, strict=True):
        if node.value_to_metric and not node.share_threshold:
            parts.append(entry_label(entry))
        else:
            parts.append(node.label)
    return ".".join(parts)


def entry_label(entry: Entry) -> str:
    """An entry's part of a stats key: `key_value`, or the key alone for an empty value."""
    return f"{entry.key}_{sanitize(entry.value)}" if entry.value else entry.key


_STAT_UNSAFE: Final = str.maketrans({".": "_", ":": "_", "|": "_"})


def sanitize(value: str) -> str:
    """A request value made safe inside a dotted stats name (dots, ':' and '|' become '_')."""
    return value.translate(_STAT_UNSAFE)
