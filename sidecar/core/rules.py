"""The rule tree one rules file becomes, as matching, the limiter, the request plans and the
frequency caps read it: a `Domain` of `Level`s of `Node`s, every domain in `Rules`, each
rule's line in `/rlconfig` (`describe`), and what in the rules is likely a mistake though they
load (`ConfigWarning`). Pure: `sidecar.core.config` parses and loads it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.errors import ConfigError
from sidecar.model import Algorithm, Limit, Unit, Window

if TYPE_CHECKING:
    from sidecar.core.lists import ListFile, Lists
    from sidecar.core.usage import Usage


@dataclass(frozen=True, slots=True)
class ConfigWarning:
    """Something in a rules file that loads as envoyproxy/ratelimit loads it but is likely a
    mistake (a key it ignores where it stands, a key repeated in one map). Logged once when the
    rules are loaded, shown by `check`; `check --strict` makes it an error.

    ``str(warning)`` reads ``FILE: PATH: message``, as a ConfigError does.
    """

    source: str
    path: str
    message: str

    def __str__(self) -> str:
        return str(ConfigError(self.source, self.path, self.message))


@dataclass(slots=True)
class Level:
    """The descriptors declared side by side at one depth of the tree.

    Lookup order, as in the reference: exact `key_value`, then wildcard patterns in declaration
    order, then `key` alone.
    """

    exact: dict[tuple[str, str], Node] = field(default_factory=dict)
    wildcards: list[tuple[str, re.Pattern[str], Node]] = field(default_factory=list)
    keys: dict[str, Node] = field(default_factory=dict)
    declared: list[Node] = field(default_factory=list)
    #: Each descriptor's `key` or `key_value`: the reference's name for it, which two
    #: descriptors of one level may not share (`key: a_b` and `key: a, value: b` collide there).
    labels: set[str] = field(default_factory=set)

    def nodes(self) -> Iterable[Node]:
        """The level's descriptors in declaration order."""
        return iter(self.declared)

    def add(self, node: Node) -> None:
        """Declare `node` at this level (after the ones declared before it)."""
        self.declared.append(node)
        self.labels.add(node.label)
        if node.value is None:
            self.keys[node.key] = node
        elif "*" in node.value:
            self.wildcards.append((node.key, compile_wildcard(node.value), node))
        else:
            self.exact[(node.key, node.value)] = node


@dataclass(slots=True)
class Node:
    """One descriptor of the rules: what it matches, its limit and the level below it.

    `label` is this node's part of the rule key (`key`, `key_value` or `key_pattern`);
    `rule_key` is the whole path from the domain, as metrics and `/rlconfig` name the rule.
    """

    key: str
    value: str | None
    label: str
    rule_key: str
    limit: Limit | None
    children: Level
    detailed_metric: bool = False
    value_to_metric: bool = False
    share_threshold: bool = False
    #: Every counter below this first-level descriptor lives in one hash per value (see
    #: `core.keys`). Opt-in: under a first entry with unbounded descendants (`app` with
    #: millions of users below it) one hash would grow without bound and be hot on one node.
    group_counters: bool = False
    metadata: Mapping[str, Any] | None = None
    #: The identifier kinds a frequency cap on this first-level descriptor counts across (a
    #: person, a household: `sidecar.frequency.caps`); empty for any other descriptor.
    identifiers: tuple[str, ...] = ()


@dataclass(slots=True)
class Domain:
    """The rules of one domain, from one file."""

    name: str
    source: str
    root: Level
    warnings: tuple[ConfigWarning, ...] = ()
    #: What the domain counts per day (`usage` in its file; `sidecar.core.usage`), None: nothing.
    usage: Usage | None = None
    #: The allow and deny lists its file names (`lists`; `sidecar.core.lists`), and what they hold
    #: once `config.load` has read them (None: no lists).
    list_files: tuple[ListFile, ...] = ()
    lists: Lists | None = None

    def limits(self) -> Iterable[Limit]:
        """Every limit of the domain, depth first in declaration order."""
        stack = list(reversed(list(self.root.nodes())))
        while stack:
            node = stack.pop()
            if node.limit is not None:
                yield node.limit
            stack.extend(reversed(list(node.children.nodes())))

    def summary(self) -> str:
        limits = list(self.limits())
        return f"{self.source}: domain '{self.name}': {len(limits)} rate limits"


@dataclass(slots=True)
class Rules:
    """Every loaded domain, by name."""

    domains: dict[str, Domain] = field(default_factory=dict)

    def dump(self) -> list[str]:
        """One line per rule, in the reference's `/rlconfig` format."""
        return [describe(limit) for domain in self.domains.values() for limit in domain.limits()]

    def warnings(self) -> list[ConfigWarning]:
        """What is likely a mistake in the rules, though they load (see ConfigWarning)."""
        return [warning for domain in self.domains.values() for warning in domain.warnings]


def describe(limit: Limit) -> str:
    """A rule as `/rlconfig` prints it: the reference's line, plus any extension in use."""
    if limit.unlimited:
        head = f"{limit.rule_key}: unlimited"
    else:
        head = f"{limit.rule_key}: " + "; ".join(_describe_window(w) for w in limit.windows)
    line = f"{head}, shadow_mode: {yaml_bool(limit.shadow_mode)}, quota_mode: {yaml_bool(limit.quota_mode)}"
    if limit.name:
        line += f", name: {limit.name}"
    if limit.replaces:
        line += f", replaces: {','.join(limit.replaces)}"
    if limit.approximate:
        line += ", approximate: true"
    if limit.leased:
        line += ", leased: true"
    if limit.pace:
        line += ", pace: true"
    penalty = limit.penalty
    if penalty is not None:
        line += (
            f", penalty: block={penalty.block_ms}ms escalate={penalty.escalate:g} "
            f"max={penalty.max_ms}ms forget_after={penalty.forget_after_ms}ms"
        )
    return line


def _describe_window(window: Window) -> str:
    text = f"unit={window.unit.name} requests_per_unit={window.requests_per_unit}"
    if window.algorithm is not Algorithm.FIXED_WINDOW:
        text += f" algorithm={window.algorithm.value}"
    if window.unit_multiplier != 1:
        text += f" unit_multiplier={window.unit_multiplier}"
    if window.burst is not None:
        text += f" burst={window.burst}"
    if window.borrow:
        text += f" borrow={window.borrow}"
    if window.ends:
        text += f" ends={window.ends}"
    if window.calendar:
        text += f" calendar timezone={window.timezone}"
        if window.unit is Unit.WEEK:
            text += f" week_start={'sunday' if window.week_start == 6 else 'monday'}"
    return text


def yaml_bool(value: bool) -> str:
    """A flag as YAML writes it."""
    return "true" if value else "false"


def compile_wildcard(value: str) -> re.Pattern[str]:
    """A wildcard value as a regex: each `*` matches zero or more characters, anything else itself."""
    return re.compile(".*".join(re.escape(part) for part in value.split("*")), re.DOTALL)
