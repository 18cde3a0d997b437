"""The sidecar as an xDS client: rules from a control plane, as Envoy Gateway deploys the reference.

One aggregated discovery stream (`envoy.service.discovery.v3.AggregatedDiscoveryService/
StreamAggregatedResources`, state of the world) subscribes to every `RateLimitConfig` resource
(a wildcard subscription) for the node `options.node_id`. Each response carries the whole set
of rules: it is converted and checked as rules files are (`sidecar.xds.convert`), then

- served from the next call (`on_rules`), and ACKed: a request with the response's
  `version_info` and `nonce`;
- or, when any resource is not valid rules, NACKed: the nonce, the version last applied, and
  `error_detail` with the error (`on_error`); the rules served before stay served.

A stream that breaks (the control plane restarts, the network fails) is opened again after a
back-off; the rules it last applied keep serving meanwhile. Until a stream has delivered a
response, attempts are `connect_retry` seconds apart (±50%); once one has, a broken stream waits
`backoff_delay` (the reference's formula, below) before the next attempt.
Files named by the TLS options are read at every attempt, so a rotated certificate is picked up
when the stream is next opened.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc  # type: ignore[import-untyped]
import structlog
from envoy.config.core.v3 import base_pb2  # type: ignore[import-untyped]
from envoy.service.discovery.v3 import discovery_pb2  # type: ignore[import-untyped]
from google.protobuf import struct_pb2  # type: ignore[import-untyped]
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from sidecar import __version__
from sidecar.core.rules import Rules
from sidecar.errors import ConfigError
from sidecar.xds import convert

METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
#: Keepalive pings no more often than grpc-go servers accept by default (5 minutes), so a
#: control plane never answers them with GOAWAY too_many_pings; they find a dead connection.
KEEPALIVE_MS = 300_000
KEEPALIVE_TIMEOUT_MS = 20_000

log = structlog.get_logger("sidecar.xds")


@dataclass(frozen=True)
class XdsOptions:
    """Where the rules come from and how to reach it (the reference's `CONFIG_GRPC_XDS_*`)."""

    #: The control plane's gRPC target, HOST:PORT.
    server: str
    node_id: str = "default"
    node_metadata: Mapping[str, str] = field(default_factory=dict)
    #: Sent with the stream as gRPC metadata (keys in lower case, as HTTP/2 needs).
    headers: Sequence[tuple[str, str]] = ()
    tls: bool = False
    #: The CA that signed the control plane's certificate (None: the system's roots).
    ca_file: str | None = None
    #: This client's certificate and key, for mTLS.
    cert_file: str | None = None
    key_file: str | None = None
    #: The name the control plane's certificate must carry, when not its address's.
    server_name: str | None = None
    connect_retry: float = 3.0
    backoff_initial: float = 10.0
    backoff_max: float = 60.0
    backoff_factor: float = 0.5
    backoff_jitter: bool = True
    #: The largest response accepted (None: gRPC's 4 MiB).
    max_message_bytes: int | None = None
    #: Serve before the first rules arrive (with none: every domain is unknown, so OK).
    force_start: bool = False
    #: Resources declaring one domain add their descriptors to it (MERGE_DOMAIN_CONFIG).
    merge_domain_config: bool = False
    #: A rule's `unit: month` is the UTC calendar month (USE_CALENDAR_MONTH_RATE_LIMIT).
    calendar_months: bool = False


def backoff_delay(
    attempt: int,
    initial: float,
    maximum: float,
    factor: float,
    jitter: bool,
    draw: Callable[[], float] = random.random,
) -> float:
    """Seconds before reconnecting after the `attempt`-th broken stream in a row (from 0).

    The reference's (jpillora/backoff): `initial × factor^attempt`, with jitter a uniform draw
    between `initial` and that, kept within [initial, maximum]; a factor of 0 or less is 2.
    Its defaults (10 s, 60 s, factor 0.5) therefore wait 10 s every time.
    """
    if initial >= maximum:
        return maximum
    growth = factor if factor > 0 else 2.0
    delay = initial * growth ** min(attempt, 64)
    if jitter:
        delay = draw() * (delay - initial) + initial
    return min(max(delay, initial), maximum)


def retry_delay(interval: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds before the next attempt to open a stream: `interval` ±50%, as the reference's
    linear back-off with jitter 0.5."""
    return interval * (0.5 + draw())


class XdsClient:
    """Keeps one stream open to the control plane and hands every valid set of rules on.

    `on_rules(rules, version)` serves new rules; `on_error(error, version)` hears a rejected
    push (the rules do not change). `first_rules` is set once rules were first applied.
    """

    def __init__(
        self,
        options: XdsOptions,
        on_rules: Callable[[Rules, str], None],
        on_error: Callable[[ConfigError, str], None],
    ) -> None:
        self.options = options
        self._on_rules = on_rules
        self._on_error = on_error
        #: The version last applied ("" before any): sent with every ACK and NACK.
        self.version = ""
        self.first_rules = asyncio.Event()
        #: Streams opened so far (1 after the first connection; more after reconnections).
        self.streams = 0
        self._failing = False

    def node(self) -> base_pb2.Node:
        node = base_pb2.Node(
            id=self.options.node_id,
            user_agent_name="ratelimit-sidecar",
            user_agent_version=__version__,
        )
        if self.options.node_metadata:
            node.metadata.CopyFrom(_struct(self.options.node_metadata))
        return node

    async def run(self) -> None:
        """Stream rules until cancelled; never raises otherwise."""
        options = self.options
        broken = 0
        while True:
            try:
                delivered = await self._stream()
            except Exception:  # a bug must not end the rules' updates: log it, reconnect
                log.exception("xds_client_error", server=options.server)
                delivered = False
            if delivered:
                delay = backoff_delay(
                    broken,
                    options.backoff_initial,
                    options.backoff_max,
                    options.backoff_factor,
                    options.backoff_jitter,
                )
                broken += 1
            else:
                delay = retry_delay(options.connect_retry)
            await asyncio.sleep(delay)

    async def _stream(self) -> bool:
        """One stream, until it ends; returns whether it delivered a response."""
        delivered = False
        try:
            channel = self._channel()
        except OSError as exc:
            self._failed(f"cannot read a TLS file: {exc}")
            return False
        try:
            call = channel.stream_stream(
                METHOD,
                request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
                response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
            )(metadata=tuple(self.options.headers))
            await call.write(self._request())
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    self._failed("the control plane ended the stream")
                    break
                assert isinstance(response, discovery_pb2.DiscoveryResponse)
                if not delivered:
                    delivered = True
                    self.streams += 1
                    self._connected()
                await call.write(self._answer(response))
        except grpc.aio.AioRpcError as exc:
            self._failed(f"{exc.code().name}: {exc.details()}")
        except (grpc.RpcError, grpc.aio.UsageError) as exc:
            # A write racing the stream's end surfaces as a bare RpcError or UsageError.
            self._failed(f"{type(exc).__name__}: {exc}")
        finally:
            await channel.close(grace=None)
        return delivered

    def _answer(self, response: discovery_pb2.DiscoveryResponse) -> discovery_pb2.DiscoveryRequest:
        """Apply a response's rules and return the ACK, or the NACK if they are not valid."""
        version = response.version_info
        try:
            if response.type_url != convert.TYPE_URL:
                raise ConfigError(
                    "xds", "", f"a response of type {response.type_url!r}, not {convert.TYPE_URL!r}"
                )
            rules = convert.rules(
                response.resources,
                self.options.merge_domain_config,
                self.options.calendar_months,
            )
        except ConfigError as exc:
            self._on_error(exc, version)
            return self._request(
                nonce=response.nonce,
                error=status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc)),
            )
        self._on_rules(rules, version)
        self.version = version
        self.first_rules.set()
        return self._request(nonce=response.nonce)

    def _request(
        self, nonce: str = "", error: status_pb2.Status | None = None
    ) -> discovery_pb2.DiscoveryRequest:
        request = discovery_pb2.DiscoveryRequest(
            version_info=self.version,
            node=self.node(),
            type_url=convert.TYPE_URL,
            response_nonce=nonce,
        )
        if error is not None:
            request.error_detail.CopyFrom(error)
        return request

    def _channel(self) -> grpc.aio.Channel:
        options = self.options
        channel_options: list[tuple[str, str | int]] = [
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.primary_user_agent", f"ratelimit-sidecar/{__version__}"),
        ]
        if options.max_message_bytes is not None:
            channel_options.append(("grpc.max_receive_message_length", options.max_message_bytes))
        if not options.tls:
            return grpc.aio.insecure_channel(options.server, options=channel_options)
        if options.server_name:
            channel_options.append(("grpc.ssl_target_name_override", options.server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(options.ca_file),
            private_key=_read(options.key_file),
            certificate_chain=_read(options.cert_file),
        )
        return grpc.aio.secure_channel(options.server, credentials, options=channel_options)

    def _connected(self) -> None:
        log.info("xds_connected", server=self.options.server, node_id=self.options.node_id)
        self._failing = False

    def _failed(self, reason: str) -> None:
        """Logged once per run of failures, so a control plane that is down costs one line."""
        if not self._failing:
            self._failing = True
            log.warning(
                "xds_unavailable",
                server=self.options.server,
                reason=reason,
                rules="kept" if self.first_rules.is_set() else "none yet",
            )


def check_files(options: XdsOptions) -> None:
    """Raise OSError naming a TLS file that cannot be read (checked once at start-up)."""
    if options.tls:
        for name in (options.ca_file, options.cert_file, options.key_file):
            _read(name)


def _read(name: str | None) -> bytes | None:
    return None if not name else Path(name).read_bytes()


def _struct(values: Mapping[str, str]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(dict(values))
    return struct
