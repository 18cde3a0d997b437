"""The reference's own rules fixtures (envoyproxy/ratelimit `test/config/*.yaml`, copied into
tests/reference_config/) through `check`: each loads, or fails with the reference's message,
as the reference's `test/config/config_test.go` expects; and what loaded matches as it does
there."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import cli
from sidecar.core import config
from sidecar.core.matching import match
from sidecar.model import Entry, Unit

FIXTURES = Path(__file__).parent / "reference_config"

#: (files loaded together, with MERGE_DOMAIN_CONFIG) -> None when the reference loads them, else
#: its error after the `FILE: ` prefix (the file named is the last). Each from config_test.go,
#: named beside it; the single files it only loads beside others are loaded alone as its
#: `loadConfig` would.
OUTCOMES: dict[tuple[tuple[str, ...], bool], str | None] = {
    (("basic_config.yaml",), False): None,  # TestBasicConfig, TestConfigLimitOverride
    (("merge_domain_key1.yaml", "merge_domain_key2.yaml"), True): None,  # TestDomainMerge
    # TestDomainMerge's files without MERGE_DOMAIN_CONFIG: TestDuplicateDomain's refusal.
    (
        ("merge_domain_key1.yaml", "merge_domain_key2.yaml"),
        False,
    ): "duplicate domain 'test-domain' in config file",
    (("empty_domain.yaml",), False): "config file cannot have empty domain",  # TestEmptyDomain
    (
        ("basic_config.yaml", "duplicate_domain.yaml"),
        False,
    ): "duplicate domain 'test-domain' in config file",  # TestDuplicateDomain
    (("duplicate_domain.yaml",), False): None,
    (("empty_key.yaml",), False): "descriptor has empty key",  # TestEmptyKey
    (
        ("duplicate_key.yaml",),
        False,
    ): "duplicate descriptor composite key 'test-domain.key1_value1'",  # TestDuplicateKey
    (
        ("merge_domain_key1.yaml", "merge_domain_key1.yaml"),
        True,
    ): "duplicate descriptor composite key 'test-domain.key1_value1'",  # TestDuplicateKeyDomainMerge
    (("bad_limit_unit.yaml",), False): "invalid rate limit unit 'foo'",  # TestBadLimitUnit
    (
        ("replaces_self.yaml",),
        False,
    ): "replaces should not contain name of same descriptor",  # TestReplacesSelf
    (
        ("replaces_empty.yaml",),
        False,
    ): "should not have an empty replaces entry",  # TestReplacesEmpty
    # TestBadYaml: go-yaml says "yaml: line 2: found unexpected end of stream"; PyYAML words
    # the same fault its own way.
    (("bad_yaml.yaml",), False): "error loading config file: yaml: line ",
    (("misspelled_key.yaml",), False): "config error, unknown key 'ratelimit'",  # TestMisspelledKey
    (("misspelled_key2.yaml",), False): "config error, unknown key 'requestsperunit'",
    (
        ("non_string_key.yaml",),
        False,
    ): "config error, key is not of type string: 0.25",  # TestNonStringKey
    (
        ("non_map_list.yaml",),
        False,
    ): "config error, yaml file contains list of type other than map: a",  # TestNonMapList
    (
        ("unlimited_with_unit.yaml",),
        False,
    ): "should not specify rate limit unit when unlimited",  # TestUnlimitedWithRateLimitUnit
    (("shadowmode_config.yaml",), False): None,  # TestShadowModeConfig
    (("wildcard.yaml",), False): None,  # TestWildcardConfig
    (("share_threshold.yaml",), False): None,  # TestShareThreshold
    (("metadata.yaml",), False): None,  # TestMetadata
    (("merge_domain_key1.yaml",), False): None,
    (("merge_domain_key2.yaml",), False): None,
}


def test_every_reference_fixture_has_an_outcome() -> None:
    """No fixture of the reference is left out."""
    named = {name for files, _ in OUTCOMES for name in files}
    assert named == {p.name for p in FIXTURES.glob("*.yaml")}


@pytest.mark.parametrize(
    ("files", "merge"), sorted(OUTCOMES), ids=lambda v: "+".join(v) if isinstance(v, tuple) else ""
)
def test_reference_fixture_has_the_reference_outcome_in_check(
    files: tuple[str, ...], merge: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check` loads what the reference loads, without a warning, and refuses what it refuses
    with its message, naming the file."""
    expected = OUTCOMES[(files, merge)]
    argv = ["check", "--strict", *(str(FIXTURES / name) for name in files)]
    if merge:
        argv.append("--merge-domain-config")
    status = cli.main(argv)
    err = capsys.readouterr().err
    if expected is None:
        assert (status, err) == (0, "")
    else:
        assert status == 1
        assert err.startswith(f"{FIXTURES / files[-1]}: ")
        assert expected in err


def _limit(name: str, *entries: tuple[str, str]) -> tuple[int, Unit] | str | None:
    domain = config.load([FIXTURES / name]).domains["test-domain"]
    found = match(domain, [Entry(k, v) for k, v in entries])
    if found is None:
        return None
    if found.limit.unlimited:
        return "unlimited"
    return (found.limit.requests_per_unit, found.limit.unit)


#: Lookups of the reference's tests on the fixtures: the limit each finds, or None.
LOOKUPS = [
    # TestBasicConfig
    ("basic_config.yaml", [("key1", "something")], None),
    ("basic_config.yaml", [("key1", "value1")], None),
    ("basic_config.yaml", [("key2", "value2"), ("subkey", "subvalue")], None),
    ("basic_config.yaml", [("key5", "value5"), ("subkey5", "subvalue")], None),
    ("basic_config.yaml", [("key1", "value1"), ("subkey1", "something")], (5, Unit.SECOND)),
    ("basic_config.yaml", [("key1", "value1"), ("subkey1", "subvalue1")], (10, Unit.SECOND)),
    ("basic_config.yaml", [("key2", "something")], (20, Unit.MINUTE)),
    ("basic_config.yaml", [("key2", "value2")], (30, Unit.MINUTE)),
    ("basic_config.yaml", [("key2", "value3")], None),
    ("basic_config.yaml", [("key3", "foo")], (1, Unit.HOUR)),
    ("basic_config.yaml", [("key4", "foo")], (1, Unit.DAY)),
    ("basic_config.yaml", [("key6", "foo")], "unlimited"),
    ("basic_config.yaml", [("key7", "unspecified_value")], (70, Unit.MINUTE)),
    # TestWildcardConfig
    ("wildcard.yaml", [("noVal", "foo1")], (20, Unit.MINUTE)),
    ("wildcard.yaml", [("wild", "foo1")], (20, Unit.MINUTE)),
    ("wildcard.yaml", [("nestedWild", "val1"), ("wild", "goo2")], (20, Unit.MINUTE)),
    ("wildcard.yaml", [("wild", "bar")], None),
    ("wildcard.yaml", [("noWild", "foo1")], None),
    ("wildcard.yaml", [("midWild", "barab")], (20, Unit.MINUTE)),
    ("wildcard.yaml", [("midWild", "barb")], (20, Unit.MINUTE)),
    ("wildcard.yaml", [("midWild", "bara")], None),
    ("wildcard.yaml", [("midWild", "xbarb")], None),
    ("wildcard.yaml", [("multiWild", "foobarbaz")], (10, Unit.MINUTE)),
    # TestShareThreshold
    ("share_threshold.yaml", [("file", "test1")], (50, Unit.MINUTE)),
    ("share_threshold.yaml", [("file", "test2")], (100, Unit.MINUTE)),
    ("share_threshold.yaml", [("multiroute", "svcABCrpc")], None),
    ("share_threshold.yaml", [("tenant", "t1prod"), ("resource", "resAv2")], (60, Unit.MINUTE)),
]


@pytest.mark.parametrize(("name", "entries", "expected"), LOOKUPS)
def test_reference_lookups_find_the_same_limits(
    name: str, entries: list[tuple[str, str]], expected: object
) -> None:
    """Each lookup the reference's tests make on its fixtures finds the same limit here."""
    assert _limit(name, *entries) == expected
