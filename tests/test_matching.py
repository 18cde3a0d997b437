"""Matching a descriptor to a rule, as envoyproxy/ratelimit does (README examples 2, 3 and 4)."""

from __future__ import annotations

import pytest

from sidecar.core import config
from sidecar.core.matching import match
from sidecar.model import Entry

RULES = config.parse(
    """
domain: d
descriptors:
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: key
    value: value
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*/users
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: files
    value: "foo*"
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: empty
    value: "*"
    rate_limit: {unit: hour, requests_per_unit: 6}
  - key: parent
    value: exact
    descriptors:
      - key: child
        value: a
        rate_limit: {unit: hour, requests_per_unit: 7}
  - key: parent
    descriptors:
      - key: child
        rate_limit: {unit: hour, requests_per_unit: 8}
  - key: both
    rate_limit: {unit: hour, requests_per_unit: 9}
    descriptors:
      - key: sub
        rate_limit: {unit: hour, requests_per_unit: 10}
  - key: tracked
    value_to_metric: true
    descriptors:
      - key: sub
        rate_limit: {unit: hour, requests_per_unit: 11}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 12}
  - key: router
  - key: shared
    value: "foo*"
    share_threshold: true
    descriptors:
      - key: leaf
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 13}
""",
    "rules.yaml",
)


def limit_of(*pairs: tuple[str, str]) -> int | None:
    found = match(RULES, [Entry(k, v) for k, v in pairs])
    return None if found is None else found.limit.requests_per_unit


def test_key_only_rule_applies_to_any_value() -> None:
    """A key-only rule is the default for every value of its key (example 2: 100/day per number)."""
    assert limit_of(("to_number", "+1555")) == 100


def test_nested_rule_applies_to_the_full_path() -> None:
    """A nested rule applies when every entry walks down to it (example 2: marketing 5/day)."""
    assert limit_of(("message_type", "marketing"), ("to_number", "+1555")) == 5


def test_exact_value_wins_over_key_only() -> None:
    """The exact key_value is tried before the key-only default (example 3: blocked IP gets 0)."""
    assert limit_of(("remote_address", "50.0.0.5")) == 0
    assert limit_of(("remote_address", "10.0.0.1")) == 10


def test_request_deeper_than_rules_gets_no_limit() -> None:
    """Example 4: a request with more entries than the rules' path is not limited."""
    assert limit_of(("key", "value"), ("subkey", "subvalue")) is None


def test_wildcards_are_tried_in_declaration_order_before_key_only() -> None:
    """The first wildcard that matches wins; key-only is the fallback."""
    assert limit_of(("path", "/api/v1/users")) == 2
    assert limit_of(("path", "/api/v1/orders")) == 3
    assert limit_of(("path", "/other")) == 4


def test_wildcard_star_matches_zero_characters() -> None:
    """`*` may match nothing, so an empty value matches `*`."""
    assert limit_of(("empty", "")) == 6
    assert limit_of(("files", "foo")) == 5


def test_no_backtracking_after_an_exact_match() -> None:
    """Once key_value matched, a miss below it is not retried under the key-only sibling."""
    assert limit_of(("parent", "exact"), ("child", "a")) == 7
    assert limit_of(("parent", "exact"), ("child", "b")) is None
    assert limit_of(("parent", "other"), ("child", "b")) == 8


def test_shorter_request_uses_the_limit_on_its_last_node() -> None:
    """A node with both a limit and children applies its own limit to a one-entry request."""
    assert limit_of(("both", "x")) == 9
    assert limit_of(("both", "x"), ("sub", "y")) == 10


def test_node_without_limit_gives_no_limit() -> None:
    """A descriptor with no rate_limit and no children whitelists its key."""
    assert limit_of(("router", "x")) is None
    assert limit_of(("unknown", "x")) is None
    assert match(RULES, []) is None


def test_counter_uses_request_values_except_with_share_threshold() -> None:
    """Counters are per request value; share_threshold makes matching values share the pattern's."""
    plain = match(RULES, [Entry("path", "/api/v1/users")])
    shared = match(RULES, [Entry("files", "foo123")])
    assert plain is not None and plain.counter_parts == (("path", "/api/v1/users"),)
    assert shared is not None and shared.counter_parts == (("files", "foo*"),)


@pytest.mark.parametrize(
    ("pairs", "metric_key"),
    [
        ((("to_number", "+1555"),), "d.to_number"),
        ((("message_type", "marketing"), ("to_number", "1")), "d.message_type_marketing.to_number"),
        ((("path", "/api/v1/users"),), "d.path_/api/*/users"),
        ((("files", "foo1"),), "d.files_foo*"),
        ((("tracked", "t1"), ("sub", "x")), "d.tracked_t1.sub"),
        ((("detailed", "1.2.3.4"),), "d.detailed_1_2_3_4"),
        # As the reference: an empty value under value_to_metric names the key alone, and
        # detailed_metric names a share_threshold level by its pattern.
        ((("tracked", ""), ("sub", "x")), "d.tracked.sub"),
        ((("shared", "foo1"), ("leaf", "x")), "d.shared_foo*.leaf_x"),
    ],
)
def test_metric_keys_follow_the_reference(
    pairs: tuple[tuple[str, str], ...], metric_key: str
) -> None:
    """Stats keys: rule path, with request values under value_to_metric and detailed_metric."""
    found = match(RULES, [Entry(k, v) for k, v in pairs])
    assert found is not None
    assert found.metric_key == metric_key
