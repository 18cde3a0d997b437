"""The command line: `serve`, `check` and `query` (a module each), `inject` and `webhook`
(`sidecar.injector.commands`), `envoy-config` (`sidecar.envoy_config.commands`); a thin layer
over `app`, `config`, `rls.client`.

Every flag can also come from the environment as `RLS_<FLAG>` (upper case, dashes as
underscores; `flags.py`); a flag on the command line wins over its variable. `ratelimit`, the
reference's entry point (`reference_main`), is `serve` reading the reference's variables too
(`sidecar.cli.settings`), beneath both, with the reference's defaults; `serve` reads those only when
asked (--reference-env), so one exported for something else changes nothing.
`ratelimit_config_check` (`config_check.py`), the reference's offline checker, is `check`
under its flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from sidecar import __version__
from sidecar.cli import check, query, serve
from sidecar.cli.flags import PROG, Flags, unknown
from sidecar.envoy_config.commands import register as register_envoy_config
from sidecar.injector.commands import register as register_injector
from sidecar.operator.commands import register as register_counters
from sidecar.operator.port import TOKEN_VARIABLE
from sidecar.reports.commands import register as register_usage

# grpc's C core writes its own lines to stderr; keep them to errors so the log stays one format.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

_DESCRIPTION = """\
An Envoy global rate limit service (envoy.service.ratelimit.v3.RateLimitService), a drop-in
for envoyproxy/ratelimit: the same YAML rules, the same gRPC and HTTP endpoints, with counters
in memory, Redis or Redis Cluster.

Every flag can also be set in the environment as RLS_<FLAG> (upper case, dashes as
underscores: --grpc-address is RLS_GRPC_ADDRESS). A flag on the command line wins.
`ratelimit` with no arguments runs `serve` from envoyproxy/ratelimit's variables (REDIS_URL,
RUNTIME_ROOT, CONFIG_TYPE, ...) alone, as the reference's /bin/ratelimit does (README lists
every variable); `serve --reference-env` reads them too, beneath RLS_* and flags.
`ratelimit_config_check [-config_dir DIR]` is `check` under the reference's checker's flags."""

_EPILOG = """\
examples:
  ratelimit-sidecar check rules/
  ratelimit-sidecar serve --config rules/ --backend redis://127.0.0.1:6379
  RLS_CONFIG=/etc/ratelimit RLS_BACKEND=redis://redis:6379 ratelimit-sidecar serve
  ratelimit-sidecar query --domain edge --descriptor remote_address=10.0.0.1

Run 'ratelimit-sidecar COMMAND --help' for the flags of a command."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Flags]]:
    """The parser, and per subcommand the flags that read RLS_* variables."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    env_flags = {"serve": serve.register(commands)}
    check.register(commands)
    env_flags["query"] = query.register(commands)
    register_injector(commands)
    register_envoy_config(commands)
    register_usage(commands)
    register_counters(commands)
    return parser, env_flags


def command_names() -> list[str]:
    """The commands of `ratelimit-sidecar` (`serve`, `check`, ...)."""
    parser, _ = build_parser()
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def parse_args(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    reference_defaults: bool = False,
) -> argparse.Namespace:
    """Flags, then RLS_* variables from `environ` (default os.environ), then (for `serve` with
    --reference-env, or `reference_defaults`) the reference's variables, then defaults;
    `reference_defaults` (`ratelimit`) reads the reference's variables and adds its defaults
    of the rules directory, of the backend and of statsd.

    Exits with status 2 and a usage message when something is missing or malformed.
    """
    parser, env_flags = build_parser()
    if reference_defaults:
        # Errors then speak as `ratelimit`, which the user ran, in one line, not as `serve`.
        for speaking in (parser, env_flags["serve"].parser):
            speaking.prog, speaking.usage = REFERENCE_PROG, REFERENCE_USAGE
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    flags = env_flags.get(args.command)
    if flags is not None and args.command == "serve":
        serve.resolve(flags, args, environ, reference_defaults)
        known = set().union(*(command.variables() for command in env_flags.values()))
        known.add(TOKEN_VARIABLE)  # the operator token: a secret, so no flag of its own
        args.unknown_variables = unknown(environ, known)
        args.rls_read = sorted(name for name in flags.variables() if environ.get(name))
    elif flags is not None:
        flags.resolve(args, environ)
    return args


REFERENCE_PROG = "ratelimit"
REFERENCE_USAGE = "ratelimit [SERVE FLAGS]   (ratelimit --help says how it differs from serve)"
REFERENCE_HELP = f"""\
usage: {REFERENCE_USAGE.split("   ")[0]}

envoyproxy/ratelimit's /bin/ratelimit: `ratelimit-sidecar serve`, configured by the
reference's environment variables (REDIS_URL, REDIS_AUTH, RUNTIME_ROOT, HOST, PORT, GRPC_PORT,
CONFIG_TYPE, USE_STATSD, LOG_LEVEL, ...; README's table lists every one), beneath RLS_*
variables and flags. Any argument is a `serve` flag (ratelimit-sidecar serve --help).

How it differs from `ratelimit-sidecar serve`:
  - it reads the reference's variables; serve reads them only with --reference-env;
  - the rules are in RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY, by default
    /srv/runtime_data/current/config (serve has no default: --config or --xds-server);
  - counters are in the Redis at REDIS_URL, which must be set (or RLS_BACKEND=memory://;
    serve's default is memory://);
  - stats go to statsd at STATSD_HOST:STATSD_PORT (localhost:8125) unless USE_STATSD=false,
    as in the reference (serve sends them only when asked).
Set, a reference variable it does not honour, or one a typo away from a real one, is logged
at start-up; one whose value cannot be used stops it with exit status 2 and one line.

It listens on gRPC 0.0.0.0:8081 and HTTP 0.0.0.0:8080 (/healthcheck, /json, /rlconfig,
/metrics) unless HOST, PORT, GRPC_HOST, GRPC_PORT or GRPC_UDS say otherwise.
"""


def reference_main(argv: Sequence[str] | None = None) -> int:
    """`ratelimit`, the reference's /bin/ratelimit: `serve` configured by the reference's
    environment variables, with its defaults (rules in RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
    RUNTIME_APPDIRECTORY, Redis at REDIS_URL, statsd unless USE_STATSD=false); arguments, if
    any, are `serve` flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        # `serve --help` is hundreds of lines, and would not say what differs here.
        print(REFERENCE_HELP, end="")
        return 0
    return main(["serve", *args], reference_defaults=True)


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    reference_defaults: bool = False,
) -> int:
    """Run the command line; returns the exit status."""
    args = parse_args(argv, environ, reference_defaults)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
