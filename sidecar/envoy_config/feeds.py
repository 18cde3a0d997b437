"""Which descriptors each route sends so that every rule of a domain can match: pure, no protobuf.

A rule is a path of descriptor keys from the domain down to a node with a limit
(`app` → `user` → `interface`). Envoy must send a descriptor with exactly those keys, in that
order, for the rule to apply, so each distinct key path becomes one route `rate_limits` entry.
A path whose keys are not all read on a route (a source with `routes`) is left off that route.
A path holding a key with `count: on_success` is check-then-count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sidecar.core.rules import Domain, Level
from sidecar.envoy_config.sources import Count, Source, Sources
from sidecar.errors import ConfigError


@dataclass(frozen=True)
class Route:
    """A gateway route: requests whose path starts with `prefix`; `name` is its descriptor value
    for keys read from the `route` attribute."""

    name: str
    prefix: str


@dataclass(frozen=True)
class Descriptor:
    """One descriptor Envoy sends: its entries' sources in order, and the first rule it feeds.

    `values` holds, for every rule with this key path, the value each of its levels asks for
    (None: any value; a value with `*` is a wildcard), in declaration order.
    """

    sources: tuple[Source, ...]
    rule: str
    values: tuple[tuple[str | None, ...], ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(source.key for source in self.sources)

    @property
    def check_then_count(self) -> bool:
        """Checked on the request (hits_addend 0), counted when the response is a 2xx."""
        return any(source.count is Count.ON_SUCCESS for source in self.sources)


@dataclass(frozen=True)
class RouteFeed:
    route: Route
    descriptors: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Feed:
    """Everything Envoy needs to feed one domain: its name and each route's descriptors;
    `source` names the rules file."""

    domain: str
    routes: tuple[RouteFeed, ...]
    source: str = ""


def key_paths(domain: Domain) -> list[tuple[tuple[str, ...], str]]:
    """Each distinct key path that ends in a limit, with the first rule key that has it.

    Declaration order, depth first: the order a reader of the rules file meets them.
    """
    return [(keys, rules[0][0]) for keys, rules in _rules_by_path(domain).items()]


def _rules_by_path(
    domain: Domain,
) -> dict[tuple[str, ...], list[tuple[str, tuple[str | None, ...]]]]:
    """Each distinct key path that ends in a limit: its rules' keys and their levels' values."""
    paths: dict[tuple[str, ...], list[tuple[str, tuple[str | None, ...]]]] = {}
    for keys, values, rule in _walk(domain.root, (), ()):
        paths.setdefault(keys, []).append((rule, values))
    return paths


def _walk(
    level: Level, keys: tuple[str, ...], values: tuple[str | None, ...]
) -> Iterator[tuple[tuple[str, ...], tuple[str | None, ...], str]]:
    for node in level.nodes():
        below = (*keys, node.key), (*values, node.value)
        if node.limit is not None:
            yield *below, node.rule_key
        yield from _walk(node.children, *below)


def feed(domain: Domain, sources: Sources, routes: Sequence[Route]) -> Feed:
    """The descriptors each route sends; a ConfigError names a key without a source or an
    unknown route, with the fix."""
    names = [route.name for route in routes]
    for source in sources.keys.values():
        for name in source.routes:
            if name not in names:
                raise ConfigError(
                    sources.name,
                    f"{source.key}.routes",
                    f"unknown route '{name}' (the routes are: {', '.join(names)})",
                )
    descriptors = []
    for keys, rules in _rules_by_path(domain).items():
        rule = rules[0][0]
        missing = [key for key in keys if key not in sources.keys]
        if missing:
            key = missing[0]
            raise ConfigError(
                sources.name,
                "",
                f"descriptor key '{key}' of rule '{rule}' ({domain.source}) has no source "
                f"(add a line such as '{key}: {{header: x-{key.replace('_', '-')}}}')",
            )
        descriptors.append(
            Descriptor(
                tuple(sources.keys[key] for key in keys),
                rule,
                tuple(dict.fromkeys(values for _, values in rules)),
            )
        )
    return Feed(
        domain=domain.name,
        routes=tuple(
            RouteFeed(
                route,
                tuple(d for d in descriptors if all(s.on_route(route.name) for s in d.sources)),
            )
            for route in routes
        ),
        source=domain.source,
    )
