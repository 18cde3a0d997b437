"""`serve`'s flags, each declared once (`sidecar.cli.flags.Flag`): option, help, type, default,
the `RLS_` variable (from its name), the `Options` field it fills and whether `serve --workers N`
passes it on. `register` (the parser and `--help`), `serve_options` (`Options`) and
`worker_flags` (a worker's command line) in `sidecar.cli.serve` read this table, and the
reference's variables (`sidecar.cli.settings.FLAGS`) set these flags by their names.

To add a flag: add one `Flag(...)` here, in the place its --help line should take, naming the
`Options` field it fills (and add that field, typed, to `sidecar.runner.options.Options`, where the
app reads it); `RLS_<NAME>`, --help and the workers' command line follow from it.

One module past the usual size because it is one table, a row per flag with its help text.
"""

from __future__ import annotations

from typing import Any

from sidecar.cli.flags import (
    Flag,
    address,
    at_least_a_second,
    count,
    count_or_auto,
    grpc_address,
    header_name,
    log_level,
    share,
    socket_mode,
)
from sidecar.telemetry import logs
from sidecar.xds import flags as xds_flags

TRANSPORT_CHOICES = ("fast", "grpcio")
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def _list(values: list[str] | None) -> list[str]:
    return values or []


def _auto_none(value: int | str) -> int | None:
    """--local-divisor auto: learned from the backend, which `Options` says as None."""
    return None if value == "auto" else int(value)


def _milliseconds(seconds: float) -> int:
    return int(seconds * 1000)


def _octal(mode: int) -> str:
    """Permission bits as --grpc-socket-mode reads them (660, not 432)."""
    return format(mode, "o")


def _xds() -> list[Flag]:
    """The xDS flags (`sidecar.xds.flags` declares them, as the xDS client's own), which fill
    `Options.xds` together."""
    declared: list[Flag] = []

    def declare(option: str, help: str, **kwargs: Any) -> None:
        declared.append(Flag(option, help, field="xds", **kwargs))

    xds_flags.add(declare)
    return declared


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--config",
        "a rules file, or a directory of *.yaml/*.yml files; repeat for more. "
        "In RLS_CONFIG, separate several paths with ':' or ','. Required, unless --xds-server",
        action="append",
        metavar="PATH",
        separators=":,",
        field="config",
        to_option=_list,
    ),
    Flag(
        "--backend",
        "where counters live: memory://, redis://[user:password@]host:port[/db], "
        "rediss://... (TLS), redis+cluster://host:port[,host:port...], rediss+cluster://... "
        "(TLS), or redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db] "
        "(Sentinels, default port 26379, asked for the master and followed across failovers; "
        "user:password is the master's, ?sentinel_username=&sentinel_password= the Sentinels'; "
        "rediss+sentinel:// for TLS to both)",
        default="memory://",
        metavar="URL",
        field="backend",
    ),
    Flag(
        "--backend-per-second",
        "a second store for the counters of descriptors whose windows are all in seconds "
        "(redis://, redis+cluster:// or redis+sentinel://; the reference's REDIS_PERSECOND)",
        metavar="URL",
        field="backend_per_second",
    ),
    Flag(
        "--grpc-address",
        "listen address for ShouldRateLimit and gRPC health: HOST:PORT (port 0 picks a free "
        "port) or unix:PATH",
        default="0.0.0.0:8081",
        type=grpc_address,
        metavar="ADDRESS",
        field="grpc_address",
        workers=False,  # each worker is given the one its parent holds
    ),
    Flag(
        "--grpc-socket-mode",
        "with a unix:PATH gRPC address: the socket file's permission bits, in octal (660, "
        "666), so a client running as another user (Envoy in the same pod) may connect; "
        "unset: as the umask leaves them",
        type=socket_mode,
        metavar="OCTAL",
        field="grpc_socket_mode",
        to_text=_octal,
    ),
    Flag(
        "--http-address",
        "listen address for /json, /healthcheck, /rlconfig and /metrics",
        default="0.0.0.0:8080",
        type=address,
        metavar="HOST:PORT",
        field="http_address",
        workers=False,  # each worker is given the one its parent holds
    ),
    Flag(
        "--transport",
        "what serves gRPC: fast (the sidecar's own HTTP/2 server, unary calls) or grpcio "
        "(grpc.aio)",
        default="fast",
        choices=TRANSPORT_CHOICES,
        field="transport",
    ),
    Flag(
        "--loop",
        "event loop: uvloop (libuv; less CPU per call), asyncio (the standard library's), or "
        "auto (uvloop when installed, as it is on Linux and macOS)",
        default="auto",
        choices=LOOP_CHOICES,
    ),
    Flag(
        "--workers",
        "processes serving the same ports (SO_REUSEPORT); more than 1 needs a shared backend",
        default=1,
        type=count(1),
        metavar="N",
        workers=False,
    ),
    Flag(
        "--reuse-port",
        "share the gRPC and HTTP ports with other sidecars (SO_REUSEPORT), as --workers does: "
        "a replacement started on them takes the new connections once this one gets SIGTERM",
        action="store_true",
        default=False,
        field="reuse_port",
    ),
    # Set by `--workers N` on the processes it starts, never by hand: no variable, no help.
    Flag(
        "--grpc-socket-fd",
        "",
        type=int,
        hidden=True,
        field="grpc_socket_fd",
        workers=False,
    ),
    Flag(
        "--redis-timeout-ms",
        "deadline for one backend call; past it the failure mode answers",
        default=50,
        type=count(1),
        metavar="N",
        field="redis_timeout_ms",
    ),
    Flag(
        "--failure-mode",
        "answer when the backend fails: allow (OK, no limit), deny (OVER_LIMIT for every "
        "limited descriptor) or local (decide on this sidecar's own counters, each limit "
        "divided by --local-divisor, until the backend answers again)",
        default="allow",
        choices=("allow", "deny", "local"),
        field="failure_mode",
    ),
    Flag(
        "--local-divisor",
        "under --failure-mode local: how many sidecars share the backend's counters; each "
        "enforces limit/N (rounded down, at least 1) while the backend fails. auto: counted "
        "on the backend, where every sidecar registers every 2 s",
        default="auto",
        type=count_or_auto,
        metavar="N|auto",
        field="local_divisor",
        to_option=_auto_none,
    ),
    Flag(
        "--rejected-hits",
        "count: rejected hits still add to counters, as the reference does; skip: a request "
        "answered OVER_LIMIT adds nothing",
        default="count",
        choices=("count", "skip"),
        field="rejected_hits",
    ),
    Flag(
        "--negative-hits",
        "take refunds: a descriptor's is_negative_hits (Envoy 1.38+) gives its hits back to "
        "its counters, answered OK (README, Refunds; the reference's ENABLE_NEGATIVE_HITS). "
        "Off, a request carrying one is refused UNIMPLEMENTED; refused too with "
        "--rejected-hits skip",
        action="store_true",
        default=False,
        field="negative_hits",
    ),
    Flag(
        "--sync-interval-ms",
        "decide the rules marked 'approximate: true' on this sidecar's local view of their "
        "counters and send the hits to the store every N ms, in one call that also learns the "
        "global counts: far fewer store calls, at the cost of admitting up to (sidecars - 1) x "
        "rate x 2 x (N + --redis-timeout-ms) past a limit (README, Local aggregation); needs a "
        "shared store, not with --rejected-hits skip. Unset: every hit is decided by the store",
        type=count(1),
        metavar="N",
        field="sync_interval_ms",
    ),
    Flag(
        "--lease-ms",
        "decide the rules marked 'leased: true' from leases of their windows' budgets, each "
        "covering about N ms of this sidecar's demand, renewed ahead of need: a few store "
        "calls per window and never past a limit (README, Leases); not with --rejected-hits "
        "skip. Unset: every hit is decided by the store",
        type=count(4),
        metavar="N",
        field="lease_ms",
    ),
    Flag(
        "--shadow-mode",
        "global shadow mode: count as usual but answer OK where the answer would be OVER_LIMIT",
        action="store_true",
        default=False,
        field="shadow_mode",
    ),
    Flag(
        "--response-limit-name",
        "name the limit behind an OVER_LIMIT answer (the rule's name, else its descriptor "
        "path): a RateLimit-Policy header Envoy adds to the 429 ('\"name\";q=QUOTA;w=SECONDS', "
        "IETF RateLimit header fields draft) and dynamic metadata limit_name, limit_quota, "
        "limit_window for Envoy's access log "
        "(%%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_name)%%)",
        action="store_true",
        default=False,
        field="response_limit_name",
    ),
    Flag(
        "--response-headers",
        "the reference's response headers (LIMIT_RESPONSE_HEADERS_ENABLED): RateLimit-Limit, "
        "RateLimit-Remaining and RateLimit-Reset of the descriptor closest to its limit (the "
        "last one over its limit that is not a quota descriptor, if any), on every answer with "
        "a limit, OK ones too; Envoy adds them to the client's response",
        action="store_true",
        default=False,
        field="response_headers",
    ),
    Flag(
        "--response-headers-all-descriptors",
        "instead, the reference's headers of every descriptor (LIMIT_ALL_DESCRIPTORS_HEADERS_"
        "ENABLED): ratelimit-limit-UNITS and ratelimit-remaining-UNITS (seconds, minutes, ...) "
        "of each descriptor with a limit, in request order, on every answer; no reset header",
        action="store_true",
        default=False,
        field="response_headers_all_descriptors",
    ),
    Flag(
        "--response-limit-header",
        "the name of the RateLimit-Limit header of --response-headers (LIMIT_LIMIT_HEADER)",
        default="RateLimit-Limit",
        type=header_name,
        metavar="NAME",
        field="response_limit_header",
    ),
    Flag(
        "--response-remaining-header",
        "the name of the RateLimit-Remaining header of --response-headers (LIMIT_REMAINING_HEADER)",
        default="RateLimit-Remaining",
        type=header_name,
        metavar="NAME",
        field="response_remaining_header",
    ),
    Flag(
        "--response-reset-header",
        "the name of the RateLimit-Reset header of --response-headers (LIMIT_RESET_HEADER)",
        default="RateLimit-Reset",
        type=header_name,
        metavar="NAME",
        field="response_reset_header",
    ),
    Flag(
        "--response-dynamic-metadata",
        "the reference's dynamic metadata (RESPONSE_DYNAMIC_METADATA): domain, descriptors, "
        "hitsAddend, and the merged 'metadata' of the rules whose descriptors passed, under "
        "envoy.filters.http.ratelimit (%%DYNAMIC_METADATA(envoy.filters.http.ratelimit:domain)%%)",
        action="store_true",
        default=False,
        field="response_dynamic_metadata",
    ),
    Flag(
        "--usage-metrics-top",
        "keys per usage dimension in /metrics: today's with the most calls, read every 30 s "
        "(ratelimit_sidecar_usage_calls, ratelimit_sidecar_usage_unique); 0 turns them off",
        default=10,
        type=count(0),
        metavar="N",
        field="usage_metrics_top",
    ),
    Flag(
        "--over-limit-cache",
        "counters known to be over their limit, remembered until their window ends and "
        "answered without a Redis call (plain fixed windows; not with --rejected-hits skip); "
        "0 turns it off",
        default=100_000,
        type=count(0),
        metavar="ENTRIES",
        field="over_limit_cache",
    ),
    Flag(
        "--grpc-tls-cert",
        "serve gRPC over TLS (TLS 1.2 or later, ALPN h2) with this PEM certificate chain; "
        "reloaded when it changes on disk (looked at every --config-poll-seconds, and on "
        "SIGHUP), connections already open keeping theirs",
        metavar="PATH",
        field="tls",
    ),
    Flag(
        "--grpc-tls-key",
        "the PEM private key of --grpc-tls-cert, reloaded with it",
        metavar="PATH",
        field="tls",
    ),
    Flag(
        "--grpc-tls-client-ca",
        "mTLS: require a client certificate signed by a CA in this PEM file (reloaded too)",
        metavar="PATH",
        field="tls",
    ),
    Flag(
        "--grpc-tls-client-san",
        "mTLS: also require this DNS name (wildcards as in host names) or IP address among the "
        "client certificate's SANs",
        metavar="NAME",
        field="tls",
    ),
    Flag(
        "--statsd-address",
        "send the reference's stats to a statsd (or DogStatsD) server at HOST:PORT, every "
        "--stats-flush-interval (the reference's USE_STATSD or USE_DOG_STATSD turn it on at "
        "STATSD_HOST:STATSD_PORT, default localhost:8125); Prometheus /metrics goes on beside it",
        type=address,
        metavar="HOST:PORT",
        field="statsd",
    ),
    Flag(
        "--statsd-protocol",
        "tcp or udp (default: tcp for statsd, udp for DogStatsD)",
        choices=("tcp", "udp"),
        field="statsd",
    ),
    Flag(
        "--statsd-format",
        "statsd: tags folded into names, as the reference's statsd sink does; dogstatsd: "
        "DogStatsD tags, and mogrifiers (default: dogstatsd with USE_DOG_STATSD=true, else "
        "statsd)",
        choices=("statsd", "dogstatsd"),
        field="statsd",
    ),
    Flag(
        "--stats-flush-interval",
        "how often stats are sent to statsd, in seconds or as 10s, 500ms",
        default="10s",
        metavar="DURATION",
        field="statsd",
    ),
    Flag(
        "--stats-tags",
        "tags on every stat sent to statsd, as key:value,key2:value2",
        metavar="TAGS",
        field="statsd",
    ),
    Flag(
        "--dogstatsd-mogrifiers",
        "DogStatsD: names of the mogrifiers to apply, separated by ',', each defined by "
        "DOG_STATSD_MOGRIFIER_<NAME>_PATTERN, _NAME and _TAGS in the environment",
        metavar="NAMES",
        field="statsd",
    ),
    Flag(
        "--tracing",
        "trace ShouldRateLimit with OpenTelemetry (spans over OTLP, the parent from Envoy's "
        "W3C traceparent or B3 headers); needs the tracing extra",
        action="store_true",
        default=False,
        field="tracing",
    ),
    Flag(
        "--tracing-protocol",
        "OTLP over http (protobuf) or grpc",
        default="http",
        choices=("http", "grpc"),
        field="tracing",
    ),
    Flag(
        "--tracing-endpoint",
        "where spans go (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318/v1/traces for http, "
        "localhost:4317 for grpc)",
        metavar="URL",
        field="tracing",
    ),
    Flag(
        "--tracing-service-name",
        "the spans' service.name",
        default="RateLimit",
        metavar="NAME",
        field="tracing",
    ),
    Flag(
        "--tracing-service-namespace",
        "the spans' service.namespace",
        metavar="NAME",
        field="tracing",
    ),
    Flag(
        "--tracing-service-instance-id",
        "the spans' service.instance.id (default: a random UUID)",
        metavar="ID",
        field="tracing",
    ),
    Flag(
        "--tracing-sampling-rate",
        "the share of calls without a sampled parent that are traced (a sampled parent is "
        "always followed)",
        default=1.0,
        type=share,
        metavar="0..1",
        field="tracing",
    ),
    Flag(
        "--log-format",
        "json: one JSON object per line; console: for people",
        default="json",
        choices=("json", "console"),
    ),
    Flag(
        "--log-level",
        "the least severe level logged (any case; WARN is warning, as the reference spells it)",
        default="info",
        choices=logs.LEVELS,
        type=log_level,
    ),
    Flag(
        "--config-poll-seconds",
        "how often to look at the rules files and reload them when they change (a bad change "
        "keeps the previous rules, counted in config_load_error); 0: only on SIGHUP",
        default=2.0,
        type=float,
        metavar="SECONDS",
        field="config_poll_seconds",
    ),
    Flag(
        "--rlqs-address",
        "listen address of the Rate Limit Quota Service (StreamRateLimitQuotas, for Envoy's "
        "rate_limit_quota filter), from the same rules and backend; not served unless set",
        type=address,
        metavar="HOST:PORT",
        field="rlqs_address",
    ),
    Flag(
        "--rlqs-assignment-ttl",
        "seconds a quota assignment lives (assignment_time_to_live); the service refreshes it "
        "before it ends when Envoy has not reported meanwhile",
        default=6.0,
        type=at_least_a_second,
        metavar="SECONDS",
        field="rlqs_assignment_ttl_ms",
        to_option=_milliseconds,
    ),
    Flag(
        "--merge-domain-config",
        "files (or xDS resources) declaring the same domain add their first-level descriptors "
        "to it, in order; one declared twice is refused (the reference's MERGE_DOMAIN_CONFIG). "
        "Without it, a domain declared twice is refused",
        action="store_true",
        default=False,
        field="merge_domain_config",
    ),
    Flag(
        "--calendar-months",
        "a rule's fixed window of one month, with no calendar or timezone, counts the UTC "
        "calendar month, its reset at the month's end, as calendar: true makes it (the "
        "reference's USE_CALENDAR_MONTH_RATE_LIMIT). Without it such a month is 30 days from "
        "the epoch, as in the reference",
        action="store_true",
        default=False,
        field="calendar_months",
    ),
    Flag(
        "--health-requires-config",
        "report unhealthy until rules with at least one domain are loaded",
        action="store_true",
        default=False,
        field="health_requires_config",
    ),
    Flag(
        "--metrics-address",
        "also serve Prometheus metrics on this address, at --metrics-path (/metrics on the "
        "HTTP address stays)",
        type=address,
        metavar="HOST:PORT",
        field="metrics_address",
    ),
    Flag(
        "--metrics-path",
        "the path of --metrics-address",
        default="/metrics",
        metavar="PATH",
        field="metrics_path",
    ),
    Flag(
        "--debug-address",
        "also serve /rlconfig and /metrics on this address (the reference's debug port)",
        type=address,
        metavar="HOST:PORT",
        field="debug_address",
    ),
    Flag(
        "--operator-address",
        "serve the operator API on this address: GET /v1/counters (a descriptor's counters, "
        "limits, remaining and resets) and POST /v1/counters/reset, for `ratelimit-sidecar "
        "counters`; never on the gRPC or HTTP port. Not served unless set; an address beyond "
        "loopback needs --operator-token-file (or RLS_OPERATOR_TOKEN) or "
        "--operator-tls-client-ca",
        type=address,
        metavar="HOST:PORT",
        field="operator",
    ),
    Flag(
        "--operator-token-file",
        "require 'Authorization: Bearer TOKEN' on the operator port, the token read from this "
        "file at start (RLS_OPERATOR_TOKEN holds it instead, if you must)",
        metavar="PATH",
        field="operator",
    ),
    Flag(
        "--operator-tls-cert",
        "serve the operator port over HTTPS with this PEM certificate chain",
        metavar="PATH",
        field="operator",
    ),
    Flag(
        "--operator-tls-key",
        "the PEM private key of --operator-tls-cert",
        metavar="PATH",
        field="operator",
    ),
    Flag(
        "--operator-tls-client-ca",
        "mTLS on the operator port: require a client certificate signed by a CA in this file",
        metavar="PATH",
        field="operator",
    ),
    Flag(
        "--reference-env",
        "also read envoyproxy/ratelimit's environment variables (REDIS_URL, HOST, PORT, "
        "RUNTIME_ROOT, ...; README lists them), beneath RLS_* variables and flags, as "
        "`ratelimit` does (without its defaults for the rules, Redis and statsd)",
        action="store_true",
        default=False,
    ),
    *_xds(),
    Flag(
        "--dedupe-horizon",
        "frequency caps: seconds an impression id is remembered at least, so a repeated "
        "record within it counts nothing (ids are forgotten by twice that)",
        default=86_400,
        type=count(1),
        metavar="SECONDS",
        field="dedupe_horizon",
    ),
)
