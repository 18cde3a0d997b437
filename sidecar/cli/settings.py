"""The reference's environment variables (envoyproxy/ratelimit `src/settings/settings.go`), read
with its meanings and turned into the sidecar's own settings.

Two tables drive it:

- `VARIABLES`: every variable the reference reads, with its default there, how far the sidecar
  honours it (`Support`) and how, in words. README's table of settings is `markdown()` of it.
- `FLAGS`: each `serve` flag that reference variables can set, the variables it reads and the
  converter that makes the flag's value (in its `RLS_<FLAG>` form) from them.
- `JUDGED`: booleans no flag takes (the sidecar already does what they ask), read only so that
  a value the reference would refuse is refused here too.

`translate` applies `FLAGS` to an environment and returns `RLS_*` variables; the command line
reads them beneath the real `RLS_*` variables and flags, which therefore win. `ignored` lists
the variables that are set but ask for something the sidecar does not do, to be logged once at
start-up: nothing set is silently ignored. To support another variable, add a row to `FLAGS`
and mark it supported in `VARIABLES`. For that log too, `shown` gives the values of the
variables read (secrets hidden) and `misspelled` the names set that are one typo from a
variable; `present` names those set when they are not read (`serve` without --reference-env).

Three kinds of variables the reference's libraries read, not settings.go, are honoured too:
STATSD_PROTOCOL (lyft/gostats; a row of `FLAGS`), DOG_STATSD_MOGRIFIER_<NAME>_PATTERN, _NAME
and _TAGS (the definitions of the mogrifiers USE_DOG_STATSD_MOGRIFIERS names, read by
`sidecar.telemetry.statsd`, for --dogstatsd-mogrifiers too) and OTEL_EXPORTER_OTLP_* (read by the
OpenTelemetry SDK; the timeouts by `sidecar.telemetry.tracing`). The other standard OTEL_* variables the
reference reads since its PR #1171 stand in for the TRACING_* ones that are unset (rows of
`VARIABLES` marked `standard`).

One module past the usual size because most of it is the two tables, a row per variable (every
variable the reference reads), which change together with `translate`.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from sidecar.storage.urls import parse as parse_backend_url
from sidecar.storage.urls import redact

Env = Mapping[str, str]

#: The reference's rules directory when nothing says otherwise: RUNTIME_ROOT, then
#: RUNTIME_SUBDIRECTORY (empty), then RUNTIME_APPDIRECTORY.
RUNTIME_ROOT = "/srv/runtime_data/current"
RUNTIME_APPDIRECTORY = "config"
#: What one over-limit cache entry costs, to turn LOCAL_CACHE_SIZE_IN_BYTES into entries: about
#: 90 bytes of dict slot and tuple measured, plus the counter's key.
CACHE_ENTRY_BYTES = 256


class SettingError(ValueError):
    """A reference variable whose value cannot be used; the message names it and says why."""


class Support(enum.Enum):
    SUPPORTED = "supported"
    #: Accepted, and what it does here differs from the reference (the note says how and why).
    DIFFERENT = "different"
    #: Not supported; set to anything but its harmless values, it is logged at start-up.
    UNSUPPORTED = "not supported"


def _false(value: str) -> bool:
    return not _truthy(value)


def _never(value: str) -> bool:
    return False


def _always(value: str) -> bool:
    return True


@dataclass(frozen=True)
class Variable:
    """One reference variable: its default there, how the sidecar takes it, and which values
    ask for nothing the sidecar lacks (those are not logged)."""

    name: str
    default: str
    support: Support
    note: str
    harmless: Callable[[str], bool] = _never
    #: A standard OpenTelemetry variable, which the reference reads too: other programs'
    #: environments set it as well, so its presence alone does not say the environment was
    #: written for the reference (`present`).
    standard: bool = False


# --- Reading values as the reference does ---------------------------------------------------

_TRUE = {"1", "t", "true"}
_FALSE = {"0", "f", "false"}


def _truthy(value: str) -> bool:
    return value.strip().lower() in _TRUE


def boolean(name: str, env: Env) -> bool | None:
    """A boolean as Go's strconv.ParseBool reads it (1, t, true, 0, f, false in any case);
    None when unset."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"{name}={raw!r}: expected true or false")


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(name: str, env: Env) -> float | None:
    """Seconds, from a Go duration (`10s`, `1m30s`, `250ms`; a bare `0` is 0); None when unset."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    text = raw.strip()
    if text == "0":
        return 0.0
    total, at = 0.0, 0
    for match in _DURATION.finditer(text):
        if match.start() != at:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        at = match.end()
    if at != len(text) or not text:
        raise SettingError(f"{name}={raw!r}: expected a duration such as 10s, 250ms or 1m30s")
    return total


def number(name: str, env: Env, minimum: int = 0) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a whole number") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def _port(name: str, env: Env, default: int) -> int:
    value = number(name, env)
    if value is None:
        return default
    if value > 65_535:
        raise SettingError(f"{name}={value}: not a port number")
    return value


def _join(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    return f"{host}:{port}"


def _listen(host_var: str, port_var: str, default_port: int, env: Env) -> str | None:
    if not env.get(host_var) and not env.get(port_var):
        return None
    return _join(env.get(host_var, "").strip(), _port(port_var, env, default_port))


def _go_address(name: str, env: Env, default: str) -> str:
    """A Go listen address (`:9090`, `host:9090`) as HOST:PORT."""
    raw = (env.get(name) or default).strip()
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65_535:
        raise SettingError(f"{name}={raw!r}: expected [HOST]:PORT, e.g. :9090")
    return _join(host.strip("[]"), int(port))


# --- Each flag, from the variables it reads -------------------------------------------------


def _grpc_address(env: Env, defaults: bool) -> str | None:
    uds = env.get("GRPC_UDS", "").strip()
    if uds:
        return f"unix:{uds}"
    return _listen("GRPC_HOST", "GRPC_PORT", 8081, env)


def _http_address(env: Env, defaults: bool) -> str | None:
    return _listen("HOST", "PORT", 8080, env)


def _debug_address(env: Env, defaults: bool) -> str | None:
    return _listen("DEBUG_HOST", "DEBUG_PORT", 6070, env)


def _metrics_address(env: Env, defaults: bool) -> str | None:
    if not boolean("USE_PROMETHEUS", env):
        return None
    return _go_address("PROMETHEUS_ADDR", env, ":9090")


def _metrics_path(env: Env, defaults: bool) -> str | None:
    if not boolean("USE_PROMETHEUS", env) or not env.get("PROMETHEUS_PATH"):
        return None
    path = env["PROMETHEUS_PATH"].strip()
    if not path.startswith("/"):
        raise SettingError(f"PROMETHEUS_PATH={path!r}: must start with '/'")
    return path


_CONFIG_TYPES = ("FILE", "GRPC_XDS_SOTW")


def _config_type(env: Env) -> str:
    value = env.get("CONFIG_TYPE", "").strip() or "FILE"
    if value not in _CONFIG_TYPES:
        raise SettingError(
            f"CONFIG_TYPE={value!r}: expected one of {', '.join(_CONFIG_TYPES)} "
            "(rules from files, or from a control plane over xDS)"
        )
    return value


def _config(env: Env, defaults: bool) -> str | None:
    """The rules directory the reference's runtime loader reads: RUNTIME_ROOT /
    RUNTIME_SUBDIRECTORY / RUNTIME_APPDIRECTORY (whether the root or that directory is watched,
    RUNTIME_WATCH_ROOT, is the same directory)."""
    if _config_type(env) != "FILE":
        return None
    names = ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY")
    if not defaults and not any(env.get(name) for name in names):
        return None
    root = env.get("RUNTIME_ROOT") or RUNTIME_ROOT
    subdirectory = env.get("RUNTIME_SUBDIRECTORY", "")
    appdirectory = env.get("RUNTIME_APPDIRECTORY") or RUNTIME_APPDIRECTORY
    return os.path.join(root, subdirectory, appdirectory)


def rules_directory(env: Env) -> str | None:
    """The rules directory `ratelimit` loads from `env` (the reference's defaults included);
    None when CONFIG_TYPE says the rules come over xDS."""
    return _config(env, True)


def _xds_server(env: Env, defaults: bool) -> str | None:
    if _config_type(env) != "GRPC_XDS_SOTW":
        return None
    return env.get("CONFIG_GRPC_XDS_SERVER_URL", "").strip() or "localhost:18000"


def _text(name: str) -> Callable[[Env, bool], str | None]:
    def convert(env: Env, defaults: bool) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    return convert


def _header_name(name: str) -> Callable[[Env, bool], str | None]:
    """A header name of LIMIT_RESPONSE_HEADERS_ENABLED, read only when that is true, as the
    reference reads it; one that cannot name an HTTP header stops the start."""

    def convert(env: Env, defaults: bool) -> str | None:
        from sidecar.rls.extras import check_header_name

        value = env.get(name, "").strip()
        if not value or not boolean("LIMIT_RESPONSE_HEADERS_ENABLED", env):
            return None
        try:
            return check_header_name(value)
        except ValueError as exc:
            raise SettingError(f"{name}={value!r}: {exc}") from None

    return convert


def _flag(name: str) -> Callable[[Env, bool], str | None]:
    """A boolean variable onto a store_true flag: set only when true."""

    def convert(env: Env, defaults: bool) -> str | None:
        return "true" if boolean(name, env) else None

    return convert


def _no_jitter(env: Env, defaults: bool) -> str | None:
    return "true" if boolean("XDS_CLIENT_BACKOFF_JITTER", env) is False else None


def _seconds(name: str) -> Callable[[Env, bool], str | None]:
    def convert(env: Env, defaults: bool) -> str | None:
        value = duration(name, env)
        return None if value is None else repr(value)

    return convert


def _ratio(name: str) -> Callable[[Env, bool], str | None]:
    def convert(env: Env, defaults: bool) -> str | None:
        raw = env.get(name, "").strip()
        if not raw:
            return None
        try:
            float(raw)
        except ValueError:
            raise SettingError(f"{name}={raw!r}: expected a number") from None
        return raw

    return convert


def _count(name: str) -> Callable[[Env, bool], str | None]:
    def convert(env: Env, defaults: bool) -> str | None:
        value = number(name, env, minimum=1)
        return None if value is None else str(value)

    return convert


def _node_metadata(env: Env, defaults: bool) -> str | None:
    """`k=v,k2=v2`; as in the reference, a part without '=' is left out."""
    raw = env.get("CONFIG_GRPC_XDS_NODE_METADATA", "")
    pairs = [part for part in raw.split(",") if "=" in part]
    return ",".join(pairs) or None


def _pairs(name: str, form: str) -> Callable[[Env, bool], str | None]:
    """`k1:v1,k2:v2`, as the reference's map variables read; `form` names a pair in the error."""

    def convert(env: Env, defaults: bool) -> str | None:
        raw = env.get(name, "").strip()
        if not raw:
            return None
        for part in raw.split(","):
            if ":" not in part or not part.split(":", 1)[0].strip():
                raise SettingError(f"{name}={raw!r}: expected {form} pairs separated by ','")
        return raw

    return convert


# --- TLS on the gRPC port, statsd and tracing -------------------------------------------------


def _grpc_tls(name: str, required: bool = False) -> Callable[[Env, bool], str | None]:
    """A TLS file of the gRPC port: read only with GRPC_SERVER_USE_TLS=true, as in the reference,
    where the certificate and the key must then be given."""

    def convert(env: Env, defaults: bool) -> str | None:
        if not boolean("GRPC_SERVER_USE_TLS", env):
            return None
        value = env.get(name, "").strip()
        if required and not value:
            raise SettingError(
                "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY"
            )
        return value or None

    return convert


def _statsd_sink(env: Env, defaults: bool) -> str | None:
    """The reference's statsd sink: "statsd", "dogstatsd" or None. DISABLE_STATS turns every
    sink off; USE_STATSD is true by default there, which applies under `ratelimit`."""
    if boolean("DISABLE_STATS", env):
        return None
    dog, plain = boolean("USE_DOG_STATSD", env), boolean("USE_STATSD", env)
    if dog and plain:
        raise SettingError(
            "USE_STATSD=true and USE_DOG_STATSD=true: set one of them (the reference sends "
            "stats to one sink)"
        )
    if dog:
        return "dogstatsd"
    if plain or (plain is None and defaults):
        return "statsd"
    return None


def _statsd_address(env: Env, defaults: bool) -> str | None:
    if _statsd_sink(env, defaults) is None:
        return None
    return _join(env.get("STATSD_HOST", "").strip() or "localhost", _port("STATSD_PORT", env, 8125))


def _statsd_format(env: Env, defaults: bool) -> str | None:
    return "dogstatsd" if _statsd_sink(env, defaults) == "dogstatsd" else None


def _statsd_protocol(env: Env, defaults: bool) -> str | None:
    """UDP for DogStatsD whatever STATSD_PROTOCOL says (the reference's DogStatsD sink is UDP);
    else STATSD_PROTOCOL, which the reference's stats library (lyft/gostats) reads."""
    if boolean("USE_DOG_STATSD", env):
        return "udp"
    raw = env.get("STATSD_PROTOCOL", "").strip()
    if not raw:
        return None
    if raw.lower() not in ("tcp", "udp"):
        raise SettingError(f"STATSD_PROTOCOL={raw!r}: expected tcp or udp")
    return raw.lower()


def _flush_interval(env: Env, defaults: bool) -> str | None:
    seconds = duration("STATS_FLUSH_INTERVAL", env)
    if seconds is None:
        return None
    if seconds <= 0:
        raise SettingError(
            f"STATS_FLUSH_INTERVAL={env['STATS_FLUSH_INTERVAL']!r}: must be more than 0"
        )
    return repr(seconds)


# Tracing: TRACING_* as the reference reads them, and where one is not set, the standard
# OpenTelemetry variable that the reference reads in its place since its PR #1171 (an empty
# variable counts as unset, as everywhere here, where the reference's lookup takes it as set).
# The OTEL_EXPORTER_OTLP_* variables (endpoint, headers, certificate, timeout) are the
# exporter's own, read by `sidecar.telemetry.tracing` under `serve` too.

#: OTEL_EXPORTER_OTLP_PROTOCOL's values the reference takes, and the protocol each means.
_OTLP_PROTOCOLS = {
    "grpc": "grpc",
    "http": "http",
    "http/protobuf": "http",
    "http/protobuf+json": "http",
}
#: OTEL_TRACES_SAMPLER's values the reference takes with no argument, and the rate each sets.
#: parentbased_always_on, which it leaves at its default of 1, is that rate here too.
_FIXED_SAMPLERS = {"always_on": 1.0, "always_off": 0.0, "parentbased_always_on": 1.0}
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


def _given(name: str, env: Env) -> bool:
    return bool(env.get(name, "").strip())


def _tracing_enabled(env: Env) -> bool:
    """TRACING_ENABLED; unset, OTEL_SDK_DISABLED=true turns tracing off and
    OTEL_TRACES_EXPORTER anything but `none` turns it on (spans go over OTLP whatever it names,
    as in the reference)."""
    if _given("TRACING_ENABLED", env):
        return bool(boolean("TRACING_ENABLED", env))
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return _given("OTEL_TRACES_EXPORTER", env) and (
        env["OTEL_TRACES_EXPORTER"].strip().lower() != "none"
    )


def _tracing(env: Env, defaults: bool) -> str | None:
    return "true" if _tracing_enabled(env) else None


def _tracing_protocol(env: Env, defaults: bool) -> str | None:
    """TRACING_EXPORTER_PROTOCOL; unset, OTEL_EXPORTER_OTLP_PROTOCOL (`grpc`, or `http/protobuf`
    and the reference's other names of http); another value stops the start when tracing is
    on, as the reference's does (and is not read otherwise, as there)."""
    raw = env.get("TRACING_EXPORTER_PROTOCOL", "").strip()
    if raw:
        if raw not in ("http", "grpc"):
            raise SettingError(f"TRACING_EXPORTER_PROTOCOL={raw!r}: expected http or grpc")
        return raw
    otlp = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip().lower()
    if otlp in _OTLP_PROTOCOLS:
        return _OTLP_PROTOCOLS[otlp]
    if not otlp or not _tracing_enabled(env):
        return None  # the reference takes an empty one as http, the default
    raise SettingError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={otlp!r}: expected grpc or http/protobuf (spans are "
        "sent as protobuf, over gRPC or HTTP)"
    )


def _resource_attribute(key: str, env: Env) -> str:
    """`key`'s value in OTEL_RESOURCE_ATTRIBUTES (`k=v,k2=v2`), read as the reference reads it:
    each pair trimmed, one without '=' left out, a later one winning; "" when absent."""
    found = ""
    for pair in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        name, sep, value = pair.strip().partition("=")
        if sep and name.strip() == key:
            found = value.strip()
    return found


def _tracing_resource(name: str, attribute: str) -> Callable[[Env, bool], str | None]:
    """A resource attribute of the spans: the TRACING_* variable `name`; unset, OTEL_SERVICE_NAME
    for `service.name`, else `attribute` in OTEL_RESOURCE_ATTRIBUTES (where the reference reads
    neither `service.name`)."""

    def convert(env: Env, defaults: bool) -> str | None:
        value = env.get(name, "").strip()
        if not value and attribute == "service.name":
            value = env.get("OTEL_SERVICE_NAME", "").strip()
        elif not value:
            value = _resource_attribute(attribute, env)
        return value or None

    return convert


def _sampling_rate(env: Env, defaults: bool) -> str | None:
    """TRACING_SAMPLING_RATE, a number; outside 0..1 it is the nearest bound, as the reference's
    ratio sampler takes it (1 or more samples every call, 0 or less none). Unset,
    OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (`_otel_sampling_rate`)."""
    name = "TRACING_SAMPLING_RATE"
    raw = env.get(name, "").strip()
    if not raw:
        name, raw = "OTEL_TRACES_SAMPLER_ARG", _otel_sampling_rate(env)
        if not raw:
            return None
    try:
        rate = float(raw)
    except ValueError:
        rate = float("nan")
    if rate != rate:  # not a number, or NaN
        if name != "TRACING_SAMPLING_RATE" and not _tracing_enabled(env):
            return None  # judged only when tracing is on, as the reference reads it only then
        raise SettingError(f"{name}={raw!r}: expected a number")
    return repr(min(1.0, max(0.0, rate)))


def _otel_sampling_rate(env: Env) -> str:
    """The rate OTEL_TRACES_SAMPLER asks for as the reference reads it: 1 for always_on, 0 for
    always_off, OTEL_TRACES_SAMPLER_ARG for traceidratio and parentbased_traceidratio (without
    one, the default); "" for none. Another sampler stops the start when tracing is on, where
    the reference would sample every call."""
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in _FIXED_SAMPLERS:
        return repr(_FIXED_SAMPLERS[sampler])
    if sampler in _RATIO_SAMPLERS:
        return env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not sampler or not _tracing_enabled(env):
        return ""
    raise SettingError(
        f"OTEL_TRACES_SAMPLER={sampler!r}: expected always_on, always_off, traceidratio or "
        "parentbased_traceidratio (with OTEL_TRACES_SAMPLER_ARG), or set TRACING_SAMPLING_RATE"
    )


def _log_level(env: Env, defaults: bool) -> str | None:
    raw = env.get("LOG_LEVEL", "").strip().lower()
    if not raw:
        return None
    # logrus's levels, onto the standard library's.
    levels = {"trace": "debug", "panic": "critical", "fatal": "critical", "warn": "warning"}
    level = levels.get(raw, raw)
    if level not in ("debug", "info", "warning", "error", "critical"):
        raise SettingError(
            f"LOG_LEVEL={raw!r}: expected one of trace, debug, info, warn, error, fatal, panic"
        )
    return level


def _log_format(env: Env, defaults: bool) -> str | None:
    raw = env.get("LOG_FORMAT", "").strip().lower()
    if not raw:
        return None
    return "json" if raw == "json" else "console"


def _rejected_hits(env: Env, defaults: bool) -> str | None:
    return "skip" if boolean("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", env) else None


def _over_limit_cache(env: Env, defaults: bool) -> str | None:
    size = number("LOCAL_CACHE_SIZE_IN_BYTES", env)
    if size is None:
        return None
    return str(size // CACHE_ENTRY_BYTES if size == 0 else max(1, size // CACHE_ENTRY_BYTES))


def _redis_timeout_ms(env: Env, defaults: bool) -> str | None:
    seconds = duration("REDIS_TIMEOUT", env)
    if seconds is None:
        return None
    return str(max(1, round(seconds * 1000)))


def _backend(env: Env, defaults: bool) -> str | None:
    """The backend URL from BACKEND_TYPE and REDIS_*; None when no Redis is named."""
    backend_type = env.get("BACKEND_TYPE", "").strip().lower() or "redis"
    if backend_type == "memcache":
        raise SettingError(
            "BACKEND_TYPE=memcache: Memcache is not supported; use Redis (REDIS_URL) or set "
            "RLS_BACKEND (memory://, redis://, redis+cluster://, redis+sentinel://)"
        )
    if backend_type != "redis":
        raise SettingError(f"BACKEND_TYPE={backend_type!r}: expected redis")
    if not env.get("REDIS_URL", "").strip():
        if not defaults:
            return None
        raise SettingError(
            "REDIS_URL is not set: the reference's default is twemproxy's Unix socket "
            "/var/run/nutcracker/ratelimit.sock; set REDIS_SOCKET_TYPE=tcp and REDIS_URL=HOST:PORT "
            "(or RLS_BACKEND=memory:// for counters in this process)"
        )
    return _redis_url(env, "REDIS_")


def _backend_per_second(env: Env, defaults: bool) -> str | None:
    """The per-second store from REDIS_PERSECOND_*, when REDIS_PERSECOND is true."""
    if not boolean("REDIS_PERSECOND", env):
        return None
    if not env.get("REDIS_PERSECOND_URL", "").strip():
        raise SettingError(
            "REDIS_PERSECOND=true without REDIS_PERSECOND_URL: the reference's default is "
            "twemproxy's Unix socket; set REDIS_PERSECOND_SOCKET_TYPE=tcp and "
            "REDIS_PERSECOND_URL=HOST:PORT"
        )
    return _redis_url(env, "REDIS_PERSECOND_")


@dataclass(frozen=True)
class _RedisHost:
    """One address of a REDIS_URL, as the reference's Redis client (radix v4) reads it: a
    HOST:PORT, or a `redis://[user:password@]HOST:PORT[/db]` URI (also `?username=`,
    `?password=`, `?db=`); `rediss://` too, here, meaning TLS."""

    address: str
    username: str = ""
    password: str | None = None
    db: str = ""
    tls: bool = False


def _redis_host(text: str) -> _RedisHost:
    scheme, sep, _ = text.partition("://")
    if not sep or scheme.lower() not in ("redis", "rediss"):
        return _RedisHost(text)
    try:
        parts = urlsplit(text)
    except ValueError:  # an unbalanced IPv6 bracket: judged as an address, below
        return _RedisHost(text.partition("://")[2])
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    userinfo, _, address = parts.netloc.rpartition("@")
    username, has_password, password = userinfo.partition(":")
    return _RedisHost(
        address,
        username=unquote(username) or query.get("username", ""),
        password=unquote(password) if has_password else query.get("password"),
        db=parts.path.strip("/") or query.get("db", ""),
        tls=scheme.lower() == "rediss",
    )


def _redis_url(env: Env, prefix: str) -> str:
    """A Redis URL from `prefix`'s URL, SOCKET_TYPE, TYPE, AUTH and TLS (REDIS_ or
    REDIS_PERSECOND_); the TLS files are REDIS_TLS_*'s for both, as in the reference.

    The URL's addresses may be `redis://` URIs, as the reference's client takes them (their
    credentials apply when the AUTH variable is empty, as there). The URL built is checked
    here, so a fault is quoted as the variable was written (its password hidden), never as
    the URL it became."""
    written = env[prefix + "URL"].strip()
    url = _build_redis_url(env, prefix, written)
    try:
        parse_backend_url(url)
    except ValueError as exc:
        reason = str(exc).removeprefix(f"{redact(url)!r}: ")
        raise SettingError(f"{prefix}URL={redact(written)!r}: {reason}") from None
    return url


def _build_redis_url(env: Env, prefix: str, url: str) -> str:
    socket_type = env.get(prefix + "SOCKET_TYPE", "").strip().lower()
    if socket_type == "unix" or (not socket_type and url.startswith("/")):
        raise SettingError(
            f"{prefix}SOCKET_TYPE={socket_type or 'unix'} with {prefix}URL={redact(url)!r}: Redis "
            f"over a Unix socket is not supported; use {prefix}SOCKET_TYPE=tcp and "
            f"{prefix}URL=HOST:PORT"
        )
    if socket_type not in ("", "tcp"):
        raise SettingError(f"{prefix}SOCKET_TYPE={socket_type!r}: expected tcp")
    redis_type = env.get(prefix + "TYPE", "").strip().lower() or "single"
    if redis_type not in ("single", "cluster", "sentinel"):
        raise SettingError(f"{prefix}TYPE={redis_type!r}: expected single, cluster or sentinel")
    name = ""
    if redis_type == "sentinel":
        # The reference's form: the master's name, then the Sentinels.
        name, _, url = url.partition(",")
        if not name.strip() or not url.strip():
            raise SettingError(
                f"{prefix}URL={redact(env[prefix + 'URL'].strip())!r} with {prefix}TYPE=sentinel: "
                "expected MASTER_NAME,SENTINEL_HOST:PORT[,SENTINEL_HOST:PORT...]"
            )
    hosts = [_redis_host(part.strip()) for part in url.split(",")]
    tls = boolean(prefix + "TLS", env) or any(host.tls for host in hosts)
    kind = {"single": "", "cluster": "+cluster", "sentinel": "+sentinel"}[redis_type]
    scheme = ("rediss" if tls else "redis") + kind
    # The AUTH variable wins over a URI's credentials; for Sentinels those are the Sentinels'.
    uri_auth = next(((h.username, h.password) for h in hosts if h.password is not None), None)
    user, password = _auth(env.get(prefix + "AUTH", ""))
    if password is None and uri_auth is not None and redis_type != "sentinel":
        user, password = uri_auth
    userinfo = ""
    if password is not None:
        userinfo = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    query: dict[str, str] = {}
    path = ""
    dbs = {host.db for host in hosts if host.db}
    if redis_type == "sentinel":
        if dbs:
            raise SettingError(
                f"{prefix}URL={redact(env[prefix + 'URL'].strip())!r}: a database on a Sentinel's "
                "address selects nothing on the master; the master's is database 0"
            )
        path = "/" + quote(name.strip(), safe="")
        sentinel_user, sentinel_password = _auth(env.get(prefix + "SENTINEL_AUTH", ""))
        if sentinel_password is None and uri_auth is not None:
            sentinel_user, sentinel_password = uri_auth
        if sentinel_password is not None:
            if sentinel_user:
                query["sentinel_username"] = sentinel_user
            query["sentinel_password"] = sentinel_password
    elif dbs:
        path = "/" + ",".join(sorted(dbs))  # more than one is refused by the URL's check
    if tls:
        for variable, parameter in (
            ("REDIS_TLS_CACERT", "ssl_ca_certs"),
            ("REDIS_TLS_CLIENT_CERT", "ssl_certfile"),
            ("REDIS_TLS_CLIENT_KEY", "ssl_keyfile"),
        ):
            if env.get(variable):
                query[parameter] = env[variable]
        query["ssl_cert_reqs"] = "required"
    addresses = ",".join(host.address for host in hosts)
    return f"{scheme}://{userinfo}{addresses}{path}" + (f"?{urlencode(query)}" if query else "")


def _auth(value: str) -> tuple[str, str | None]:
    """`password` or `user:password` (REDIS_AUTH's forms): the user ("" for none) and the
    password (None when `value` is empty)."""
    if not value:
        return "", None
    user, sep, password = value.partition(":")
    return (user, password) if sep else ("", value)


@dataclass(frozen=True)
class Flag:
    """A `serve` flag that reference variables set: `convert(env, defaults)` gives its value in
    `RLS_<FLAG>` form, or None when those variables leave it alone. `dest` is the name of the
    flag declared in `sidecar.cli.serve_flags`. `defaults` is true for
    `ratelimit` (the reference's entry point), where the reference's defaults apply."""

    dest: str
    reads: tuple[str, ...]
    convert: Callable[[Env, bool], str | None]


#: What turns tracing on or off when TRACING_ENABLED is unset.
_OTEL_ENABLED = ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED")

FLAGS: tuple[Flag, ...] = (
    Flag("grpc_address", ("GRPC_UDS", "GRPC_HOST", "GRPC_PORT"), _grpc_address),
    Flag("http_address", ("HOST", "PORT"), _http_address),
    Flag("debug_address", ("DEBUG_HOST", "DEBUG_PORT"), _debug_address),
    Flag("metrics_address", ("USE_PROMETHEUS", "PROMETHEUS_ADDR"), _metrics_address),
    Flag("metrics_path", ("USE_PROMETHEUS", "PROMETHEUS_PATH"), _metrics_path),
    Flag(
        "config",
        (
            "CONFIG_TYPE",
            "RUNTIME_ROOT",
            "RUNTIME_SUBDIRECTORY",
            "RUNTIME_APPDIRECTORY",
            "RUNTIME_WATCH_ROOT",
        ),
        _config,
    ),
    Flag("xds_server", ("CONFIG_TYPE", "CONFIG_GRPC_XDS_SERVER_URL"), _xds_server),
    Flag("xds_node_id", ("CONFIG_GRPC_XDS_NODE_ID",), _text("CONFIG_GRPC_XDS_NODE_ID")),
    Flag("xds_node_metadata", ("CONFIG_GRPC_XDS_NODE_METADATA",), _node_metadata),
    Flag(
        "xds_header",
        ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",),
        _pairs("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "NAME:VALUE"),
    ),
    Flag("xds_tls", ("CONFIG_GRPC_XDS_SERVER_USE_TLS",), _flag("CONFIG_GRPC_XDS_SERVER_USE_TLS")),
    Flag(
        "xds_ca", ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT",), _text("CONFIG_GRPC_XDS_SERVER_TLS_CACERT")
    ),
    Flag(
        "xds_cert", ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT",), _text("CONFIG_GRPC_XDS_CLIENT_TLS_CERT")
    ),
    Flag("xds_key", ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY",), _text("CONFIG_GRPC_XDS_CLIENT_TLS_KEY")),
    Flag(
        "xds_server_name",
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN",),
        _text("CONFIG_GRPC_XDS_SERVER_TLS_SAN"),
    ),
    Flag(
        "xds_retry_seconds",
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",),
        _seconds("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL"),
    ),
    Flag(
        "xds_backoff_seconds",
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",),
        _seconds("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL"),
    ),
    Flag(
        "xds_backoff_max_seconds",
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL",),
        _seconds("XDS_CLIENT_BACKOFF_MAX_INTERVAL"),
    ),
    Flag(
        "xds_backoff_factor",
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR",),
        _ratio("XDS_CLIENT_BACKOFF_RANDOM_FACTOR"),
    ),
    Flag("xds_backoff_no_jitter", ("XDS_CLIENT_BACKOFF_JITTER",), _no_jitter),
    Flag(
        "xds_max_message_bytes",
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",),
        _count("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES"),
    ),
    Flag(
        "force_start_without_initial_config",
        ("FORCE_START_WITHOUT_INITIAL_CONFIG",),
        _flag("FORCE_START_WITHOUT_INITIAL_CONFIG"),
    ),
    Flag("merge_domain_config", ("MERGE_DOMAIN_CONFIG",), _flag("MERGE_DOMAIN_CONFIG")),
    Flag(
        "calendar_months",
        ("USE_CALENDAR_MONTH_RATE_LIMIT",),
        _flag("USE_CALENDAR_MONTH_RATE_LIMIT"),
    ),
    Flag(
        "health_requires_config",
        ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",),
        _flag("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED"),
    ),
    Flag(
        "backend",
        (
            "BACKEND_TYPE",
            "REDIS_SOCKET_TYPE",
            "REDIS_TYPE",
            "REDIS_URL",
            "REDIS_AUTH",
            "REDIS_SENTINEL_AUTH",
            "REDIS_TLS",
            "REDIS_TLS_CACERT",
            "REDIS_TLS_CLIENT_CERT",
            "REDIS_TLS_CLIENT_KEY",
        ),
        _backend,
    ),
    Flag(
        "backend_per_second",
        (
            "REDIS_PERSECOND",
            "REDIS_PERSECOND_SOCKET_TYPE",
            "REDIS_PERSECOND_TYPE",
            "REDIS_PERSECOND_URL",
            "REDIS_PERSECOND_AUTH",
            "REDIS_PERSECOND_SENTINEL_AUTH",
            "REDIS_PERSECOND_TLS",
        ),
        _backend_per_second,
    ),
    Flag("redis_timeout_ms", ("REDIS_TIMEOUT",), _redis_timeout_ms),
    Flag("over_limit_cache", ("LOCAL_CACHE_SIZE_IN_BYTES",), _over_limit_cache),
    Flag("rejected_hits", ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",), _rejected_hits),
    Flag("negative_hits", ("ENABLE_NEGATIVE_HITS",), _flag("ENABLE_NEGATIVE_HITS")),
    Flag("shadow_mode", ("SHADOW_MODE",), _flag("SHADOW_MODE")),
    Flag(
        "response_dynamic_metadata",
        ("RESPONSE_DYNAMIC_METADATA",),
        _flag("RESPONSE_DYNAMIC_METADATA"),
    ),
    Flag(
        "response_headers",
        ("LIMIT_RESPONSE_HEADERS_ENABLED",),
        _flag("LIMIT_RESPONSE_HEADERS_ENABLED"),
    ),
    Flag(
        "response_headers_all_descriptors",
        ("LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED",),
        _flag("LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED"),
    ),
    *(
        Flag(dest, ("LIMIT_RESPONSE_HEADERS_ENABLED", name), _header_name(name))
        for dest, name in (
            ("response_limit_header", "LIMIT_LIMIT_HEADER"),
            ("response_remaining_header", "LIMIT_REMAINING_HEADER"),
            ("response_reset_header", "LIMIT_RESET_HEADER"),
        )
    ),
    Flag("log_level", ("LOG_LEVEL",), _log_level),
    Flag("log_format", ("LOG_FORMAT",), _log_format),
    Flag(
        "grpc_tls_cert",
        ("GRPC_SERVER_USE_TLS", "GRPC_SERVER_TLS_CERT"),
        _grpc_tls("GRPC_SERVER_TLS_CERT", required=True),
    ),
    Flag(
        "grpc_tls_key",
        ("GRPC_SERVER_USE_TLS", "GRPC_SERVER_TLS_KEY"),
        _grpc_tls("GRPC_SERVER_TLS_KEY", required=True),
    ),
    Flag(
        "grpc_tls_client_ca",
        ("GRPC_SERVER_USE_TLS", "GRPC_CLIENT_TLS_CACERT"),
        _grpc_tls("GRPC_CLIENT_TLS_CACERT"),
    ),
    Flag(
        "grpc_tls_client_san",
        ("GRPC_SERVER_USE_TLS", "GRPC_CLIENT_TLS_SAN"),
        _grpc_tls("GRPC_CLIENT_TLS_SAN"),
    ),
    Flag(
        "statsd_address",
        ("DISABLE_STATS", "USE_STATSD", "USE_DOG_STATSD", "STATSD_HOST", "STATSD_PORT"),
        _statsd_address,
    ),
    Flag("statsd_format", ("DISABLE_STATS", "USE_STATSD", "USE_DOG_STATSD"), _statsd_format),
    Flag("statsd_protocol", ("USE_DOG_STATSD", "STATSD_PROTOCOL"), _statsd_protocol),
    Flag("stats_flush_interval", ("STATS_FLUSH_INTERVAL",), _flush_interval),
    Flag("stats_tags", ("EXTRA_TAGS",), _pairs("EXTRA_TAGS", "key:value")),
    Flag(
        "dogstatsd_mogrifiers",
        ("USE_DOG_STATSD_MOGRIFIERS",),
        _text("USE_DOG_STATSD_MOGRIFIERS"),
    ),
    Flag("tracing", ("TRACING_ENABLED", *_OTEL_ENABLED), _tracing),
    Flag(
        "tracing_protocol",
        ("TRACING_EXPORTER_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL", *_OTEL_ENABLED),
        _tracing_protocol,
    ),
    Flag(
        "tracing_service_name",
        ("TRACING_SERVICE_NAME", "OTEL_SERVICE_NAME"),
        _tracing_resource("TRACING_SERVICE_NAME", "service.name"),
    ),
    Flag(
        "tracing_service_namespace",
        ("TRACING_SERVICE_NAMESPACE", "OTEL_RESOURCE_ATTRIBUTES"),
        _tracing_resource("TRACING_SERVICE_NAMESPACE", "service.namespace"),
    ),
    Flag(
        "tracing_service_instance_id",
        ("TRACING_SERVICE_INSTANCE_ID", "OTEL_RESOURCE_ATTRIBUTES"),
        _tracing_resource("TRACING_SERVICE_INSTANCE_ID", "service.instance.id"),
    ),
    Flag(
        "tracing_sampling_rate",
        ("TRACING_SAMPLING_RATE", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", *_OTEL_ENABLED),
        _sampling_rate,
    ),
)


#: Booleans no flag takes, read only to be judged: whichever value is set, the sidecar already
#: does what one of them asks (each one's note in `VARIABLES` says which), but a value the
#: reference refuses at start-up (`yes`, `on`) stops the start here too, so a typo in a value is
#: never taken for a setting.
JUDGED: tuple[str, ...] = ("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR",)


def _variables() -> tuple[Variable, ...]:
    S, D, U = Support.SUPPORTED, Support.DIFFERENT, Support.UNSUPPORTED
    V = Variable
    memcache = "Memcache is not supported (`BACKEND_TYPE`)"
    return (
        # Listeners.
        V("HOST", "0.0.0.0", S, "`--http-address HOST:PORT`"),
        V("PORT", "8080", S, "`--http-address HOST:PORT`"),
        V("DEBUG_HOST", "0.0.0.0", D, "`--debug-address`: set, `/rlconfig` and `/metrics` are also served there; no pprof or `/stats` (expvar). Unset, no debug port: `/rlconfig` is on the HTTP port"),
        V("DEBUG_PORT", "6070", D, "as `DEBUG_HOST`"),
        V("GRPC_HOST", "0.0.0.0", S, "`--grpc-address HOST:PORT`"),
        V("GRPC_PORT", "8081", S, "`--grpc-address HOST:PORT`"),
        V("GRPC_UDS", "", S, "`--grpc-address unix:PATH`"),
        V("GRPC_MAX_CONNECTION_AGE", "24h", U, "connections last until Envoy closes them; the fast transport has no maximum age"),
        V("GRPC_MAX_CONNECTION_AGE_GRACE", "1h", U, "as `GRPC_MAX_CONNECTION_AGE`"),
        V("GRPC_SERVER_USE_TLS", "false", S, "TLS (1.2 or later, ALPN `h2`) on the gRPC port, on both transports, with `GRPC_SERVER_TLS_CERT` and `GRPC_SERVER_TLS_KEY`, which must then be set; the other `GRPC_*TLS*` variables are read only with it"),
        V("GRPC_SERVER_TLS_CERT", "", S, "`--grpc-tls-cert`; reloaded when it changes on disk (and on SIGHUP), as in the reference"),
        V("GRPC_SERVER_TLS_KEY", "", S, "`--grpc-tls-key`; reloaded with the certificate"),
        V("GRPC_CLIENT_TLS_CACERT", "", S, "`--grpc-tls-client-ca`: mTLS, a client certificate signed by this CA is required. Envoy Gateway also sets `GRPC_SERVER_TLS_CA_CERT`, which the reference does not read, and neither does the sidecar: its gRPC port is then TLS without client certificates, as the reference's is"),
        V("GRPC_CLIENT_TLS_SAN", "", D, "`--grpc-tls-client-san`: the client certificate must carry this DNS name or IP address among its SANs; without `GRPC_CLIENT_TLS_CACERT` the start stops (the reference then ignores it, pinning nothing)", _always),
        V("LOG_LEVEL", "WARN", S, "`--log-level` (trace is debug, fatal and panic are critical); unset, `info`"),
        V("LOG_FORMAT", "text", D, "`--log-format`: `json` is JSON lines (`event`, `timestamp`, not `@message`, `@timestamp`); `text` is the console format; unset, `json`"),
        # Where the rules come from.
        V("CONFIG_TYPE", "FILE", S, "`FILE`: `--config` from `RUNTIME_*`; `GRPC_XDS_SOTW`: `--xds-server` (rules over xDS)"),
        V("FORCE_START_WITHOUT_INITIAL_CONFIG", "false", D, "`--force-start-without-initial-config`: until the first rules arrive every domain is unknown, answered OK (the reference answers an error, which Envoy's `failure_mode_deny` decides)", _false),
        V("RUNTIME_ROOT", RUNTIME_ROOT, S, "`--config ROOT/SUBDIRECTORY/APPDIRECTORY`"),
        V("RUNTIME_SUBDIRECTORY", "", S, "as `RUNTIME_ROOT`"),
        V("RUNTIME_APPDIRECTORY", RUNTIME_APPDIRECTORY, S, "as `RUNTIME_ROOT`"),
        V("RUNTIME_IGNOREDOTFILES", "false", D, "files whose name starts with `.` are always ignored (as a Kubernetes ConfigMap's `..data` needs)", _truthy),
        V("RUNTIME_WATCH_ROOT", "true", S, "either way the same directory; its rules files are polled every 2 s (`--config-poll-seconds`), which sees a swapped symlink as well as an edited file"),
        V("MERGE_DOMAIN_CONFIG", "false", S, "`--merge-domain-config`: files (or xDS resources) declaring one domain add their first-level descriptors to it; one declared in two is refused, as within a file"),
        V("CONFIG_GRPC_XDS_NODE_ID", "default", S, "`--xds-node-id`"),
        V("CONFIG_GRPC_XDS_NODE_METADATA", "", S, "`--xds-node-metadata k=v,k2=v2`"),
        V("CONFIG_GRPC_XDS_SERVER_URL", "localhost:18000", S, "`--xds-server`"),
        V("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3s", S, "`--xds-retry-seconds`: between attempts to reach a control plane that has not answered yet (±50%)"),
        V("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "", S, "`--xds-header NAME:VALUE` (names in lower case, as HTTP/2 sends them)"),
        V("CONFIG_GRPC_XDS_SERVER_USE_TLS", "false", S, "`--xds-tls`"),
        V("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "", S, "`--xds-cert` (mTLS)"),
        V("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "", S, "`--xds-key` (mTLS)"),
        V("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "", S, "`--xds-ca`; unset, the system's roots"),
        V("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "", S, "`--xds-server-name`"),
        V("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "10s", S, "`--xds-backoff-seconds`: after a stream that delivered rules breaks"),
        V("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "60s", S, "`--xds-backoff-max-seconds`"),
        V("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.5", S, "`--xds-backoff-factor`: the multiplier of each step, as in the reference (so its defaults wait 10 s every time)"),
        V("XDS_CLIENT_BACKOFF_JITTER", "true", S, "`--xds-backoff-no-jitter` when false"),
        V("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "", S, "`--xds-max-message-bytes`; unset, gRPC's 4 MiB"),
        # Counters.
        V("BACKEND_TYPE", "redis", S, "`redis` builds `--backend` from `REDIS_*`; `memcache` is refused at start-up"),
        V("REDIS_SOCKET_TYPE", "unix", D, "`tcp`; `unix` is refused at start-up (no Redis over a Unix socket); unset, a `REDIS_URL` that is not a path is TCP", lambda value: value.strip().lower() == "tcp"),
        V("REDIS_TYPE", "SINGLE", S, "`single`: `redis://`; `cluster`: `redis+cluster://`; `sentinel`: `redis+sentinel://` (`REDIS_URL` is then `MASTER_NAME,HOST:PORT,...`, the master's name and the Sentinels)"),
        V("REDIS_URL", "/var/run/nutcracker/ratelimit.sock", S, "the host of `--backend`: `HOST:PORT`, or a `redis://[USER:PASSWORD@]HOST:PORT[/DB]` URI read as the reference's client reads it (also `?username=`, `?password=`, `?db=`; `REDIS_AUTH` wins over its credentials; `rediss://` is TLS, which the reference's client does not take); a list of them for a cluster; under `ratelimit` it must be set, unless `RLS_BACKEND` is"),
        V("REDIS_POOL_SIZE", "10", D, "no pool: each Redis server gets two pipelined connections, which carry every call"),
        V("REDIS_AUTH", "", S, "`password` or `user:password`, in the `--backend` URL"),
        V("REDIS_SENTINEL_AUTH", "", S, "`password` or `user:password` of the Sentinels: `?sentinel_password=` (and `sentinel_username=`); `REDIS_AUTH` stays the master's"),
        V("REDIS_TLS", "false", S, "`rediss://` (certificates verified)"),
        V("REDIS_TLS_CLIENT_CERT", "", S, "`?ssl_certfile=`"),
        V("REDIS_TLS_CLIENT_KEY", "", S, "`?ssl_keyfile=`"),
        V("REDIS_TLS_CACERT", "", S, "`?ssl_ca_certs=`"),
        V("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "false", U, "the certificate's name is always checked", _false),
        V("REDIS_PIPELINE_WINDOW", "0", D, "commands of one event-loop turn always leave in one write"),
        V("REDIS_PIPELINE_LIMIT", "0", D, "deprecated in the reference too"),
        V("REDIS_CLUSTER_PIPELINE_PARALLELISM", "1", D, "a request's slots are always called concurrently"),
        V("REDIS_POOL_ON_EMPTY_BEHAVIOR", "WAIT", D, "calls never wait for a connection; each has a deadline (`--redis-timeout-ms`)"),
        V("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "false", D, "health pings the backend every 2 s; see Health below", _false),
        V("REDIS_TIMEOUT", "10s", S, "`--redis-timeout-ms`: the deadline of one backend call; unset, 50 ms"),
        V("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", "false", D, "`true` or `false` (anything else stops the start): either way a READONLY reply (a master demoted by a failover) drops that server's connections and the next call dials again, on every topology, as the reference does with `true` (its PR #1191); with `false` the reference keeps them until it restarts", _truthy),
        V("REDIS_STARTUP_INITIAL_INTERVAL", "1s", D, "the sidecar starts without waiting for Redis and reconnects on its own"),
        V("REDIS_STARTUP_MAX_INTERVAL", "30s", D, "as `REDIS_STARTUP_INITIAL_INTERVAL`"),
        V("REDIS_STARTUP_MAX_ELAPSED_TIME", "0", D, "as `REDIS_STARTUP_INITIAL_INTERVAL`"),
        V("REDIS_PERSECOND", "false", S, "`--backend-per-second`: the counters of descriptors whose windows are all in seconds go to the store `REDIS_PERSECOND_*` names; not with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` (two stores cannot decide one request all or nothing)"),
        V("REDIS_PERSECOND_SOCKET_TYPE", "unix", D, "as `REDIS_SOCKET_TYPE`", lambda value: value.strip().lower() == "tcp"),
        V("REDIS_PERSECOND_TYPE", "SINGLE", S, "as `REDIS_TYPE`"),
        V("REDIS_PERSECOND_URL", "/var/run/nutcracker/ratelimitpersecond.sock", S, "the host of `--backend-per-second`; must be set with `REDIS_PERSECOND=true`"),
        V("REDIS_PERSECOND_AUTH", "", S, "as `REDIS_AUTH`"),
        V("REDIS_PERSECOND_TLS", "false", S, "as `REDIS_TLS` (with the `REDIS_TLS_*` files, as in the reference)"),
        V("REDIS_PERSECOND_POOL_SIZE", "10", D, "as `REDIS_POOL_SIZE`"),
        V("REDIS_PERSECOND_SENTINEL_AUTH", "", S, "as `REDIS_SENTINEL_AUTH`"),
        V("REDIS_PERSECOND_PIPELINE_WINDOW", "0", D, "as `REDIS_PIPELINE_WINDOW`"),
        V("REDIS_PERSECOND_PIPELINE_LIMIT", "0", D, "as `REDIS_PIPELINE_LIMIT`"),
        V("REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", "1", D, "as `REDIS_CLUSTER_PIPELINE_PARALLELISM`"),
        V("REDIS_PERSECOND_TIMEOUT", "10s", D, "the per-second store's calls have `REDIS_TIMEOUT`'s deadline (`--redis-timeout-ms`)"),
        V("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "WAIT", D, "as `REDIS_POOL_ON_EMPTY_BEHAVIOR`"),
        *(
            V(name, default, U, memcache, _always)
            for name, default in (
                ("MEMCACHE_HOST_PORT", ""),
                ("MEMCACHE_MAX_IDLE_CONNS", "2"),
                ("MEMCACHE_SRV", ""),
                ("MEMCACHE_SRV_REFRESH", "0"),
                ("MEMCACHE_TLS", "false"),
                ("MEMCACHE_TLS_CLIENT_CERT", ""),
                ("MEMCACHE_TLS_CLIENT_KEY", ""),
                ("MEMCACHE_TLS_CACERT", ""),
                ("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", "false"),
            )
        ),
        # Limiting.
        V("EXPIRATION_JITTER_MAX_SECONDS", "300", D, "no jitter: a counter expires once, when its window (and a grace) ends"),
        V("LOCAL_CACHE_SIZE_IN_BYTES", "0", D, f"`--over-limit-cache ENTRIES`, at {CACHE_ENTRY_BYTES} bytes an entry (0 turns it off); unset, 100,000 entries, where the reference's cache is off"),
        V("NEAR_LIMIT_RATIO", "0.8", U, "`near_limit` always counts hits above 80% of a limit", lambda value: value.strip() in ("0.8", ".8", "0.80")),
        V("CACHE_KEY_PREFIX", "", U, "counter keys have their own format (they start with `rl{`), so they never collide with the reference's; give another Redis database (`/N` in `RLS_BACKEND`) to keep two sets apart"),
        V("USE_CALENDAR_MONTH_RATE_LIMIT", "false", S, "`--calendar-months`: a rule's fixed window of one `unit: month`, with no `calendar` or `timezone` of its own, counts the UTC calendar month (its TTL and reset run to the month's end), as `calendar: true` makes it; months of other algorithms or of a `unit_multiplier` (the reference has neither), and a month in a request's `limit` override, stay 30 days from the epoch"),
        V("ENABLE_NEGATIVE_HITS", "false", S, "`--negative-hits`: a descriptor's `is_negative_hits` (Envoy 1.38+) gives its hits back to its counters (a fixed or sliding window's counter down, floored at 0; a bucket's tokens back, up to its burst), answered OK; off (the default, as in the reference's #1230), a request carrying one is refused UNIMPLEMENTED and changes no counter; refused also under `--rejected-hits skip`"),
        V("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "false", D, "`--rejected-hits skip`: a request answered OVER_LIMIT adds nothing to any of its counters (the reference still adds to those that would not exceed)", _false),
        V("SHADOW_MODE", "false", S, "`--shadow-mode`"),
        V("QUOTA_MODE", "false", U, "per-rule `quota_mode` is supported; the global switch is not", _false),
        V("RESPONSE_DYNAMIC_METADATA", "false", S, "`--response-dynamic-metadata`"),
        V("LIMIT_RESPONSE_HEADERS_ENABLED", "false", S, "`--response-headers`"),
        V("LIMIT_LIMIT_HEADER", "RateLimit-Limit", S, "`--response-limit-header`, read with `LIMIT_RESPONSE_HEADERS_ENABLED=true` as in the reference"),
        V("LIMIT_REMAINING_HEADER", "RateLimit-Remaining", S, "`--response-remaining-header`, read with `LIMIT_RESPONSE_HEADERS_ENABLED=true`"),
        V("LIMIT_RESET_HEADER", "RateLimit-Reset", S, "`--response-reset-header`, read with `LIMIT_RESPONSE_HEADERS_ENABLED=true`"),
        V("LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED", "false", S, "`--response-headers-all-descriptors`: instead of the three headers, `ratelimit-limit-<unit>s` and `ratelimit-remaining-<unit>s` (`seconds`, `minutes`, ...) of every descriptor with a limit, in request order, whether `LIMIT_RESPONSE_HEADERS_ENABLED` is set or not, as the reference's PR #1190 does"),
        V("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "false", S, "`--health-requires-config`: unhealthy until rules with at least one domain are loaded"),
        # Stats.
        V("USE_STATSD", "true", D, "`--statsd-address STATSD_HOST:STATSD_PORT`: the reference's stat names over TCP (`STATSD_PROTOCOL=udp`, which the reference's stats library reads, for UDP); under `ratelimit` on unless false, as in the reference, under `serve` only when true. Prometheus `/metrics` stays beside it (the reference allows one sink)", _always),
        V("STATSD_HOST", "localhost", S, "the host of `--statsd-address`"),
        V("STATSD_PORT", "8125", S, "the port of `--statsd-address`"),
        V("EXTRA_TAGS", "", S, "`--stats-tags k:v,k2:v2`: folded into the names for statsd (as the reference's statsd sink does), tags for DogStatsD"),
        V("STATS_FLUSH_INTERVAL", "10s", S, "`--stats-flush-interval`: stats leave in batches, never a write per call"),
        V("DISABLE_STATS", "false", D, "no statsd or DogStatsD; `/metrics` keeps serving (its counters cost nothing until scraped)", _false),
        V("USE_DOG_STATSD", "false", S, "`--statsd-format dogstatsd`, over UDP to `STATSD_HOST:STATSD_PORT`; with `USE_STATSD=true` the start stops, as the reference's does"),
        V("USE_DOG_STATSD_MOGRIFIERS", "", S, "`--dogstatsd-mogrifiers NAME,...`, each defined by `DOG_STATSD_MOGRIFIER_<NAME>_PATTERN`, `_NAME` and `_TAGS`, read as the reference's DogStatsD library reads them"),
        V("USE_PROMETHEUS", "false", S, "`--metrics-address` from `PROMETHEUS_ADDR`; `/metrics` on the HTTP port is always there", _always),
        V("PROMETHEUS_ADDR", ":9090", S, "`--metrics-address` (with `USE_PROMETHEUS=true`)"),
        V("PROMETHEUS_PATH", "/metrics", S, "`--metrics-path` (with `USE_PROMETHEUS=true`)"),
        V("PROMETHEUS_MAPPER_YAML", "", D, "series are named as the reference's built-in mapper names them; a mapper file is not read"),
        V("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "false", U, "the latency histogram is in seconds", _false),
        # Tracing.
        V("TRACING_ENABLED", "false", S, "`--tracing`: OpenTelemetry spans of `ShouldRateLimit` and its backend call over OTLP, the parent from W3C or B3 headers; the endpoint from the standard `OTEL_EXPORTER_OTLP_*` variables"),
        V("TRACING_SERVICE_NAME", "RateLimit", S, "`--tracing-service-name`"),
        V("TRACING_SERVICE_NAMESPACE", "", S, "`--tracing-service-namespace`"),
        V("TRACING_SERVICE_INSTANCE_ID", "", S, "`--tracing-service-instance-id`; unset, a random UUID"),
        V("TRACING_EXPORTER_PROTOCOL", "http", S, "`--tracing-protocol`: `http` or `grpc`"),
        V("TRACING_SAMPLING_RATE", "1", S, "`--tracing-sampling-rate`: the share of calls without a sampled parent traced; outside 0..1 the nearest bound, as in the reference"),
        # The standard OpenTelemetry variables the reference reads (its PR #1171), each where
        # the TRACING_* variable it stands for is unset.
        *(V(name, "", S, note, standard=True) for name, note in _otel_notes()),
    )  # fmt: skip


def _otel_notes() -> tuple[tuple[str, str], ...]:
    unset = "where `{}` is unset (empty counts as unset)"
    sdk = "read by the OTLP exporter, under `serve` too, as the reference's exporter reads it"
    return (
        ("OTEL_SDK_DISABLED", "`true` turns tracing off " + unset.format("TRACING_ENABLED")),
        ("OTEL_TRACES_EXPORTER", "`--tracing` when anything but `none` (spans go over OTLP whatever it names, as in the reference) " + unset.format("TRACING_ENABLED")),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "`--tracing-protocol`: `grpc`, or `http/protobuf` (also `http`, `http/protobuf+json`) for http, " + unset.format("TRACING_EXPORTER_PROTOCOL") + "; another value stops the start when tracing is on"),
        ("OTEL_SERVICE_NAME", "`--tracing-service-name` " + unset.format("TRACING_SERVICE_NAME")),
        ("OTEL_RESOURCE_ATTRIBUTES", "its `service.namespace` and `service.instance.id` (`k=v,k2=v2`, as the reference splits it, not percent-decoded) are `--tracing-service-namespace` and `--tracing-service-instance-id` " + unset.format("TRACING_SERVICE_NAMESPACE` or `TRACING_SERVICE_INSTANCE_ID") + "; its other attributes are on the spans' resource too (the reference drops them)"),
        ("OTEL_TRACES_SAMPLER", "`--tracing-sampling-rate` " + unset.format("TRACING_SAMPLING_RATE") + ": `always_on` 1, `always_off` 0, `traceidratio` and `parentbased_traceidratio` `OTEL_TRACES_SAMPLER_ARG` (unset, 1), and `parentbased_always_on` 1 (the reference's default for it); another sampler stops the start when tracing is on (the reference would sample every call)"),
        ("OTEL_TRACES_SAMPLER_ARG", "the rate of `OTEL_TRACES_SAMPLER`'s ratio samplers, read as `TRACING_SAMPLING_RATE`; not a number stops the start when tracing is on (the reference ignores it)"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "where spans go (`/v1/traces` added for http), " + sdk + "; `--tracing-endpoint` wins"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "where spans go, as it is; wins over `OTEL_EXPORTER_OTLP_ENDPOINT`, " + sdk),
        ("OTEL_EXPORTER_OTLP_HEADERS", "`k=v,k2=v2` headers on each export, " + sdk + " (also `OTEL_EXPORTER_OTLP_TRACES_HEADERS`)"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "the CA file that verifies the collector, " + sdk + " (also `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE`)"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "milliseconds an export may take (default 10000), as the specification and the reference read it, under `serve` too (also `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, which wins; Python's exporter alone would read seconds); not a whole number above 0 stops the start when tracing is on"),
    )  # fmt: skip


VARIABLES: tuple[Variable, ...] = _variables()
_BY_NAME = {variable.name: variable for variable in VARIABLES}


def translate(
    env: Env, *, defaults: bool = False, given: frozenset[str] = frozenset()
) -> dict[str, str]:
    """`RLS_<FLAG>` variables for the flags that the reference variables in `env` set.

    Flags in `given` (set on the command line or by their own RLS_ variable) are left out, so
    their reference variables are neither read nor judged. Raises SettingError, naming the
    variable, for a value that cannot be used.
    """
    for name in JUDGED:
        boolean(name, env)
    translated = {}
    for flag in FLAGS:
        if flag.dest in given:
            continue
        value = flag.convert(env, defaults)
        if value is not None:
            translated["RLS_" + flag.dest.upper()] = value
    return translated


def ignored(env: Env) -> list[Variable]:
    """The reference variables set in `env` to something the sidecar does not do: unsupported
    at a value that asks for it, or accepted with a different meaning."""
    found = []
    for name, value in env.items():
        variable = _BY_NAME.get(name)
        if variable is None or variable.support is Support.SUPPORTED or value == "":
            continue
        if variable.harmless(value):
            continue
        found.append(variable)
    return sorted(found, key=lambda v: v.name)


def applied(env: Env) -> list[str]:
    """The reference variables set in `env` that the sidecar reads."""
    read = {name for flag in FLAGS for name in flag.reads}.union(JUDGED)
    return sorted(name for name in env if name in read and env[name] != "")


#: Variables whose values are never logged: passwords, and headers that may carry tokens.
_SECRET = re.compile(r"AUTH|PASSWORD|TOKEN|SECRET|HEADERS")


def shown(env: Env) -> dict[str, str]:
    """The reference variables `applied` reads, with their values as the start-up log shows
    them: a secret as `***`, the password of a Redis URI hidden."""
    values = {}
    for name in applied(env):
        value = env[name]
        if _SECRET.search(name):
            value = "***"
        elif name.endswith("_URL"):
            value = ",".join(redact(part) for part in value.split(","))
        values[name] = value
    return values


def present(env: Env) -> list[str]:
    """The reference's own variables set (not empty) in `env`, whether read or not: not the
    standard OpenTelemetry ones, which other programs' environments set as well."""
    return sorted(
        name for name in env if name in _BY_NAME and env[name] != "" and not _BY_NAME[name].standard
    )


#: How alike (difflib's ratio) a name set in the environment must be to a reference variable's
#: to be taken for a typo of it: one letter swapped, missing or extra in a name of ten or more
#: (RUNTIME_SUBDIRECTROY is 0.95, LOGLEVEL 0.94), not a neighbour such as HOSTNAME (0.67).
TYPO_RATIO = 0.9
#: Names near a reference variable's that are not typos of one: Envoy Gateway sets
#: GRPC_SERVER_TLS_CA_CERT, which the reference does not read (see GRPC_CLIENT_TLS_CACERT).
_NOT_TYPOS = frozenset({"GRPC_SERVER_TLS_CA_CERT"})
#: OpenTelemetry's variables of each signal, near the table's (OTEL_EXPORTER_OTLP_LOGS_ENDPOINT
#: to OTEL_EXPORTER_OTLP_ENDPOINT) without being typos of them.
_OTEL_SIGNALS = re.compile(r"OTEL_(EXPORTER_OTLP_(TRACES|METRICS|LOGS)|METRICS|LOGS)_")


def misspelled(env: Env) -> list[tuple[str, str]]:
    """(name, the reference variable it is likely meant to be) for each name set in `env` that
    is not a reference variable but one typo from one."""
    found = []
    for name in sorted(env):
        if name in _BY_NAME or name in _NOT_TYPOS or env[name] == "":
            continue
        if _OTEL_SIGNALS.match(name):
            continue
        close = difflib.get_close_matches(name, _BY_NAME, n=1, cutoff=TYPO_RATIO)
        if close:
            found.append((name, close[0]))
    return found


def markdown() -> str:
    """README's table: every reference variable, its default there, and how the sidecar takes it."""
    lines = ["| variable | reference default | here | how |", "|---|---|---|---|"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default else ""
        lines.append(f"| `{v.name}` | {default} | {v.support.value} | {v.note} |")
    return "\n".join(lines) + "\n"
