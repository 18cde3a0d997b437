"""Backend URLs: the one parser of what a URL names, for the sidecar that opens it and for the
injector that checks it at admission time (`sidecar.injector.urls`). Standard library only, so
checking a URL imports no client.

The forms: ``memory://`` (``?max_counters=N`` caps its counters), ``redis://[user:password@]host[:port][/db]``,
``rediss://...`` (TLS), ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``
for TLS) and ``redis+sentinel://[user:password@]host[:port][,host[:port]...]/master-name[/db]``
(``rediss+sentinel://`` for TLS; ``?sentinel_username=&sentinel_password=`` for the Sentinels).
TLS URLs take ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and ``ssl_cert_reqs`` (none,
optional, required) as query parameters.

`parse` raises ValueError naming the fault; messages quote the URL by `redact`, which hides its
passwords, because they end up in logs, events and `kubectl` output.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit

#: A Redis server's port when a URL gives none.
REDIS_PORT = 6379
#: A Sentinel's port when a URL gives none.
SENTINEL_PORT = 26379

TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
#: Query parameters of a Sentinel URL beside the TLS ones: the Sentinels' own credentials (the
#: userinfo is the master's, as envoyproxy/ratelimit's REDIS_AUTH and REDIS_SENTINEL_AUTH).
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_SCHEMES = (
    "use memory://, redis://host:port, rediss://host:port, "
    "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS) "
    "or redis+sentinel://host:port[,host:port...]/master-name (rediss+sentinel:// for TLS)"
)

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class TLS:
    """A TLS URL's query: verification on unless ``ssl_cert_reqs`` says otherwise."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: ssl.VerifyMode = ssl.CERT_REQUIRED

    def context(self) -> ssl.SSLContext:
        """A new context: built at each connection, so certificate files are read when they are
        needed (and read again after a rotation), not when the URL is parsed."""
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        if self.cert_reqs == ssl.CERT_NONE:
            context.check_hostname = False
        context.verify_mode = self.cert_reqs
        return context


@dataclass(frozen=True, slots=True)
class MemoryURL:
    """``memory://``: counters in this process; `max_counters` None keeps the default."""

    max_counters: int | None


@dataclass(frozen=True, slots=True)
class RedisURL:
    """``redis://`` or ``rediss://``: one server (or any single endpoint: a proxy, a primary)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    tls: TLS | None


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """``redis+cluster://`` or ``rediss+cluster://``: the nodes discovery starts from."""

    nodes: tuple[Address, ...]
    username: str | None
    password: str | None
    tls: TLS | None


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """``redis+sentinel://`` or ``rediss+sentinel://``: the Sentinels and the master they name;
    `username` and `password` are the master's, TLS is for both."""

    sentinels: tuple[Address, ...]
    master_name: str
    db: int
    username: str | None
    password: str | None
    sentinel_username: str | None
    sentinel_password: str | None
    tls: TLS | None


BackendURL = MemoryURL | RedisURL | ClusterURL | SentinelURL


def parse(url: str) -> BackendURL:
    """What a backend URL names; raises ValueError with the reason for a URL no backend can use."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # urlsplit refuses an unbalanced IPv6 bracket
        raise ValueError(f"{redact(url)!r}: {exc}") from None
    scheme = parts.scheme
    if scheme == "memory":
        return _memory(url, parts)
    if scheme in ("redis", "rediss"):
        return _redis(url, parts, scheme == "rediss")
    if scheme in ("redis+cluster", "rediss+cluster"):
        return _cluster(url, parts, scheme == "rediss+cluster")
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return _sentinel(url, parts, scheme == "rediss+sentinel")
    raise ValueError(f"unsupported backend URL {redact(url)!r}: {_SCHEMES}")


def redact(url: str) -> str:
    """The URL with its passwords replaced by ``***`` (the userinfo's, and a Sentinel URL's
    ``sentinel_password``). Read as text, so a URL `urlsplit` refuses is redacted too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, question, query = rest.partition("?")
    if "sentinel_password=" in query:
        query = "&".join(
            "sentinel_password=***" if field.startswith("sentinel_password=") else field
            for field in query.split("&")
        )
    netloc, slash, tail = head.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    return f"{scheme}://{netloc}{slash}{tail}{question}{query}"


def timeout_seconds(url: str, timeout_ms: int) -> float:
    """A backend's call timeout in seconds; raises ValueError, naming the URL, unless positive."""
    if timeout_ms <= 0:
        raise ValueError(
            f"{redact(url)!r}: timeout must be a positive number of ms, not {timeout_ms}"
        )
    return timeout_ms / 1000


def _memory(url: str, parts: SplitResult) -> MemoryURL:
    """`memory://` takes one query parameter, `max_counters` (a whole number, at least 1)."""
    if parts.netloc or parts.path or parts.fragment:
        raise ValueError(f"{redact(url)!r}: memory:// takes no host or path, only ?max_counters=N")
    max_counters = None
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name != "max_counters":
            raise ValueError(
                f"{redact(url)!r}: unknown query parameter {name!r} (allowed: max_counters)"
            )
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"{redact(url)!r}: max_counters must be a whole number of at least 1")
        max_counters = int(value)
    return MemoryURL(max_counters)


def _redis(url: str, parts: SplitResult, tls: bool) -> RedisURL:
    host, port = _address(url, parts.netloc.rpartition("@")[2], REDIS_PORT)
    options = _tls(url, parts.query, tls)
    if parts.fragment:
        raise ValueError(f"{redact(url)!r}: unexpected fragment '#{parts.fragment}'")
    username, password = _credentials(parts.netloc)
    return RedisURL(host, port, _database(url, parts.path), username, password, options)


def _cluster(url: str, parts: SplitResult, tls: bool) -> ClusterURL:
    nodes = _addresses(
        url, parts.netloc, REDIS_PORT, "no host:port to start cluster discovery from"
    )
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{redact(url)!r}: Redis Cluster has only database 0, not {parts.path!r}")
    if parts.fragment or (parts.query and not tls):
        raise ValueError(f"{redact(url)!r}: {parts.scheme}:// takes no query or fragment")
    options = _tls(url, parts.query, tls)
    return ClusterURL(nodes, *_credentials(parts.netloc), options)


def _sentinel(url: str, parts: SplitResult, tls: bool) -> SentinelURL:
    sentinels = _addresses(url, parts.netloc, SENTINEL_PORT, "no Sentinel host:port")
    name, _, database = parts.path.lstrip("/").partition("/")
    if not name:
        raise ValueError(
            f"{redact(url)!r}: no master name: want {parts.scheme}://host:port/master-name[/db]"
        )
    if database and not (database.isascii() and database.isdigit()):
        raise ValueError(
            f"{redact(url)!r}: database must be a number like /master-name/0, not {database!r}"
        )
    if parts.fragment:
        raise ValueError(f"{redact(url)!r}: unexpected fragment '#{parts.fragment}'")
    fields = parse_qsl(parts.query, keep_blank_values=True)
    credentials = {field: value for field, value in fields if field in SENTINEL_OPTIONS}
    rest = urlencode([(field, value) for field, value in fields if field not in SENTINEL_OPTIONS])
    options = _tls(url, rest, tls, SENTINEL_OPTIONS)
    return SentinelURL(
        sentinels,
        unquote(name),
        int(database or 0),
        *_credentials(parts.netloc),
        sentinel_username=credentials.get("sentinel_username") or None,
        sentinel_password=credentials.get("sentinel_password"),
        tls=options,
    )


def _credentials(netloc: str) -> tuple[str | None, str | None]:
    """The userinfo's user name (None when empty) and password (None when there is none)."""
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return None, None
    username, has_password, password = userinfo.partition(":")
    return unquote(username) or None, unquote(password) if has_password else None


def _addresses(url: str, netloc: str, default_port: int, missing: str) -> tuple[Address, ...]:
    """A comma-separated list of ``host[:port]`` after any userinfo; `missing` when empty."""
    hosts = netloc.rpartition("@")[2]
    if not hosts:
        raise ValueError(f"{redact(url)!r}: {missing}")
    return tuple(_address(url, address, default_port) for address in hosts.split(","))


def _address(url: str, address: str, default_port: int) -> Address:
    """``host[:port]`` (IPv6 in brackets) to a host and a port, `default_port` when none is
    given."""
    bad_port = f"{redact(url)!r}: bad port in {address!r} (want a number from 1 to 65535)"
    try:
        parts = urlsplit(f"//{address}")
    except ValueError:  # an unbalanced IPv6 bracket
        raise ValueError(
            f"{redact(url)!r}: bad address {address!r} (want host:port, port from 1 to 65535)"
        ) from None
    host = parts.hostname
    if not host:
        raise ValueError(f"{redact(url)!r}: missing host in {address!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(bad_port) from None
    if port == 0:
        raise ValueError(bad_port)
    return host, port if port is not None else default_port


def _database(url: str, path: str) -> int:
    name = path.lstrip("/")
    if not name:
        return 0
    if not (name.isascii() and name.isdigit()):
        raise ValueError(f"{redact(url)!r}: database must be a number like /0, not {path!r}")
    return int(name)


def _tls(url: str, query: str, tls: bool, also: tuple[str, ...] = ()) -> TLS | None:
    """A URL's TLS parameters (None without TLS); `also` names the other parameters its
    scheme takes, for the message that refuses an unknown one."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if not tls or name not in TLS_OPTIONS:
            allowed = ", ".join([*(sorted(TLS_OPTIONS) if tls else []), *also]) or "none"
            raise ValueError(
                f"{redact(url)!r}: unknown query parameter {name!r} (allowed: {allowed})"
            )
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise ValueError(
                f"{redact(url)!r}: ssl_cert_reqs must be none, optional or required, not {value!r}"
            )
        options[name] = value
    if not tls:
        return None
    return TLS(
        ca_certs=options.get("ssl_ca_certs"),
        certfile=options.get("ssl_certfile"),
        keyfile=options.get("ssl_keyfile"),
        cert_reqs=_CERT_REQS[options.get("ssl_cert_reqs", "required")],
    )
