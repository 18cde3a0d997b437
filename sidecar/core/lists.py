"""Allow and deny lists: files of CIDRs or of exact values per descriptor key, which decide a
request before any counter is asked.

A domain names its lists in its rules file (`lists`, an extension of the reference's format)::

    lists:
      - key: remote_address        # the descriptor key whose values the files hold
        match: cidr                # cidr: networks (IPv4 and IPv6); exact (the default): values
        deny: lists/blocked.txt    # paths relative to the rules file
        allow: lists/trusted.txt   # deny, allow or both

A list file holds one entry a line: a value, or under `match: cidr` a network (`10.0.0.0/8`,
`2001:db8::/32`) or an address (a network of one); blank lines and lines starting with `#` are
skipped. Files are read with the rules (`config.load`), and the files' marks are part of the
rules' fingerprint (`config.fingerprint`), so they reload with them (`App.reload`): a change of
a list file is a change of the rules, and a broken list is a broken rules load, counted in
`config_load_error`, logged once, and the rules and lists served before stay.

Precedence, decided per request, in this order:

1. deny: when any entry of any descriptor of the request has a value on a deny list of its key,
   the request is OVER_LIMIT (that descriptor's status OVER_LIMIT, the others OK), and no
   counter of any descriptor is touched;
2. allow: otherwise, when any entry is on an allow list, the request is OK, and nothing of it is
   counted (its other descriptors are not judged either);
3. otherwise the rules decide, as if there were no lists.

The request, not the descriptor, is the unit, because Envoy sends one call per HTTP request and
a client is what a list names: a trusted client judged by its other descriptors would still be
counted and refused, and a blocked one would still spend other clients' shared counters.
Deny comes first so that a network both trusted and blocked (a broad allow, a narrow deny) is
blocked: the safer mistake. Global shadow mode answers a denied request OK, as it answers any.

Cost: a CIDR list is a hash set of network numbers per prefix length present in it, so a lookup
masks the address once per distinct prefix length (at most 33 for IPv4, 129 for IPv6) and asks
a set: O(prefix length), whatever the length of the list. Memory: each entry is one integer in
one set, 86 bytes an entry on average (`bench/lists.py`: a 100,000-entry list, three quarters
IPv4, keeps 8.6 MB), so a file of at most MAX_ENTRIES entries keeps about 100 MB at most. An
exact list is a frozenset of its values. The lookup is made when a request body is planned
(`sidecar.decision.plan`), so a body sent again pays it once.

`parse` (pure) reads the rules' declaration; `read` is the one function here that touches disk.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Literal

from sidecar.errors import ConfigError
from sidecar.model import Descriptor

#: Bounds on what a domain may declare and a list file may hold.
MAX_LISTS = 32
MAX_ENTRIES = 1_000_000
MAX_FILE_BYTES = 64 * 1024 * 1024

Match = Literal["cidr", "exact"]
Action = Literal["deny", "allow"]
_KEYS = ("key", "match", "deny", "allow")
_MATCHES: tuple[Match, ...] = ("cidr", "exact")
_ACTIONS: tuple[Action, ...] = ("deny", "allow")
#: IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) are matched as the IPv4 address they carry.
_MAPPED = 0xFFFF


@dataclass(frozen=True, slots=True)
class ListFile:
    """One list a rules file names: the key whose values it holds, how they match, whether it
    denies or allows, the file, and where the rules name it (for errors)."""

    key: str
    match: Match
    action: Action
    path: Path
    source: str
    where: str


class Networks:
    """A set of IPv4 and IPv6 networks: per prefix length, the set of network numbers (the
    address shifted right past its host bits). `__contains__` takes an address as text."""

    __slots__ = ("_v4", "_v6", "entries")

    def __init__(self, networks: Iterable[tuple[int, int, int]]) -> None:
        """`networks`: (version, address, prefix length) of each, host bits clear."""
        v4: dict[int, set[int]] = {}
        v6: dict[int, set[int]] = {}
        count = 0
        for version, address, length in networks:
            bits = 32 if version == 4 else 128
            (v4 if version == 4 else v6).setdefault(bits - length, set()).add(
                address >> (bits - length)
            )
            count += 1
        #: (host bits, network numbers), shortest prefix first: a broad network is likelier hit.
        self._v4 = tuple(sorted(((shift, frozenset(s)) for shift, s in v4.items()), reverse=True))
        self._v6 = tuple(sorted(((shift, frozenset(s)) for shift, s in v6.items()), reverse=True))
        self.entries = count

    def __contains__(self, value: str) -> bool:
        """Whether the address `value` lies in one of the networks; False for anything that is
        not an address (a list never fails a request)."""
        address = _address(value)
        if address is None:
            return False
        version, number = address
        for shift, numbers in self._v4 if version == 4 else self._v6:
            if number >> shift in numbers:
                return True
        return False

    def __len__(self) -> int:
        return self.entries

    @property
    def probes(self) -> tuple[int, int]:
        """The most sets one lookup asks, of an IPv4 and of an IPv6 address: the prefix lengths
        the list holds (at most 33 and 129), whatever its number of entries."""
        return len(self._v4), len(self._v6)


def _address(value: str) -> tuple[int, int] | None:
    """(version, number) of an IPv4 or IPv6 address written as text, None for anything else."""
    # One parse, of the family the text can be: a failed parse costs an exception.
    family = socket.AF_INET6 if ":" in value else socket.AF_INET
    try:
        number = int.from_bytes(socket.inet_pton(family, value), "big")
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return None
    if family == socket.AF_INET:
        return 4, number
    if number >> 32 == _MAPPED:
        return 4, number & 0xFFFFFFFF
    return 6, number


@dataclass(frozen=True, slots=True)
class Listed:
    """What the lists decided for a request: denied (else allowed), by the list of `key`, on
    the descriptor at `index`; `stat` names its counter (`domain.key`)."""

    denied: bool
    key: str
    index: int
    stat: str


@dataclass(frozen=True, slots=True)
class _KeyLists:
    deny: Networks | frozenset[str] | None
    allow: Networks | frozenset[str] | None


class Lists:
    """Every list of one domain, by descriptor key (see the module docstring for precedence)."""

    __slots__ = ("_by_key", "_domain")

    def __init__(self, domain: str, contents: Mapping[ListFile, Networks | frozenset[str]]) -> None:
        self._domain = domain
        by_key: dict[str, _KeyLists] = {}
        for declared, held in contents.items():
            known = by_key.get(declared.key, _KeyLists(None, None))
            if declared.action == "deny":
                by_key[declared.key] = _KeyLists(held, known.allow)
            else:
                by_key[declared.key] = _KeyLists(known.deny, held)
        self._by_key = by_key

    def held(self, key: str, action: Action) -> Networks | frozenset[str] | None:
        """What the `action` list of `key` holds (None: no such list)."""
        lists = self._by_key.get(key)
        if lists is None:
            return None
        return lists.deny if action == "deny" else lists.allow

    def judge(self, descriptors: Sequence[Descriptor]) -> Listed | None:
        """Denied, allowed, or None when no list names a value of the request."""
        allowed: Listed | None = None
        by_key = self._by_key
        for index, descriptor in enumerate(descriptors):
            for entry in descriptor.entries:
                lists = by_key.get(entry.key)
                if lists is None:
                    continue
                if lists.deny is not None and entry.value in lists.deny:
                    return Listed(True, entry.key, index, f"{self._domain}.{entry.key}")
                if allowed is None and lists.allow is not None and entry.value in lists.allow:
                    allowed = Listed(False, entry.key, index, f"{self._domain}.{entry.key}")
        return allowed


def parse(raw: object, source: str) -> tuple[ListFile, ...]:
    """The `lists` of a rules file named `source`; raises ConfigError naming the file, the
    path and the fix. Paths are relative to the rules file's directory."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(
            source,
            "lists",
            "lists must be a list of maps like {key: remote_address, match: cidr, deny: "
            "denied.txt} (or remove 'lists')",
        )
    if len(raw) > MAX_LISTS:
        raise ConfigError(source, "lists", f"at most {MAX_LISTS} lists, got {len(raw)}")
    base = PurePath(source).parent
    found: list[ListFile] = []
    keys: dict[str, str] = {}
    for index, item in enumerate(raw):
        here = f"lists[{index}]"
        if not isinstance(item, dict):
            raise ConfigError(
                source, here, f"a list is a map like {{key: user, deny: denied.txt}}, got {item!r}"
            )
        for name in item:
            if name not in _KEYS:
                raise ConfigError(
                    source, here, f"unknown key '{name}' in a list (allowed: {', '.join(_KEYS)})"
                )
        key = item.get("key")
        if not isinstance(key, str) or not key:
            raise ConfigError(
                source, f"{here}.key", "key must be the descriptor key the list's values are of"
            )
        if key in keys:
            raise ConfigError(
                source,
                f"{here}.key",
                f"key '{key}' has its lists at {keys[key]} already (put deny and allow there)",
            )
        keys[key] = here
        match = item.get("match", "exact")
        if match not in _MATCHES:
            raise ConfigError(
                source, f"{here}.match", f"match must be cidr or exact, not {match!r}"
            )
        if not any(item.get(action) is not None for action in _ACTIONS):
            raise ConfigError(source, here, "a list needs a file: deny: PATH, allow: PATH, or both")
        for action in _ACTIONS:
            path = item.get(action)
            if path is None:
                continue
            if not isinstance(path, str) or not path:
                raise ConfigError(
                    source,
                    f"{here}.{action}",
                    f"{action} must be the path of a list file (relative to {source})",
                )
            found.append(
                ListFile(key, match, action, Path(base / path), source, f"{here}.{action}")
            )
    return tuple(found)


def read(domain: str, files: Sequence[ListFile]) -> Lists:
    """The lists of `domain` read from their files; raises ConfigError naming the list file,
    the line and the fix for a bad entry, or the rules file and the path for a missing file."""
    return Lists(domain, {declared: _read_one(declared) for declared in files})


def _read_one(declared: ListFile) -> Networks | frozenset[str]:
    name = str(declared.path)
    try:
        with declared.path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            declared.source,
            declared.where,
            f"error loading list file {name}: {exc.strerror or exc} (fix the path, relative "
            "to the rules file)",
        ) from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(name, "", f"list file larger than {MAX_FILE_BYTES} bytes (split it)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, "", f"list file is not UTF-8: {exc}") from exc
    lines = _entries(text, name)
    if declared.match == "exact":
        return frozenset(value for _, value in lines)
    return Networks(_network(value, name, number) for number, value in lines)


def _entries(text: str, name: str) -> list[tuple[int, str]]:
    """(line number, entry) of each line that is not blank or a comment."""
    found: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        if len(found) == MAX_ENTRIES:
            raise ConfigError(
                name, f"line {number}", f"more than {MAX_ENTRIES} entries (split the list)"
            )
        found.append((number, entry))
    return found


def _network(text: str, name: str, number: int) -> tuple[int, int, int]:
    """(version, address, prefix length) of `10.0.0.0/8`, `2001:db8::/32` or an address."""
    address_text, slash, length_text = text.partition("/")
    address = _address(address_text)
    if address is None or "%" in address_text:
        raise ConfigError(
            name,
            f"line {number}",
            f"'{text}' is not a network: write an address or ADDRESS/PREFIX, like 10.0.0.0/8 "
            "or 2001:db8::/32",
        )
    version, value = address
    # An IPv4-mapped network (::ffff:10.0.0.0/104) counts IPv6 bits, and is kept as the IPv4
    # network it maps, as its addresses are matched.
    mapped = 96 if ":" in address_text and version == 4 else 0
    bits = 32 if version == 4 else 128
    if not slash:
        return version, value, bits
    if not (length_text.isascii() and length_text.isdigit()) or not (
        mapped <= int(length_text) <= bits + mapped
    ):
        raise ConfigError(
            name,
            f"line {number}",
            f"'{text}': the prefix length must be a number from {mapped} to {bits + mapped}",
        )
    length = int(length_text) - mapped
    host = value & ((1 << (bits - length)) - 1)
    if host:
        network = value - host
        shown = socket.inet_ntop(
            socket.AF_INET if version == 4 else socket.AF_INET6,
            network.to_bytes(bits // 8, "big"),
        )
        raise ConfigError(
            name,
            f"line {number}",
            f"'{text}' has host bits set (did you mean {shown}/{length}?)",
        )
    return version, value, length
