"""The `webhook` and `inject` subcommands; `register` adds them to the CLI's subparsers.

Each sets ``func`` on its parser: the CLI calls ``args.func(args)`` and exits with what it
returns (0 success, 1 failure at run time, 2 bad flags or files given on the command line).

One module past the usual size because its two commands share their settings: the flags they
both take (`_add_settings`, a sixth of its length) and how those become `Settings`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import ssl
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from sidecar.errors import InjectionError
from sidecar.injector.apiserver import (
    SERVICE_ACCOUNT,
    Client,
    parse_version,
    pod_image,
    pod_namespace,
    server_version,
)
from sidecar.injector.bootstrap import REFRESH_SECONDS, Keeper, Target, parse_target
from sidecar.injector.manifests import inject_yaml
from sidecar.injector.settings import (
    DEFAULT_IMAGE,
    DEFAULT_RULES_CONFIGMAP,
    NATIVE_SINCE,
    SIDECAR_UID,
    Settings,
)
from sidecar.injector.webhook import Certificates, WebhookServer
from sidecar.telemetry import logs

PROG = "ratelimit-sidecar"
DEFAULT_WEBHOOK_ADDRESS = "0.0.0.0:8443"
#: The Service the manifests put in front of the webhook (k8s/base/webhook/service.yaml).
DEFAULT_SERVICE = "ratelimit-sidecar-webhook"
#: How often `webhook --native-sidecars auto` reads the API server's version again (a cluster
#: upgraded while the webhook runs gets native sidecars from then on).
VERSION_SECONDS = 600.0
#: Waits between tries of the first `Keeper.keep`, before giving up with status 1: on a first
#: install the RBAC that allows it may reach the API server a moment after the webhook's pod
#: (31 s in all, so a lasting refusal still shows as a restart, with its reason).
START_RETRY_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0)

_WEBHOOK_DESCRIPTION = """\
Serve the mutating admission webhook: AdmissionReview v1 over HTTPS only, and GET /healthz
for probes. POST /mutate injects pods annotated ratelimit-sidecar/inject: "true"; POST
/mutate/injection-enabled (for namespaces labelled ratelimit-sidecar/injection=enabled) every
pod but those annotated "false". Pods on the host's network and in kube-system or kube-public
are never injected. A bad ratelimit-sidecar/* annotation is refused with a message saying
which and why.
The certificate files are read again when they change (a renewed Secret).
With --certificate-secret, the webhook makes its own certificate (a CA and a serving
certificate for --service's DNS names) when that Secret of its namespace has none, keeps it
there for its other replicas, writes it to --tls-cert and --tls-key, and puts the CA in the
caBundle of every --ca-bundle-for configuration before it listens; then checks both every
10 minutes. Without --image, it injects the image of its own pod's `webhook` container.
With --native-sidecars auto (the default) and no --kube-version, the webhook reads its API
server's version at start and every 10 minutes, and injects native sidecars from 1.29 on;
when it cannot read it, ordinary containers (they work on every version).
SIGTERM or SIGINT: stop listening, finish the reviews in flight, exit 0."""

_INJECT_DESCRIPTION = """\
Print a manifest with the sidecar injected into every Pod, Deployment, StatefulSet and
DaemonSet whose pod template is annotated ratelimit-sidecar/inject: "true"; other documents
pass through unchanged. For GitOps, and for clusters without the webhook. Injecting the
output again changes nothing. Exit status 1, with the reason, for a file that cannot be read
or a workload whose annotations cannot make a working sidecar.
With --native-sidecars auto (the default), native sidecars unless --kube-version names a
Kubernetes older than 1.29."""

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
    webhook.add_argument(
        "--certificate-secret",
        metavar="NAME",
        help="make and keep its own certificate in this Secret of its namespace, written to "
        "--tls-cert and --tls-key (for clusters without cert-manager; see k8s/README.md)",
    )
    webhook.add_argument(
        "--ca-bundle-for",
        action="append",
        type=_target,
        default=[],
        metavar="mutating/NAME",
        help="a webhook configuration (mutating/NAME or validating/NAME) whose entries calling "
        "--service get the CA of --certificate-secret as their caBundle (repeatable)",
    )
    webhook.add_argument(
        "--service",
        default=DEFAULT_SERVICE,
        metavar="NAME",
        help=f"the Service, in its namespace, the API server calls it through: its certificate's "
        f"DNS names (default: {DEFAULT_SERVICE})",
    )
    # No default image: its own pod's (`_start`), so the manifests name the image once.
    _add_settings(webhook, image_default=None)
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
    if args.ca_bundle_for and not args.certificate_secret:
        print(
            f"{PROG} webhook: --ca-bundle-for needs --certificate-secret (the CA comes from it)",
            file=sys.stderr,
        )
        return 2
    detect = args.native_sidecars == "auto" and args.kube_version is None
    if detect:
        # Until the API server says otherwise: ordinary containers work on every version.
        settings = dataclasses.replace(settings, native_sidecars=False)
    try:
        return asyncio.run(_start(args, settings, detect, os.environ))
    except (OSError, ValueError) as exc:
        print(f"{PROG} webhook: {exc}", file=sys.stderr)
        return 1


async def _start(
    args: argparse.Namespace,
    settings: Settings,
    detect: bool,
    environ: Mapping[str, str],
    account: Path = SERVICE_ACCOUNT,
    retry_seconds: tuple[float, ...] = START_RETRY_SECONDS,
) -> int:
    """The certificate and the image, from the API server where the flags ask; then serve."""
    keeper = None
    if args.certificate_secret:
        client = Client.in_cluster(environ, account)
        keeper = Keeper(
            client,
            pod_namespace(environ, account),
            args.certificate_secret,
            args.service,
            tuple(args.ca_bundle_for),
            Path(args.tls_cert),
            Path(args.tls_key),
        )
        # Before listening: once it answers its readiness probe, the API server trusts it.
        for delay in retry_seconds:
            try:
                await keeper.keep()
                break
            except (OSError, ValueError) as exc:
                log.warning("certificate_keeping_failed", error=str(exc), retry_seconds=delay)
                await asyncio.sleep(delay)
        else:
            await keeper.keep()  # the last try: its error stops the start
    if args.image is None:
        pod = environ.get("POD_NAME")
        image = DEFAULT_IMAGE
        if pod:
            client = Client.in_cluster(environ, account)
            image = await pod_image(client, pod_namespace(environ, account), pod)
        settings = dataclasses.replace(settings, image=image)
    try:
        certificates = Certificates(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        print(f"{PROG} webhook: cannot load --tls-cert/--tls-key: {exc}", file=sys.stderr)
        return 2
    host, port = args.address
    server = WebhookServer(settings, certificates, host, port)
    return await _serve(server, detect, keeper, environ, account)


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


async def _serve(
    server: WebhookServer,
    detect: bool,
    keeper: Keeper | None = None,
    environ: Mapping[str, str] | None = None,
    account: Path = SERVICE_ACCOUNT,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watches: list[asyncio.Task[None]] = []
    try:
        if detect:
            await detect_native(server, environ, account)
            watches.append(asyncio.create_task(_detect_forever(server, environ, account)))
        if keeper is not None:
            watches.append(asyncio.create_task(_keep_forever(keeper)))
        await server.start()
        await stop.wait()
        log.info("webhook_stopping")
    finally:
        for watch in watches:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)
    return 0


async def detect_native(
    server: WebhookServer,
    environ: Mapping[str, str] | None = None,
    account: Path = SERVICE_ACCOUNT,
) -> None:
    """Inject native sidecars from now on if the API server is 1.29 or later; on an older one,
    or one whose version cannot be read (logged), ordinary containers."""
    try:
        version = await server_version(os.environ if environ is None else environ, account)
    except (OSError, ValueError) as exc:
        log.warning("kubernetes_version_unknown", error=str(exc), native_sidecars=False)
        native = False
    else:
        native = version >= NATIVE_SINCE
        if native != server.settings.native_sidecars or not server.version_known:
            shown = ".".join(map(str, version))
            log.info("kubernetes_version", version=shown, native_sidecars=native)
        server.version_known = True
    server.settings = dataclasses.replace(server.settings, native_sidecars=native)


async def _detect_forever(
    server: WebhookServer, environ: Mapping[str, str] | None, account: Path
) -> None:
    while True:
        await asyncio.sleep(VERSION_SECONDS)
        await detect_native(server, environ, account)


async def _keep_forever(keeper: Keeper) -> None:
    """Renew the certificate near its end and put back a caBundle someone removed; a failure
    is logged and tried again at the next round, the webhook serving what it has meanwhile."""
    while True:
        await asyncio.sleep(REFRESH_SECONDS)
        try:
            await keeper.keep()
        except (OSError, ValueError) as exc:
            log.warning("certificate_keeping_failed", error=str(exc))


def _add_settings(
    parser: argparse.ArgumentParser, image_default: str | None = DEFAULT_IMAGE
) -> None:
    shown = image_default or (
        "the image of its own pod's webhook container, read from the API server; "
        f"{DEFAULT_IMAGE} outside a pod"
    )
    parser.add_argument(
        "--image",
        default=image_default,
        help=f"the sidecar's container image (default: {shown})",
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
        "--default-rules-configmap",
        default=DEFAULT_RULES_CONFIGMAP,
        metavar="NAME",
        help="the rules ConfigMap, in the pod's namespace, for pods without a "
        f"ratelimit-sidecar/rules-configmap annotation (default: {DEFAULT_RULES_CONFIGMAP})",
    )
    parser.add_argument(
        "--pre-stop-seconds",
        type=int,
        default=10,
        metavar="N",
        help="how long an ordinary sidecar keeps serving after its pod starts terminating, "
        "so Envoy stops first (default: 10; a native sidecar stops after Envoy anyway)",
    )
    parser.add_argument(
        "--native-sidecars",
        default="auto",
        choices=("auto", "true", "false"),
        help="inject the sidecar as a native sidecar (an init container with restartPolicy "
        "Always; Kubernetes 1.29 and later) or as an ordinary container; a pod's "
        "ratelimit-sidecar/native-sidecar annotation overrides it (default: auto)",
    )
    parser.add_argument(
        "--kube-version",
        type=_kube_version,
        metavar="X.Y",
        help="the cluster's Kubernetes version, for --native-sidecars auto",
    )
    for name, default in (
        ("cpu-request", "100m"),
        ("cpu-limit", "1"),
        ("memory-request", "128Mi"),
        ("memory-limit", "256Mi"),
    ):
        parser.add_argument(
            f"--{name}",
            default=default,
            metavar="QUANTITY",
            help=f"the sidecar's {name.replace('-', ' ')}, unless a pod's "
            f"ratelimit-sidecar/{name} annotation says otherwise (default: {default})",
        )
    for name in ("run-as-user", "run-as-group"):
        parser.add_argument(
            f"--{name}",
            type=int,
            default=SIDECAR_UID,
            metavar="ID",
            help=f"the sidecar's {name.removeprefix('run-as-')} id (non-root), unless a pod's "
            f"ratelimit-sidecar/{name} annotation says otherwise (default: {SIDECAR_UID}, the "
            "image's)",
        )


def _settings(args: argparse.Namespace, command: str) -> Settings | None:
    try:
        return Settings(
            image=args.image or DEFAULT_IMAGE,
            image_pull_policy=args.image_pull_policy,
            default_backend=args.default_backend,
            rules_configmap=args.default_rules_configmap,
            pre_stop_seconds=args.pre_stop_seconds,
            native_sidecars=_native(args.native_sidecars, args.kube_version),
            cpu_request=args.cpu_request,
            cpu_limit=args.cpu_limit,
            memory_request=args.memory_request,
            memory_limit=args.memory_limit,
            run_as_user=args.run_as_user,
            run_as_group=args.run_as_group,
        )
    except ValueError as exc:
        print(f"{PROG} {command}: {exc}", file=sys.stderr)
        return None


def _native(choice: str, version: tuple[int, int] | None) -> bool:
    """--native-sidecars: true or false as said; auto from the version, native if unknown
    (the webhook then asks its API server, see `detect_native`)."""
    if choice == "auto":
        return version is None or version >= NATIVE_SINCE
    return choice == "true"


def _target(text: str) -> Target:
    try:
        return parse_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kube_version(text: str) -> tuple[int, int]:
    try:
        return parse_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``; port 0 picks a free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65_535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 0.0.0.0:8443, not {text!r}")
    return host.strip("[]"), int(port)
