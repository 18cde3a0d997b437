"""`serve`: the rate limit service, from its flags, their RLS_* variables and the reference's
variables (`sidecar.settings`), beneath both; `--workers N` runs N of it.

One module past the usual size because its flags are one table (a row per flag, each turned
into an `Options` field by `run`): adding a flag touches the table and `run` together.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sidecar import logs, settings, statsd
from sidecar.cli.flags import (
    ENV_PREFIX,
    PROG,
    Flags,
    address,
    at_least_a_second,
    boolean,
    count,
    count_or_auto,
    fail,
    grpc_address,
    header_name,
    log_level,
    share,
    socket_mode,
)
from sidecar.errors import ConfigError
from sidecar.operator_port import TOKEN_VARIABLE, OperatorSettings
from sidecar.rls.tls import TlsFiles
from sidecar.statsd import StatsdError, StatsdSettings
from sidecar.tracing import TracingSettings
from sidecar.xds import flags as xds_flags

TRANSPORT_CHOICES = ("fast", "grpcio")
LOOP_CHOICES = ("auto", "uvloop", "asyncio")

DESCRIPTION = """\
Serve ShouldRateLimit over gRPC and, over HTTP: POST /json (the same call in proto3 JSON;
200 OK, 429 OVER_LIMIT, 400 bad request), GET /healthcheck, GET /rlconfig (the loaded
rules) and GET /metrics (Prometheus). The gRPC health service reports SERVING for "" and
"ratelimit" once the backend answers.

Rules are envoyproxy/ratelimit YAML files, one domain per file (--config), or RateLimitConfig
resources a control plane pushes over xDS (--xds-server; a push that is not valid rules is
NACKed and the rules served before stay). A bad file stops the start with 'FILE: PATH:
message' and exit status 1; a backend URL that cannot be used exits with 2.

With --reference-env (or as `ratelimit`, the reference's entry point), the reference's
environment variables (HOST, PORT, GRPC_PORT, GRPC_SERVER_USE_TLS, REDIS_URL, REDIS_TYPE,
RUNTIME_ROOT, CONFIG_TYPE, CONFIG_GRPC_XDS_*, USE_STATSD, TRACING_*, USE_PROMETHEUS,
LOG_LEVEL, ...) set these flags too, beneath RLS_* variables and the command line; those read
are logged at start-up, and one it does not honour too. Without it they are not read (a
REDIS_URL or HOST exported for something else changes nothing), and their names are logged.

SIGTERM or SIGINT: report unhealthy, refuse new calls, let calls in flight finish (5 s),
then exit 0. To replace a sidecar (--transport fast) without failing a call, start the new
one on the same addresses first (--reuse-port on both for TCP; a unix:PATH is taken over as
it is), then send SIGTERM to the old one: its clients finish their calls there and open
their next connection to the new one.

--transport fast (the default) serves gRPC with the sidecar's own HTTP/2 server: unary calls
only (ShouldRateLimit, Health/Check), over TCP or a Unix socket (unix:PATH).
Both transports serve TLS or mTLS with --grpc-tls-cert and --grpc-tls-key (and
--grpc-tls-client-ca), or the reference's GRPC_SERVER_USE_TLS=true, GRPC_SERVER_TLS_CERT,
GRPC_SERVER_TLS_KEY, GRPC_CLIENT_TLS_CACERT and GRPC_CLIENT_TLS_SAN.
--transport grpcio serves it with grpc.aio, at several times the CPU per call.
--loop auto (the default) runs the event loop on uvloop when it is installed, as it is with
the package on Linux and macOS; --loop asyncio keeps the standard library's.
--workers N runs N processes sharing the ports (SO_REUSEPORT); the kernel spreads
connections, not calls, over them, so N should not exceed the connections Envoy opens (about
one per Envoy worker thread). Workers need a shared backend (redis://...), and each worker
serves its own /metrics.

--rlqs-address HOST:PORT also serves the Rate Limit Quota Service
(envoy.service.rate_limit_quota.v3.RateLimitQuotaService) for Envoy's rate_limit_quota filter:
Envoy enforces token-bucket assignments itself and reports its usage; each bucket id is
matched against the same rules as a descriptor, and every Envoy (through every sidecar sharing
the backend) gets its demand's share of the rule's limit per window. See README, "Quota
service"."""


def register(commands: Any) -> Flags:
    """Add `serve` to the subcommands; its flags, which read RLS_* variables."""
    formatter = argparse.RawDescriptionHelpFormatter
    serve = Flags(
        commands.add_parser(
            "serve",
            help="run the rate limit service (gRPC and HTTP)",
            description=DESCRIPTION,
            formatter_class=formatter,
        )
    )
    serve.add(
        "--config",
        "a rules file, or a directory of *.yaml/*.yml files; repeat for more. "
        "In RLS_CONFIG, separate several paths with ':' or ','. Required, unless --xds-server",
        action="append",
        metavar="PATH",
        separators=":,",
    )
    serve.add(
        "--backend",
        "where counters live: memory://, redis://[user:password@]host:port[/db], "
        "rediss://... (TLS), redis+cluster://host:port[,host:port...], rediss+cluster://... "
        "(TLS), or redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db] "
        "(Sentinels, default port 26379, asked for the master and followed across failovers; "
        "user:password is the master's, ?sentinel_username=&sentinel_password= the Sentinels'; "
        "rediss+sentinel:// for TLS to both)",
        default="memory://",
        metavar="URL",
    )
    serve.add(
        "--backend-per-second",
        "a second store for the counters of descriptors whose windows are all in seconds "
        "(redis://, redis+cluster:// or redis+sentinel://; the reference's REDIS_PERSECOND)",
        metavar="URL",
    )
    serve.add(
        "--grpc-address",
        "listen address for ShouldRateLimit and gRPC health: HOST:PORT (port 0 picks a free "
        "port) or unix:PATH",
        default="0.0.0.0:8081",
        type=grpc_address,
        metavar="ADDRESS",
    )
    serve.add(
        "--grpc-socket-mode",
        "with a unix:PATH gRPC address: the socket file's permission bits, in octal (660, "
        "666), so a client running as another user (Envoy in the same pod) may connect; "
        "unset: as the umask leaves them",
        type=socket_mode,
        metavar="OCTAL",
    )
    serve.add(
        "--http-address",
        "listen address for /json, /healthcheck, /rlconfig and /metrics",
        default="0.0.0.0:8080",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add(
        "--transport",
        "what serves gRPC: fast (the sidecar's own HTTP/2 server, unary calls) or grpcio "
        "(grpc.aio)",
        default="fast",
        choices=TRANSPORT_CHOICES,
    )
    serve.add(
        "--loop",
        "event loop: uvloop (libuv; less CPU per call), asyncio (the standard library's), or "
        "auto (uvloop when installed, as it is on Linux and macOS)",
        default="auto",
        choices=LOOP_CHOICES,
    )
    serve.add(
        "--workers",
        "processes serving the same ports (SO_REUSEPORT); more than 1 needs a shared backend",
        default=1,
        type=count(1),
        metavar="N",
    )
    serve.add(
        "--reuse-port",
        "share the gRPC and HTTP ports with other sidecars (SO_REUSEPORT), as --workers does: "
        "a replacement started on them takes the new connections once this one gets SIGTERM",
        action="store_true",
        default=False,
    )
    # Set by `--workers N` on the processes it starts, never by hand.
    serve.parser.add_argument("--grpc-socket-fd", type=int, help=argparse.SUPPRESS)
    serve.add(
        "--redis-timeout-ms",
        "deadline for one backend call; past it the failure mode answers",
        default=50,
        type=count(1),
        metavar="N",
    )
    serve.add(
        "--failure-mode",
        "answer when the backend fails: allow (OK, no limit), deny (OVER_LIMIT for every "
        "limited descriptor) or local (decide on this sidecar's own counters, each limit "
        "divided by --local-divisor, until the backend answers again)",
        default="allow",
        choices=("allow", "deny", "local"),
    )
    serve.add(
        "--local-divisor",
        "under --failure-mode local: how many sidecars share the backend's counters; each "
        "enforces limit/N (rounded down, at least 1) while the backend fails. auto: counted "
        "on the backend, where every sidecar registers every 2 s",
        default="auto",
        type=count_or_auto,
        metavar="N|auto",
    )
    serve.add(
        "--rejected-hits",
        "count: rejected hits still add to counters, as the reference does; skip: a request "
        "answered OVER_LIMIT adds nothing",
        default="count",
        choices=("count", "skip"),
    )
    serve.add(
        "--sync-interval-ms",
        "decide the rules marked 'approximate: true' on this sidecar's local view of their "
        "counters and send the hits to the store every N ms, in one call that also learns the "
        "global counts: far fewer store calls, at the cost of admitting up to (sidecars - 1) x "
        "rate x 2 x (N + --redis-timeout-ms) past a limit (README, Local aggregation); needs a "
        "shared store, not with --rejected-hits skip. Unset: every hit is decided by the store",
        type=count(1),
        metavar="N",
    )
    serve.add(
        "--shadow-mode",
        "global shadow mode: count as usual but answer OK where the answer would be OVER_LIMIT",
        action="store_true",
        default=False,
    )
    serve.add(
        "--response-limit-name",
        "name the limit behind an OVER_LIMIT answer (the rule's name, else its descriptor "
        "path): a RateLimit-Policy header Envoy adds to the 429 ('\"name\";q=QUOTA;w=SECONDS', "
        "IETF RateLimit header fields draft) and dynamic metadata limit_name, limit_quota, "
        "limit_window for Envoy's access log "
        "(%%DYNAMIC_METADATA(envoy.filters.http.ratelimit:limit_name)%%)",
        action="store_true",
        default=False,
    )
    serve.add(
        "--response-headers",
        "the reference's response headers (LIMIT_RESPONSE_HEADERS_ENABLED): RateLimit-Limit, "
        "RateLimit-Remaining and RateLimit-Reset of the descriptor closest to its limit (the "
        "last one over its limit that is not a quota descriptor, if any), on every answer with "
        "a limit, OK ones too; Envoy adds them to the client's response",
        action="store_true",
        default=False,
    )
    for option, name, variable in (
        ("--response-limit-header", "RateLimit-Limit", "LIMIT_LIMIT_HEADER"),
        ("--response-remaining-header", "RateLimit-Remaining", "LIMIT_REMAINING_HEADER"),
        ("--response-reset-header", "RateLimit-Reset", "LIMIT_RESET_HEADER"),
    ):
        serve.add(
            option,
            f"the name of the {name} header of --response-headers ({variable})",
            default=name,
            type=header_name,
            metavar="NAME",
        )
    serve.add(
        "--response-dynamic-metadata",
        "the reference's dynamic metadata (RESPONSE_DYNAMIC_METADATA): domain, descriptors, "
        "hitsAddend, and the merged 'metadata' of the rules whose descriptors passed, under "
        "envoy.filters.http.ratelimit (%%DYNAMIC_METADATA(envoy.filters.http.ratelimit:domain)%%)",
        action="store_true",
        default=False,
    )
    serve.add(
        "--usage-metrics-top",
        "keys per usage dimension in /metrics: today's with the most calls, read every 30 s "
        "(ratelimit_sidecar_usage_calls, ratelimit_sidecar_usage_unique); 0 turns them off",
        default=10,
        type=count(0),
        metavar="N",
    )
    serve.add(
        "--over-limit-cache",
        "counters known to be over their limit, remembered until their window ends and "
        "answered without a Redis call (plain fixed windows; not with --rejected-hits skip); "
        "0 turns it off",
        default=100_000,
        type=count(0),
        metavar="ENTRIES",
    )
    serve.add(
        "--grpc-tls-cert",
        "serve gRPC over TLS (TLS 1.2 or later, ALPN h2) with this PEM certificate chain; "
        "reloaded when it changes on disk (looked at every --config-poll-seconds, and on "
        "SIGHUP), connections already open keeping theirs",
        metavar="PATH",
    )
    serve.add(
        "--grpc-tls-key",
        "the PEM private key of --grpc-tls-cert, reloaded with it",
        metavar="PATH",
    )
    serve.add(
        "--grpc-tls-client-ca",
        "mTLS: require a client certificate signed by a CA in this PEM file (reloaded too)",
        metavar="PATH",
    )
    serve.add(
        "--grpc-tls-client-san",
        "mTLS: also require this DNS name (wildcards as in host names) or IP address among the "
        "client certificate's SANs",
        metavar="NAME",
    )
    serve.add(
        "--statsd-address",
        "send the reference's stats to a statsd (or DogStatsD) server at HOST:PORT, every "
        "--stats-flush-interval (the reference's USE_STATSD or USE_DOG_STATSD turn it on at "
        "STATSD_HOST:STATSD_PORT, default localhost:8125); Prometheus /metrics goes on beside it",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add(
        "--statsd-protocol",
        "tcp or udp (default: tcp for statsd, udp for DogStatsD)",
        choices=("tcp", "udp"),
    )
    serve.add(
        "--statsd-format",
        "statsd: tags folded into names, as the reference's statsd sink does; dogstatsd: "
        "DogStatsD tags, and mogrifiers (default: dogstatsd with USE_DOG_STATSD=true, else "
        "statsd)",
        choices=("statsd", "dogstatsd"),
    )
    serve.add(
        "--stats-flush-interval",
        "how often stats are sent to statsd, in seconds or as 10s, 500ms",
        default="10s",
        metavar="DURATION",
    )
    serve.add(
        "--stats-tags",
        "tags on every stat sent to statsd, as key:value,key2:value2",
        metavar="TAGS",
    )
    serve.add(
        "--dogstatsd-mogrifiers",
        "DogStatsD: names of the mogrifiers to apply, separated by ',', each defined by "
        "DOG_STATSD_MOGRIFIER_<NAME>_PATTERN, _NAME and _TAGS in the environment",
        metavar="NAMES",
    )
    serve.add(
        "--tracing",
        "trace ShouldRateLimit with OpenTelemetry (spans over OTLP, the parent from Envoy's "
        "W3C traceparent or B3 headers); needs the tracing extra",
        action="store_true",
        default=False,
    )
    serve.add(
        "--tracing-protocol",
        "OTLP over http (protobuf) or grpc",
        default="http",
        choices=("http", "grpc"),
    )
    serve.add(
        "--tracing-endpoint",
        "where spans go (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318/v1/traces for http, "
        "localhost:4317 for grpc)",
        metavar="URL",
    )
    serve.add(
        "--tracing-service-name",
        "the spans' service.name",
        default="RateLimit",
        metavar="NAME",
    )
    serve.add(
        "--tracing-service-namespace",
        "the spans' service.namespace",
        metavar="NAME",
    )
    serve.add(
        "--tracing-service-instance-id",
        "the spans' service.instance.id (default: a random UUID)",
        metavar="ID",
    )
    serve.add(
        "--tracing-sampling-rate",
        "the share of calls without a sampled parent that are traced (a sampled parent is "
        "always followed)",
        default=1.0,
        type=share,
        metavar="0..1",
    )
    serve.add(
        "--log-format",
        "json: one JSON object per line; console: for people",
        default="json",
        choices=("json", "console"),
    )
    serve.add(
        "--log-level",
        "the least severe level logged (any case; WARN is warning, as the reference spells it)",
        default="info",
        choices=logs.LEVELS,
        type=log_level,
    )
    serve.add(
        "--config-poll-seconds",
        "how often to look at the rules files and reload them when they change (a bad change "
        "keeps the previous rules, counted in config_load_error); 0: only on SIGHUP",
        default=2.0,
        type=float,
        metavar="SECONDS",
    )
    serve.add(
        "--rlqs-address",
        "listen address of the Rate Limit Quota Service (StreamRateLimitQuotas, for Envoy's "
        "rate_limit_quota filter), from the same rules and backend; not served unless set",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add(
        "--rlqs-assignment-ttl",
        "seconds a quota assignment lives (assignment_time_to_live); the service refreshes it "
        "before it ends when Envoy has not reported meanwhile",
        default=6.0,
        type=at_least_a_second,
        metavar="SECONDS",
    )
    serve.add(
        "--merge-domain-config",
        "files (or xDS resources) declaring the same domain add their first-level descriptors "
        "to it, in order; one declared twice is refused (the reference's MERGE_DOMAIN_CONFIG). "
        "Without it, a domain declared twice is refused",
        action="store_true",
        default=False,
    )
    serve.add(
        "--calendar-months",
        "a rule's fixed window of one month, with no calendar or timezone, counts the UTC "
        "calendar month, its reset at the month's end, as calendar: true makes it (the "
        "reference's USE_CALENDAR_MONTH_RATE_LIMIT). Without it such a month is 30 days from "
        "the epoch, as in the reference",
        action="store_true",
        default=False,
    )
    serve.add(
        "--health-requires-config",
        "report unhealthy until rules with at least one domain are loaded",
        action="store_true",
        default=False,
    )
    serve.add(
        "--metrics-address",
        "also serve Prometheus metrics on this address, at --metrics-path (/metrics on the "
        "HTTP address stays)",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add("--metrics-path", "the path of --metrics-address", default="/metrics", metavar="PATH")
    serve.add(
        "--debug-address",
        "also serve /rlconfig and /metrics on this address (the reference's debug port)",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add(
        "--operator-address",
        "serve the operator API on this address: GET /v1/counters (a descriptor's counters, "
        "limits, remaining and resets) and POST /v1/counters/reset, for `ratelimit-sidecar "
        "counters`; never on the gRPC or HTTP port. Not served unless set; an address beyond "
        "loopback needs --operator-token-file (or RLS_OPERATOR_TOKEN) or "
        "--operator-tls-client-ca",
        type=address,
        metavar="HOST:PORT",
    )
    serve.add(
        "--operator-token-file",
        "require 'Authorization: Bearer TOKEN' on the operator port, the token read from this "
        "file at start (RLS_OPERATOR_TOKEN holds it instead, if you must)",
        metavar="PATH",
    )
    serve.add(
        "--operator-tls-cert",
        "serve the operator port over HTTPS with this PEM certificate chain",
        metavar="PATH",
    )
    serve.add("--operator-tls-key", "the PEM private key of --operator-tls-cert", metavar="PATH")
    serve.add(
        "--operator-tls-client-ca",
        "mTLS on the operator port: require a client certificate signed by a CA in this file",
        metavar="PATH",
    )
    serve.add(
        "--reference-env",
        "also read envoyproxy/ratelimit's environment variables (REDIS_URL, HOST, PORT, "
        "RUNTIME_ROOT, ...; README lists them), beneath RLS_* variables and flags, as "
        "`ratelimit` does (without its defaults for the rules, Redis and statsd)",
        action="store_true",
        default=False,
    )
    xds_flags.add(serve.add)
    serve.add(
        "--dedupe-horizon",
        "frequency caps: seconds an impression id is remembered at least, so a repeated "
        "record within it counts nothing (ids are forgotten by twice that)",
        default=86_400,
        type=count(1),
        metavar="SECONDS",
    )
    serve.parser.set_defaults(func=run)
    return serve


def resolve(
    flags: Flags,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    reference_defaults: bool,
) -> None:
    """Fill `serve`'s flags: the command line, then RLS_* variables, then the reference's
    variables (as `ratelimit`, whose `reference_defaults` adds the reference's defaults, or
    with --reference-env), then defaults; exits with status 2 and one line saying what when
    something is missing or malformed."""
    given = frozenset(
        flag.dest
        for flag in flags.flags
        if getattr(args, flag.dest) is not None or environ.get(ENV_PREFIX + flag.dest.upper())
    )
    reads_reference = reference_defaults or _asks_for_reference(args, environ)
    translated: dict[str, str] = {}
    if reads_reference:
        try:
            translated = settings.translate(environ, defaults=reference_defaults, given=given)
        except settings.SettingError as exc:
            # A typo may be why (REDIS_UR set, so REDIS_URL is not): say so on the same line.
            typos = "; ".join(
                f"{name} is set: did you mean {meant}?"
                for name, meant in settings.misspelled(environ)
            )
            fail(flags.parser, f"{exc} ({typos})" if typos else str(exc))
    flags.resolve(args, {**translated, **environ})
    if not args.config and not args.xds_server:
        fail(
            flags.parser,
            "the following arguments are required: --config (or RLS_CONFIG), or --xds-server",
        )
    if args.config and args.xds_server:
        fail(flags.parser, "--config and --xds-server exclude each other: rules come from one")
    problem = _tls_problem(args) or _operator_problem(args)
    if problem:
        fail(flags.parser, problem)
    args.operator = operator_settings(args, environ)
    try:
        args.statsd = statsd_settings(args, environ)
    except StatsdError as exc:
        fail(flags.parser, str(exc))
    args.reference_applied = settings.shown(environ) if reads_reference else {}
    args.reference_ignored = settings.ignored(environ) if reads_reference else []
    args.reference_unread = [] if reads_reference else settings.present(environ)
    args.reference_misspelled = settings.misspelled(environ) if reads_reference else []


def _asks_for_reference(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """Whether --reference-env (or RLS_REFERENCE_ENV) asks for the reference's variables; a
    value that is not a boolean reads as no here, and `Flags.resolve` refuses it after."""
    if args.reference_env:
        return True
    try:
        return boolean(environ.get(ENV_PREFIX + "REFERENCE_ENV", "") or "false")
    except ValueError:
        return False


def statsd_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> StatsdSettings | None:
    """Where and how `serve` sends stats to statsd, from its flags (which the reference's
    USE_STATSD, USE_DOG_STATSD, STATSD_* and EXTRA_TAGS set, see `sidecar.settings`); None
    when it does not. The mogrifiers --dogstatsd-mogrifiers names are defined in `environ`."""
    address = args.statsd_address
    if address is None:
        return None
    format: statsd.Format = args.statsd_format or "statsd"
    protocol: statsd.Protocol = args.statsd_protocol or ("udp" if format == "dogstatsd" else "tcp")
    if format == "dogstatsd" and protocol != "udp":
        raise StatsdError("--statsd-format dogstatsd is sent over udp, not tcp")
    host, _, port = address.rpartition(":")
    names = [n.strip() for n in (args.dogstatsd_mogrifiers or "").split(",") if n.strip()]
    if names and format != "dogstatsd":
        raise StatsdError("--dogstatsd-mogrifiers needs --statsd-format dogstatsd")
    return StatsdSettings(
        host=host.strip("[]") or "localhost",
        port=int(port),
        protocol=protocol,
        format=format,
        flush_interval=statsd.parse_duration(args.stats_flush_interval),
        tags=statsd.parse_tags(args.stats_tags or ""),
        mogrifiers=statsd.mogrifiers_from_env(names, environ),
    )


def _tls_problem(args: argparse.Namespace) -> str | None:
    """What is missing from the gRPC TLS flags, if anything."""
    cert, key = args.grpc_tls_cert, args.grpc_tls_key
    if (cert is None) != (key is None):
        return "--grpc-tls-cert needs --grpc-tls-key, and the reverse"
    if cert is None and (args.grpc_tls_client_ca or args.grpc_tls_client_san):
        return (
            "--grpc-tls-client-ca and --grpc-tls-client-san need --grpc-tls-cert and --grpc-tls-key"
        )
    if args.grpc_tls_client_san and not args.grpc_tls_client_ca:
        return "--grpc-tls-client-san needs --grpc-tls-client-ca (the CA that verifies clients)"
    return None


def _operator_problem(args: argparse.Namespace) -> str | None:
    """What is missing from the operator port's flags, if anything."""
    cert, key = args.operator_tls_cert, args.operator_tls_key
    if (cert is None) != (key is None):
        return "--operator-tls-cert needs --operator-tls-key, and the reverse"
    if cert is None and args.operator_tls_client_ca:
        return "--operator-tls-client-ca needs --operator-tls-cert and --operator-tls-key"
    uses = (args.operator_token_file, cert)
    if args.operator_address is None and any(use is not None for use in uses):
        return "the --operator-token-file and --operator-tls-* flags need --operator-address"
    return None


def operator_settings(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> OperatorSettings | None:
    """The operator port's settings from `serve`'s flags and RLS_OPERATOR_TOKEN; None when
    it is not served."""
    if args.operator_address is None:
        return None
    host, _, port = args.operator_address.rpartition(":")
    cert = args.operator_tls_cert
    return OperatorSettings(
        host=host.strip("[]") or "0.0.0.0",
        port=int(port),
        token_file=Path(args.operator_token_file) if args.operator_token_file else None,
        token=environ.get(TOKEN_VARIABLE) or None,
        tls=None
        if cert is None
        else TlsFiles(
            Path(cert),
            Path(args.operator_tls_key),
            client_ca=Path(args.operator_tls_client_ca) if args.operator_tls_client_ca else None,
        ),
    )


def tracing_settings(args: argparse.Namespace) -> TracingSettings | None:
    """`serve`'s OpenTelemetry settings; None when tracing is off."""
    if not args.tracing:
        return None
    return TracingSettings(
        protocol=args.tracing_protocol,
        endpoint=args.tracing_endpoint,
        service_name=args.tracing_service_name,
        service_namespace=args.tracing_service_namespace or "",
        service_instance_id=args.tracing_service_instance_id or "",
        sampling_rate=args.tracing_sampling_rate,
    )


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The gRPC port's TLS files from `serve`'s flags; None for cleartext."""
    if args.grpc_tls_cert is None:
        return None
    return TlsFiles(
        Path(args.grpc_tls_cert),
        Path(args.grpc_tls_key),
        client_ca=Path(args.grpc_tls_client_ca) if args.grpc_tls_client_ca else None,
        client_san=args.grpc_tls_client_san or None,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; the exit status."""
    from sidecar.app import App, InvalidOption, Options

    logs.configure(args.log_level, args.log_format)
    _log_reference_settings(args)
    if args.workers > 1:
        return _serve_workers(args)
    options = Options(
        config=args.config or [],
        backend=args.backend,
        backend_per_second=args.backend_per_second,
        grpc_address=args.grpc_address,
        http_address=args.http_address,
        redis_timeout_ms=args.redis_timeout_ms,
        failure_mode=args.failure_mode,
        local_divisor=None if args.local_divisor == "auto" else args.local_divisor,
        rejected_hits=args.rejected_hits,
        sync_interval_ms=args.sync_interval_ms,
        shadow_mode=args.shadow_mode,
        over_limit_cache=args.over_limit_cache,
        response_limit_name=args.response_limit_name,
        response_headers=args.response_headers,
        response_limit_header=args.response_limit_header,
        response_remaining_header=args.response_remaining_header,
        response_reset_header=args.response_reset_header,
        response_dynamic_metadata=args.response_dynamic_metadata,
        usage_metrics_top=args.usage_metrics_top,
        transport=args.transport,
        reuse_port=args.reuse_port,
        grpc_socket_fd=args.grpc_socket_fd,
        grpc_socket_mode=args.grpc_socket_mode,
        dedupe_horizon=args.dedupe_horizon,
        config_poll_seconds=args.config_poll_seconds,
        rlqs_address=args.rlqs_address,
        rlqs_assignment_ttl_ms=int(args.rlqs_assignment_ttl * 1000),
        xds=xds_flags.options(args),
        health_requires_config=args.health_requires_config,
        merge_domain_config=args.merge_domain_config,
        calendar_months=args.calendar_months,
        metrics_address=args.metrics_address,
        metrics_path=args.metrics_path,
        debug_address=args.debug_address,
        operator=args.operator,
        tls=tls_files(args),
        statsd=args.statsd,
        tracing=tracing_settings(args),
    )
    try:
        loop_factory = event_loop_factory(args.loop)
    except InvalidOption as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(App(options).run())
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    except InvalidOption as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def _log_reference_settings(args: argparse.Namespace) -> None:
    """Once at start-up: which reference variables were read (with their values, secrets
    hidden), and each one set to something this sidecar does not do (never silently ignored);
    or, when they were not read, the names of those set."""
    import structlog

    log = structlog.get_logger("sidecar.settings")
    if args.rls_read:
        # Names only: values may carry passwords (RLS_BACKEND's URL).
        log.info("rls_settings", read=args.rls_read)
    if args.reference_applied:
        log.info("reference_settings", read=args.reference_applied)
    for variable, meant in [*args.unknown_variables, *args.reference_misspelled]:
        # A misspelled setting would otherwise pass in silence, its default serving instead.
        if meant is None:
            log.warning("unknown_setting", variable=variable)
        else:
            log.warning("unknown_setting", variable=variable, did_you_mean=meant)
    if args.reference_unread:
        log.info(
            "reference_settings_not_read",
            variables=args.reference_unread,
            why="serve reads envoyproxy/ratelimit's variables with --reference-env "
            "(RLS_REFERENCE_ENV=true), and `ratelimit` always",
        )
    for variable in args.reference_ignored:
        if variable.support is settings.Support.DIFFERENT:
            log.info("reference_setting_differs", variable=variable.name, here=variable.note)
        else:
            log.warning(
                "reference_setting_not_supported", variable=variable.name, why=variable.note
            )


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes `serve`'s event loop: uvloop's for "uvloop" (and for "auto" when uvloop is
    installed), None for the standard library's. uvloop runs the loop itself (polling, timers,
    socket reads and writes) in C: when calls come one at a time, that is about a fifth of the
    CPU per call."""
    from sidecar.app import InvalidOption

    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "auto":
            return None
        raise InvalidOption("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    return uvloop.new_event_loop


def _serve_workers(args: argparse.Namespace) -> int:
    """`serve --workers N`: start N `serve` processes with the same flags and supervise them."""
    from sidecar import workers
    from sidecar.rls.h2.server import unix_path

    problem = None
    if args.backend.startswith("memory:"):
        problem = (
            f"--workers {args.workers} needs a shared backend (redis://... or "
            "redis+cluster://...): with memory:// every worker would keep its own counters"
        )
    elif args.transport == "grpcio" and unix_path(args.grpc_address) is not None:
        problem = "--workers with a unix: gRPC address needs --transport fast"
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    try:
        return workers.run(worker_flags(args), args.workers, args.grpc_address, args.http_address)
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The `serve` flags of this command line, but for the addresses and the worker count."""
    serve = register(argparse.ArgumentParser(prog=PROG).add_subparsers())
    argv: list[str] = []
    for flag in serve.flags:
        if flag.dest in ("grpc_address", "http_address", "workers"):
            continue
        value = getattr(args, flag.dest)
        if value is None or value is False:
            continue
        if flag.dest == "local_divisor" and isinstance(value, int):
            # Each worker keeps its own local counters: the sidecar's share is split again
            # (auto needs nothing: every worker registers on its own).
            value *= args.workers
        if value is True:
            argv.append(flag.option)
        elif isinstance(value, list):
            for item in value:
                argv += [flag.option, str(item)]
        else:
            argv += [flag.option, str(value)]
    return argv
