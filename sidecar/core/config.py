"""Rules in envoyproxy/ratelimit's YAML format: `parse` one file's text, `load` files from disk.

One file holds one domain: a tree of descriptors, each a `key` with an optional `value` (exact,
or a pattern where `*` matches any run of characters) and an optional `rate_limit`; it becomes
the rule tree of `sidecar.core.rules`. `parse` is pure; `load` is the only function here that
touches the disk. It is one module past 400 lines because it is the format: `_Loader` decodes
its YAML as the reference's decoder does, each `_Parser` method reads one kind of map of it (a
descriptor, a limit, a window and its parts: unit, algorithm, token bucket, borrowing, calendar),
and a change of the format changes them together.
Every error is a ConfigError naming the file, the path inside it and, where it helps, the fix,
worded as the reference words it so existing runbooks still match.
A file the reference loads loads here, read as it reads it; what it loads but is likely a
mistake (a key it ignores where it stands, a key repeated in one map) is a ConfigWarning
(`sidecar.core.rules`), kept on its Domain.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import yaml

from sidecar.algorithms import packing
from sidecar.algorithms.windows import check_zone, is_calendar_unit
from sidecar.core import lists, penalty_rules, usage
from sidecar.core.counters import code, kind
from sidecar.core.rules import ConfigWarning, Domain, Level, Node, Rules, yaml_bool
from sidecar.errors import ConfigError
from sidecar.model import Algorithm, Limit, Unit, Window

MAX_REQUESTS_PER_UNIT = 4_294_967_295
#: A concurrency limit's bounds: each start in flight is stored (`sidecar.algorithms.concurrency`),
#: so its limit bounds its state; a lease runs from a second to a day.
MAX_IN_FLIGHT = 10_000
MAX_LEASE_SECONDS = 86_400
_LEASE = re.compile(r"(\d+)(s|m|h)")
_LEASE_SECONDS = {"s": 1, "m": 60, "h": 3_600}

_ROOT_KEYS = ("domain", "descriptors", "usage", "lists")
_DESCRIPTOR_KEYS = (
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "group_counters",
    "approximate",
    "leased",
    "pace",
    "metadata",
    "identifiers",
    "penalty",
)
#: At most this many identifier kinds under one `identifiers` (a request names no more).
MAX_IDENTIFIERS = 8
_RATE_LIMIT_KEYS = (
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "unit_multiplier",
    "burst",
    "borrow",
    "calendar",
    "timezone",
    "week_start",
    "ends",
    "lease",
    "request_id",
)
#: Windows anchored on events (`sidecar.algorithms.anchored`), read by `_Parser.anchored`.
_ANCHORED = {a.value: a for a in (Algorithm.FIRST_EVENT, Algorithm.COOLDOWN, Algorithm.LIFETIME)}
_ALGORITHMS = {a.value: a for a in Algorithm if a is not Algorithm.PENALTY}  # not a window
_WEEK_STARTS = {"monday": 0, "sunday": 6}
_REPLACES_KEYS = ("name",)
#: Every key envoyproxy/ratelimit accepts, at any depth of a rules file (its `validKeys`). One of
#: them in the wrong place is ignored there, so here it is a warning, and the file loads as there.
#: The fields of the reference's `rate_limit`: what a repeated `rate_limit` keeps of an earlier
#: one (go-yaml decodes both into one struct, so a field only the earlier one sets survives).
_LIMIT_FIELDS = ("unit", "requests_per_unit", "unlimited", "name", "replaces")
_REFERENCE_KEYS = frozenset(
    (
        *(key for key in _ROOT_KEYS if key not in ("usage", "lists")),
        *_LIMIT_FIELDS,
        *(
            key
            for key in _DESCRIPTOR_KEYS
            if key
            not in (
                "rate_limits",
                "group_counters",
                "approximate",
                "leased",
                "pace",
                "identifiers",
                "penalty",
            )
        ),
    )
)
#: Where each of those keys does something, for the warning's fix.
_HOMES = {
    **{key: "a descriptor" for key in _DESCRIPTOR_KEYS},
    **{key: "rate_limit" for key in _RATE_LIMIT_KEYS},
    "domain": "the top level",
    "descriptors": "the top level or a descriptor",
    "name": "rate_limit or a replaces entry",
}
_UNITS = {unit.name.lower(): unit for unit in Unit}
_UNIT_LIST = ", ".join(u.name.lower() for u in sorted(Unit, key=lambda u: u.seconds))


def load(paths: Sequence[str | Path], merge: bool = False, calendar_months: bool = False) -> Rules:
    """Load every rules file named by `paths` (files, or directories of `*.yaml` / `*.yml`).

    Raises ConfigError on the first bad file, or when two files declare the same domain (unless
    `merge`: see `gather`). `calendar_months`: see `parse`. The allow and deny lists the files
    name (`sidecar.core.lists`) are read too: a bad list is a bad load.
    """
    rules = gather(
        (parse(_read(file), str(file), calendar_months) for file in _files(paths)), merge
    )
    for domain in rules.domains.values():
        if domain.list_files:
            domain.lists = lists.read(domain.name, domain.list_files)
    return rules


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(file), "", f"error loading config file: {exc}") from exc


def gather(domains: Iterable[Domain], merge: bool = False) -> Rules:
    """The rules of several parsed domains (files, or xDS resources); raises ConfigError when
    two declare the same domain, naming the second's source.

    With `merge` (the reference's MERGE_DOMAIN_CONFIG), a domain declared again adds its
    first-level descriptors to the domain's, after them; one declared in both (the same `key`
    or `key_value`) is refused, as it would be within one file.
    """
    rules = Rules()
    for domain in domains:
        known = rules.domains.get(domain.name)
        if known is None:
            rules.domains[domain.name] = domain
        elif merge:
            rules.domains[domain.name] = _merge(known, domain)
        else:
            raise ConfigError(
                domain.source,
                "domain",
                f"duplicate domain '{domain.name}' in config file (already declared in {known.source})",
            )
    return rules


def _merge(first: Domain, second: Domain) -> Domain:
    """One domain with the first-level descriptors of `first`, then those of `second`."""
    root = Level()
    for node in first.root.nodes():
        root.add(node)
    for index, node in enumerate(second.root.nodes()):
        if node.label in root.labels:
            raise ConfigError(
                second.source,
                f"descriptors[{index}]",
                f"duplicate descriptor composite key '{node.rule_key}' (already declared in "
                f"{first.source}; merge the two descriptors)",
            )
        root.add(node)
    if first.list_files and second.list_files:
        raise ConfigError(
            second.source,
            "lists",
            f"lists of domain '{first.name}' are declared in {first.source} already "
            "(declare them in one file)",
        )
    if first.usage is not None and second.usage is not None:
        raise ConfigError(
            second.source,
            "usage",
            f"usage of domain '{first.name}' is declared in {first.source} already "
            "(declare it in one file)",
        )
    return Domain(
        first.name,
        f"{first.source}, {second.source}",
        root,
        first.warnings + second.warnings,
        first.usage or second.usage,
        first.list_files or second.list_files,
    )


def fingerprint(
    paths: Sequence[str | Path], rules: Rules | None = None
) -> tuple[tuple[str, int, int, int], ...]:
    """What `load` would read, as (name, inode, size, mtime) of every rules file, then of every
    list file `rules` (loaded from them) read: which list files a load reads is known once the
    rules are parsed, and polling must not parse them.

    Cheap enough to poll: a change of any file, a file added or removed, or a directory swapped
    under a symlink (how Kubernetes updates a mounted ConfigMap) changes it. Raises OSError when
    a path vanishes mid-change; the caller looks again later.
    """
    marks = []
    for file in _files(paths):
        stat = file.stat()  # follows symlinks: a swapped target changes inode and mtime
        marks.append((str(file), stat.st_ino, stat.st_size, stat.st_mtime_ns))
    for domain in rules.domains.values() if rules is not None else ():
        for declared in domain.list_files:
            stat = declared.path.stat()
            marks.append((str(declared.path), stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(marks)


def _files(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()
            )
            files.extend(p for p in found if not p.name.startswith("."))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(str(path), "", "error loading config file: no such file or directory")
    return files


def parse(text: str, source: str, calendar_months: bool = False) -> Domain:
    """Parse one rules file's text; `source` names it in errors and warnings.

    The YAML is read as the reference's decoder (go-yaml v2) reads it: the first document only,
    a key repeated in one map keeps its last value (see `_Loader`), and a number or boolean
    written where text belongs (`value: 010`, `value: on`) is that text.

    `calendar_months` (the reference's USE_CALENDAR_MONTH_RATE_LIMIT): a fixed window of one
    `unit: month` that says nothing of calendars (no `calendar`, no `timezone`) is the UTC
    calendar month, a calendar window as `calendar: true` makes it, so one mechanism counts
    both; without it such a month is 30 days from the epoch, as the reference's default.
    A month of another algorithm, or of several months, stays 30-day blocks (calendar windows
    are one fixed window), and so does a month in a request's `limit` override, which no rule
    declares.
    """
    loader = _Loader(text)
    try:
        document = loader.get_data() if loader.check_data() else None  # type: ignore[no-untyped-call]
        loader.overlay()
        try:
            more = loader.check_data()  # type: ignore[no-untyped-call]
        except yaml.YAMLError:  # the reference does not read past the first document
            more = True
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"error loading config file: {_yaml_problem(exc)}") from exc
    finally:
        loader.dispose()
    notes = [ConfigWarning(source, "", note) for note in loader.notes]
    if more:
        notes.append(
            ConfigWarning(
                source,
                "",
                "yaml: a second document is ignored, as envoyproxy/ratelimit reads only the "
                "first (one domain per file: move it to a file of its own)",
            )
        )
    return _Parser(source, notes, calendar_months).root(document)


def parse_mapping(document: object, source: str, calendar_months: bool = False) -> Domain:
    """Parse one domain's rules already decoded from their format (as `parse` does once YAML
    has decoded a file): rules pushed over xDS take this way, through the same checks. Allow
    and deny lists are files on the sidecar's disk, read with rules files: rules that come
    this way may not name them."""
    domain = _Parser(source, calendar_months=calendar_months).root(document)
    if domain.list_files:
        raise ConfigError(
            source,
            "lists",
            "lists are files the sidecar reads with its rules files: declare them in a rules "
            "file (--config), not over xDS",
        )
    return domain


class _Map(dict[Any, Any]):
    """A decoded YAML map that remembers the text its non-string scalar values were written as."""

    __slots__ = ("texts",)

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[Any, str] = {}


def _text(mapping: Mapping[Any, Any], key: str) -> str | None:
    """How `mapping[key]` was written, when YAML read it as a number, boolean or date."""
    return mapping.texts.get(key) if isinstance(mapping, _Map) else None


#: Keys whose repeats in one map are merged as go-yaml merges them (see `_Loader`): the fields
#: an earlier one may leave in the last (None: any).
_OVERLAID: dict[str, frozenset[str] | None] = {
    "rate_limit": frozenset(_LIMIT_FIELDS),
    "metadata": None,
}


class _Loader(yaml.SafeLoader):
    """A SafeLoader that decodes a rules file as the reference's decoder (go-yaml v2) does.

    A key repeated in one map keeps its last value (YAML forbids repeats; go-yaml takes them),
    except that a repeated `rate_limit` or `metadata` map keeps what only an earlier one sets,
    since go-yaml decodes each into the same struct or map. Each repeat is noted, to be warned
    about. Maps are `_Map`s, which remember how their scalar values were written.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        #: Warnings found while decoding (a key repeated in one map).
        self.notes: list[str] = []
        #: (last, earlier, keys the earlier may give) for each repeated `rate_limit` or
        #: `metadata` map, in document order; `overlay` applies them once the maps are built.
        self._overlays: list[tuple[_Map, _Map, frozenset[str] | None]] = []

    def overlay(self) -> None:
        """Give each repeated `rate_limit` or `metadata` the fields only an earlier one set."""
        for last, earlier, keys in self._overlays:
            for key, value in earlier.items():
                if key not in last and (keys is None or key in keys):
                    last[key] = value
                    if key in earlier.texts:
                        last.texts[key] = earlier.texts[key]
        self._overlays.clear()

    def construct_rules_map(self, node: yaml.MappingNode) -> Iterator[_Map]:
        data = _Map()
        yield data
        stated = {id(key_node) for key_node, _ in node.value}
        self.flatten_mapping(node)  # `<<` merge keys: merged pairs first, then the stated ones
        from_stated: dict[Any, bool] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found unhashable key",
                    key_node.start_mark,
                ) from None
            value = self.construct_object(value_node)
            if key in data:
                # A stated key overriding a merged one is what `<<` is for: no warning.
                if id(key_node) in stated and from_stated[key]:
                    self.notes.append(
                        f"yaml: line {key_node.start_mark.line + 1}: key '{key}' is repeated in "
                        "one map: the last one counts, as envoyproxy/ratelimit reads it (remove "
                        "the others)"
                    )
                earlier = data[key]
                if key in _OVERLAID and isinstance(value, _Map) and isinstance(earlier, _Map):
                    self._overlays.append((value, earlier, _OVERLAID[key]))
            data[key] = value
            from_stated[key] = id(key_node) in stated
            if isinstance(value_node, yaml.ScalarNode) and not isinstance(value, str | None):
                data.texts[key] = value_node.value
            else:
                data.texts.pop(key, None)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_rules_map)
# go-yaml v2 also reads y, Y, n and N as booleans (YAML 1.1), where PyYAML reads text.
_Loader.bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"yaml: line {mark.line + 1}: {problem}"
    return f"yaml: {problem}"


class _Parser:
    """Walks one YAML document, keeping the file name for errors and the warnings found."""

    def __init__(
        self, source: str, warnings: Sequence[ConfigWarning] = (), calendar_months: bool = False
    ) -> None:
        self.source = source
        self.warnings = list(warnings)
        self.calendar_months = calendar_months
        # While parsing a group_counters tree: each window code in it, with the kind of window
        # that has it and where it was declared (two kinds must never share a code).
        self.codes: dict[str, tuple[tuple[object, ...], Window]] | None = None
        # While parsing a `group_counters: packed` tree (`sidecar.algorithms.packing`).
        self.packed = False
        # While parsing the tree of a descriptor with `identifiers`: its rule key (its caps are
        # summed across identifiers, which only plain fixed windows allow).
        self.summed: str | None = None

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(self.source, path, message)

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(ConfigWarning(self.source, path, message))

    def root(self, document: object) -> Domain:
        if document is None:
            document = {}
        if not isinstance(document, dict):
            raise self.error(
                "", "config error, the file must be a map with 'domain' and 'descriptors'"
            )
        self.check_keys(document, _ROOT_KEYS, "", "at the top level")
        domain = self.scalar(document.get("domain"), "domain", _text(document, "domain"))
        if not domain:
            raise self.error(
                "domain", "config file cannot have empty domain (add a top-level 'domain: NAME')"
            )
        root = self.level(document.get("descriptors"), "descriptors", domain)
        counted = (
            None if document.get("usage") is None else usage.parse(document["usage"], self.source)
        )
        named = () if document.get("lists") is None else lists.parse(document["lists"], self.source)
        return Domain(
            name=domain,
            source=self.source,
            root=root,
            warnings=tuple(self.warnings),
            usage=counted,
            list_files=named,
        )

    def check_keys(
        self, mapping: dict[Any, Any], allowed: Sequence[str], path: str, place: str
    ) -> None:
        """Refuse a key the reference refuses too; warn about one of its keys that stands
        where it does nothing (`place` says where: "in a descriptor"), as there it is ignored."""
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise self.error(path, f"config error, key is not of type string: {key} (quote it)")
            if key in allowed:
                continue
            if key in _REFERENCE_KEYS:
                self.check_ignored(value, f"{path}.{key}" if path else key, key)
                self.warn(
                    path,
                    f"key '{key}' is ignored {place}, as envoyproxy/ratelimit ignores it (it "
                    f"belongs in {_HOMES[key]}: move it there, or remove it)",
                )
                continue
            hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            fix = f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(allowed)})"
            raise self.error(path, f"config error, unknown key '{key}'{fix}")

    def check_ignored(self, value: object, path: str, key: str) -> None:
        """What the reference refuses even under a key it ignores (its check of keys walks the
        whole file but `metadata`): a list of anything but maps, a key it does not know, a
        number with a fraction."""
        if key == "metadata":
            return
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, dict):
                    raise self.error(
                        f"{path}[{index}]",
                        f"config error, yaml file contains list of type other than map: {item}",
                    )
                self.check_ignored(item, f"{path}[{index}]", "")
        elif isinstance(value, dict):
            for name, item in value.items():
                if not isinstance(name, str):
                    raise self.error(path, f"config error, key is not of type string: {name}")
                if name not in _REFERENCE_KEYS:
                    raise self.error(path, f"config error, unknown key '{name}'")
                self.check_ignored(item, f"{path}.{name}", name)
        elif isinstance(value, float):
            raise self.error(path, f"error checking config: {value} is a number with a fraction")

    def level(self, items: object, path: str, parent_key: str, depth: int = 0) -> Level:
        level = Level()
        if items is None:
            return level
        if not isinstance(items, list):
            raise self.error(path, "descriptors must be a list of maps")
        for index, item in enumerate(items):
            here = f"{path}[{index}]"
            if not isinstance(item, dict):
                raise self.error(
                    here,
                    f"config error, yaml file contains list of type other than map: {item} "
                    "(each descriptor is a map with at least 'key')",
                )
            self.descriptor(item, here, parent_key, level, depth)
        return level

    def descriptor(
        self, item: dict[Any, Any], path: str, parent_key: str, level: Level, depth: int
    ) -> None:
        self.check_keys(item, _DESCRIPTOR_KEYS, path, "in a descriptor")
        key = self.scalar(item.get("key"), f"{path}.key", _text(item, "key"))
        if not key:
            raise self.error(path, "descriptor has empty key (add 'key: NAME')")
        # An empty value is no value (a key-only descriptor), as the reference reads it.
        value = self.scalar(item.get("value"), f"{path}.value", _text(item, "value")) or None
        label = key if value is None else f"{key}_{value}"
        rule_key = f"{parent_key}.{label}"
        if label in level.labels:
            # The reference names descriptors by `key_value` alone, so `key: a_b` and
            # `key: a, value: b` are one to it: refused as it refuses them.
            raise self.error(
                path, f"duplicate descriptor composite key '{rule_key}' (merge the two descriptors)"
            )
        if "*" in key:
            self.warn(
                f"{path}.key",
                f"'*' in key '{key}' is the character itself here; envoyproxy/ratelimit matches "
                "it as a wildcard over the joined 'key_value' (rename the key, or put the "
                "pattern in 'value')",
            )

        flags = {
            name: self.flag(item, name, path)
            for name in (
                "shadow_mode",
                "quota_mode",
                "detailed_metric",
                "value_to_metric",
                "share_threshold",
                "approximate",
                "leased",
                "pace",
            )
        }
        flags["group_counters"], packed = self.grouping(item, path)
        wildcard = value is not None and "*" in value
        if flags["share_threshold"] and not wildcard and "*" in key:
            # The reference takes it (its check reads the joined `key_value`); nothing here
            # matches values by that pattern, so there is nothing to share.
            self.warn(
                f"{path}.share_threshold",
                f"share_threshold is ignored on '{label}': only a wildcard value shares a counter",
            )
            flags["share_threshold"] = False
        elif flags["share_threshold"] and not wildcard:
            raise self.error(
                f"{path}.share_threshold",
                "share_threshold can only be used with wildcard values (containing '*'), "
                f"but found key '{label}'",
            )
        grouped = flags["group_counters"]
        if grouped and depth > 0:
            raise self.error(
                f"{path}.group_counters",
                f"group_counters applies to a first-level descriptor, but found it on "
                f"'{rule_key}' (move it to the first-level descriptor whose values own the "
                "counters, like 'key: user')",
            )
        if grouped and value is not None:
            raise self.error(
                f"{path}.group_counters",
                f"group_counters applies to a key-only descriptor, but found key '{label}' "
                "(remove 'value', or group_counters)",
            )
        metadata = item.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise self.error(f"{path}.metadata", "metadata must be a map")

        identifiers = self.identifiers(item, path, key, value, depth)
        if grouped:
            self.codes = {}
            self.packed = packed
        if identifiers:
            self.summed = rule_key
        limit = self.limit(item, path, rule_key, flags["shadow_mode"], flags["quota_mode"])
        if flags["approximate"]:
            limit = self.approximate(limit, item, path, rule_key)
        if flags["leased"]:
            limit = self.leased(limit, item, path, rule_key, flags["approximate"])
        if flags["pace"]:
            limit = self.paced(limit, path, rule_key)
        if "penalty" in item:
            limit = penalty_rules.read(
                item["penalty"], self.source, f"{path}.penalty", rule_key, limit,
                flags["approximate"], flags["leased"],
            )  # fmt: skip
        if metadata and limit is not None:
            limit = dataclasses.replace(limit, metadata=metadata)
        if self.packed and limit is not None:
            limit = dataclasses.replace(limit, packing=packing.plan(limit.windows))
        children = self.level(item.get("descriptors"), f"{path}.descriptors", rule_key, depth + 1)
        if grouped:
            self.codes = None
            self.packed = False
        self.summed = None if identifiers else self.summed
        node = Node(
            key=key,
            value=value,
            label=label,
            rule_key=rule_key,
            limit=limit,
            children=children,
            detailed_metric=flags["detailed_metric"],
            value_to_metric=flags["value_to_metric"],
            share_threshold=flags["share_threshold"],
            group_counters=grouped,
            metadata=metadata,
            identifiers=identifiers,
        )
        level.add(node)

    def identifiers(
        self, item: dict[Any, Any], path: str, key: str, value: str | None, depth: int
    ) -> tuple[str, ...]:
        """The identifier kinds a first-level, key-only descriptor counts across (a person
        reaching the ad server as a user, a device, a cookie); empty when it declares none."""
        raw = item.get("identifiers")
        if raw is None:
            return ()
        here = f"{path}.identifiers"
        if depth > 0 or value is not None:
            raise self.error(
                here,
                "identifiers applies to a first-level, key-only descriptor (like 'key: person' "
                "with 'key: ad' below it)",
            )
        if (
            not isinstance(raw, list)
            or not 0 < len(raw) <= MAX_IDENTIFIERS
            or not all(isinstance(kind, str) and kind for kind in raw)
            or len(set(raw)) != len(raw)
            or key in raw
        ):
            raise self.error(
                here,
                f"identifiers must be a list of 1 to {MAX_IDENTIFIERS} distinct identifier "
                f"kinds other than '{key}', like [user, device, cookie]",
            )
        return tuple(raw)

    def scalar(self, raw: object, path: str, text: str | None = None) -> str:
        """A key, value or name: a string as it is; a number, boolean or date as `text`, the
        way YAML wrote it (go-yaml reads `010` and `on` into a string as written). A number
        with a fraction is refused, as the reference refuses it."""
        if raw is None:
            return ""
        if isinstance(raw, str):
            return raw
        if isinstance(raw, float):
            raise self.error(
                path,
                f"error checking config: {text or raw} is a number with a fraction, which "
                f"envoyproxy/ratelimit refuses (quote it: '{text or raw}')",
            )
        if text is not None:
            return text
        if isinstance(raw, bool):  # rules pushed over xDS, as decoded from their message
            return yaml_bool(raw)
        if isinstance(raw, int):
            return str(raw)
        raise self.error(path, f"must be a string, got {type(raw).__name__} {raw!r}")

    def grouping(self, item: dict[Any, Any], path: str) -> tuple[bool, bool]:
        """`group_counters`: (whether the tree groups its counters, whether it packs several
        windows of a descriptor in one field: `packed`, see `sidecar.algorithms.packing`)."""
        if item.get("group_counters") == "packed":
            return True, True
        raw = item.get("group_counters")
        if raw is not None and not isinstance(raw, bool):
            raise self.error(
                f"{path}.group_counters",
                f"group_counters must be true, false or packed, got {raw!r}",
            )
        return bool(raw), False

    def flag(self, mapping: dict[Any, Any], name: str, path: str) -> bool:
        raw = mapping.get(name)
        if raw is None:  # absent, or written `~`: false, as the reference reads it
            return False
        if not isinstance(raw, bool):
            raise self.error(f"{path}.{name}", f"{name} must be true or false, got {raw!r}")
        return raw

    def limit(
        self, item: dict[Any, Any], path: str, rule_key: str, shadow: bool, quota: bool
    ) -> Limit | None:
        """The descriptor's `rate_limit` (one window) or `rate_limits` (several), if any."""
        if "rate_limit" in item and "rate_limits" in item:
            raise self.error(
                path,
                "rate_limit and rate_limits are mutually exclusive (put every window in rate_limits)",
            )
        if "rate_limits" in item:
            raw_list = item["rate_limits"]
            here = f"{path}.rate_limits"
            if not isinstance(raw_list, list) or not raw_list:
                raise self.error(here, "rate_limits must be a non-empty list of windows")
            windows: list[Window] = []
            replaced: list[str] = []
            for index, raw in enumerate(raw_list):
                window, unlimited, names = self.window(raw, f"{here}[{index}]")
                if window.algorithm is Algorithm.CONCURRENCY:
                    raise self.error(
                        f"{here}[{index}].algorithm",
                        "a concurrency limit stands alone: put it in rate_limit (every window of "
                        "a descriptor gets its refunds, so a window beside it would count what is "
                        "in flight too)",
                    )
                if unlimited:
                    raise self.error(
                        f"{here}[{index}].unlimited",
                        "unlimited belongs in rate_limit, not rate_limits",
                    )
                windows.append(window)
                replaced.extend(names)
            return Limit(
                windows=tuple(windows),
                replaces=tuple(replaced),
                shadow_mode=shadow,
                quota_mode=quota,
                rule_key=rule_key,
            )
        if "rate_limit" not in item:
            return None
        if item["rate_limit"] is None:
            self.warn(
                f"{path}.rate_limit",
                "rate_limit is empty, so this descriptor has no limit, as envoyproxy/ratelimit "
                "reads it (give it unit and requests_per_unit, or remove it)",
            )
            return None
        window, unlimited, replaces = self.window(item["rate_limit"], f"{path}.rate_limit")
        return Limit(
            windows=(window,),
            name=window.name,
            unlimited=unlimited,
            replaces=replaces,
            shadow_mode=shadow,
            quota_mode=quota,
            rule_key=rule_key,
        )

    def approximate(
        self, limit: Limit | None, item: dict[Any, Any], path: str, rule_key: str
    ) -> Limit:
        """`limit` with every window approximate (see `sidecar.algorithms.approximate`): plain
        fixed windows only, since a local view can only add up counts."""
        here = f"{path}.approximate"
        if limit is None or limit.unlimited:
            raise self.error(
                here,
                f"approximate applies to a rate limit, but '{rule_key}' has "
                f"{'an unlimited one' if limit is not None else 'none'} (remove 'approximate')",
            )
        windows = []
        many = "rate_limits" in item
        for index, window in enumerate(limit.windows):
            where = f"rate_limits[{index}]" if many else "rate_limit"
            if window.algorithm is Algorithm.CONCURRENCY:
                raise self.error(
                    here,
                    f"approximate needs fixed windows, but {where} has algorithm concurrency, "
                    "whose count goes down with refunds, which a local view that only adds "
                    "cannot follow (remove 'approximate')",
                )
            if window.algorithm is not Algorithm.FIXED_WINDOW:
                raise self.error(
                    here,
                    f"approximate needs fixed windows, but {where} has algorithm "
                    f"{window.algorithm.value}: only a fixed window's count is a sum that a "
                    "local view can add to (remove 'approximate', or use algorithm: "
                    "fixed_window)",
                )
            if window.borrow:
                raise self.error(
                    here,
                    f"approximate needs windows that do not borrow, but {where} has borrow: "
                    f"{window.borrow}, whose capacity depends on the previous window's count "
                    "(remove 'approximate' or 'borrow')",
                )
            windows.append(dataclasses.replace(window, approximate=True))
        return dataclasses.replace(limit, windows=tuple(windows))

    def leased(
        self,
        limit: Limit | None,
        item: dict[Any, Any],
        path: str,
        rule_key: str,
        approximate: bool,
    ) -> Limit:
        """`limit` with every window leased (see `sidecar.algorithms.lease`): fixed windows
        and token buckets, whose budget is a count of units a store can hand out, each counter
        at its own key."""
        here = f"{path}.leased"
        if limit is None or limit.unlimited:
            raise self.error(
                here,
                f"leased applies to a rate limit, but '{rule_key}' has "
                f"{'an unlimited one' if limit is not None else 'none'} (remove 'leased')",
            )
        if approximate:
            raise self.error(
                here,
                f"leased and approximate are two ways to decide '{rule_key}' locally; a window "
                "takes one (remove one of them)",
            )
        if self.codes is not None:
            raise self.error(
                here,
                f"leased needs counters at their own keys, but '{rule_key}' is under "
                "group_counters, whose counters share a hash (remove 'leased' or "
                "'group_counters')",
            )
        windows = []
        many = "rate_limits" in item
        for index, window in enumerate(limit.windows):
            where = f"rate_limits[{index}]" if many else "rate_limit"
            if window.algorithm is Algorithm.SLIDING_WINDOW:
                raise self.error(
                    here,
                    f"leased needs fixed windows or token buckets, but {where} has algorithm "
                    "sliding_window, whose budget depends on the previous window's count "
                    "(remove 'leased', or use algorithm: fixed_window)",
                )
            if window.algorithm is Algorithm.CONCURRENCY:
                raise self.error(
                    here,
                    f"leased needs fixed windows or token buckets, but {where} has algorithm "
                    "concurrency, whose places come back with refunds that a lease cannot see "
                    "(remove 'leased')",
                )
            if window.borrow:
                raise self.error(
                    here,
                    f"leased needs windows that do not borrow, but {where} has borrow: "
                    f"{window.borrow}, which admits past the budget a lease hands out "
                    "(remove 'leased' or 'borrow')",
                )
            windows.append(dataclasses.replace(window, leased=True))
        return dataclasses.replace(limit, windows=tuple(windows))

    def paced(self, limit: Limit | None, path: str, rule_key: str) -> Limit:
        """`limit` whose RLQS budget is paced over its window (`sidecar.quota.allocator`)."""
        if limit is None or limit.unlimited:
            raise self.error(
                f"{path}.pace",
                f"pace applies to a rate limit, but '{rule_key}' has "
                f"{'an unlimited one' if limit is not None else 'none'} (remove 'pace')",
            )
        return dataclasses.replace(limit, pace=True)

    def window(self, raw: object, path: str) -> tuple[Window, bool, tuple[str, ...]]:
        """One window: (window, unlimited, names it replaces). Its parts are checked in the
        order of the keys a reader meets, each by one function below."""
        if not isinstance(raw, dict):
            raise self.error(path, "a rate limit must be a map with unit and requests_per_unit")
        self.check_keys(raw, _RATE_LIMIT_KEYS, path, "in rate_limit")
        unlimited = self.flag(raw, "unlimited", path)
        name = self.scalar(raw.get("name"), f"{path}.name", _text(raw, "name"))
        replaces = self.replaces(raw.get("replaces"), f"{path}.replaces", name)
        unit_text = self.scalar(raw.get("unit"), f"{path}.unit", _text(raw, "unit"))
        if unlimited:
            if unit_text:
                raise self.error(
                    f"{path}.unit",
                    "should not specify rate limit unit when unlimited (remove 'unit' or 'unlimited')",
                )
            return Window(0, Unit.SECOND, name=name), True, replaces
        named = raw.get("algorithm")
        if "request_id" in raw and named != Algorithm.CONCURRENCY.value:
            raise self.error(
                f"{path}.request_id",
                "request_id applies to concurrency limits, whose refunds close the start of "
                "their request (add 'algorithm: concurrency', or remove it)",
            )
        anchored = _ANCHORED.get(named) if isinstance(named, str) else None
        if anchored is not None:
            window = self.anchored(raw, path, anchored, unit_text, name)
            if self.codes is not None:
                self.check_code(window, path)
            self.check_summed(window, path)
            return window, False, replaces
        if named == Algorithm.CONCURRENCY.value:
            window = self.concurrency(raw, path, name)
            self.check_summed(window, path)
            return window, False, replaces
        if "lease" in raw:
            raise self.error(
                f"{path}.lease",
                "lease applies to concurrency limits (add 'algorithm: concurrency')",
            )
        if "ends" in raw:
            raise self.error(
                f"{path}.ends", "ends applies to lifetime caps (add 'algorithm: lifetime')"
            )
        unit = self.unit(unit_text, path)
        requests = self.count(raw, "requests_per_unit", path, 0, default=0)
        algorithm = self.algorithm(raw, path)
        multiplier = self.count(raw, "unit_multiplier", path, 1, default=1)
        borrow = self.count(raw, "borrow", path, 0, default=0)
        calendar = self.flag(raw, "calendar", path) or self.calendar_month(
            raw, unit, algorithm, multiplier
        )
        burst = self.token_bucket(raw, path, algorithm, requests)
        self.check_borrow(borrow, path, algorithm, requests)
        timezone, week_start = self.calendar(raw, path, calendar, algorithm, unit, multiplier)
        window = Window(
            requests_per_unit=requests,
            unit=unit,
            algorithm=algorithm,
            unit_multiplier=multiplier,
            burst=burst,
            borrow=borrow,
            calendar=calendar,
            timezone=timezone,
            week_start=week_start,
            name=name,
        )
        if self.codes is not None:
            self.check_code(window, path)
        self.check_summed(window, path)
        return window, False, replaces

    def anchored(
        self, raw: dict[Any, Any], path: str, algorithm: Algorithm, unit_text: str, name: str
    ) -> Window:
        """A window anchored on events: `first_event` and `cooldown` take an interval (`unit`,
        `unit_multiplier`), `lifetime` a flight end (`ends`), an interval (its TTL) or both. A
        cooldown admits one event per interval, so it takes no other requests_per_unit."""
        kind = algorithm.value
        for key in ("burst", "borrow", "calendar", "timezone", "week_start"):
            if key in raw:
                raise self.error(f"{path}.{key}", f"{key} does not apply to {kind} (remove it)")
        ends = self.ends(raw.get("ends"), f"{path}.ends") if "ends" in raw else 0
        if "ends" in raw and algorithm is not Algorithm.LIFETIME:
            raise self.error(
                f"{path}.ends", f"ends applies to lifetime caps, not {kind} (remove it)"
            )
        if not unit_text and not ends:
            if algorithm is Algorithm.LIFETIME:
                raise self.error(
                    path,
                    "a lifetime cap needs an end: give ends (the flight's end), as in "
                    "{algorithm: lifetime, requests_per_unit: 3, ends: 2026-12-31T00:00:00Z}, "
                    "or a TTL from the first event with unit and unit_multiplier",
                )
            raise self.error(
                path,
                f"a {kind} window needs an interval: give unit and unit_multiplier, as in "
                f"{{algorithm: {kind}, unit: minute, unit_multiplier: 10}}",
            )
        unit = self.unit(unit_text, path) if unit_text else Unit.YEAR
        multiplier = self.count(raw, "unit_multiplier", path, 1, default=1) if unit_text else 0
        if algorithm is Algorithm.COOLDOWN:
            requests = self.count(raw, "requests_per_unit", path, 1, default=1)
            if requests != 1:
                raise self.error(
                    f"{path}.requests_per_unit",
                    "a cooldown admits one event per interval (remove requests_per_unit, or use "
                    "algorithm: first_event for several per window)",
                )
        else:
            requests = self.count(raw, "requests_per_unit", path, 0, default=0)
        return Window(requests, unit, algorithm, multiplier, name=name, ends=ends)

    def concurrency(self, raw: dict[Any, Any], path: str, name: str) -> Window:
        """A concurrency limit (`sidecar.algorithms.concurrency`): `requests_per_unit` requests in
        flight, each forgotten `lease` after it started (`30s`, `5m`, `1h`, or seconds) unless a
        refund closed it. It counts no time unit, so it takes none of a window's parts, and its
        starts must be stored at its own keys (a sorted set each)."""
        for key in ("unit", "unit_multiplier", "burst", "borrow", "calendar", "timezone",
                    "week_start", "ends"):  # fmt: skip
            if key in raw:
                raise self.error(
                    f"{path}.{key}",
                    f"{key} does not apply to concurrency, which counts requests in flight, not "
                    "per unit of time (remove it; 'lease' says how long a start is kept without "
                    "its refund)",
                )
        if self.codes is not None:
            raise self.error(
                f"{path}.algorithm",
                "concurrency needs its starts at their own keys, but this descriptor is under "
                "group_counters, whose counters share a hash (remove 'group_counters', or count "
                "what is in flight in another tree)",
            )
        requests = self.count(raw, "requests_per_unit", path, 0, default=0)
        if requests > MAX_IN_FLIGHT:
            raise self.error(
                f"{path}.requests_per_unit",
                f"a concurrency limit keeps each start in flight, so it admits at most "
                f"{MAX_IN_FLIGHT} at once, got {requests}",
            )
        lease = self.lease(raw.get("lease"), f"{path}.lease")
        request_id = raw.get("request_id", "")
        if not isinstance(request_id, str) or (request_id == "" and "request_id" in raw):
            raise self.error(
                f"{path}.request_id",
                "request_id names the descriptor entry that carries the request's id (the "
                "descriptor_key of Envoy's request_headers action on x-request-id), as in "
                f"request_id: x_request_id, got {request_id!r}",
            )
        return Window(
            requests, Unit.SECOND, Algorithm.CONCURRENCY, lease, name=name, request_id=request_id
        )

    def lease(self, raw: object, path: str) -> int:
        """A concurrency limit's lease in seconds: `30s`, `5m`, `1h`, or a number of seconds."""
        seconds = None
        if isinstance(raw, int) and not isinstance(raw, bool):
            seconds = raw
        elif isinstance(raw, str) and (found := _LEASE.fullmatch(raw.strip())):
            seconds = int(found.group(1)) * _LEASE_SECONDS[found.group(2)]
        if seconds is None or not 1 <= seconds <= MAX_LEASE_SECONDS:
            raise self.error(
                path,
                "a concurrency limit needs a lease from 1s to 24h, how long a start counts "
                "when no refund closes it (set it above your longest request, as in "
                "{algorithm: concurrency, requests_per_unit: 10, lease: 30s}), got "
                + ("none" if raw is None else repr(raw)),
            )
        return seconds

    def ends(self, raw: object, path: str) -> int:
        """A lifetime's end as Unix seconds: a YAML timestamp or date (UTC unless it says), an
        ISO 8601 string, or a number of Unix seconds."""
        value: object = raw
        if isinstance(raw, str):
            try:
                value = datetime.fromisoformat(raw)
            except ValueError:
                value = None
        if isinstance(value, datetime):
            aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
            return int(aware.timestamp())
        if isinstance(value, date):
            return int(datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp())
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise self.error(
            path, f"ends must be a date and time, like 2026-12-31T00:00:00Z, got {raw!r}"
        )

    def check_summed(self, window: Window, path: str) -> None:
        """Caps counted across identifiers are judged on the sum of their counters under each
        identifier, which only a plain fixed window's count allows."""
        if self.summed is None or window.plain:
            return
        what = "borrow" if window.borrow else "algorithm"
        found = f"borrow: {window.borrow}" if window.borrow else window.algorithm.value
        raise self.error(
            f"{path}.{what}",
            f"caps under '{self.summed}' are counted across identifiers, summed from fixed "
            f"windows only, but found {found} (count it per identifier, under the identifier's "
            "own key, or use a fixed window)",
        )

    def calendar_month(
        self, raw: dict[Any, Any], unit: Unit, algorithm: Algorithm, multiplier: int
    ) -> bool:
        """Whether `calendar_months` makes this window the UTC calendar month (see `parse`):
        one month, fixed, saying nothing of calendars, so a file valid without the setting is
        valid with it and means the same but for the month's bounds."""
        return (
            self.calendar_months
            and unit is Unit.MONTH
            and algorithm is Algorithm.FIXED_WINDOW
            and multiplier == 1
            and "calendar" not in raw
            and "timezone" not in raw
        )

    def unit(self, text: str, path: str) -> Unit:
        unit = _UNITS.get(text.lower())
        if unit is None:
            raise self.error(
                f"{path}.unit", f"invalid rate limit unit '{text}' (expected one of: {_UNIT_LIST})"
            )
        return unit

    def algorithm(self, raw: dict[Any, Any], path: str) -> Algorithm:
        text = self.scalar(raw.get("algorithm", "fixed_window"), f"{path}.algorithm")
        algorithm = _ALGORITHMS.get(text)
        if algorithm is None:
            hint = difflib.get_close_matches(text, list(_ALGORITHMS), n=1, cutoff=0.5)
            fix = (
                f"did you mean '{hint[0]}'?"
                if hint
                else f"expected one of: {', '.join(_ALGORITHMS)}"
            )
            raise self.error(f"{path}.algorithm", f"unknown algorithm '{text}' ({fix})")
        return algorithm

    def token_bucket(
        self, raw: dict[Any, Any], path: str, algorithm: Algorithm, requests: int
    ) -> int | None:
        """The burst, which only a token bucket has (None: as many as its requests_per_unit);
        a token bucket's requests_per_unit is its refill rate, so at least 1."""
        burst: int | None = None
        if "burst" in raw:
            if algorithm is not Algorithm.TOKEN_BUCKET:
                raise self.error(
                    f"{path}.burst",
                    "burst applies to token buckets (add 'algorithm: token_bucket')",
                )
            burst = self.count(raw, "burst", path, 1, default=1)
        if algorithm is Algorithm.TOKEN_BUCKET and requests < 1:
            raise self.error(
                f"{path}.requests_per_unit",
                "a token bucket needs requests_per_unit of at least 1 (its refill rate)",
            )
        return burst

    def check_borrow(self, borrow: int, path: str, algorithm: Algorithm, requests: int) -> None:
        """Borrowing is for fixed windows (at most one window's worth: the next window alone
        repays it) and token buckets."""
        if not borrow:
            return
        if algorithm is Algorithm.SLIDING_WINDOW:
            raise self.error(
                f"{path}.borrow",
                "borrow applies to fixed windows and token buckets, not sliding windows",
            )
        if algorithm is Algorithm.FIXED_WINDOW and borrow > requests:
            raise self.error(
                f"{path}.borrow",
                f"borrow {borrow} exceeds requests_per_unit {requests}: the next window alone repays "
                "the debt (lower borrow, or use a token bucket)",
            )

    def calendar(
        self,
        raw: dict[Any, Any],
        path: str,
        calendar: bool,
        algorithm: Algorithm,
        unit: Unit,
        multiplier: int,
    ) -> tuple[str, int]:
        """(timezone, week_start) of a calendar window: one fixed window of a day, week, month
        or year in its time zone; a window that is not a calendar one takes neither."""
        if not calendar:
            for key in ("timezone", "week_start"):
                if key in raw:
                    raise self.error(
                        f"{path}.{key}", f"{key} applies to calendar windows (add 'calendar: true')"
                    )
            return "UTC", 0
        if algorithm is not Algorithm.FIXED_WINDOW:
            raise self.error(
                f"{path}.calendar", "calendar windows are fixed windows (remove 'algorithm')"
            )
        if not is_calendar_unit(unit):
            raise self.error(
                f"{path}.calendar",
                "calendar windows are days, weeks, months or years (remove 'calendar')",
            )
        if multiplier != 1:
            raise self.error(
                f"{path}.unit_multiplier",
                "calendar windows are one unit long (remove 'unit_multiplier')",
            )
        timezone = self.scalar(raw.get("timezone", "UTC"), f"{path}.timezone")
        try:
            check_zone(timezone)
        except ValueError as exc:
            raise self.error(f"{path}.timezone", str(exc)) from exc
        week_text = self.scalar(raw.get("week_start", "monday"), f"{path}.week_start")
        if week_text not in _WEEK_STARTS:
            raise self.error(
                f"{path}.week_start", f"week_start must be monday or sunday, got '{week_text}'"
            )
        if "week_start" in raw and unit is not Unit.WEEK:
            raise self.error(
                f"{path}.week_start", "week_start applies to calendar weeks (unit: week)"
            )
        return timezone, _WEEK_STARTS[week_text]

    def check_code(self, window: Window, path: str) -> None:
        """Refuse a window whose code in a grouped tree is another kind's (hashed zone names)."""
        assert self.codes is not None
        window_code = code(window)
        window_kind = kind(window)
        known = self.codes.setdefault(window_code, (window_kind, window))
        if known[0] != window_kind:
            raise self.error(
                f"{path}.timezone",
                f"time zones '{known[1].timezone}' and '{window.timezone}' get the same counter "
                f"code '{window_code}' under group_counters (use one zone for both, or drop "
                "group_counters from this tree)",
            )

    def count(self, raw: dict[Any, Any], key: str, path: str, minimum: int, default: int) -> int:
        value = raw.get(key)
        if value is None:  # absent, or written `~`
            value = default
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not minimum <= value <= MAX_REQUESTS_PER_UNIT
        ):
            raise self.error(
                f"{path}.{key}",
                f"{key} must be a whole number from {minimum} to {MAX_REQUESTS_PER_UNIT}, got {value!r}",
            )
        return value

    def replaces(self, raw: object, path: str, own_name: str) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            raise self.error(path, "replaces must be a list of maps with a name")
        names = []
        for index, item in enumerate(raw):
            here = f"{path}[{index}]"
            if not isinstance(item, dict):
                raise self.error(
                    here, f"config error, yaml file contains list of type other than map: {item}"
                )
            self.check_keys(item, _REPLACES_KEYS, here, "in a replaces entry")
            name = self.scalar(item.get("name"), f"{here}.name", _text(item, "name"))
            if not name:
                raise self.error(
                    here, "should not have an empty replaces entry (name another rule's limit)"
                )
            if name == own_name:
                raise self.error(
                    here,
                    "replaces should not contain name of same descriptor (name another rule's limit)",
                )
            names.append(name)
        return tuple(names)
