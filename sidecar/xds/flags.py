"""`serve`'s xDS flags, and the `XdsOptions` they make (the CLI calls `add` and `options`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sidecar.xds.client import XdsOptions


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _pair(separator: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        name, sep, _ = text.partition(separator)
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME{separator}VALUE, got {text!r}")
        return text

    return check


def add(add_flag: Callable[..., None]) -> None:
    """Register the flags through the CLI's `add(option, help, **argparse options)`."""
    add_flag(
        "--xds-server",
        "take the rules from this control plane (HOST:PORT) over xDS instead of --config: "
        "RateLimitConfig resources on an aggregated discovery stream (state of the world)",
        metavar="HOST:PORT",
    )
    add_flag("--xds-node-id", "the node id sent to the control plane", default="default")
    add_flag(
        "--xds-node-metadata",
        "node metadata sent to the control plane, as K=V; repeat for more. In the variable, "
        "separate pairs with ','",
        action="append",
        type=_pair("="),
        metavar="K=V",
        separators=",",
    )
    add_flag(
        "--xds-header",
        "a gRPC header sent with the stream, as NAME:VALUE; repeat for more. In the variable, "
        "separate pairs with ','",
        action="append",
        type=_pair(":"),
        metavar="NAME:VALUE",
        separators=",",
    )
    add_flag("--xds-tls", "TLS to the control plane", action="store_true", default=False)
    add_flag(
        "--xds-ca",
        "the CA of the control plane's certificate (default: the system's)",
        metavar="FILE",
    )
    add_flag("--xds-cert", "this client's certificate, for mTLS", metavar="FILE")
    add_flag("--xds-key", "this client's private key, for mTLS", metavar="FILE")
    add_flag(
        "--xds-server-name",
        "the name the control plane's certificate must carry, if not its address's",
        metavar="NAME",
    )
    add_flag(
        "--xds-retry-seconds",
        "between attempts to reach a control plane that has not answered yet (±50%%)",
        default=3.0,
        type=_seconds,
        metavar="SECONDS",
    )
    add_flag(
        "--xds-backoff-seconds",
        "the first wait before reopening a stream that delivered rules and broke",
        default=10.0,
        type=_seconds,
        metavar="SECONDS",
    )
    add_flag(
        "--xds-backoff-max-seconds",
        "the longest such wait",
        default=60.0,
        type=_seconds,
        metavar="SECONDS",
    )
    add_flag(
        "--xds-backoff-factor",
        "each wait is the first times FACTOR^attempt, within the first and the longest",
        default=0.5,
        type=float,
        metavar="FACTOR",
    )
    add_flag(
        "--xds-backoff-no-jitter",
        "wait exactly the computed time, rather than a draw between the first wait and it",
        action="store_true",
        default=False,
    )
    add_flag(
        "--xds-max-message-bytes",
        "the largest response accepted from the control plane (default: gRPC's 4 MiB)",
        type=_positive,
        metavar="N",
    )
    add_flag(
        "--force-start-without-initial-config",
        "with --xds-server, serve at once rather than after the first rules arrive (until "
        "then every domain is unknown, answered OK)",
        action="store_true",
        default=False,
    )


def options(args: argparse.Namespace) -> XdsOptions | None:
    """The xDS options of a parsed `serve` command line; None without --xds-server."""
    if not args.xds_server:
        return None
    metadata: dict[str, Any] = {}
    for pair in args.xds_node_metadata or ():
        name, _, value = pair.partition("=")
        metadata[name.strip()] = value
    headers = []
    for pair in args.xds_header or ():
        name, _, value = pair.partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return XdsOptions(
        server=args.xds_server,
        node_id=args.xds_node_id,
        node_metadata=metadata,
        headers=tuple(headers),
        tls=args.xds_tls,
        ca_file=args.xds_ca,
        cert_file=args.xds_cert,
        key_file=args.xds_key,
        server_name=args.xds_server_name,
        connect_retry=args.xds_retry_seconds,
        backoff_initial=args.xds_backoff_seconds,
        backoff_max=args.xds_backoff_max_seconds,
        backoff_factor=args.xds_backoff_factor,
        backoff_jitter=not args.xds_backoff_no_jitter,
        max_message_bytes=args.xds_max_message_bytes,
        force_start=args.force_start_without_initial_config,
        merge_domain_config=args.merge_domain_config,
        calendar_months=args.calendar_months,
    )
