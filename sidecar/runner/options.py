"""What `serve` is started with: `Options`, filled by the command line (`sidecar.cli.serve`) or
by tests, and the checks of its addresses; `InvalidOption` when one cannot be used.

Apart from `sidecar.runner.app` so that the parts it assembles (`sidecar.runner.assembly`) and the flags
(`sidecar.cli.flags`) read it without importing the composition root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sidecar.decision.limiter import FailureMode, RejectedHits
from sidecar.frequency.caps import DEDUPE_HORIZON
from sidecar.operator.port import OperatorSettings
from sidecar.quota.service import DEFAULT_TTL_MS
from sidecar.rls.extras import Extras, HeaderNames
from sidecar.rls.h2.server import unix_path
from sidecar.rls.tls import TlsFiles
from sidecar.telemetry.statsd import StatsdSettings
from sidecar.telemetry.tracing import TracingSettings
from sidecar.xds.client import XdsOptions

#: `fast`: the sidecar's own HTTP/2 server (sidecar.rls.h2); `grpcio`: grpc.aio.
Transport = Literal["fast", "grpcio"]
TRANSPORTS: tuple[Transport, ...] = ("fast", "grpcio")


class InvalidOption(ValueError):
    """An address or backend URL the sidecar cannot start with; the message says why."""


#: The reference's names of its response headers (LIMIT_LIMIT_HEADER and the others' defaults).
_HEADER_NAMES = HeaderNames()


@dataclass(frozen=True)
class Options:
    """What `serve` needs; the CLI fills it from flags and RLS_* variables."""

    #: Rules files or directories; empty when the rules come over xDS (`xds`).
    config: Sequence[str | Path]
    backend: str = "memory://"
    #: A second store for the counters of per-second descriptors (the reference's
    #: REDIS_PERSECOND; `sidecar.storage.per_second`).
    backend_per_second: str | None = None
    grpc_address: str = "0.0.0.0:8081"
    http_address: str = "0.0.0.0:8080"
    redis_timeout_ms: int = 50
    failure_mode: FailureMode = "allow"
    #: Under failure_mode "local": how many sidecars share the counters (see Settings); None
    #: (`--local-divisor auto`): learned from the backend (`sidecar.storage.peers`).
    local_divisor: int | None = None
    rejected_hits: RejectedHits = "count"
    #: Take refunds (`is_negative_hits`; `--negative-hits`, ENABLE_NEGATIVE_HITS): see
    #: `sidecar.decision.limiter.Settings`.
    negative_hits: bool = False
    #: Decide `approximate` rules locally and sync their counts every this many ms
    #: (`sidecar.storage.aggregation`); None: off, every hit is decided by the store.
    sync_interval_ms: int | None = None
    #: Decide `leased` rules from leases covering this many ms of demand
    #: (`sidecar.storage.leases`); None: off, every hit is decided by the store.
    lease_ms: int | None = None
    shadow_mode: bool = False
    #: Entries of the over-limit cache (0: off).
    over_limit_cache: int = 100_000
    #: Keys per usage dimension in /metrics (today's with the most calls); 0: none.
    usage_metrics_top: int = 10
    #: Name the limit behind an OVER_LIMIT answer (a `RateLimit-Policy` header, dynamic metadata).
    response_limit_name: bool = False
    #: The reference's RateLimit-Limit/-Remaining/-Reset headers on every answer with a limit
    #: (LIMIT_RESPONSE_HEADERS_ENABLED), under these names.
    response_headers: bool = False
    response_limit_header: str = _HEADER_NAMES.limit
    response_remaining_header: str = _HEADER_NAMES.remaining
    response_reset_header: str = _HEADER_NAMES.reset
    #: Instead, the reference's limit and remaining headers of every descriptor, named by unit
    #: (LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED; `sidecar.rls.extras.all_descriptors_headers`).
    response_headers_all_descriptors: bool = False
    #: The reference's dynamic metadata (RESPONSE_DYNAMIC_METADATA): the request's domain and
    #: descriptors, and the passing rules' `metadata`.
    response_dynamic_metadata: bool = False
    transport: Transport = "fast"
    #: Share the gRPC and HTTP ports with other processes (SO_REUSEPORT): `serve --workers N`.
    reuse_port: bool = False
    #: A listening Unix socket inherited from the parent of `serve --workers N`.
    grpc_socket_fd: int | None = None
    #: Permission bits set on a unix:PATH gRPC socket once bound (None: as the umask left them).
    grpc_socket_mode: int | None = None
    #: Seconds an impression id is remembered at least (frequency caps' exactly-once counting).
    dedupe_horizon: int = DEDUPE_HORIZON
    #: Seconds between looks at the rules files, and at the TLS files, for a change to reload
    #: (0: only on SIGHUP).
    config_poll_seconds: float = 2.0
    #: HOST:PORT of the Rate Limit Quota Service (`sidecar.quota`); None: not served.
    rlqs_address: str | None = None
    #: A quota assignment's `assignment_time_to_live`, in ms.
    rlqs_assignment_ttl_ms: int = DEFAULT_TTL_MS
    #: TLS (and with a client CA, mTLS) on the gRPC port; None: cleartext.
    tls: TlsFiles | None = None
    #: Where to send the stats as statsd or DogStatsD (beside /metrics); None: nowhere.
    statsd: StatsdSettings | None = None
    #: OpenTelemetry tracing of ShouldRateLimit; None: off, at no cost to a call.
    tracing: TracingSettings | None = None
    #: Rules from a control plane instead of files (`sidecar.xds`).
    xds: XdsOptions | None = None
    #: Unhealthy until rules with at least one domain are loaded.
    health_requires_config: bool = False
    #: Files declaring one domain add their descriptors to it (the reference's
    #: MERGE_DOMAIN_CONFIG; rules over xDS take theirs from `xds`).
    merge_domain_config: bool = False
    #: A rule's `unit: month` with no `calendar` is the UTC calendar month (the reference's
    #: USE_CALENDAR_MONTH_RATE_LIMIT; `config.parse`), in files and over xDS (`xds` has its own).
    calendar_months: bool = False
    #: Another listener for Prometheus (HOST:PORT, at `metrics_path`), as the reference's
    #: USE_PROMETHEUS/PROMETHEUS_ADDR; /metrics on the HTTP port stays.
    metrics_address: str | None = None
    metrics_path: str = "/metrics"
    #: Another listener for /rlconfig and /metrics, as the reference's DEBUG_PORT.
    debug_address: str | None = None
    #: The operator port (`sidecar.operator.port`: counters read and reset); None: not served.
    operator: OperatorSettings | None = None

    def extras(self) -> Extras:
        """What answers carry beside their statuses; raises InvalidOption for a header name
        that cannot be one."""
        try:
            headers = HeaderNames(
                self.response_limit_header,
                self.response_remaining_header,
                self.response_reset_header,
            )
        except ValueError as exc:
            raise InvalidOption(f"response headers: {exc}") from exc
        return Extras(
            limit_name=self.response_limit_name,
            headers=headers if self.response_headers else None,
            dynamic_metadata=self.response_dynamic_metadata,
            all_descriptors_headers=self.response_headers_all_descriptors,
        )


def check_grpc_address(address: str) -> None:
    """`HOST:PORT` or `unix:PATH`; raises InvalidOption if malformed."""
    path = unix_path(address)
    if path is None:
        split_address(address)
    elif not path:
        raise InvalidOption(
            f"invalid address {address!r}: expected unix:PATH, e.g. unix:/run/rls.sock"
        )


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPv6]:PORT`) as host and port; raises InvalidOption if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65_535:
        raise InvalidOption(f"invalid address {address!r}: expected HOST:PORT, e.g. 0.0.0.0:8081")
    return host.strip("[]") or "0.0.0.0", int(port)
