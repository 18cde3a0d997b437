"""A `Feed` through Envoy's `rate_limit_quota` filter (RLQS) instead of the `rate_limit` filter.

The filter asks no one per request: it sorts each request into a bucket with its
`bucket_matchers`, enforces the assignment the sidecar's RLQS server (`serve --rlqs-address`)
gave that bucket, and reports usage. Each descriptor of a route becomes one bucket: its
`bucket_id_builder` carries the descriptor's keys with the values read from the request as the
sources say (a header, `:path`, the client's address, a fixed value, the route's name), and the
sidecar matches that bucket id against the rules as it would the descriptor.

What differs from the `rate_limit` filter, and how the command deals with it:

- A request counts in one bucket only, the first whose matcher it satisfies; the
  `rate_limit` filter checks every descriptor. A bucket's matcher asks for what its rules
  could match (each header present, or the rules' exact values and wildcards); a bucket goes
  before the first one that would take all its requests, and one that no request could reach
  past an earlier one is a ConfigError. The output's header states each route's order
  (`notes`).
- The filter's matchers run before routing, so each route's buckets also match the route's
  `:path` prefix, and not the prefix of an earlier route that would take the request first.
- `count: on_success` (check-then-count) has no counterpart: every request in a bucket counts.
  `notes` says so.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.core.rules import compile_wildcard
from sidecar.envoy_config.feeds import Descriptor, Feed, Route, RouteFeed
from sidecar.envoy_config.sources import Attribute, Count, Source
from sidecar.errors import ConfigError

# See messages.py: envoy-data-plane's import-time DeprecationWarning is not ours to show.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.core import v3 as core_v3
    from envoy_data_plane.envoy.extensions.filters.http.rate_limit_quota import v3 as quota_v3
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import (
        v3 as hcm_v3,
    )
    from envoy_data_plane.envoy.extensions.matching.common_inputs.network import (
        v3 as network_inputs_v3,
    )
    from envoy_data_plane.envoy.type import v3 as type_v3
    from envoy_data_plane.envoy.type.matcher import v3 as http_inputs_v3
    from envoy_data_plane.google import rpc
    from envoy_data_plane.google.protobuf import Any as AnyMessage
    from envoy_data_plane.xds.core import v3 as xds_core_v3
    from envoy_data_plane.xds.type.matcher import v3 as xds_matcher_v3

FILTER_NAME = "envoy.filters.http.rate_limit_quota"
RLQS_CLUSTER = "rlqs"
#: How often Envoy reports a bucket's usage (Envoy 1.40 reports every 5 s whatever it says).
REPORTING_INTERVAL = datetime.timedelta(seconds=5)
#: gRPC's RESOURCE_EXHAUSTED, for a denied gRPC request: the status that means quota, which
#: clients do not retry on their own (the filter's default, UNAVAILABLE, they do).
RESOURCE_EXHAUSTED = 8
#: Any non-empty value, for a key whose rules take every value (RE2, as Envoy requires).
ANY_VALUE = ".+"
#: The client's address, as `Condition.header` names it.
CLIENT_ADDRESS = ""


@dataclass(frozen=True, order=True)
class Condition:
    """One test on a request: a header (`:path` included; CLIENT_ADDRESS for the client's
    address) that must match `value` by `kind`: "exact", "prefix" or "regex" (RE2, whole)."""

    header: str
    kind: str
    value: str


#: Sets of conditions, any one of which puts a request in a bucket; an empty set matches every
#: request of the route.
Alternatives = tuple[frozenset[Condition], ...]


@dataclass(frozen=True)
class Bucket:
    """One descriptor of one route as a bucket, and which requests fall in it."""

    route: Route
    descriptor: Descriptor
    alternatives: Alternatives


# --- which requests each bucket takes: pure ---------------------------------------------------


def buckets(feed: Feed) -> list[Bucket]:
    """Every route's buckets, in the order the filter tries them (route by route, narrower
    buckets first); a ConfigError names a rule whose bucket no request could reach."""
    found: list[Bucket] = []
    for route_feed in feed.routes:
        found.extend(_route_buckets(route_feed, feed.source))
    return found


def _route_buckets(route_feed: RouteFeed, source: str) -> list[Bucket]:
    candidates = []
    for descriptor in route_feed.descriptors:
        alternatives = _alternatives(descriptor, route_feed.route.name)
        # A rule whose fixed value differs from the route's is never matched there, by the
        # rate_limit filter either: no bucket.
        if alternatives:
            candidates.append(Bucket(route_feed.route, descriptor, alternatives))
    ordered = _narrower_first(candidates)
    for index, later in enumerate(ordered):
        for earlier in ordered[:index]:
            if _covers(earlier.alternatives, later.alternatives):
                raise ConfigError(
                    source,
                    "",
                    f"rule '{later.descriptor.rule}' cannot be a rate_limit_quota bucket on "
                    f"route '{route_feed.route.name}': a request counts in one bucket only, and "
                    f"every request it could match falls first in the bucket of rule "
                    f"'{earlier.descriptor.rule}' (read one of its keys from a request "
                    "attribute the other does not need, or leave out --rlqs-address to feed "
                    "the rules through the rate_limit filter, which checks every rule)",
                )
    return ordered


def _narrower_first(candidates: list[Bucket]) -> list[Bucket]:
    """The rules' order, except that a bucket goes before the first one that would take all
    its requests and more (which would otherwise leave it none)."""
    ordered: list[Bucket] = []
    for bucket in candidates:
        at = next(
            (
                index
                for index, placed in enumerate(ordered)
                if _covers(placed.alternatives, bucket.alternatives)
                and not _covers(bucket.alternatives, placed.alternatives)
            ),
            len(ordered),
        )
        ordered.insert(at, bucket)
    return ordered


def _covers(earlier: Alternatives, later: Alternatives) -> bool:
    """True when every request `later` takes is taken by `earlier` first."""
    return all(any(_implies(alternative, e) for e in earlier) for alternative in later)


def _implies(narrow: frozenset[Condition], broad: frozenset[Condition]) -> bool:
    """True when a request meeting `narrow` meets `broad` too: each condition of `broad` is one
    of `narrow`'s, or asks only that a header `narrow` tests be there."""
    return all(
        c in narrow
        or (
            c.value == ANY_VALUE and c.kind == "regex" and any(n.header == c.header for n in narrow)
        )
        for c in broad
    )


def _alternatives(descriptor: Descriptor, route: str) -> Alternatives:
    """What a request must carry for one of the descriptor's rules to match it."""
    found: list[frozenset[Condition]] = []
    for values in descriptor.values or (tuple(None for _ in descriptor.sources),):
        conditions = _conditions(descriptor.sources, values, route)
        if conditions is not None:
            found.append(conditions)
    # A set implying another takes fewer requests: the broader one suffices.
    unique = list(dict.fromkeys(found))
    kept = [a for a in unique if not any(b != a and _implies(a, b) for b in unique)]
    return tuple(sorted(kept, key=lambda a: (len(a), sorted(a))))


def _conditions(
    sources: Sequence[Source], values: Sequence[str | None], route: str
) -> frozenset[Condition] | None:
    """The conditions of one rule's values; None when a fixed value can never match."""
    conditions = set()
    for source, value in zip(sources, values, strict=True):
        match source.attribute:
            case Attribute.GENERIC_KEY | Attribute.ROUTE:
                fixed = source.argument if source.attribute is Attribute.GENERIC_KEY else route
                if value is not None and not compile_wildcard(value).fullmatch(fixed):
                    return None
            case Attribute.REMOTE_ADDRESS if value is None:
                pass  # every request has a client address
            case _:
                header = _header_of(source)
                if value is None or not value.strip("*"):
                    conditions.add(Condition(header, "regex", ANY_VALUE))
                elif "*" in value:
                    conditions.add(Condition(header, "regex", _re2(value)))
                else:
                    conditions.add(Condition(header, "exact", value))
    return frozenset(conditions)


def _header_of(source: Source) -> str:
    match source.attribute:
        case Attribute.HEADER:
            return source.argument
        case Attribute.PATH:
            return ":path"
        case _:
            return CLIENT_ADDRESS


def _re2(pattern: str) -> str:
    """A rules wildcard as an RE2 regex, as `sidecar.core.rules.compile_wildcard` reads it: each `*`
    any characters, the rest literal."""
    return ".*".join(_escape(part) for part in pattern.split("*"))


def _escape(text: str) -> str:
    # RE2 takes a backslash before punctuation only, so only its metacharacters are escaped.
    return "".join(f"\\{c}" if c in r"\.+*?()|[]{}^$" else c for c in text)


def notes(feed: Feed, found: Sequence[Bucket]) -> list[str]:
    """What the generated filter does differently from the rate_limit filter, for the output's
    header: one sentence per line."""
    lines = []
    for route_feed in feed.routes:
        order = [b.descriptor.rule for b in found if b.route == route_feed.route]
        if len(order) > 1:
            lines.append(
                f"On route '{route_feed.route.name}' a request counts in the first of these "
                f"buckets it matches, and in no other: {', '.join(order)}."
            )
    on_success = sorted(
        {s.key for b in found for s in b.descriptor.sources if s.count is Count.ON_SUCCESS}
    )
    for key in on_success:
        lines.append(
            f"Key '{key}' has count: on_success, which the rate_limit_quota filter cannot do: "
            "every request in its buckets counts, served or not."
        )
    return lines


# --- the filter: Envoy's messages -------------------------------------------------------------


def quota_filter(feed: Feed, found: Sequence[Bucket], deny: bool) -> hcm_v3.HttpFilter:
    """The rate_limit_quota filter; it must come before the router in `http_filters`.

    `deny`: a bucket without a live assignment (before the first, or past its TTL with the
    sidecar out of reach) denies its requests instead of letting them through."""
    config = quota_v3.RateLimitQuotaFilterConfig(
        rlqs_server=core_v3.GrpcService(
            envoy_grpc=core_v3.GrpcServiceEnvoyGrpc(cluster_name=RLQS_CLUSTER)
        ),
        domain=feed.domain,
        bucket_matchers=xds_matcher_v3.Matcher(
            matcher_list=xds_matcher_v3.MatcherMatcherList(
                matchers=[_field_matcher(b, feed, deny) for b in found]
            )
        ),
    )
    return hcm_v3.HttpFilter(name=FILTER_NAME, typed_config=AnyMessage.pack(config))


def _field_matcher(
    bucket: Bucket, feed: Feed, deny: bool
) -> xds_matcher_v3.MatcherMatcherListFieldMatcher:
    routes = [r.route for r in feed.routes]
    earlier = routes[: routes.index(bucket.route)]
    on_route = [_single(Condition(":path", "prefix", bucket.route.prefix))]
    # Envoy routes a request to the first route whose prefix it has: not to this one when an
    # earlier route's prefix is also the request's.
    on_route.extend(
        xds_matcher_v3.MatcherMatcherListPredicate(
            not_matcher=_single(Condition(":path", "prefix", e.prefix))
        )
        for e in earlier
        if e.prefix.startswith(bucket.route.prefix) or bucket.route.prefix.startswith(e.prefix)
    )
    if len(bucket.alternatives) == 1:
        on_route.extend(_single(c) for c in sorted(bucket.alternatives[0]))
    else:  # several, none empty: _alternatives keeps an empty set alone
        on_route.append(_any([_all([_single(c) for c in sorted(a)]) for a in bucket.alternatives]))
    return xds_matcher_v3.MatcherMatcherListFieldMatcher(
        predicate=_all(on_route),
        on_match=xds_matcher_v3.MatcherOnMatch(
            action=xds_core_v3.TypedExtensionConfig(
                name=bucket.descriptor.rule,
                typed_config=AnyMessage.pack(_settings(bucket, deny)),
            )
        ),
    )


def _all(
    predicates: list[xds_matcher_v3.MatcherMatcherListPredicate],
) -> xds_matcher_v3.MatcherMatcherListPredicate:
    return _joined(predicates, any_of=False)


def _any(
    predicates: list[xds_matcher_v3.MatcherMatcherListPredicate],
) -> xds_matcher_v3.MatcherMatcherListPredicate:
    return _joined(predicates, any_of=True)


def _joined(
    predicates: list[xds_matcher_v3.MatcherMatcherListPredicate], *, any_of: bool
) -> xds_matcher_v3.MatcherMatcherListPredicate:
    """`predicates` under an or_matcher (`any_of`) or an and_matcher, or the one alone."""
    if len(predicates) == 1:
        return predicates[0]
    joined = xds_matcher_v3.MatcherMatcherListPredicatePredicateList(predicate=predicates)
    if any_of:
        return xds_matcher_v3.MatcherMatcherListPredicate(or_matcher=joined)
    return xds_matcher_v3.MatcherMatcherListPredicate(and_matcher=joined)


def _single(condition: Condition) -> xds_matcher_v3.MatcherMatcherListPredicate:
    match condition.kind:
        case "exact":
            value = xds_matcher_v3.StringMatcher(exact=condition.value)
        case "prefix":
            value = xds_matcher_v3.StringMatcher(prefix=condition.value)
        case _:
            value = xds_matcher_v3.StringMatcher(
                safe_regex=xds_matcher_v3.RegexMatcher(
                    google_re2=xds_matcher_v3.RegexMatcherGoogleRe2(), regex=condition.value
                )
            )
    name, typed_config = _input(condition.header)
    return xds_matcher_v3.MatcherMatcherListPredicate(
        single_predicate=xds_matcher_v3.MatcherMatcherListPredicateSinglePredicate(
            input=xds_core_v3.TypedExtensionConfig(name=name, typed_config=typed_config),
            value_match=value,
        )
    )


def _input(header: str) -> tuple[str, AnyMessage]:
    """A matcher input's name and config: a request header, or the client's address."""
    if header == CLIENT_ADDRESS:
        return "source_ip", AnyMessage.pack(network_inputs_v3.SourceIpInput())
    return header, AnyMessage.pack(http_inputs_v3.HttpRequestHeaderMatchInput(header_name=header))


def _settings(bucket: Bucket, deny: bool) -> quota_v3.RateLimitQuotaBucketSettings:
    rule = (
        type_v3.RateLimitStrategyBlanketRule.DENY_ALL
        if deny
        else type_v3.RateLimitStrategyBlanketRule.ALLOW_ALL
    )
    fallback = type_v3.RateLimitStrategy(blanket_rule=rule)
    return quota_v3.RateLimitQuotaBucketSettings(
        bucket_id_builder=quota_v3.RateLimitQuotaBucketSettingsBucketIdBuilder(
            bucket_id_builder={
                s.key: _value(s, bucket.route.name) for s in bucket.descriptor.sources
            }
        ),
        reporting_interval=REPORTING_INTERVAL,
        deny_response_settings=quota_v3.RateLimitQuotaBucketSettingsDenyResponseSettings(
            http_status=type_v3.HttpStatus(code=type_v3.StatusCode.TooManyRequests),
            grpc_status=rpc.Status(code=RESOURCE_EXHAUSTED),
        ),
        no_assignment_behavior=quota_v3.RateLimitQuotaBucketSettingsNoAssignmentBehavior(
            fallback_rate_limit=fallback
        ),
        expired_assignment_behavior=quota_v3.RateLimitQuotaBucketSettingsExpiredAssignmentBehavior(
            fallback_rate_limit=fallback
        ),
    )


def _value(
    source: Source, route: str
) -> quota_v3.RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder:
    """The bucket id's value for `source.key`: fixed, or read from each request."""
    builder = quota_v3.RateLimitQuotaBucketSettingsBucketIdBuilderValueBuilder
    match source.attribute:
        case Attribute.GENERIC_KEY:
            return builder(string_value=source.argument)
        case Attribute.ROUTE:
            return builder(string_value=route)
    name, typed_config = _input(_header_of(source))
    return builder(custom_value=core_v3.TypedExtensionConfig(name=name, typed_config=typed_config))
