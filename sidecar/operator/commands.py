"""`ratelimit-sidecar counters`: one descriptor's counters, read from a running sidecar's
operator port (`GET /v1/counters`), or reset there (`POST /v1/counters/reset`), printed as
text (or the JSON as it comes). The descriptor is named as Envoy sends it; the sidecar finds
its rule and counters."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sidecar.operator.port import TOKEN_VARIABLE

_DESCRIPTION = f"""\
Ask a running sidecar's operator port (serve --operator-address) what one descriptor's
counters hold: the rule that applies, each window's count, limit, remaining and reset, and
what a check would be answered now. With --reset, delete those counters (lifting the limit
until they fill again), then print their state.

The token, when the port wants one, comes from --token-file or {TOKEN_VARIABLE}.
Exit status: 0 when a check would be answered OK (or the reset was done), 1 when
OVER_LIMIT, 2 on error.

examples:
  ratelimit-sidecar counters --domain gateway --descriptor remote_address=10.0.0.1
  ratelimit-sidecar counters --domain gateway --descriptor remote_address=10.0.0.1 --reset
  ratelimit-sidecar counters --domain open --entry app=shop --entry path=/a,b
"""


def register(subparsers: Any) -> None:
    """Add `counters` to an argparse subparsers object (from `add_subparsers`)."""
    parser = subparsers.add_parser(
        "counters",
        help="read or reset one descriptor's counters on a running sidecar (operator port)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--address",
        default="127.0.0.1:8082",
        metavar="HOST:PORT",
        help="the sidecar's operator address, serve --operator-address (default: 127.0.0.1:8082)",
    )
    parser.add_argument("--domain", required=True, help="the rate limit domain")
    named = parser.add_mutually_exclusive_group(required=True)
    named.add_argument(
        "--descriptor", metavar="K=V[,K=V]", help="the descriptor's entries, as query takes them"
    )
    named.add_argument(
        "--entry",
        action="append",
        metavar="K=V",
        help="one entry (repeat, in order); its value may hold ',' and '='",
    )
    parser.add_argument(
        "--reset", action="store_true", help="delete the descriptor's counters and lift its penalty"
    )
    parser.add_argument("--token-file", metavar="PATH", help="a file holding the bearer token")
    parser.add_argument("--cacert", metavar="PATH", help="HTTPS: the CA of the port's certificate")
    parser.add_argument("--cert", metavar="PATH", help="mTLS: this client's certificate (PEM)")
    parser.add_argument("--key", metavar="PATH", help="mTLS: the key of --cert (PEM)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    parser.set_defaults(func=run)


class _Failed(Exception):
    """What went wrong, as one line for stderr."""


def run(args: argparse.Namespace) -> int:
    try:
        entries = _entries(args)
        answer = _call(args, entries)
    except _Failed as exc:
        print(f"ratelimit-sidecar counters: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(answer, indent=2, ensure_ascii=False))
    else:
        print(render(answer))
    if args.reset:
        return 0
    return 1 if answer.get("code") == "OVER_LIMIT" else 0


def _entries(args: argparse.Namespace) -> list[tuple[str, str]]:
    texts = args.descriptor.split(",") if args.descriptor is not None else args.entry
    entries = []
    for text in texts:
        key, equals, value = text.partition("=")
        if not equals or not key:
            raise _Failed(f"{text!r}: expected KEY=VALUE")
        entries.append((key, value))
    return entries


def _call(args: argparse.Namespace, entries: list[tuple[str, str]]) -> dict[str, Any]:
    scheme = "https" if args.cacert or args.cert else "http"
    base = f"{scheme}://{args.address}/v1/counters"
    headers = {"X-Operator": getpass.getuser()}
    token = _token(args)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if args.reset:
        body = {"domain": args.domain, "entries": [{"key": k, "value": v} for k, v in entries]}
        headers["Content-Type"] = "application/json"
        request = urllib.request.Request(
            f"{base}/reset", json.dumps(body).encode(), headers, method="POST"
        )
    else:
        query = [("domain", args.domain), *(("entry", f"{k}={v}") for k, v in entries)]
        request = urllib.request.Request(f"{base}?{urllib.parse.urlencode(query)}", None, headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=_tls(args)) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            reason = exc.reason
        raise _Failed(f"HTTP {exc.code}: {reason}") from exc
    except (OSError, ValueError) as exc:
        raise _Failed(f"{args.address}: {exc}") from exc
    return answer


def _token(args: argparse.Namespace) -> str:
    if args.token_file is None:
        return os.environ.get(TOKEN_VARIABLE, "").strip()
    try:
        with open(args.token_file, encoding="utf-8") as file:
            return file.read().strip()
    except OSError as exc:
        raise _Failed(f"--token-file {args.token_file}: {exc}") from exc


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not (args.cacert or args.cert):
        return None
    if (args.cert is None) != (args.key is None):
        raise _Failed("--cert needs --key, and the reverse")
    try:
        context = ssl.create_default_context(cafile=args.cacert)
        if args.cert:
            context.load_cert_chain(args.cert, args.key)
    except (OSError, ssl.SSLError) as exc:
        raise _Failed(f"TLS files: {exc}") from exc
    return context


def render(answer: dict[str, Any]) -> str:
    """The operator port's answer as text: the descriptor, its rule, the verdict and until
    when, then a line per window."""
    entries = ",".join(f"{e['key']}={e['value']}" for e in answer["entries"])
    lines = [f"{answer['domain']}: {entries}"]
    if "counters_deleted" in answer:
        lines.append(f"  reset: {answer['counters_deleted']} counters deleted")
    rule = answer["rule"]
    if rule is None:
        lines.append("  no rule applies: OK, no limit, nothing counted")
        return "\n".join(lines)
    name = f" ({rule['name']})" if rule["name"] else ""
    modes = [mode for mode in ("shadow_mode", "quota_mode") if rule[mode]]
    lines.append(f"  rule {rule['key']}{name}{''.join(f', {m}' for m in modes)}")
    counted = ",".join(f"{e['key']}={e['value']}" for e in answer.get("counted_as", ()))
    if counted and counted != entries:
        lines.append(f"  counted as {counted} (shared by every value the rule's pattern matches)")
    if rule["unlimited"]:
        lines.append("  unlimited: OK, nothing counted")
        return "\n".join(lines)
    limit = answer["current_limit"]
    verdict = (
        f"  {answer['code']}: {answer['limit_remaining']} left of {limit['requests_per_unit']} "
        f"per {limit['unit']}"
    )
    if answer["code"] == "OVER_LIMIT":
        verdict += f", until {answer['reset_at']} (in {answer['duration_until_reset']} s)"
    elif answer["would_be_over"]:
        verdict += " (over its limit, but in shadow mode)"
    lines.append(verdict)
    if "penalty" in answer:
        lines.append(_penalty_line(answer["penalty"]))
    header = ["window", "count", "limit", "remaining", "resets in", "resets at"]
    rows = [header]
    for window in answer["windows"]:
        size = (
            window["unit"]
            if window["unit_multiplier"] == 1
            else (f"{window['unit_multiplier']} {window['unit']}s")
        )
        held = window.get("count", window.get("tokens"))
        rows.append(
            [
                f"{window['name'] or window['algorithm']} per {size}",
                f"{held} tokens" if "tokens" in window else str(held),
                str(window["requests_per_unit"])
                + (f" (burst {window['burst']})" if "burst" in window else ""),
                str(window["limit_remaining"]),
                f"{window['duration_until_reset']} s",
                window["reset_at"],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:-1], strict=True)
        ]
        lines.append("  " + "  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def _penalty_line(penalty: dict[str, Any]) -> str:
    """The descriptor's penalty (`sidecar.algorithms.penalty`): blocked until when, or clear."""
    if penalty["blocked"]:
        return (
            f"  penalty: blocked until {penalty['blocked_until']} "
            f"(in {penalty['block_left_seconds']} s), level {penalty['level']}, "
            f"{penalty['strikes']} strikes"
        )
    if penalty["strikes"]:
        return f"  penalty: not blocked, {penalty['strikes']} strikes remembered"
    return "  penalty: not blocked"
