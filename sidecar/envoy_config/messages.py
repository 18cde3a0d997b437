"""A `Feed` as Envoy's own typed messages (envoy-data-plane), and those messages as YAML.

The pieces that feed a rules file are the rate limit HTTP filter, the `ratelimit` cluster that
reaches the sidecar over HTTP/2, and per route a `RateLimitPerRoute` whose `rate_limits` send
the feed's descriptors. `bootstrap` puts a whole gateway around them: a listener, the routes,
the upstream cluster and the admin interface.

Route limits live in the filter's per-route config (`typed_per_filter_config`) rather than in
the route action's `rate_limits`: only there does Envoy honour a per-descriptor `hits_addend`,
which check-then-count needs.
"""

from __future__ import annotations

import datetime
import ipaddress
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import betterproto2
import yaml

from sidecar.envoy_config import quota
from sidecar.envoy_config.feeds import Descriptor, Feed, RouteFeed
from sidecar.envoy_config.sources import Attribute, Source

# envoy-data-plane 2.2 declares its oneof checks as pydantic deprecated in 2.12 (a classmethod
# `model_validator(mode="after")`); harmless here, and not ours to change, so the warning it
# raises on import is not shown to every user of envoy-config.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.bootstrap import v3 as bootstrap_v3
    from envoy_data_plane.envoy.config.cluster import v3 as cluster_v3
    from envoy_data_plane.envoy.config.core import v3 as core_v3
    from envoy_data_plane.envoy.config.endpoint import v3 as endpoint_v3
    from envoy_data_plane.envoy.config.listener import v3 as listener_v3
    from envoy_data_plane.envoy.config.ratelimit import v3 as ratelimit_v3
    from envoy_data_plane.envoy.config.route import v3 as route_v3
    from envoy_data_plane.envoy.extensions.filters.http.ratelimit import v3 as ratelimit_filter_v3
    from envoy_data_plane.envoy.extensions.filters.http.router import v3 as router_v3
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import (
        v3 as hcm_v3,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http import v3 as upstream_http_v3
    from envoy_data_plane.envoy.type.matcher import v3 as matcher_v3
    from envoy_data_plane.google.protobuf import Any as AnyMessage

FILTER_NAME = "envoy.filters.http.ratelimit"
SIDECAR_CLUSTER = "ratelimit"
UPSTREAM_CLUSTER = "upstream"
#: Hits a stream-done descriptor adds: 1 for a 2xx response, 0 for anything else (an upstream
#: error, a reset, Envoy's own 429 or 503). Envoy evaluates it once the response is known.
SUCCESS_HITS = "%CEL(response.code >= 200 && response.code < 300 ? 1 : 0)%"
#: The client's address as the remote_address action reads it, for keys not named remote_address.
REMOTE_ADDRESS = "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"
CONNECT_TIMEOUT = datetime.timedelta(seconds=1)


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Pipe:
    """A Unix socket, as Envoy names one: the injected sidecar listens on one in its pod."""

    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


@dataclass(frozen=True)
class Settings:
    """How Envoy reaches the sidecar and, for a bootstrap, where the gateway listens and sends.

    `timeout` bounds one ShouldRateLimit call; past it, or when the sidecar cannot be reached,
    `failure_mode_deny` decides (false: the request goes on unlimited).
    """

    sidecar: Address | Pipe
    timeout: datetime.timedelta
    failure_mode_deny: bool = False
    #: The sidecar's RLQS address: feed the rules through the rate_limit_quota filter instead.
    rlqs: Address | Pipe | None = None
    listen: Address = Address("0.0.0.0", 10000)
    upstream: Address = Address("127.0.0.1", 8000)
    admin: Address = Address("127.0.0.1", 9901)


# --- the pieces -------------------------------------------------------------------------------


def rate_limit_filter(domain: str, settings: Settings) -> hcm_v3.HttpFilter:
    """The rate limit HTTP filter; it must come before the router in `http_filters`."""
    config = ratelimit_filter_v3.RateLimit(
        domain=domain,
        failure_mode_deny=settings.failure_mode_deny,
        timeout=settings.timeout,
        enable_x_ratelimit_headers=ratelimit_filter_v3.RateLimitXRateLimitHeadersRfcVersion.DRAFT_VERSION_03,
        rate_limited_as_resource_exhausted=True,
        rate_limit_service=ratelimit_v3.RateLimitServiceConfig(
            transport_api_version=core_v3.ApiVersion.V3,
            grpc_service=core_v3.GrpcService(
                envoy_grpc=core_v3.GrpcServiceEnvoyGrpc(cluster_name=SIDECAR_CLUSTER)
            ),
        ),
    )
    return hcm_v3.HttpFilter(name=FILTER_NAME, typed_config=AnyMessage.pack(config))


def sidecar_cluster(address: Address | Pipe, name: str = SIDECAR_CLUSTER) -> cluster_v3.Cluster:
    """The `ratelimit` cluster (or another `name`): gRPC, so HTTP/2 only, to the sidecar."""
    http2 = upstream_http_v3.HttpProtocolOptions(
        explicit_http_config=upstream_http_v3.HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=core_v3.Http2ProtocolOptions()
        )
    )
    cluster = _cluster(name, address)
    cluster.typed_extension_protocol_options = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyMessage.pack(http2)
    }
    return cluster


def per_route_config(route: RouteFeed) -> ratelimit_filter_v3.RateLimitPerRoute:
    """The route's `rate_limits`: one entry per descriptor, two for a check-then-count one."""
    rate_limits: list[route_v3.RateLimit] = []
    for descriptor in route.descriptors:
        rate_limits.extend(_rate_limits(descriptor, route.route.name))
    return ratelimit_filter_v3.RateLimitPerRoute(rate_limits=rate_limits)


def _rate_limits(descriptor: Descriptor, route: str) -> list[route_v3.RateLimit]:
    actions = [action(source, route) for source in descriptor.sources]
    if not descriptor.check_then_count:
        return [route_v3.RateLimit(actions=actions)]
    return [
        # On the request: ask without counting; OVER_LIMIT once the count reached the limit.
        route_v3.RateLimit(actions=actions, hits_addend=route_v3.RateLimitHitsAddend(number=0)),
        # When the stream is done: count, but only what was served.
        route_v3.RateLimit(
            actions=list(actions),
            apply_on_stream_done=True,
            hits_addend=route_v3.RateLimitHitsAddend(format=SUCCESS_HITS),
        ),
    ]


def action(source: Source, route: str) -> route_v3.RateLimitAction:
    """The action that appends the entry (`source.key`, value) to a descriptor."""
    key = source.key
    match source.attribute:
        case Attribute.REMOTE_ADDRESS if key == "remote_address":
            return route_v3.RateLimitAction(remote_address=route_v3.RateLimitActionRemoteAddress())
        case Attribute.REMOTE_ADDRESS:
            # remote_address always names its entry "remote_address"; this one takes any key.
            # An inverted matcher with no ranges matches every address.
            return route_v3.RateLimitAction(
                remote_address_match=route_v3.RateLimitActionRemoteAddressMatch(
                    descriptor_key=key,
                    descriptor_value=REMOTE_ADDRESS,
                    address_matcher=matcher_v3.AddressMatcher(invert_match=True),
                )
            )
        case Attribute.PATH:
            return _header(":path", key)
        case Attribute.HEADER:
            return _header(source.argument, key)
        case Attribute.GENERIC_KEY:
            return _generic_key(source.argument, key)
        case Attribute.ROUTE:
            return _generic_key(route, key)


def _header(name: str, key: str) -> route_v3.RateLimitAction:
    # A request without the header sends no descriptor for this rule (skip_if_absent false).
    return route_v3.RateLimitAction(
        request_headers=route_v3.RateLimitActionRequestHeaders(header_name=name, descriptor_key=key)
    )


def _generic_key(value: str, key: str) -> route_v3.RateLimitAction:
    generic = route_v3.RateLimitActionGenericKey(descriptor_value=value)
    if key != "generic_key":
        generic.descriptor_key = key
    return route_v3.RateLimitAction(generic_key=generic)


def route(feed: RouteFeed, *, with_rate_limit: bool = True) -> route_v3.Route:
    """A route to the upstream cluster, with its rate limits when it has any."""
    message = route_v3.Route(
        name=feed.route.name,
        match=route_v3.RouteMatch(prefix=feed.route.prefix),
        route=route_v3.RouteAction(cluster=UPSTREAM_CLUSTER),
    )
    if with_rate_limit and feed.descriptors:
        message.typed_per_filter_config = {FILTER_NAME: AnyMessage.pack(per_route_config(feed))}
    return message


# --- a whole gateway --------------------------------------------------------------------------


def bootstrap(
    feed: Feed, settings: Settings, *, with_rate_limit: bool = True
) -> bootstrap_v3.Bootstrap:
    """A gateway: listener → routes → upstream, each request checked with the sidecar first.

    Without `with_rate_limit`, the same gateway with no rate limit filter, no per-route limits
    and no sidecar cluster: the baseline a benchmark compares with.
    """
    filters, clusters = _rate_limiting(feed, settings) if with_rate_limit else ([], [])
    # The rate_limit filter reads each route's limits; the quota filter's buckets match routes
    # themselves.
    route_limits = with_rate_limit and settings.rlqs is None
    filters.append(
        hcm_v3.HttpFilter(
            name="envoy.filters.http.router", typed_config=AnyMessage.pack(router_v3.Router())
        )
    )
    manager = hcm_v3.HttpConnectionManager(
        stat_prefix="gateway",
        # An edge proxy: the connection's peer is the client, whatever x-forwarded-for says,
        # so remote_address cannot be forged by a header.
        use_remote_address=True,
        route_config=route_v3.RouteConfiguration(
            name="gateway",
            virtual_hosts=[
                route_v3.VirtualHost(
                    name="gateway",
                    domains=["*"],
                    routes=[route(r, with_rate_limit=route_limits) for r in feed.routes],
                )
            ],
        ),
        http_filters=filters,
    )
    listener = listener_v3.Listener(
        name="gateway",
        address=_address(settings.listen),
        filter_chains=[
            listener_v3.FilterChain(
                filters=[
                    listener_v3.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=AnyMessage.pack(manager),
                    )
                ]
            )
        ],
    )
    clusters.insert(0, _cluster(UPSTREAM_CLUSTER, settings.upstream))
    return bootstrap_v3.Bootstrap(
        admin=bootstrap_v3.Admin(address=_address(settings.admin)),
        static_resources=bootstrap_v3.BootstrapStaticResources(
            listeners=[listener], clusters=clusters
        ),
    )


def pieces(feed: Feed, settings: Settings) -> dict[str, Any]:
    """The filter, the cluster and each route with its rate limits, as plain data for YAML."""
    filters, clusters = _rate_limiting(feed, settings)
    return {
        "http_filters": [_data(f) for f in filters],
        "clusters": [_data(c) for c in clusters],
        "routes": [_data(route(r, with_rate_limit=settings.rlqs is None)) for r in feed.routes],
    }


def _rate_limiting(
    feed: Feed, settings: Settings
) -> tuple[list[hcm_v3.HttpFilter], list[cluster_v3.Cluster]]:
    """The filter that limits the requests, and the cluster it reaches the sidecar by: the
    rate_limit filter, or with `settings.rlqs` the rate_limit_quota filter."""
    if settings.rlqs is None:
        return [rate_limit_filter(feed.domain, settings)], [sidecar_cluster(settings.sidecar)]
    found = quota.buckets(feed)
    return (
        [quota.quota_filter(feed, found, settings.failure_mode_deny)],
        [sidecar_cluster(settings.rlqs, quota.RLQS_CLUSTER)],
    )


def to_yaml(document: Mapping[str, Any] | betterproto2.Message, header: str = "") -> str:
    """YAML in Envoy's field names (snake_case), keys in proto declaration order."""
    data = _data(document) if isinstance(document, betterproto2.Message) else document
    text = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False, width=100)
    return header + text


def _data(message: betterproto2.Message) -> dict[str, Any]:
    data: dict[str, Any] = _show_failure_mode(message.to_dict(casing=betterproto2.Casing.SNAKE))
    return data


def _show_failure_mode(data: Any) -> Any:
    """`failure_mode_deny: false` is proto3's default, so to_dict leaves it out; a reader of the
    filter should see the choice, so it is put back where Envoy declares it."""
    if isinstance(data, dict):
        if data.get("@type", "").endswith("filters.http.ratelimit.v3.RateLimit"):
            shown = {}
            for name, value in data.items():
                shown[name] = value
                if name == "domain":
                    shown["failure_mode_deny"] = data.get("failure_mode_deny", False)
            return shown
        return {name: _show_failure_mode(value) for name, value in data.items()}
    if isinstance(data, list):
        return [_show_failure_mode(item) for item in data]
    return data


def _cluster(name: str, address: Address | Pipe) -> cluster_v3.Cluster:
    # An IP or a pipe needs no resolver; a name is resolved and re-resolved as DNS changes.
    kind = (
        cluster_v3.ClusterDiscoveryType.STRICT_DNS
        if isinstance(address, Address) and not _is_ip(address.host)
        else cluster_v3.ClusterDiscoveryType.STATIC
    )
    return cluster_v3.Cluster(
        name=name,
        type=kind,
        connect_timeout=CONNECT_TIMEOUT,
        load_assignment=endpoint_v3.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                endpoint_v3.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_v3.LbEndpoint(
                            endpoint=endpoint_v3.Endpoint(address=_address(address))
                        )
                    ]
                )
            ],
        ),
    )


def _address(address: Address | Pipe) -> core_v3.Address:
    if isinstance(address, Pipe):
        return core_v3.Address(pipe=core_v3.Pipe(path=address.path))
    return core_v3.Address(
        socket_address=core_v3.SocketAddress(address=address.host, port_value=address.port)
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
