"""`ratelimit-sidecar usage`: a running sidecar's usage per day, from its `GET /v1/usage`, as a
table (or the JSON as it comes)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sidecar.reports.usage import DEFAULT_TOP

_DESCRIPTION = """\
Ask a running sidecar (its HTTP port) for the usage its rules declare: calls per day of each
key of one dimension (`by`), admitted and refused apart, and the distinct values of a `unique`
key where declared. Days are calendar days in the domain's usage time zone.

examples:
  ratelimit-sidecar usage --domain open --by app
  ratelimit-sidecar usage --domain open --by app,interface --from 2026-11-20 --to 2026-11-24
"""


def register(subparsers: Any) -> None:
    """Add `usage` to an argparse subparsers object (from `add_subparsers`)."""
    parser = subparsers.add_parser(
        "usage",
        help="print a running sidecar's usage per day (calls per key, unique counts)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--http-address",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="the sidecar's HTTP address (default: 127.0.0.1:8080)",
    )
    parser.add_argument("--domain", required=True, help="the rate limit domain")
    parser.add_argument(
        "--by", required=True, metavar="KEY[,KEY]", help="the dimension: its keys, comma-separated"
    )
    parser.add_argument("--day", metavar="YYYY-MM-DD", help="one day (default: today)")
    parser.add_argument("--from", dest="first", metavar="YYYY-MM-DD", help="first day of a range")
    parser.add_argument("--to", dest="last", metavar="YYYY-MM-DD", help="last day of a range")
    parser.add_argument(
        "--top", type=int, default=DEFAULT_TOP, metavar="N", help="keys per day (default: 10)"
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = {"domain": args.domain, "by": args.by, "top": str(args.top)}
    for name, value in (("day", args.day), ("from", args.first), ("to", args.last)):
        if value is not None:
            params[name] = value
    url = f"http://{args.http_address}/v1/usage?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]
        except (ValueError, KeyError):
            reason = f"HTTP {exc.code}"
        print(f"ratelimit-sidecar usage: {reason}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"ratelimit-sidecar usage: {args.http_address}: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(answer, indent=2, ensure_ascii=False))
    else:
        print(render(answer))
    return 0


def render(answer: dict[str, Any]) -> str:
    """`/v1/usage`'s answer as text: a heading and a table per day."""
    by, uniques = answer["by"], answer["unique"]
    lines = []
    for day in answer["days"]:
        lines.append(
            f"{answer['domain']}: calls by {','.join(by)} on {day['day']} ({answer['timezone']}): "
            f"{day['keys']} keys, {day['admitted']} admitted, {day['refused']} refused"
        )
        header = [",".join(by), "admitted", "refused", *(f"unique {u}" for u in uniques)]
        rows = [
            [
                ",".join(row["key"][k] for k in by),
                str(row["admitted"]),
                str(row["refused"]),
                *(str(row["unique"][u]) for u in uniques),
            ]
            for row in day["top"]
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [row[0].ljust(widths[0])] + [
                c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
            ]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
