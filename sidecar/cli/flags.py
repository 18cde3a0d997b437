"""The flags of the commands: each may also come from the environment as `RLS_<FLAG>`, and the
converters that check their values.

A `Flag` is one flag declared once: its option, help, type, default, `RLS_` variable (its
name's), and for `serve` the `Options` field it fills and whether `serve --workers N` gives it to
its workers (`sidecar.cli.serve_flags` is that table). `Flags` adds a command's flags to its
parser and remembers how to read each from its variable; `resolve` fills what the command line
left out, from the variable, else the default. A flag on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

PROG = "ratelimit-sidecar"
ENV_PREFIX = "RLS_"


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Flag:
    """One flag, declared once; `Flags.declare` turns it into an argparse argument, its --help
    line (help, then "required", "default: ..." and its variable) and its `RLS_` variable.

    `action`, `type`, `choices`, `metavar` and `default` are argparse's: `action` is None (one
    value), "store_true" (a switch, "true" or "false" in its variable) or "append" (repeated;
    in its variable, values separated by any of `separators`).
    """

    option: str
    help: str
    default: Any = None
    action: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    separators: str = ""
    required: bool = False
    #: Set by the program, never by hand: no --help line, no `RLS_` variable.
    hidden: bool = False
    #: The `Options` field the value fills (`sidecar.cli.serve.serve_options`), through
    #: `to_option`; a field several flags fill (tls, statsd, tracing, xds) is made from them
    #: all by its builder there. None: `run` reads it (the loop, logs, workers).
    field: str | None = None
    to_option: Callable[[Any], Any] = _same
    #: Whether `serve --workers N` passes it on to its workers, written by `to_text`.
    workers: bool = True
    to_text: Callable[[Any], str] = str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def variable(self) -> str:
        return ENV_PREFIX + self.dest.upper()


@dataclass(frozen=True)
class EnvFlag:
    """A flag that may also come from RLS_<DEST>, with the default applied when neither is set."""

    dest: str
    option: str
    default: Any
    from_env: Callable[[str], Any]
    required: bool


class Flags:
    """Adds flags to one subcommand and remembers how to read each from the environment."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.flags: list[EnvFlag] = []

    def add(
        self,
        option: str,
        help: str,
        *,
        default: Any = None,
        required: bool = False,
        separators: str = "",
        **kwargs: Any,
    ) -> None:
        """Declare `Flag(option, help, ...)` (the keywords are its fields)."""
        self.declare(
            Flag(option, help, default=default, required=required, separators=separators, **kwargs)
        )

    def declare(self, flag: Flag) -> None:
        """Add `flag` to the parser, and (unless hidden) to the flags read from `RLS_` variables."""
        given: dict[str, Any] = {
            name: value
            for name, value in (
                ("action", flag.action),
                ("type", flag.type),
                ("choices", flag.choices),
                ("metavar", flag.metavar),
            )
            if value is not None
        }
        if flag.hidden:
            self.parser.add_argument(flag.option, help=argparse.SUPPRESS, **given)
            return
        shown = f"default: {flag.default}; " if flag.default not in (None, False) else ""
        where = "required; " if flag.required else ""
        action = self.parser.add_argument(
            flag.option,
            default=None,
            help=f"{flag.help} ({where}{shown}env {flag.variable})",
            **given,
        )
        reader = env_reader(action, flag.action, flag.separators)
        self.flags.append(EnvFlag(flag.dest, flag.option, flag.default, reader, flag.required))

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        """Fill every flag the command line left out from its variable, else its default."""
        for flag in self.flags:
            if getattr(args, flag.dest) is not None:
                continue
            var = ENV_PREFIX + flag.dest.upper()
            raw = environ.get(var, "")
            value = flag.default
            if raw:
                try:
                    value = flag.from_env(raw)
                except (ValueError, argparse.ArgumentTypeError) as exc:
                    fail(self.parser, f"{var}={raw!r}: {exc}")
            if value is None and flag.required:
                fail(self.parser, f"the following arguments are required: {flag.option} (or {var})")
            setattr(args, flag.dest, value)

    def variables(self) -> set[str]:
        """The RLS_* variables these flags read."""
        return {ENV_PREFIX + flag.dest.upper() for flag in self.flags}


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Stop on a setting that cannot be used: one line under the program's name, exit status 2.
    (argparse's error prints the usage first, dozens of lines for `serve`, which say nothing
    about a variable.)"""
    parser.exit(2, f"{parser.prog}: {message}\n")


def unknown(environ: Mapping[str, str], known: Iterable[str]) -> list[tuple[str, str | None]]:
    """(name, the likely intended one or None) for each RLS_* variable in `environ` that no
    flag reads."""
    names = sorted(known)
    found = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
            found.append((name, close[0] if close else None))
    return found


def env_reader(action: argparse.Action, kind: str | None, separators: str) -> Callable[[str], Any]:
    """How to read an environment value for `action`: its type, its choices, one value or many."""
    convert: Callable[[str], Any] = action.type if callable(action.type) else str

    def one(raw: str) -> Any:
        value = convert(raw.strip())
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ValueError(f"invalid choice {value!r} (choose from {choices})")
        return value

    if kind == "store_true":
        return boolean
    if kind == "append":
        pattern = f"[{re.escape(separators)}]"
        return lambda raw: [one(part) for part in re.split(pattern, raw) if part.strip()]
    return one


def boolean(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def grpc_address(text: str) -> str:
    from sidecar.runner.app import InvalidOption, check_grpc_address

    try:
        check_grpc_address(text)
    except InvalidOption as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def socket_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"expected octal permission bits like 660, got {text!r}")
    return mode


def address(text: str) -> str:
    from sidecar.runner.app import InvalidOption, split_address

    try:
        split_address(text)
    except InvalidOption as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def log_level(text: str) -> str:
    level = text.strip().lower()
    return "warning" if level == "warn" else level


def count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def count_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    return count(1)(text)


def header_name(text: str) -> str:
    from sidecar.rls.extras import check_header_name

    try:
        return check_header_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def at_least_a_second(text: str) -> float:
    value = seconds(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text}")
    return value
