"""Rules files: what loads, and every error worded as the reference words it, with path and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.core import config
from sidecar.core.counters import tag
from sidecar.core.matching import match
from sidecar.core.rules import Rules
from sidecar.errors import ConfigError
from sidecar.model import Entry, Unit, Window

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
    "joined_key_collision.yaml": (
        "descriptors[1]: duplicate descriptor composite key 'test-domain.a_b' "
        "(merge the two descriptors)"
    ),
    "empty_value_beside_key.yaml": (
        "descriptors[1]: duplicate descriptor composite key 'test-domain.k' "
        "(merge the two descriptors)"
    ),
    "float_value.yaml": (
        "descriptors[0].value: error checking config: 1.50 is a number with a fraction, which "
        "envoyproxy/ratelimit refuses (quote it: '1.50')"
    ),
    "ignored_key_unknown_inside.yaml": (
        "descriptors[0].rate_limit.descriptors[0]: config error, unknown key 'ratelimit'"
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
    "group_counters_not_a_layout.yaml": (
        "descriptors[0].group_counters: group_counters must be true, false or packed, got 'tight'"
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
    # Local aggregation (`approximate`): plain fixed windows of a limit only.
    "approximate_token_bucket.yaml": (
        "descriptors[0].approximate: approximate needs fixed windows, but rate_limit has "
        "algorithm token_bucket: only a fixed window's count is a sum that a local view can add "
        "to (remove 'approximate', or use algorithm: fixed_window)"
    ),
    "approximate_sliding_window.yaml": (
        "descriptors[0].approximate: approximate needs fixed windows, but rate_limits[1] has "
        "algorithm sliding_window: only a fixed window's count is a sum that a local view can "
        "add to (remove 'approximate', or use algorithm: fixed_window)"
    ),
    "approximate_borrow.yaml": (
        "descriptors[0].approximate: approximate needs windows that do not borrow, but "
        "rate_limit has borrow: 300, whose capacity depends on the previous window's count "
        "(remove 'approximate' or 'borrow')"
    ),
    "approximate_without_limit.yaml": (
        "descriptors[0].approximate: approximate applies to a rate limit, but 'api.client' has "
        "none (remove 'approximate')"
    ),
    "approximate_unlimited.yaml": (
        "descriptors[0].approximate: approximate applies to a rate limit, but "
        "'api.client_internal' has an unlimited one (remove 'approximate')"
    ),
    "approximate_not_a_flag.yaml": (
        "descriptors[0].approximate: approximate must be true or false, got 'yes'"
    ),
    # Leases (`leased`): fixed windows that do not borrow, each counter at its own key.
    "leased_sliding_window.yaml": (
        "descriptors[0].leased: leased needs fixed windows or token buckets, but rate_limits[1] "
        "has algorithm sliding_window, whose budget depends on the previous window's count "
        "(remove 'leased', or use algorithm: fixed_window)"
    ),
    "leased_borrow.yaml": (
        "descriptors[0].leased: leased needs windows that do not borrow, but rate_limit has "
        "borrow: 300, which admits past the budget a lease hands out (remove 'leased' or "
        "'borrow')"
    ),
    "leased_unlimited.yaml": (
        "descriptors[0].leased: leased applies to a rate limit, but 'api.client_internal' has "
        "an unlimited one (remove 'leased')"
    ),
    "leased_and_approximate.yaml": (
        "descriptors[0].leased: leased and approximate are two ways to decide 'api.client' "
        "locally; a window takes one (remove one of them)"
    ),
    "leased_group_counters.yaml": (
        "descriptors[0].descriptors[0].leased: leased needs counters at their own keys, but "
        "'ads.user.ad' is under group_counters, whose counters share a hash (remove 'leased' or "
        "'group_counters')"
    ),
    "leased_not_a_flag.yaml": "descriptors[0].leased: leased must be true or false, got 'yes'",
    "pace_unlimited.yaml": (
        "descriptors[0].pace: pace applies to a rate limit, but 'api.client_internal' has "
        "an unlimited one (remove 'pace')"
    ),
    "pace_not_a_flag.yaml": "descriptors[0].pace: pace must be true or false, got 'yes'",
    "usage_not_a_list.yaml": "usage: usage must be a list of maps like {by: [app]} (or remove 'usage')",
    "usage_not_a_map.yaml": "usage[0]: a usage dimension is a map like {by: [app]}, got 'app'",
    "usage_empty_by.yaml": "usage[0].by: by must be a list of distinct descriptor keys, like [app, interface]",
    "usage_repeated_by.yaml": "usage[0].by: by must be a list of distinct descriptor keys, like [app, interface]",
    "usage_unknown_key.yaml": "usage[0]: unknown key 'per' in a usage dimension (allowed: by, unique, timezone, retention_days)",
    "usage_unique_in_by.yaml": "usage[0].unique: 'app' is in by: count the distinct values of another key",
    "usage_unknown_timezone.yaml": "usage[0].timezone: unknown time zone 'Mars/Base' (use an IANA name like 'Asia/Shanghai')",
    "usage_zero_retention.yaml": "usage[0].retention_days: retention_days must be a whole number from 1 to 366, got 0",
    "usage_days_differ.yaml": "usage[1]: every usage dimension of a domain counts by the same days: give all the same timezone and retention_days",
    "usage_twice.yaml": "usage[1]: usage dimension by [app] declared twice",
    # Windows anchored on events (frequency caps): cooldowns, first-event windows, lifetimes.
    "cooldown_without_interval.yaml": (
        "descriptors[0].descriptors[0].rate_limit: a cooldown window needs an interval: give "
        "unit and unit_multiplier, as in {algorithm: cooldown, unit: minute, unit_multiplier: 10}"
    ),
    "cooldown_requests_per_unit.yaml": (
        "descriptors[0].descriptors[0].rate_limit.requests_per_unit: a cooldown admits one "
        "event per interval (remove requests_per_unit, or use algorithm: first_event for "
        "several per window)"
    ),
    "lifetime_without_end.yaml": (
        "descriptors[0].descriptors[0].rate_limit: a lifetime cap needs an end: give ends (the "
        "flight's end), as in {algorithm: lifetime, requests_per_unit: 3, ends: "
        "2026-12-31T00:00:00Z}, or a TTL from the first event with unit and unit_multiplier"
    ),
    "lifetime_bad_ends.yaml": (
        "descriptors[0].descriptors[0].rate_limit.ends: ends must be a date and time, like "
        "2026-12-31T00:00:00Z, got 'soon'"
    ),
    "ends_without_lifetime.yaml": (
        "descriptors[0].descriptors[0].rate_limit.ends: ends applies to lifetime caps (add "
        "'algorithm: lifetime')"
    ),
    # Caps counted across a person's identifiers (frequency caps).
    "identifiers_nested.yaml": (
        "descriptors[0].descriptors[0].identifiers: identifiers applies to a first-level, "
        "key-only descriptor (like 'key: person' with 'key: ad' below it)"
    ),
    "identifiers_own_key.yaml": (
        "descriptors[0].identifiers: identifiers must be a list of 1 to 8 distinct identifier "
        "kinds other than 'person', like [user, device, cookie]"
    ),
    "identifiers_cooldown.yaml": (
        "descriptors[0].descriptors[0].rate_limits[1].algorithm: caps under 'ads.person' are "
        "counted across identifiers, summed from fixed windows only, but found cooldown (count "
        "it per identifier, under the identifier's own key, or use a fixed window)"
    ),
    "first_event_borrow.yaml": (
        "descriptors[0].descriptors[0].rate_limit.borrow: borrow does not apply to first_event "
        "(remove it)"
    ),
    # Concurrency limits (requests in flight, closed by refunds or their lease).
    "concurrency_with_unit.yaml": (
        "descriptors[0].rate_limit.unit: unit does not apply to concurrency, which counts "
        "requests in flight, not per unit of time (remove it; 'lease' says how long a start is "
        "kept without its refund)"
    ),
    "concurrency_without_lease.yaml": (
        "descriptors[0].rate_limit.lease: a concurrency limit needs a lease from 1s to 24h, how "
        "long a start counts when no refund closes it (set it above your longest request, as in "
        "{algorithm: concurrency, requests_per_unit: 10, lease: 30s}), got none"
    ),
    "request_id_without_concurrency.yaml": (
        "descriptors[0].rate_limit.request_id: request_id applies to concurrency limits, whose "
        "refunds close the start of their request (add 'algorithm: concurrency', or remove it)"
    ),
    "concurrency_request_id_not_a_key.yaml": (
        "descriptors[0].rate_limit.request_id: request_id names the descriptor entry that "
        "carries the request's id (the descriptor_key of Envoy's request_headers action on "
        "x-request-id), as in request_id: x_request_id, got 7"
    ),
    "concurrency_in_rate_limits.yaml": (
        "descriptors[0].rate_limits[1].algorithm: a concurrency limit stands alone: put it in "
        "rate_limit (every window of a descriptor gets its refunds, so a window beside it would "
        "count what is in flight too)"
    ),
    "concurrency_approximate.yaml": (
        "descriptors[0].approximate: approximate needs fixed windows, but rate_limit has "
        "algorithm concurrency, whose count goes down with refunds, which a local view that only "
        "adds cannot follow (remove 'approximate')"
    ),
    "concurrency_leased.yaml": (
        "descriptors[0].leased: leased needs fixed windows or token buckets, but rate_limit has "
        "algorithm concurrency, whose places come back with refunds that a lease cannot see "
        "(remove 'leased')"
    ),
    "concurrency_group_counters.yaml": (
        "descriptors[0].descriptors[0].rate_limit.algorithm: concurrency needs its starts at "
        "their own keys, but this descriptor is under group_counters, whose counters share a "
        "hash (remove 'group_counters', or count what is in flight in another tree)"
    ),
    "concurrency_too_many.yaml": (
        "descriptors[0].rate_limit.requests_per_unit: a concurrency limit keeps each start in "
        "flight, so it admits at most 10000 at once, got 1000000"
    ),
    "lease_without_concurrency.yaml": (
        "descriptors[0].rate_limit.lease: lease applies to concurrency limits (add 'algorithm: "
        "concurrency')"
    ),
}


#: Files the reference loads, likely by mistake: loaded as it loads them, with these warnings.
WARNINGS = {
    "duplicate_yaml_key.yaml": [
        "yaml: line 5: key 'rate_limit' is repeated in one map: the last one counts, as "
        "envoyproxy/ratelimit reads it (remove the others)"
    ],
    "limit_fields_beside_rate_limit.yaml": [
        "descriptors[0]: key 'unit' is ignored in a descriptor, as envoyproxy/ratelimit ignores "
        "it (it belongs in rate_limit: move it there, or remove it)",
        "descriptors[0]: key 'requests_per_unit' is ignored in a descriptor, as "
        "envoyproxy/ratelimit ignores it (it belongs in rate_limit: move it there, or remove it)",
    ],
    "empty_rate_limit.yaml": [
        "descriptors[0].rate_limit: rate_limit is empty, so this descriptor has no limit, as "
        "envoyproxy/ratelimit reads it (give it unit and requests_per_unit, or remove it)"
    ],
    "top_level_name.yaml": [
        "key 'name' is ignored at the top level, as envoyproxy/ratelimit ignores it (it belongs "
        "in rate_limit or a replaces entry: move it there, or remove it)"
    ],
    "shadow_mode_in_rate_limit.yaml": [
        "descriptors[0].rate_limit: key 'shadow_mode' is ignored in rate_limit, as "
        "envoyproxy/ratelimit ignores it (it belongs in a descriptor: move it there, or remove it)"
    ],
    "second_document.yaml": [
        "yaml: a second document is ignored, as envoyproxy/ratelimit reads only the first "
        "(one domain per file: move it to a file of its own)"
    ],
    "star_in_key.yaml": [
        "descriptors[0].key: '*' in key 'user*' is the character itself here; "
        "envoyproxy/ratelimit matches it as a wildcard over the joined 'key_value' (rename the "
        "key, or put the pattern in 'value')"
    ],
}


@pytest.mark.parametrize("name", sorted(WARNINGS))
def test_likely_mistake_loads_as_the_reference_loads_it_with_a_warning(name: str) -> None:
    """A file the reference loads but that is likely a mistake loads, with each warning naming
    file, path and fix."""
    path = FIXTURES / name
    rules = config.load([path])
    assert [str(w) for w in rules.warnings()] == [f"{path}: {w}" for w in WARNINGS[name]]


def test_limit_fields_beside_rate_limit_give_no_limit() -> None:
    """`unit` and `requests_per_unit` beside `rate_limit` do nothing, as in the reference: the
    descriptor is whitelisted, not limited."""
    domain = config.load([FIXTURES / "limit_fields_beside_rate_limit.yaml"]).domains["test-domain"]
    assert domain.root.keys["key1"].limit is None
    assert not config.load([FIXTURES / "empty_rate_limit.yaml"]).dump()


def test_repeated_key_keeps_the_last_and_a_repeated_rate_limit_keeps_earlier_fields() -> None:
    """A key repeated in one map keeps its last value; a repeated `rate_limit` keeps the fields
    only an earlier one sets (go-yaml decodes both into one struct), and so does `metadata`;
    a key overriding a `<<` merge is no repeat."""
    domain = config.parse(
        """
domain: d
descriptors:
  - key: k
    key: k2
    rate_limit: {unit: minute, requests_per_unit: 5, name: five, bogus: 1}
    rate_limit: {unit: hour}
    metadata: {a: 1, b: 2}
    metadata: {b: 3}
  - key: x
    rate_limit: &base {unit: second, requests_per_unit: 1}
  - key: m
    rate_limit: {<<: *base, unit: day}
""",
        "rules.yaml",
    )
    node = domain.root.keys["k2"]
    assert "k" not in domain.root.keys
    assert node.limit is not None
    assert (node.limit.unit, node.limit.requests_per_unit, node.limit.name) == (
        Unit.HOUR,
        5,
        "five",
    )
    assert node.metadata == {"a": 1, "b": 3}
    merged = domain.root.keys["m"].limit
    assert merged is not None and (merged.unit, merged.requests_per_unit) == (Unit.DAY, 1)
    assert [w.message.split(":")[1] for w in domain.warnings] == [" line 5", " line 7", " line 9"]


def test_scalars_are_read_as_written() -> None:
    """A number, boolean or date where text belongs is the text as written (`010`, `on`), as
    go-yaml reads it into a string; `~` flags and counts are false and 0; `y` is a true flag, as
    go-yaml reads it; an empty value is a key-only descriptor, as the reference reads it."""
    domain = config.parse(
        """
domain: 2024-01-01
descriptors:
  - key: 010
    value: on
    shadow_mode: ~
    rate_limit: {unit: minute, requests_per_unit: ~, name: 0x1F}
  - key: ev
    value: ""
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: n
    value: y
    quota_mode: y
""",
        "rules.yaml",
    )
    assert domain.name == "2024-01-01"
    node = domain.root.exact[("010", "on")]
    assert node.limit is not None
    assert (node.limit.requests_per_unit, node.limit.name, node.limit.shadow_mode) == (
        0,
        "0x1F",
        False,
    )
    assert domain.root.keys["ev"].value is None
    assert domain.root.exact[("n", "y")].limit is None
    assert match(domain, (Entry("ev", "a"),)) is not None
    assert not domain.warnings


def test_merge_domain_config_adds_descriptors_and_refuses_one_declared_twice() -> None:
    """With merge (MERGE_DOMAIN_CONFIG), a domain declared again adds its descriptors; one in
    both files is refused, naming the second file and the first."""
    first = config.parse(
        "domain: d\ndescriptors: [{key: a, rate_limit: {unit: second}}]\n", "1.yaml"
    )
    second = config.parse(
        "domain: d\ndescriptors: [{key: b, value: '*', rate_limit: {unit: hour}}]\n", "2.yaml"
    )
    again = config.parse("domain: d\ndescriptors: [{key: b, value: 'x'}, {key: a}]\n", "3.yaml")
    rules = config.gather([first, second], merge=True)
    domain = rules.domains["d"]
    assert domain.source == "1.yaml, 2.yaml"
    assert [n.label for n in domain.root.nodes()] == ["a", "b_*"]
    assert match(domain, (Entry("b", "anything"),)) is not None
    with pytest.raises(ConfigError) as info:
        config.gather([first, second, again], merge=True)
    assert str(info.value) == (
        "3.yaml: descriptors[1]: duplicate descriptor composite key 'd.a' "
        "(already declared in 1.yaml, 2.yaml; merge the two descriptors)"
    )
    with pytest.raises(ConfigError, match="duplicate domain 'd'"):
        config.gather([first, second])


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
    assert names == set(ERRORS) | set(WARNINGS)


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


def test_approximate_marks_every_window_of_its_limit() -> None:
    """`approximate: true` on a descriptor makes each window of its limit approximate (the Hit
    carries the window), is shown by `/rlconfig`, and leaves the counters' keys as they were,
    so approximate and exact sidecars share one counter."""
    domain = config.parse(
        """
domain: d
descriptors:
  - key: client
    approximate: true
    rate_limits:
      - {unit: second, requests_per_unit: 100}
      - {unit: day, requests_per_unit: 9000, calendar: true}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 100}
""",
        "rules.yaml",
    )
    client, ip = domain.root.nodes()
    assert client.limit is not None and ip.limit is not None
    assert client.limit.approximate and all(w.approximate for w in client.limit.windows)
    assert not ip.limit.approximate
    assert Rules({"d": domain}).dump()[0].endswith(", approximate: true")
    assert tag(client.limit.windows[0]) == tag(Window(100, Unit.SECOND))


MONTHS = """
domain: months
descriptors:
  - key: plain
    rate_limit: {unit: month, requests_per_unit: 10}
  - key: upper
    rate_limit: {unit: MONTH, requests_per_unit: 10}
  - key: said_no
    rate_limit: {unit: month, requests_per_unit: 10, calendar: false}
  - key: zoned
    rate_limit: {unit: month, requests_per_unit: 10, calendar: true, timezone: Asia/Tokyo}
  - key: bucket
    rate_limit: {unit: month, requests_per_unit: 10, algorithm: token_bucket}
  - key: sliding
    rate_limit: {unit: month, requests_per_unit: 10, algorithm: sliding_window}
  - key: quarter
    rate_limit: {unit: month, requests_per_unit: 10, unit_multiplier: 3}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 10}
  - key: both
    rate_limits:
      - {unit: month, requests_per_unit: 10}
      - {unit: hour, requests_per_unit: 1}
"""


def test_calendar_months_makes_a_plain_month_the_utc_calendar_month() -> None:
    """With calendar_months (USE_CALENDAR_MONTH_RATE_LIMIT) a fixed window of one month that
    says nothing of calendars is a UTC calendar window, as `calendar: true` writes it; one that
    says (calendar: false, or a zone), other algorithms, several months and other units keep
    their windows; without it nothing changes."""

    def windows(calendar_months: bool) -> dict[str, list[Window]]:
        domain = config.parse(MONTHS, "months.yaml", calendar_months=calendar_months)
        return {limit.rule_key: list(limit.windows) for limit in domain.limits()}

    without, with_ = windows(False), windows(True)
    calendar = {"months.plain", "months.upper", "months.both"}
    for key, found in with_.items():
        month = found[0]
        if key in calendar:
            assert (month.calendar, month.timezone) == (True, "UTC"), key
            assert month == Window(10, Unit.MONTH, calendar=True), key
            assert found[1:] == without[key][1:], key
        else:
            assert found == without[key], key
    assert [w.calendar for w in without["months.plain"]] == [False]
    assert with_["months.zoned"][0].timezone == "Asia/Tokyo"


def test_leased_marks_every_window_of_its_limit() -> None:
    """`leased: true` on a descriptor makes each window of its limit leased, calendar ones too,
    is shown by `/rlconfig`, and leaves the counters' keys as they were, so leased and exact
    sidecars share one counter."""
    domain = config.parse(
        """
domain: d
descriptors:
  - key: client
    leased: true
    rate_limits:
      - {unit: second, requests_per_unit: 100}
      - {unit: day, requests_per_unit: 9000, calendar: true}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 100}
""",
        "rules.yaml",
    )
    client, ip = domain.root.nodes()
    assert client.limit is not None and ip.limit is not None
    assert client.limit.leased and all(w.leased for w in client.limit.windows)
    assert not ip.limit.leased and not client.limit.approximate
    assert Rules({"d": domain}).dump()[0].endswith(", leased: true")
    assert tag(client.limit.windows[0]) == tag(Window(100, Unit.SECOND))
