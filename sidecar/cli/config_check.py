"""`ratelimit_config_check`, the reference's offline checker (envoyproxy/ratelimit
`src/config_check_cmd`): its flags, onto `ratelimit-sidecar check`, so there is one checker.

The reference's takes `-config_dir DIR` and `-merge_domain_configs`, in Go's flag syntax
(one dash or two, a value after `=` or as the next argument, a boolean bare or `=true`), and
exits 0 when the directory's rules load, 1 when they do not, 2 on a flag it does not know.
Here the same, and without `-config_dir` the directory is the one `ratelimit` loads, from the
reference's RUNTIME_ROOT, RUNTIME_SUBDIRECTORY and RUNTIME_APPDIRECTORY (and
MERGE_DOMAIN_CONFIG is `-merge_domain_configs`'s default), where the reference's checker, with
an empty directory name, fails.
What it prints is `check`'s: a summary line per domain, or the error as `FILE: PATH: message`
with its fix, and warnings, on stderr; not the reference's progress lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from sidecar.cli import check, settings

PROG = "ratelimit_config_check"

_DESCRIPTION = """\
envoyproxy/ratelimit's ratelimit_config_check: check that the rules files of a directory load,
as `ratelimit-sidecar check DIR` does. Exit status 0 when they load; 1, with the error (file,
path in it, fix), when they do not; 2 on a bad flag or setting.

Without -config_dir, the directory `ratelimit` loads: RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
RUNTIME_APPDIRECTORY (by default /srv/runtime_data/current/config)."""


#: Every flag name, as Go's flag package matches them: whole names only.
_FLAG_NAMES = frozenset({"config_dir", "merge_domain_configs", "h", "help"})


def _go_bool(text: str) -> bool:
    """A Go flag's boolean value (`-merge_domain_configs=false`)."""
    value = settings.boolean("value", {"value": text})
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid boolean value {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-config_dir",
        "--config_dir",
        dest="config_dir",
        metavar="DIR",
        help="the directory of rules files (default: the directory the reference's RUNTIME_* "
        "variables name)",
    )
    parser.add_argument(
        "-merge_domain_configs",
        "--merge_domain_configs",
        dest="merge_domain_configs",
        nargs="?",
        const=True,
        default=None,
        type=_go_bool,
        metavar="BOOL",
        help="files declaring the same domain add their descriptors to it (default: the "
        "reference's MERGE_DOMAIN_CONFIG, else false)",
    )
    return parser


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Check the rules; the exit status (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    command = parser()
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:
        # Go's flags take no abbreviations (`-config` is not `-config_dir`), and argparse
        # takes them of single-dash options even with allow_abbrev=False (Python 3.11).
        name = arg.lstrip("-").partition("=")[0]
        if arg.startswith("-") and name not in _FLAG_NAMES:
            command.print_usage(sys.stderr)
            command.exit(2, f"{PROG}: flag provided but not defined: -{name}\n")
    args = command.parse_args(argv)
    try:
        directory = args.config_dir or settings.rules_directory(environ)
        merge = args.merge_domain_configs
        if merge is None:
            merge = bool(settings.boolean("MERGE_DOMAIN_CONFIG", environ))
    except settings.SettingError as exc:
        command.exit(2, f"{PROG}: {exc}\n")
    if directory is None:
        command.exit(
            2,
            f"{PROG}: CONFIG_TYPE={environ.get('CONFIG_TYPE', '').strip()}: the rules come from "
            "a control plane; name a directory of rules files with -config_dir\n",
        )
    checking = argparse.Namespace(paths=[directory], strict=False, merge_domain_config=merge)
    return check.run(checking)
