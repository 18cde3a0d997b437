"""`check`: validate rules files without starting anything."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sidecar.cli.flags import PROG
from sidecar.core import config
from sidecar.errors import ConfigError

DESCRIPTION = """\
Validate rules files without starting anything: print one summary line per domain and exit
0, or print the first error as 'FILE: PATH-IN-FILE: message' and exit 1.

Every file envoyproxy/ratelimit loads loads here too. What it loads but is likely a mistake
(a key where it does nothing, such as a unit beside rate_limit instead of inside it; a key
repeated in one map; an empty rate_limit) is printed to stderr as 'warning: FILE: PATH:
message'; `serve` logs it once. With --strict a warning fails the check (exit 1)."""


def register(commands: Any) -> None:
    """Add `check` to the subcommands (`argparse`'s `add_subparsers` object)."""
    formatter = argparse.RawDescriptionHelpFormatter
    check = commands.add_parser(
        "check",
        help="validate rules files and summarise them",
        description=DESCRIPTION,
        formatter_class=formatter,
    )
    check.add_argument(
        "paths", nargs="+", metavar="PATH", help="a rules file or a directory of them"
    )
    check.add_argument(
        "--strict", action="store_true", help="fail (exit 1) on a warning as on an error"
    )
    check.add_argument(
        "--merge-domain-config",
        action="store_true",
        help="files declaring the same domain add their descriptors to it, as `serve "
        "--merge-domain-config` does (the reference's MERGE_DOMAIN_CONFIG)",
    )
    check.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        rules = config.load(args.paths, merge=args.merge_domain_config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not rules.domains:
        print(f"{PROG}: no rules files (*.yaml, *.yml) in {', '.join(args.paths)}", file=sys.stderr)
        return 1
    warnings = rules.warnings()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for domain in rules.domains.values():
        print(domain.summary())
    if warnings and args.strict:
        print(f"{PROG} check --strict: {len(warnings)} warning(s)", file=sys.stderr)
        return 1
    return 0
