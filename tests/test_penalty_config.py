"""A rule's `penalty` as the rules' YAML says it (`sidecar.core.penalty_rules`): what loads, and one
fixture per error (tests/config/penalty/*.yaml), each asserted by its whole message, naming the
file, the path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.core import config
from sidecar.core.matching import match
from sidecar.core.rules import describe
from sidecar.errors import ConfigError
from sidecar.model import Entry, Penalty

FIXTURES = Path(__file__).parent / "config" / "penalty"

ERRORS = {
    "zero_block.yaml": (
        "descriptors[0].penalty.block: block must be longer than zero, got '0s' "
        "(use a duration like 10m)"
    ),
    "negative_block.yaml": (
        "descriptors[0].penalty.block: block must be longer than zero, got -600 "
        "(use a duration like 10m)"
    ),
    "bad_duration.yaml": (
        "descriptors[0].penalty.block: block must be a duration like 10m, 90s, 24h or 7d "
        "(units ms, s, m, h, d, w), got 'ten minutes'"
    ),
    "too_long.yaml": (
        "descriptors[0].penalty.max: max must be at most a year, got '400d' (use 365d or less)"
    ),
    "escalate_below_one.yaml": (
        "descriptors[0].penalty.escalate: escalate must be between 1 (every block as long as "
        "the first) and 1000, got 0.5"
    ),
    "max_below_block.yaml": (
        "descriptors[0].penalty.max: max (5m) is shorter than block (10m): the longest block is "
        "at least the first (make max at least block)"
    ),
    "escalate_without_max.yaml": (
        "descriptors[0].penalty: escalate 2 needs a max longer than block (10m) for blocks to "
        "grow (add 'max: 24h', or remove 'escalate')"
    ),
    "unlimited.yaml": (
        "descriptors[0].penalty: penalty applies to a rate limit, but 'api.client' has an "
        "unlimited one (remove 'penalty')"
    ),
    "without_limit.yaml": (
        "descriptors[0].penalty: penalty applies to a rate limit, but 'api.client' has none "
        "(remove 'penalty')"
    ),
    "approximate.yaml": (
        "descriptors[0].penalty: penalty needs the backend to judge every request of "
        "'api.client', but it is approximate, decided on this sidecar's own view "
        "(remove 'penalty' or 'approximate')"
    ),
    "leased.yaml": (
        "descriptors[0].penalty: penalty needs the backend to judge every request of "
        "'api.client', but it is leased, decided on this sidecar's own view "
        "(remove 'penalty' or 'leased')"
    ),
    "unknown_key.yaml": (
        "descriptors[0].penalty.ban: unknown key 'ban' in penalty "
        "(expected block, escalate, max, forget_after)"
    ),
    "not_a_map.yaml": (
        "descriptors[0].penalty: penalty must be a map like "
        "{block: 10m, escalate: 2, max: 24h, forget_after: 7d}"
    ),
    "without_block.yaml": (
        "descriptors[0].penalty: penalty needs a block, the first block's length (add 'block: 10m')"
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_a_penalty_error_names_file_path_and_fix(name: str) -> None:
    """Each broken fixture fails to load with the whole expected message, prefixed by its file."""
    path = FIXTURES / name
    with pytest.raises(ConfigError) as info:
        config.load([path])
    assert str(info.value) == f"{path}: {ERRORS[name]}"


def test_every_penalty_fixture_is_asserted() -> None:
    """No fixture file is left without an asserted message."""
    assert {p.name for p in FIXTURES.glob("*.yaml")} == set(ERRORS)


def test_a_penalty_loads_with_its_defaults() -> None:
    """`block` alone is a block of that length every time, strikes forgotten after a day;
    the issue's example reads as written, and `/rlconfig` shows it; `algorithm: penalty` is no
    window a rule can name."""
    domain = config.parse(
        """\
domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 1}
    penalty: {block: 90s}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1}
    penalty: {block: 10m, escalate: 2, max: 24h, forget_after: 7d}
""",
        "rules.yaml",
    )
    found = [match(domain, (Entry(key, "x"),)) for key in "ab"]
    penalties = [f.limit.penalty if f is not None else None for f in found]
    assert penalties == [
        Penalty(90_000, 1.0, 90_000, 86_400_000),
        Penalty(600_000, 2.0, 86_400_000, 7 * 86_400_000),
    ]
    assert found[1] is not None
    assert describe(found[1].limit) == (
        "d.b: unit=MINUTE requests_per_unit=1, shadow_mode: false, quota_mode: false, "
        "penalty: block=600000ms escalate=2 max=86400000ms forget_after=604800000ms"
    )
    with pytest.raises(ConfigError, match="algorithm"):
        config.parse(
            "domain: d\ndescriptors:\n  - key: a\n"
            "    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: penalty}\n",
            "rules.yaml",
        )
