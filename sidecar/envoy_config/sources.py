"""Where each descriptor key of the rules comes from in a request: the `--sources` file.

The file maps a descriptor key to a request attribute::

    remote_address: remote_address          # the client's address
    interface: route                        # the name of the route the request matched
    page: path                              # the :path header, query string included
    user: {header: x-user-id}               # a request header
    tier: {generic_key: free}               # a fixed value
    ad: {header: x-ad-id, count: on_success, routes: [ads]}

A string is shorthand for ``{attribute: NAME}``. In the long form, ``count: on_success`` makes
every rule whose descriptor holds the key check-then-count: checked when the request arrives
(``hits_addend`` 0) and counted once the response is a 2xx. ``routes`` sends the key, and so
every descriptor holding it, on the named routes only.

`parse` is pure; `load` is the only function here that reads the disk.
Errors are ConfigErrors naming the file, the key and the fix.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar.errors import ConfigError


class Attribute(enum.Enum):
    """What a descriptor entry's value is read from."""

    REMOTE_ADDRESS = "remote_address"
    PATH = "path"
    ROUTE = "route"
    HEADER = "header"
    GENERIC_KEY = "generic_key"


class Count(enum.Enum):
    """When a request adds to the counters of a descriptor holding the key."""

    ON_REQUEST = "on_request"
    ON_SUCCESS = "on_success"


#: Attributes that need no argument, usable as a plain string.
_NAMED = (Attribute.REMOTE_ADDRESS, Attribute.PATH, Attribute.ROUTE)
_OPTIONS = ("header", "generic_key", "attribute", "count", "routes")
_EXPECTED = "remote_address, path, route, {header: NAME} or {generic_key: VALUE}"


@dataclass(frozen=True)
class Source:
    """One descriptor key and where its value comes from.

    `argument` is the header name for HEADER and the fixed value for GENERIC_KEY; `routes` is
    empty when the key is read on every route.
    """

    key: str
    attribute: Attribute
    argument: str = ""
    count: Count = Count.ON_REQUEST
    routes: tuple[str, ...] = ()

    def on_route(self, route: str) -> bool:
        return not self.routes or route in self.routes


@dataclass(frozen=True)
class Sources:
    """Every key of one sources file, in the file's order."""

    name: str
    keys: Mapping[str, Source]


def load(path: str | Path) -> Sources:
    """Read and parse a sources file; a file that cannot be read is a ConfigError too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read the sources file: {exc.strerror}") from exc
    return parse(text, str(path))


def parse(text: str, name: str) -> Sources:
    """The sources in `text`, read from the file called `name` (used in error messages)."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, "", f"not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not document:
        raise ConfigError(
            name,
            "",
            "a sources file maps each descriptor key to a request attribute "
            "(for example 'user: {header: x-user-id}')",
        )
    keys: dict[str, Source] = {}
    for key, spec in document.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(name, str(key), "a descriptor key must be a non-empty string")
        keys[key] = _source(name, key, spec)
    return Sources(name=name, keys=keys)


def _source(name: str, key: str, spec: object) -> Source:
    if isinstance(spec, str):
        return Source(key, _named(name, key, spec))
    if not isinstance(spec, dict):
        raise ConfigError(name, key, f"expected {_EXPECTED}, got {spec!r}")
    _check_options(name, key, spec)
    given = [option for option in ("header", "generic_key", "attribute") if option in spec]
    if len(given) != 1:
        raise ConfigError(
            name, key, "give exactly one of header, generic_key or attribute for the value"
        )
    option = given[0]
    raw = spec[option]
    if option == "attribute":
        attribute, argument = _named(name, f"{key}.attribute", raw), ""
    else:
        if not isinstance(raw, str | int) or isinstance(raw, bool) or str(raw) == "":
            raise ConfigError(name, f"{key}.{option}", f"{option} must be a non-empty string")
        attribute, argument = Attribute(option), str(raw)
    return Source(
        key,
        attribute,
        argument,
        count=_count(name, key, spec.get("count", Count.ON_REQUEST.value)),
        routes=_routes(name, key, spec.get("routes")),
    )


def _named(name: str, path: str, raw: object) -> Attribute:
    for attribute in _NAMED:
        if raw == attribute.value:
            return attribute
    hint = difflib.get_close_matches(str(raw), [a.value for a in _NAMED], n=1, cutoff=0.6)
    fix = f"did you mean '{hint[0]}'?" if hint else f"expected {_EXPECTED}"
    raise ConfigError(name, path, f"unknown attribute {raw!r} ({fix})")


def _check_options(name: str, key: str, spec: Mapping[Any, Any]) -> None:
    for option in spec:
        if option not in _OPTIONS:
            hint = difflib.get_close_matches(str(option), _OPTIONS, n=1, cutoff=0.6)
            fix = f"did you mean '{hint[0]}'?" if hint else f"allowed: {', '.join(_OPTIONS)}"
            raise ConfigError(name, key, f"unknown option '{option}' ({fix})")


def _count(name: str, key: str, raw: object) -> Count:
    for count in Count:
        if raw == count.value:
            return count
    raise ConfigError(name, f"{key}.count", f"count must be on_request or on_success, got {raw!r}")


def _routes(name: str, key: str, raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or not all(isinstance(r, str) and r for r in raw):
        raise ConfigError(name, f"{key}.routes", "routes must be a non-empty list of route names")
    return tuple(raw)
