"""A rule's `penalty`, read from the rules' YAML (`sidecar.core.config` calls `read` for a
descriptor that has one): what it may say, and the error, naming file, path and fix, for what
it may not. What a penalty does is `sidecar.algorithms.penalty`'s.

    penalty: {block: 10m, escalate: 2, max: 24h, forget_after: 7d}

`block` is required; `escalate` is 1 unless said (every block as long as the first), `max` is
`block` unless said (so an `escalate` above 1 needs a `max` above `block`), and `forget_after`
is a day unless said. A duration is a whole number and a unit (`ms`, `s`, `m`, `h`, `d`, `w`),
or a whole number of seconds.

A penalty needs a rate limit to trip (not `unlimited`), and the backend's answer on every
request: an `approximate` or `leased` rule, decided on a local view or a lease, cannot have one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

from sidecar.errors import ConfigError
from sidecar.model import Limit, Penalty

_KEYS: Final = ("block", "escalate", "max", "forget_after")
_DURATION: Final = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_UNIT_MS["w"] = 7 * _UNIT_MS["d"]
#: The longest duration a penalty takes (block, max or forget_after): a year.
MAX_DURATION_MS: Final = 365 * _UNIT_MS["d"]
#: The largest `escalate`: past it the second block is already a year for any block of a
#: few seconds, and products stay exact in a double (both renderings must agree).
MAX_ESCALATE: Final = 1_000
DEFAULT_FORGET_AFTER_MS: Final = _UNIT_MS["d"]


def read(
    raw: object,
    source: str,
    path: str,
    rule_key: str,
    limit: Limit | None,
    approximate: bool,
    leased: bool,
) -> Limit:
    """`limit`, the limit of the rule `rule_key`, with the penalty `raw` (the value of
    `penalty` at `path`); raises ConfigError naming the file, the path and the fix."""

    def error(where: str, message: str) -> ConfigError:
        return ConfigError(source, where, message)

    if limit is None or limit.unlimited:
        raise error(
            path,
            f"penalty applies to a rate limit, but '{rule_key}' has "
            f"{'an unlimited one' if limit is not None else 'none'} (remove 'penalty')",
        )
    for flag, used in (("approximate", approximate), ("leased", leased)):
        if used:
            raise error(
                path,
                f"penalty needs the backend to judge every request of '{rule_key}', but it is "
                f"{flag}, decided on this sidecar's own view (remove 'penalty' or '{flag}')",
            )
    if not isinstance(raw, dict):
        raise error(
            path, "penalty must be a map like {block: 10m, escalate: 2, max: 24h, forget_after: 7d}"
        )
    for key in raw:
        if key not in _KEYS:
            raise error(
                f"{path}.{key}",
                f"unknown key {key!r} in penalty (expected {', '.join(_KEYS)})",
            )
    if "block" not in raw:
        raise error(path, "penalty needs a block, the first block's length (add 'block: 10m')")
    block = _duration(raw["block"], f"{path}.block", error)
    escalate = _escalate(raw.get("escalate", 1), f"{path}.escalate", error)
    most = _duration(raw["max"], f"{path}.max", error) if "max" in raw else block
    if most < block:
        raise error(
            f"{path}.max",
            f"max ({raw['max']}) is shorter than block ({raw['block']}): the longest block is at "
            "least the first (make max at least block)",
        )
    if escalate > 1 and most == block:
        raise error(
            f"{path}.max" if "max" in raw else path,
            f"escalate {raw['escalate']} needs a max longer than block ({raw['block']}) for "
            "blocks to grow (add 'max: 24h', or remove 'escalate')",
        )
    forget = (
        _duration(raw["forget_after"], f"{path}.forget_after", error)
        if "forget_after" in raw
        else DEFAULT_FORGET_AFTER_MS
    )
    return dataclasses.replace(limit, penalty=Penalty(block, escalate, most, forget))


def _duration(raw: Any, path: str, error: Any) -> int:
    """A positive duration at most MAX_DURATION_MS, in ms: `10m`, `90s`, `7d` or seconds."""
    ms: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        ms = raw * 1_000
    elif isinstance(raw, str):
        found = _DURATION.fullmatch(raw.strip())
        if found is not None:
            ms = int(found.group(1)) * _UNIT_MS[found.group(2)]
    name = path.rpartition(".")[2]
    if ms is None:
        raise error(
            path,
            f"{name} must be a duration like 10m, 90s, 24h or 7d (units ms, s, m, h, d, w), "
            f"got {raw!r}",
        )
    if ms <= 0:
        raise error(path, f"{name} must be longer than zero, got {raw!r} (use a duration like 10m)")
    if ms > MAX_DURATION_MS:
        raise error(path, f"{name} must be at most a year, got {raw!r} (use 365d or less)")
    return ms


def _escalate(raw: Any, path: str, error: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise error(path, f"escalate must be a number like 2, got {raw!r}")
    if not 1 <= raw <= MAX_ESCALATE:
        raise error(
            path,
            f"escalate must be between 1 (every block as long as the first) and {MAX_ESCALATE}, "
            f"got {raw!r}",
        )
    return float(raw)
