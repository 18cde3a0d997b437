"""The `webhook` and `inject` subcommands; `register` adds them to the CLI's subparsers.

Each sets ``func`` on its parser: the CLI calls ``args.func(args)`` and exits with what it
returns (0 success, 1 failure at run time, 2 bad flags or files given on the command line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
from pathlib import Path
from typing import Any

import structlog

from sidecar import logs
from sidecar.errors import InjectionError
from sidecar.injector.manifests import inject_yaml
from sidecar.injector.patch import DEFAULT_IMAGE, Settings
from sidecar.injector.webhook import Certificates, WebhookServer

PROG = "ratelimit-sidecar"
DEFAULT_WEBHOOK_ADDRESS = "0.0.0.0:8443"

_WEBHOOK_DESCRIPTION = """\
Serve the mutating admission webhook: AdmissionReview v1 at POST /mutate, over HTTPS only,
and GET /healthz for probes. Pods annotated ratelimit-sidecar/inject: "true" get the sidecar
container; a bad ratelimit-sidecar/* annotation is refused with a message saying which and why.
The certificate files are read again when they change (a renewed Secret).
SIGTERM or SIGINT: stop listening, finish the reviews in flight, exit 0."""

_INJECT_DESCRIPTION = """\
Print a manifest with the sidecar injected into every Pod, Deployment, StatefulSet and
DaemonSet whose pod template is annotated ratelimit-sidecar/inject: "true"; other documents
pass through unchanged. For GitOps, and for clusters without the webhook. Injecting the
output again changes nothing. Exit status 1, with the reason, for a file that cannot be read
or a workload whose annotations cannot make a working sidecar."""

log = structlog.get_logger("sidecar.injector")


def register(subparsers: Any) -> None:
    """Add `webhook` and `inject` to an argparse subparsers object (from `add_subparsers`)."""
    formatter = argparse.RawDescriptionHelpFormatter
    webhook = subparsers.add_parser(
        "webhook",
        help="serve the Kubernetes admission webhook that injects the sidecar",
        description=_WEBHOOK_DESCRIPTION,
        formatter_class=formatter,
    )
    webhook.add_argument("--tls-cert", required=True, metavar="FILE", help="certificate (PEM)")
    webhook.add_argument("--tls-key", required=True, metavar="FILE", help="private key (PEM)")
    webhook.add_argument(
        "--address",
        default=DEFAULT_WEBHOOK_ADDRESS,
        type=_address,
        metavar="HOST:PORT",
        help=f"HTTPS listen address (default: {DEFAULT_WEBHOOK_ADDRESS})",
    )
    _add_settings(webhook)
    webhook.add_argument(
        "--log-format", default="json", choices=("json", "console"), help="default: json"
    )
    webhook.add_argument("--log-level", default="info", choices=logs.LEVELS, help="default: info")
    webhook.set_defaults(func=run_webhook)

    inject = subparsers.add_parser(
        "inject",
        help="print a Kubernetes manifest with the sidecar injected",
        description=_INJECT_DESCRIPTION,
        formatter_class=formatter,
    )
    inject.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="the manifest; - for stdin"
    )
    _add_settings(inject)
    inject.set_defaults(func=run_inject)


def run_webhook(args: argparse.Namespace) -> int:
    logs.configure(args.log_level, args.log_format)
    settings = _settings(args, "webhook")
    if settings is None:
        return 2
    try:
        certificates = Certificates(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        print(f"{PROG} webhook: cannot load --tls-cert/--tls-key: {exc}", file=sys.stderr)
        return 2
    host, port = args.address
    server = WebhookServer(settings, certificates, host, port)
    try:
        return asyncio.run(_serve(server))
    except OSError as exc:
        print(f"{PROG} webhook: {exc}", file=sys.stderr)
        return 1


def run_inject(args: argparse.Namespace) -> int:
    settings = _settings(args, "inject")
    if settings is None:
        return 2
    source = "<stdin>" if args.filename == "-" else args.filename
    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{PROG} inject: {source}: {exc}", file=sys.stderr)
        return 1
    try:
        output = inject_yaml(text, settings, source)
    except InjectionError as exc:
        print(f"{PROG} inject: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(output)
    return 0


async def _serve(server: WebhookServer) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
        log.info("webhook_stopping")
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)
    return 0


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"the sidecar's container image (default: {DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--image-pull-policy",
        default="IfNotPresent",
        choices=("Always", "IfNotPresent", "Never"),
        help="default: IfNotPresent",
    )
    parser.add_argument(
        "--default-backend",
        metavar="URL",
        help="backend URL for pods without a ratelimit-sidecar/backend annotation "
        "(default: none, so the sidecar's own memory://)",
    )
    parser.add_argument(
        "--pre-stop-seconds",
        type=int,
        default=10,
        metavar="N",
        help="how long the sidecar keeps serving after its pod starts terminating, "
        "so Envoy stops first (default: 10)",
    )


def _settings(args: argparse.Namespace, command: str) -> Settings | None:
    try:
        return Settings(
            image=args.image,
            image_pull_policy=args.image_pull_policy,
            default_backend=args.default_backend,
            pre_stop_seconds=args.pre_stop_seconds,
        )
    except ValueError as exc:
        print(f"{PROG} {command}: {exc}", file=sys.stderr)
        return None


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``; port 0 picks a free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65_535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 0.0.0.0:8443, not {text!r}")
    return host.strip("[]"), int(port)
