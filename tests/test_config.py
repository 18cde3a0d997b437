"""Rules files: what loads, and every error worded as the reference words it, with path and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import config
from sidecar.errors import ConfigError
from sidecar.model import Unit
from sidecar.rules import Rules

FIXTURES = Path(__file__).parent / "config"

ERRORS = {
    "empty_domain.yaml": "domain: config file cannot have empty domain (add a top-level 'domain: NAME')",
    "empty_key.yaml": "descriptors[0]: descriptor has empty key (add 'key: NAME')",
    "duplicate_key.yaml": (
        "descriptors[1]: duplicate descriptor composite key 'test-domain.key1_value1' "
        "(merge the two descriptors)"
    ),
    "bad_limit_unit.yaml": (
        "descriptors[0].rate_limit.unit: invalid rate limit unit 'foo' "
        "(expected one of: second, minute, hour, day, week, month, year)"
    ),
    "unlimited_with_unit.yaml": (
        "descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited "
        "(remove 'unit' or 'unlimited')"
    ),
    "replaces_self.yaml": (
        "descriptors[0].rate_limit.replaces[0]: replaces should not contain name of same "
        "descriptor (name another rule's limit)"
    ),
    "replaces_empty.yaml": (
        "descriptors[0].rate_limit.replaces[0]: should not have an empty replaces entry "
        "(name another rule's limit)"
    ),
    "misspelled_key.yaml": (
        "descriptors[0]: config error, unknown key 'ratelimit' (did you mean 'rate_limit'?)"
    ),
    "misspelled_limit_key.yaml": (
        "descriptors[0].rate_limit: config error, unknown key 'requestsperunit' "
        "(did you mean 'requests_per_unit'?)"
    ),
    "nested_unknown_key.yaml": (
        "descriptors[0].descriptors[0]: config error, unknown key 'shadowmode' "
        "(did you mean 'shadow_mode'?)"
    ),
    "non_string_key.yaml": "descriptors[0]: config error, key is not of type string: 0.25 (quote it)",
    "non_map_list.yaml": (
        "descriptors[0]: config error, yaml file contains list of type other than map: a "
        "(each descriptor is a map with at least 'key')"
    ),
    "bad_yaml.yaml": (
        "error loading config file: yaml: line 3: expected the node content, but found '<stream end>'"
    ),
    "duplicate_yaml_key.yaml": (
        "error loading config file: yaml: line 5: found duplicate key 'rate_limit'"
    ),
    "share_threshold_without_wildcard.yaml": (
        "descriptors[0].share_threshold: share_threshold can only be used with wildcard values "
        "(containing '*'), but found key 'files_plain'"
    ),
    "bad_requests_per_unit.yaml": (
        "descriptors[0].rate_limit.requests_per_unit: requests_per_unit must be a whole number "
        "from 0 to 4294967295, got 'lots'"
    ),
    "bad_flag.yaml": "descriptors[0].shadow_mode: shadow_mode must be true or false, got 'sometimes'",
    "not_a_map.yaml": "config error, the file must be a map with 'domain' and 'descriptors'",
    # The extensions beyond the reference's format (issue 3).
    "both_rate_limit_and_rate_limits.yaml": (
        "descriptors[0]: rate_limit and rate_limits are mutually exclusive "
        "(put every window in rate_limits)"
    ),
    "empty_rate_limits.yaml": (
        "descriptors[0].rate_limits: rate_limits must be a non-empty list of windows"
    ),
    "misspelled_rate_limits.yaml": (
        "descriptors[0]: config error, unknown key 'ratelimits' (did you mean 'rate_limits'?)"
    ),
    "unknown_algorithm.yaml": (
        "descriptors[0].rate_limit.algorithm: unknown algorithm 'token_bucked' "
        "(did you mean 'token_bucket'?)"
    ),
    "burst_without_token_bucket.yaml": (
        "descriptors[0].rate_limit.burst: burst applies to token buckets "
        "(add 'algorithm: token_bucket')"
    ),
    "borrow_on_sliding_window.yaml": (
        "descriptors[0].rate_limit.borrow: borrow applies to fixed windows and token buckets, "
        "not sliding windows"
    ),
    "borrow_exceeds_limit.yaml": (
        "descriptors[0].rate_limit.borrow: borrow 300 exceeds requests_per_unit 100: the next "
        "window alone repays the debt (lower borrow, or use a token bucket)"
    ),
    "calendar_minute.yaml": (
        "descriptors[0].rate_limit.calendar: calendar windows are days, weeks, months or years "
        "(remove 'calendar')"
    ),
    "calendar_token_bucket.yaml": (
        "descriptors[0].rate_limit.calendar: calendar windows are fixed windows "
        "(remove 'algorithm')"
    ),
    "calendar_unit_multiplier.yaml": (
        "descriptors[0].rate_limit.unit_multiplier: calendar windows are one unit long "
        "(remove 'unit_multiplier')"
    ),
    "unknown_timezone.yaml": (
        "descriptors[0].rate_limit.timezone: unknown time zone 'Asia/Shangai' "
        "(did you mean 'Asia/Shanghai'?)"
    ),
    "timezone_without_calendar.yaml": (
        "descriptors[0].rate_limit.timezone: timezone applies to calendar windows "
        "(add 'calendar: true')"
    ),
    "bad_week_start.yaml": (
        "descriptors[0].rate_limit.week_start: week_start must be monday or sunday, got 'friday'"
    ),
    "week_start_not_week.yaml": (
        "descriptors[0].rate_limit.week_start: week_start applies to calendar weeks (unit: week)"
    ),
    "token_bucket_zero_rate.yaml": (
        "descriptors[0].rate_limit.requests_per_unit: a token bucket needs requests_per_unit "
        "of at least 1 (its refill rate)"
    ),
    "unlimited_in_rate_limits.yaml": (
        "descriptors[0].rate_limits[0].unlimited: unlimited belongs in rate_limit, not rate_limits"
    ),
    "bad_unit_multiplier.yaml": (
        "descriptors[0].rate_limit.unit_multiplier: unit_multiplier must be a whole number "
        "from 1 to 4294967295, got 0"
    ),
    # Grouped counters (frequency caps).
    "group_counters_nested.yaml": (
        "descriptors[0].descriptors[0].group_counters: group_counters applies to a first-level "
        "descriptor, but found it on 'ads.user.ad' (move it to the first-level descriptor whose "
        "values own the counters, like 'key: user')"
    ),
    "group_counters_with_value.yaml": (
        "descriptors[0].group_counters: group_counters applies to a key-only descriptor, but "
        "found key 'user_vip' (remove 'value', or group_counters)"
    ),
    # The only pair of IANA zones whose three-character codes collide.
    "group_counters_zone_collision.yaml": (
        "descriptors[0].descriptors[0].rate_limits[1].timezone: time zones 'Africa/Addis_Ababa' "
        "and 'America/Iqaluit' get the same counter code 'cdwz7' under group_counters (use one "
        "zone for both, or drop group_counters from this tree)"
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_config_error_names_file_path_and_fix(name: str) -> None:
    """Each broken fixture fails to load with the whole expected message, prefixed by its file."""
    path = FIXTURES / name
    with pytest.raises(ConfigError) as info:
        config.load([path])
    assert str(info.value) == f"{path}: {ERRORS[name]}"


def test_every_error_fixture_is_asserted() -> None:
    """No fixture file is left without an asserted message."""
    names = {p.name for p in FIXTURES.glob("*.yaml")} - {
        "duplicate_domain_a.yaml",
        "duplicate_domain_b.yaml",
    }
    assert names == set(ERRORS)


def test_duplicate_domain_across_files_names_both_files() -> None:
    """Two files may not declare one domain; the error names the second and points at the first."""
    first, second = FIXTURES / "duplicate_domain_a.yaml", FIXTURES / "duplicate_domain_b.yaml"
    with pytest.raises(ConfigError) as info:
        config.load([first, second])
    assert str(info.value) == (
        f"{second}: domain: duplicate domain 'test-domain' in config file "
        f"(already declared in {first})"
    )


def test_missing_path_is_a_config_error() -> None:
    """A path that does not exist is reported, not ignored."""
    with pytest.raises(ConfigError, match="no such file or directory"):
        config.load(["/nonexistent/rules.yaml"])


def test_directory_loads_every_yaml_file_one_domain_each(tmp_path: Path) -> None:
    """A directory contributes each *.yaml / *.yml file as one domain; other files are ignored."""
    (tmp_path / "a.yaml").write_text("domain: a\n")
    (tmp_path / "b.yml").write_text("domain: b\n")
    (tmp_path / "notes.txt").write_text("not rules")
    (tmp_path / ".hidden.yaml").write_text("domain: hidden\n")
    rules = config.load([tmp_path])
    assert sorted(rules.domains) == ["a", "b"]


def test_full_rule_parses_every_reference_field() -> None:
    """Every field of the reference format is read: names, replaces, flags, units in any case."""
    domain = config.parse(
        """
domain: d
descriptors:
  - key: k
    value: 200
    shadow_mode: true
    quota_mode: true
    detailed_metric: true
    metadata: {owner: team-a}
    rate_limit:
      unit: MINUTE
      requests_per_unit: 7
      name: seven
      replaces: [{name: other}]
  - key: u
    rate_limit: {unlimited: true}
""",
        "rules.yaml",
    )
    node = domain.root.exact[("k", "200")]
    assert node.limit is not None
    assert node.limit.unit is Unit.MINUTE
    assert node.limit.requests_per_unit == 7
    assert node.limit.name == "seven"
    assert node.limit.replaces == ("other",)
    assert node.limit.shadow_mode and node.limit.quota_mode
    assert node.detailed_metric
    assert node.metadata == {"owner": "team-a"}
    unlimited = domain.root.keys["u"].limit
    assert unlimited is not None and unlimited.unlimited


def test_dump_prints_one_reference_line_per_rule() -> None:
    """`/rlconfig` shows one line per rule in the reference's format."""
    rules = Rules(
        {
            "d": config.parse(
                """
domain: d
descriptors:
  - key: k
    value: v
    rate_limit: {unit: minute, requests_per_unit: 20}
    descriptors:
      - key: s
        shadow_mode: true
        rate_limit: {unit: second, requests_per_unit: 1, name: per-s}
  - key: u
    rate_limit: {unlimited: true}
""",
                "rules.yaml",
            )
        }
    )
    assert rules.dump() == [
        "d.k_v: unit=MINUTE requests_per_unit=20, shadow_mode: false, quota_mode: false",
        "d.k_v.s: unit=SECOND requests_per_unit=1, shadow_mode: true, quota_mode: false, name: per-s",
        "d.u: unlimited, shadow_mode: false, quota_mode: false",
    ]


def test_empty_file_is_an_empty_domain_error() -> None:
    """An empty file has no domain, and says so."""
    with pytest.raises(ConfigError, match="cannot have empty domain"):
        config.parse("", "empty.yaml")


def test_extensions_show_in_rlconfig() -> None:
    """`/rlconfig` and `check` show the new fields; reference-format rules print as before."""
    rules = Rules(
        {
            "d": config.parse(
                """
domain: d
descriptors:
  - key: user
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 5, calendar: true, timezone: Asia/Shanghai}
          - {unit: week, requests_per_unit: 9, calendar: true, week_start: sunday}
  - key: api_key
    rate_limit:
      algorithm: token_bucket
      unit: second
      requests_per_unit: 10
      burst: 20
      borrow: 5
  - key: ip
    rate_limit: {algorithm: sliding_window, unit: minute, unit_multiplier: 5, requests_per_unit: 100}
  - key: app
    rate_limit: {unit: hour, requests_per_unit: 1000, borrow: 300}
""",
                "rules.yaml",
            )
        }
    )
    assert rules.dump() == [
        "d.user.ad: unit=DAY requests_per_unit=5 calendar timezone=Asia/Shanghai; "
        "unit=WEEK requests_per_unit=9 calendar timezone=UTC week_start=sunday, "
        "shadow_mode: false, quota_mode: false",
        "d.api_key: unit=SECOND requests_per_unit=10 algorithm=token_bucket burst=20 borrow=5, "
        "shadow_mode: false, quota_mode: false",
        "d.ip: unit=MINUTE requests_per_unit=100 algorithm=sliding_window unit_multiplier=5, "
        "shadow_mode: false, quota_mode: false",
        "d.app: unit=HOUR requests_per_unit=1000 borrow=300, shadow_mode: false, quota_mode: false",
    ]
