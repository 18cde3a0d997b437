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

from sidecar.envoy_config.sources import Count, Source, Sources
from sidecar.errors import ConfigError
from sidecar.rules import Domain, Level


@dataclass(frozen=True)
class Route:
    """A gateway route: requests whose path starts with `prefix`; `name` is its descriptor value
    for keys read from the `route` attribute."""

    name: str
    prefix: str


@dataclass(frozen=True)
class Descriptor:
    """One descriptor Envoy sends: its entries' sources in order, and the first rule it feeds."""

    sources: tuple[Source, ...]
    rule: str

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
    """Everything Envoy needs to feed one domain: its name and each route's descriptors."""

    domain: str
    routes: tuple[RouteFeed, ...]


def key_paths(domain: Domain) -> list[tuple[tuple[str, ...], str]]:
    """Each distinct key path that ends in a limit, with the first rule key that has it.

    Declaration order, depth first: the order a reader of the rules file meets them.
    """
    seen: dict[tuple[str, ...], str] = {}
    for keys, rule in _walk(domain.root, ()):
        seen.setdefault(keys, rule)
    return list(seen.items())


def _walk(level: Level, above: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
    for node in level.nodes():
        keys = (*above, node.key)
        if node.limit is not None:
            yield keys, node.rule_key
        yield from _walk(node.children, keys)


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
    for keys, rule in key_paths(domain):
        missing = [key for key in keys if key not in sources.keys]
        if missing:
            key = missing[0]
            raise ConfigError(
                sources.name,
                "",
                f"descriptor key '{key}' of rule '{rule}' ({domain.source}) has no source "
                f"(add a line such as '{key}: {{header: x-{key.replace('_', '-')}}}')",
            )
        descriptors.append(Descriptor(tuple(sources.keys[key] for key in keys), rule))
    return Feed(
        domain=domain.name,
        routes=tuple(
            RouteFeed(
                route,
                tuple(d for d in descriptors if all(s.on_route(route.name) for s in d.sources)),
            )
            for route in routes
        ),
    )
