"""The `envoy-config` subcommand; `register` adds it to the CLI's subparsers.

It prints, as YAML, the Envoy pieces that feed a rules file, or with `--bootstrap` a whole
gateway around them. Exit status: 0 printed, 1 a rules or sources file is wrong, 2 bad flags.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sidecar.core import config
from sidecar.core.rules import Domain
from sidecar.errors import ConfigError

if TYPE_CHECKING:
    # Imported when a command runs: envoy-data-plane is slow to import for the other commands.
    from sidecar.envoy_config import messages

PROG = "ratelimit-sidecar"
DEFAULT_ROUTE = "default=/"

_DESCRIPTION = """\
Print the Envoy configuration that feeds a rules file: the rate limit HTTP filter (put it
before envoy.filters.http.router), the 'ratelimit' cluster that reaches the sidecar over
HTTP/2, and per route a typed_per_filter_config whose rate_limits send one descriptor per
key path of the rules ('app' -> 'user' -> 'interface'), so every rule can match.

The sources file says where each descriptor key's value comes from in a request:
  remote_address: remote_address       the client's address
  interface: route                     the name of the matched route (--route)
  page: path                           the :path header, query string included
  user: {header: x-user-id}            a request header
  tier: {generic_key: free}            a fixed value
  ad: {header: x-ad-id, count: on_success, routes: [ads]}
count: on_success checks those descriptors when the request arrives (hits_addend 0) and
counts them when the response is a 2xx; routes sends the key on the named routes only.

With --rlqs-address, the rate_limit_quota filter instead (the sidecar's Rate Limit Quota
Service, serve --rlqs-address): Envoy enforces the sidecar's quota assignments itself and asks
nothing per request. Each key path becomes a bucket whose id carries the descriptor's keys and
values; a request counts in one bucket only (the first it matches, narrower buckets first), and
count: on_success is not honoured (every request counts). The output's header says where this
changes what the rules do; a rule no request could reach is an error.

With --bootstrap, a whole gateway: a listener, the routes to one upstream cluster, the
sidecar's cluster and the admin interface, ready for 'envoy -c'."""

_EPILOG = """\
examples:
  ratelimit-sidecar envoy-config --rules rules/ --sources sources.yaml
  ratelimit-sidecar envoy-config --rules rules/ --sources sources.yaml --bootstrap \\
      --route orders=/api/orders --route ads=/ads > envoy.yaml
  ratelimit-sidecar envoy-config --rules rules/ --sources sources.yaml \\
      --rlqs-address 127.0.0.1:8083"""


def register(subparsers: Any) -> None:
    """Add `envoy-config` to an argparse subparsers object (from `add_subparsers`)."""
    parser = subparsers.add_parser(
        "envoy-config",
        help="print the Envoy filter, cluster and route rate_limits that feed a rules file",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rules",
        required=True,
        action="append",
        metavar="PATH",
        help="a rules file or a directory of them; repeat for more",
    )
    parser.add_argument(
        "--sources", required=True, metavar="FILE", help="descriptor key -> request attribute"
    )
    parser.add_argument(
        "--domain", metavar="NAME", help="the domain to feed, when the rules hold several"
    )
    parser.add_argument(
        "--route",
        action="append",
        type=_route,
        metavar="NAME=PREFIX",
        help=f"a route for requests whose path starts with PREFIX; repeat for more "
        f"(default: {DEFAULT_ROUTE})",
    )
    parser.add_argument(
        "--sidecar",
        default="127.0.0.1:8081",
        type=_sidecar,
        metavar="HOST:PORT|unix:PATH",
        help="the sidecar's gRPC address: TCP, or a Unix socket Envoy reaches as a pipe, such as "
        "unix:/var/run/ratelimit-sidecar/rls.sock where the injected sidecar listens in a "
        "Kubernetes pod (default: 127.0.0.1:8081)",
    )
    parser.add_argument(
        "--timeout-ms",
        default=100,
        type=_milliseconds,
        metavar="N",
        help="Envoy's deadline for one rate limit call; keep it above the sidecar's "
        "--redis-timeout-ms so the sidecar's failure mode answers first (default: 100)",
    )
    parser.add_argument(
        "--rlqs-address",
        type=_address,
        metavar="HOST:PORT",
        help="feed the rules through the rate_limit_quota filter and the 'rlqs' cluster to the "
        "sidecar's Rate Limit Quota Service at this address (its serve --rlqs-address), "
        "instead of the rate_limit filter; --sidecar and --timeout-ms are then unused",
    )
    parser.add_argument(
        "--failure-mode-deny",
        action="store_true",
        help="answer 500 when the sidecar cannot be reached in time; with --rlqs-address, "
        "answer 429 for a bucket without a live assignment: a new bucket's first requests, "
        "until its first assignment arrives (a round trip to the sidecar), and a bucket whose "
        "assignment expired with the sidecar out of reach (default: let the request through)",
    )
    parser.add_argument("--bootstrap", action="store_true", help="print a whole gateway bootstrap")
    parser.add_argument(
        "--listen",
        default="0.0.0.0:10000",
        type=_address,
        metavar="HOST:PORT",
        help="with --bootstrap: the gateway's listener (default: 0.0.0.0:10000)",
    )
    parser.add_argument(
        "--upstream",
        default="127.0.0.1:8000",
        type=_address,
        metavar="HOST:PORT",
        help="with --bootstrap: where every route sends (default: 127.0.0.1:8000)",
    )
    parser.add_argument(
        "--admin",
        default="127.0.0.1:9901",
        type=_address,
        metavar="HOST:PORT",
        help="with --bootstrap: Envoy's admin interface (default: 127.0.0.1:9901)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the pieces, or the bootstrap; exit status 1 with the message for a bad file."""
    try:
        text = generate(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


def generate(
    args: argparse.Namespace, argv: Sequence[str] | None = None, *, with_rate_limit: bool = True
) -> str:
    """The YAML `run` prints; `argv` (default: this process's) is quoted in its header.

    `with_rate_limit=False` drops the filter, the route limits and the sidecar's cluster from a
    bootstrap: the same gateway without rate limiting, for comparison.
    """
    from sidecar.envoy_config import feeds, messages, quota, sources

    domain = _domain(args.rules, args.domain)
    routes = [feeds.Route(name, prefix) for name, prefix in args.route or [_route(DEFAULT_ROUTE)]]
    names = [r.name for r in routes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError("--route", "", f"route '{duplicates[0]}' is given twice")
    feed = feeds.feed(domain, sources.load(args.sources), routes)
    settings = messages.Settings(
        sidecar=_endpoint(args.sidecar),
        timeout=datetime.timedelta(milliseconds=args.timeout_ms),
        failure_mode_deny=args.failure_mode_deny,
        rlqs=None if args.rlqs_address is None else messages.Address(*args.rlqs_address),
        listen=messages.Address(*args.listen),
        upstream=messages.Address(*args.upstream),
        admin=messages.Address(*args.admin),
    )
    command = shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)])
    what = "A gateway bootstrap" if args.bootstrap else "The Envoy pieces"
    header = (
        f"# {what} for the rate limit rules of domain '{domain.name}', generated by:\n"
        f"#   {command}\n"
        "# Change the rules or the sources and generate it again rather than editing it.\n"
    )
    if settings.rlqs is not None:
        notes = quota.notes(feed, quota.buckets(feed))
        if notes:
            header += "# Through the rate_limit_quota filter, unlike the rate_limit filter:\n"
            header += "".join(f"#   {line}\n" for line in notes)
    if args.bootstrap:
        return messages.to_yaml(
            messages.bootstrap(feed, settings, with_rate_limit=with_rate_limit), header
        )
    return messages.to_yaml(messages.pieces(feed, settings), header)


def _endpoint(address: tuple[str, int] | str) -> messages.Address | messages.Pipe:
    """A parsed --sidecar as the address Envoy reaches: TCP or a pipe."""
    from sidecar.envoy_config import messages

    return messages.Pipe(address) if isinstance(address, str) else messages.Address(*address)


def _domain(paths: Sequence[str], name: str | None) -> Domain:
    rules = config.load(paths)
    where = ", ".join(paths)
    if not rules.domains:
        raise ConfigError(where, "", "no rules files (*.yaml, *.yml)")
    if name is not None:
        if name not in rules.domains:
            known = ", ".join(sorted(rules.domains))
            raise ConfigError(where, "", f"no domain '{name}' (the rules declare: {known})")
        return rules.domains[name]
    if len(rules.domains) > 1:
        known = ", ".join(sorted(rules.domains))
        raise ConfigError(where, "", f"several domains ({known}): choose one with --domain")
    return next(iter(rules.domains.values()))


def _route(text: str) -> tuple[str, str]:
    name, sep, prefix = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not prefix.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"expected NAME=PREFIX with a prefix starting with '/', got {text!r}"
        )
    return name, prefix


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _sidecar(text: str) -> tuple[str, int] | str:
    """``HOST:PORT``, or ``unix:PATH`` with an absolute PATH (returned as the path alone)."""
    if not text.startswith("unix:"):
        return _address(text)
    path = text.removeprefix("unix:")
    if not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected unix:/ABSOLUTE/PATH, got {text!r}")
    return path


def _milliseconds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of milliseconds, got {text!r}")
    return int(text)
