"""Who a frequency cap counts: the identifier kinds a domain's rules declare, and the caps
counted across a person's identifiers.

A domain declares identifier kinds in two ways:
- a first-level, key-only descriptor with `ad` or `campaign` below it is a kind with caps of its
  own (`user`, the usual one; `device`, `household`): an impression naming it counts on them,
  in its hash, as Envoy's ShouldRateLimit with that first entry would;
- a first-level descriptor with `identifiers: [user, device, cookie]` is a *scope* (a person, a
  household): its caps count every impression recorded under any of those kinds. A kind listed
  there needs no caps of its own.

The linking: a check names every identifier the ad server knows for the request, and no link
table is written or read. A record counts a scope's caps once, under its *primary* identifier,
the first kind of the scope's `identifiers` the impression names, in that identifier's hash
slot beside its own counters (the field ``%person|ad|a1|d1voo0`` of ``rl{ads|device|d1}``: ``%``
never comes out of key escaping, so no descriptor's field can take that name). A check judges a
scope's cap on the sum of its counters under every identifier it names. So a check costs one
backend round trip per hash slot (one per identifier named, all sent at once: on one Redis, one
round trip in all) and writes nothing; a record is one atomic call per identifier's slot, each
exactly once, so a retry after a partial failure counts exactly what is missing.

Identifiers linked later: when the ad server learns that two identifiers are one person (a login
joins a cookie and a device), it names both from then on and their counts merge at once: a check
sums what was recorded under either, past impressions included while their windows are open.
Nothing moves in storage, so two persons wrongly linked come apart as simply: a check naming one
identifier sees what was recorded with it as primary. An impression counts towards a check's
scope cap only when its primary identifier is among those the check names: name them all.

Pure: the rules in, the layout out; `sidecar.frequency.caps` reads and writes the counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.core.rules import Domain, Level, Node
from sidecar.decision.plan import MAX_VALUE_LENGTH
from sidecar.errors import InvalidRequest

AD_KEY = "ad"
CAMPAIGN_KEY = "campaign"
USER_KEY = "user"
#: Identifiers one check or impression may name (the rules' `identifiers` hold no more).
MAX_IDENTIFIERS = 8


@dataclass(frozen=True, slots=True)
class Scope:
    """A descriptor whose caps count across identifiers: its rule node and their kinds, the
    primary one first."""

    node: Node
    identifiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """A domain's identifier kinds: those with caps of their own (their first-level nodes),
    the scopes, and every kind a request may name, in the order the rules declare them."""

    trees: dict[str, Node]
    scopes: tuple[Scope, ...]
    kinds: tuple[str, ...]

    def nodes(self) -> list[Node]:
        """The first-level nodes whose `ad` and `campaign` descriptors hold caps."""
        return [*self.trees.values(), *(scope.node for scope in self.scopes)]

    def named(
        self, user: str, identities: Sequence[tuple[str, str]], where: str
    ) -> list[tuple[str, str]]:
        """The identifiers a call names (`user` and `identities`), in the order the rules
        declare their kinds (a gRPC map has no order of its own); raises InvalidRequest naming
        the field at fault (`where` its prefix)."""
        if not identities:
            check_value(f"{where}user", user)
            if USER_KEY not in self.kinds:
                raise InvalidRequest(self._unknown(f"{where}user", USER_KEY))
            return [(USER_KEY, user)]
        named: dict[str, str] = {}
        if user:
            check_value(f"{where}user", user)
            named[USER_KEY] = user
        if len(identities) + len(named) > MAX_IDENTIFIERS:
            raise InvalidRequest(
                f"{where}identities: too many identifiers: {len(identities) + len(named)} (at "
                f"most {MAX_IDENTIFIERS})"
            )
        for kind, value in identities:
            field = f"{where}identities.{kind}"
            if kind not in self.kinds:
                raise InvalidRequest(self._unknown(field, kind))
            if kind in named:
                raise InvalidRequest(f"{field}: identifier kind '{kind}' named twice")
            check_value(field, value)
            named[kind] = value
        if USER_KEY in named and USER_KEY not in self.kinds:
            raise InvalidRequest(self._unknown(f"{where}user", USER_KEY))
        return [(kind, named[kind]) for kind in self.kinds if kind in named]

    def _unknown(self, field: str, kind: str) -> str:
        return (
            f"{field}: unknown identifier kind '{kind}' (the rules declare: "
            f"{', '.join(sorted(self.kinds))})"
        )


def layout(domain: Domain) -> Layout | None:
    """The identifier kinds and scopes of `domain`, or None when it has no frequency caps."""
    trees: dict[str, Node] = {}
    scopes: list[Scope] = []
    kinds: list[str] = []
    for node in domain.root.nodes():
        if node.value is not None or not _holds_caps(node.children):
            continue
        if node.identifiers:
            scopes.append(Scope(node, node.identifiers))
            kinds += [kind for kind in node.identifiers if kind not in kinds]
        else:
            trees[node.key] = node
            if node.key not in kinds:
                kinds.append(node.key)
    if not trees and not scopes:
        return None
    return Layout(trees, tuple(scopes), tuple(kinds))


def _holds_caps(level: Level) -> bool:
    """Whether `level` has any descriptor for `ad` (key-only, exact value or wildcard)."""
    return (
        AD_KEY in level.keys
        or any(k == AD_KEY for k, _ in level.exact)
        or any(k == AD_KEY for k, _, _ in level.wildcards)
    )


def check_value(name: str, value: object) -> None:
    """Refuse a value no counter can be named by: empty, too long or not Unicode."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string")
    if len(value) > MAX_VALUE_LENGTH:
        raise InvalidRequest(f"{name} is too long (at most {MAX_VALUE_LENGTH} characters)")
    check_unicode(name, value)


def check_unicode(name: str, value: str) -> None:
    """Refuse lone surrogates (JSON lets them through), which no key can be made of."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid Unicode ({exc.reason})") from exc
