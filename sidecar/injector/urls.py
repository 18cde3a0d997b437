"""Backend URLs checked without opening anything, so a bad one is refused at admission time.

The rules mirror what `sidecar.storage` accepts when the sidecar starts (``memory://``,
``redis://[user:password@]host[:port][/db]``, ``rediss://...`` with its TLS query parameters,
``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://`` with the same TLS
parameters, ``redis+sentinel://[user:password@]host[:port][,...]/master-name[/db]`` with
``sentinel_username`` and ``sentinel_password``, ``rediss+sentinel://`` with the TLS parameters
too): a URL that passes here starts a sidecar, so a
typo becomes an admission error instead of a pod in CrashLoopBackOff. Messages never show a
password, because they end up in events and `kubectl` output.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

#: Longer than any real backend URL, short enough that an error message stays readable.
MAX_URL_LENGTH = 2048

_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_CERT_REQS = ("none", "optional", "required")
_SCHEMES = (
    "use memory://, redis://host:port, rediss://host:port, "
    "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS) "
    "or redis+sentinel://host:port[,host:port...]/master-name (rediss+sentinel:// for TLS)"
)


def validate_url(url: str) -> None:
    """Raise ValueError, naming the fault, for a backend URL the sidecar would refuse."""
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(
            f"backend URL is {len(url)} characters long; the limit is {MAX_URL_LENGTH}"
        )
    if any(char.isspace() or not char.isprintable() for char in url):
        raise ValueError(f"{redact(url)!r}: backend URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # urlsplit refuses an unbalanced IPv6 bracket
        raise ValueError(f"{redact(url)!r}: {exc}") from None
    if parts.scheme == "memory":
        if parts.netloc or parts.path or parts.fragment:
            raise ValueError(f"{redact(url)!r}: memory:// takes no host or path")
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name != "max_counters" or not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"{redact(url)!r}: memory:// takes only ?max_counters=N (N at least 1)"
                )
    elif parts.scheme in ("redis", "rediss"):
        _check_redis(url, parts.scheme == "rediss")
    elif parts.scheme in ("redis+cluster", "rediss+cluster"):
        _check_cluster(url, parts.scheme == "rediss+cluster")
    elif parts.scheme in ("redis+sentinel", "rediss+sentinel"):
        _check_sentinel(url, parts.scheme == "rediss+sentinel")
    else:
        raise ValueError(f"unsupported backend URL {redact(url)!r}: {_SCHEMES}")


def redact(url: str) -> str:
    """The URL with its passwords replaced by ``***`` (the userinfo's, and a Sentinel URL's
    ``sentinel_password``)."""
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


def _check_redis(url: str, tls: bool) -> None:
    parts = urlsplit(url)
    _check_address(url, parts.netloc.rpartition("@")[2])
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise ValueError(f"{redact(url)!r}: database must be a number like /0, not {parts.path!r}")
    _check_tls_options(url, parts.query, tls)
    if parts.fragment:
        raise ValueError(f"{redact(url)!r}: unexpected fragment '#{parts.fragment}'")


def _check_tls_options(url: str, query: str, tls: bool, also: tuple[str, ...] = ()) -> None:
    """The query of a URL: TLS parameters, each with a value the sidecar accepts, or nothing;
    and the parameters in `also`, with any value."""
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in also:
            continue
        if not tls or name not in _TLS_OPTIONS:
            allowed = ", ".join([*(sorted(_TLS_OPTIONS) if tls else []), *also]) or "none"
            raise ValueError(
                f"{redact(url)!r}: unknown query parameter {name!r} (allowed: {allowed})"
            )
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise ValueError(
                f"{redact(url)!r}: ssl_cert_reqs must be none, optional or required, not {value!r}"
            )


def _check_cluster(url: str, tls: bool) -> None:
    parts = urlsplit(url)
    _check_hosts(url, parts.netloc, "no host:port to start cluster discovery from")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{redact(url)!r}: Redis Cluster has only database 0, not {parts.path!r}")
    if parts.fragment or (parts.query and not tls):
        raise ValueError(f"{redact(url)!r}: {parts.scheme}:// takes no query or fragment")
    _check_tls_options(url, parts.query, tls)


def _check_sentinel(url: str, tls: bool) -> None:
    parts = urlsplit(url)
    _check_hosts(url, parts.netloc, "no Sentinel host:port")
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
    _check_tls_options(url, parts.query, tls, _SENTINEL_OPTIONS)


def _check_hosts(url: str, netloc: str, missing: str) -> None:
    """A comma-separated list of ``host[:port]`` after any userinfo; `missing` when empty."""
    hosts = netloc.rpartition("@")[2]
    if not hosts:
        raise ValueError(f"{redact(url)!r}: {missing}")
    for address in hosts.split(","):
        _check_address(url, address)


def _check_address(url: str, address: str) -> None:
    """``host[:port]``, IPv6 in brackets; the port, when given, from 1 to 65535."""
    try:
        parts = urlsplit(f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(
            f"{redact(url)!r}: bad address {address!r} (want host:port, port from 1 to 65535)"
        ) from None
    if not host:
        raise ValueError(f"{redact(url)!r}: missing host in {address!r}")
    if port == 0:
        raise ValueError(
            f"{redact(url)!r}: bad port in {address!r} (want a number from 1 to 65535)"
        )
