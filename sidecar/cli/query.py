"""`query`: send one ShouldRateLimit call to a running service and print the answer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sidecar.cli.flags import PROG, Flags, count, grpc_address, seconds

DESCRIPTION = """\
Send one ShouldRateLimit call to a running service and print the response.
Exit status: 0 when overall_code is OK, 1 when OVER_LIMIT, 2 on error."""


def register(commands: Any) -> Flags:
    """Add `query` to the subcommands; its flags, which read RLS_* variables."""
    formatter = argparse.RawDescriptionHelpFormatter
    query = Flags(
        commands.add_parser(
            "query",
            help="send one ShouldRateLimit call to a running service",
            description=DESCRIPTION,
            formatter_class=formatter,
        )
    )
    query.add(
        "--address",
        "the service's gRPC address: HOST:PORT or unix:PATH",
        default="127.0.0.1:8081",
        type=grpc_address,
        metavar="ADDRESS",
    )
    query.add("--domain", "the rate limit domain", required=True, metavar="DOMAIN")
    query.add(
        "--descriptor",
        "one descriptor as key=value[,key2=value2]; repeat for more. "
        "In RLS_DESCRIPTOR, separate descriptors with ';'",
        required=True,
        action="append",
        metavar="K=V[,K=V]",
        separators=";",
    )
    query.add(
        "--hits",
        "the request's hits_addend (0 counts as 1)",
        default=0,
        type=count(0),
        metavar="N",
    )
    query.add(
        "--format",
        "print the response as protobuf text or JSON",
        default="text",
        choices=("text", "json"),
    )
    query.add(
        "--timeout", "seconds to wait for the answer", default=5.0, type=seconds, metavar="SECONDS"
    )
    query.parser.set_defaults(func=run)
    return query


def run(args: argparse.Namespace) -> int:
    from sidecar.model import Code
    from sidecar.rls import client

    try:
        descriptors = [client.parse_descriptor(text) for text in args.descriptor]
    except ValueError as exc:
        print(f"{PROG} query: {exc}", file=sys.stderr)
        return 2
    try:
        response = client.query(args.address, args.domain, descriptors, args.hits, args.timeout)
    except client.QueryError as exc:
        print(f"{PROG} query: {args.address}: {exc}", file=sys.stderr)
        return 2
    print(client.render(response, args.format))
    code = client.overall_code(response)
    if code is Code.OK:
        return 0
    return 1 if code is Code.OVER_LIMIT else 2
