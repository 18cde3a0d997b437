"""`serve`: the rate limit service, from its flags, their RLS_* variables and the reference's
variables (`sidecar.cli.settings`), beneath both; `--workers N` runs N of it.

Its flags are declared once each, in `sidecar.cli.serve_flags`: `register`, `serve_options`
and `worker_flags` read that table.

One module just past the usual size because it is the one command every option reaches: the
flags and the reference's variables resolved into `Options`, each edge's settings checked
before anything starts, and the workers' command lines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.cli import settings
from sidecar.cli.flags import ENV_PREFIX, PROG, Flags, boolean, fail
from sidecar.cli.serve_flags import SERVE_FLAGS
from sidecar.errors import ConfigError
from sidecar.operator.port import TOKEN_VARIABLE, OperatorSettings
from sidecar.rls.tls import TlsFiles
from sidecar.telemetry import logs, statsd
from sidecar.telemetry.statsd import StatsdError, StatsdSettings
from sidecar.telemetry.tracing import TracingSettings
from sidecar.xds import flags as xds_flags

if TYPE_CHECKING:
    from sidecar.runner.options import Options

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
    """Add `serve` to the subcommands; its flags (`SERVE_FLAGS`), which read RLS_* variables."""
    serve = Flags(
        commands.add_parser(
            "serve",
            help="run the rate limit service (gRPC and HTTP)",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    for flag in SERVE_FLAGS:
        serve.declare(flag)
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
    USE_STATSD, USE_DOG_STATSD, STATSD_* and EXTRA_TAGS set, see `sidecar.cli.settings`); None
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


def serve_options(args: argparse.Namespace) -> Options:
    """The `Options` of a resolved `serve` command line (`resolve`): each field from the flag
    declared to fill it (`SERVE_FLAGS`), or from the several that make it (`BUILT`)."""
    from sidecar.runner.options import Options

    values = {
        flag.field: flag.to_option(getattr(args, flag.dest))
        for flag in SERVE_FLAGS
        if flag.field is not None and flag.field not in BUILT
    }
    for field, build in BUILT.items():
        values[field] = build(args)
    return Options(**values)


#: The `Options` fields several flags fill together, and what makes each from them.
BUILT: dict[str, Callable[[argparse.Namespace], Any]] = {
    "tls": lambda args: tls_files(args),
    "statsd": lambda args: args.statsd,  # made, and checked, by `resolve`
    "tracing": lambda args: tracing_settings(args),
    "xds": xds_flags.options,
    "operator": lambda args: args.operator,  # made, and checked, by `resolve`
}


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; the exit status."""
    from sidecar.runner.app import App, InvalidOption

    logs.configure(args.log_level, args.log_format)
    _log_reference_settings(args)
    if args.workers > 1:
        return _serve_workers(args)
    options = serve_options(args)
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
    from sidecar.runner.app import InvalidOption

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
    from sidecar.rls.h2.server import unix_path
    from sidecar.runner import workers

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
    """The `serve` flags of this command line that workers inherit (`Flag.workers`)."""
    argv: list[str] = []
    for flag in SERVE_FLAGS:
        if not flag.workers:
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
                argv += [flag.option, flag.to_text(item)]
        else:
            argv += [flag.option, flag.to_text(value)]
    return argv
