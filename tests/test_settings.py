"""The reference's environment variables: a Deployment written for envoyproxy/ratelimit runs the
sidecar unchanged, each variable read with the reference's meaning, RLS_* variables and flags
still winning, and nothing set ever silently ignored."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
import redis
from support.reference_process import reference_process
from support.sidecars import client, request, serve_process, write_rules

from sidecar import cli
from sidecar.cli import settings
from sidecar.injector.urls import validate_url
from sidecar.model import Code
from sidecar.storage.backends import open_backend

ROOT = Path(__file__).resolve().parent.parent

#: Every variable envoyproxy/ratelimit's src/settings/settings.go reads (`envconfig` tags, in
#: their order there), at the snapshot REFERENCE.md describes.
REFERENCE_VARIABLES = """
HOST PORT DEBUG_HOST DEBUG_PORT GRPC_UDS GRPC_HOST GRPC_PORT GRPC_MAX_CONNECTION_AGE
GRPC_MAX_CONNECTION_AGE_GRACE GRPC_SERVER_USE_TLS GRPC_SERVER_TLS_CERT GRPC_SERVER_TLS_KEY
GRPC_CLIENT_TLS_CACERT GRPC_CLIENT_TLS_SAN LOG_LEVEL LOG_FORMAT CONFIG_TYPE
FORCE_START_WITHOUT_INITIAL_CONFIG CONFIG_GRPC_XDS_NODE_ID CONFIG_GRPC_XDS_NODE_METADATA
CONFIG_GRPC_XDS_SERVER_URL CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL
CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS CONFIG_GRPC_XDS_SERVER_USE_TLS
CONFIG_GRPC_XDS_CLIENT_TLS_CERT CONFIG_GRPC_XDS_CLIENT_TLS_KEY CONFIG_GRPC_XDS_SERVER_TLS_CACERT
CONFIG_GRPC_XDS_SERVER_TLS_SAN XDS_CLIENT_BACKOFF_INITIAL_INTERVAL XDS_CLIENT_BACKOFF_MAX_INTERVAL
XDS_CLIENT_BACKOFF_RANDOM_FACTOR XDS_CLIENT_BACKOFF_JITTER XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES
USE_DOG_STATSD USE_DOG_STATSD_MOGRIFIERS USE_STATSD STATSD_HOST STATSD_PORT EXTRA_TAGS
STATS_FLUSH_INTERVAL DISABLE_STATS USE_PROMETHEUS PROMETHEUS_ADDR PROMETHEUS_PATH
PROMETHEUS_MAPPER_YAML PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS RUNTIME_ROOT RUNTIME_SUBDIRECTORY
RUNTIME_APPDIRECTORY RUNTIME_IGNOREDOTFILES RUNTIME_WATCH_ROOT EXPIRATION_JITTER_MAX_SECONDS
LOCAL_CACHE_SIZE_IN_BYTES NEAR_LIMIT_RATIO CACHE_KEY_PREFIX BACKEND_TYPE
STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT LIMIT_RESPONSE_HEADERS_ENABLED LIMIT_LIMIT_HEADER
LIMIT_REMAINING_HEADER LIMIT_RESET_HEADER HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED
REDIS_SOCKET_TYPE REDIS_TYPE REDIS_URL REDIS_POOL_SIZE REDIS_AUTH REDIS_TLS REDIS_TLS_CLIENT_CERT
REDIS_TLS_CLIENT_KEY REDIS_TLS_CACERT REDIS_TLS_SKIP_HOSTNAME_VERIFICATION REDIS_PIPELINE_WINDOW
REDIS_PIPELINE_LIMIT REDIS_CLUSTER_PIPELINE_PARALLELISM REDIS_PERSECOND REDIS_PERSECOND_SOCKET_TYPE
REDIS_PERSECOND_TYPE REDIS_PERSECOND_URL REDIS_PERSECOND_POOL_SIZE REDIS_PERSECOND_AUTH
REDIS_PERSECOND_TLS REDIS_SENTINEL_AUTH REDIS_PERSECOND_SENTINEL_AUTH
REDIS_PERSECOND_PIPELINE_WINDOW REDIS_PERSECOND_PIPELINE_LIMIT
REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM REDIS_HEALTH_CHECK_ACTIVE_CONNECTION REDIS_TIMEOUT
REDIS_PERSECOND_TIMEOUT REDIS_POOL_ON_EMPTY_BEHAVIOR REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR
REDIS_STARTUP_INITIAL_INTERVAL REDIS_STARTUP_MAX_INTERVAL REDIS_STARTUP_MAX_ELAPSED_TIME
MEMCACHE_HOST_PORT MEMCACHE_MAX_IDLE_CONNS MEMCACHE_SRV MEMCACHE_SRV_REFRESH MEMCACHE_TLS
MEMCACHE_TLS_CLIENT_CERT MEMCACHE_TLS_CLIENT_KEY MEMCACHE_TLS_CACERT
MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION SHADOW_MODE QUOTA_MODE RESPONSE_DYNAMIC_METADATA
MERGE_DOMAIN_CONFIG TRACING_ENABLED TRACING_SERVICE_NAME TRACING_SERVICE_NAMESPACE
TRACING_SERVICE_INSTANCE_ID TRACING_EXPORTER_PROTOCOL TRACING_SAMPLING_RATE
""".split()  # noqa: SIM905 (a block of names reads like the source it is checked against)

#: Variables the reference's settings.go read after that snapshot, from its PRs: #1191
#: (REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR), #1206 (USE_CALENDAR_MONTH_RATE_LIMIT), #1190
#: (LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED); and from its open #1230 (ENABLE_NEGATIVE_HITS),
#: which puts refunds behind a switch.
LATER_VARIABLES = [
    "REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR",
    "USE_CALENDAR_MONTH_RATE_LIMIT",
    "LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED",
    "ENABLE_NEGATIVE_HITS",
]
#: The standard OpenTelemetry variables the reference reads since its PR #1171: those its
#: src/settings/tracing_config.go reads in place of unset TRACING_* ones, and the exporter's
#: its README names.
OTEL_VARIABLES = """
OTEL_SDK_DISABLED OTEL_TRACES_EXPORTER OTEL_EXPORTER_OTLP_PROTOCOL OTEL_SERVICE_NAME
OTEL_RESOURCE_ATTRIBUTES OTEL_TRACES_SAMPLER OTEL_TRACES_SAMPLER_ARG OTEL_EXPORTER_OTLP_ENDPOINT
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT OTEL_EXPORTER_OTLP_HEADERS OTEL_EXPORTER_OTLP_CERTIFICATE
OTEL_EXPORTER_OTLP_TIMEOUT
""".split()  # noqa: SIM905 (as REFERENCE_VARIABLES)
#: Of those, the ones the OTLP exporter reads itself, whichever flags are set.
EXPORTER_VARIABLES = {
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
}

RULES = """\
domain: helm
descriptors:
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 2
"""


def helm_chart_env(rules_root: Path, redis_url: str) -> dict[str, str]:
    """What a typical Helm chart (and Istio's ratelimit sample) sets for the reference, with the
    rules mounted at /data/ratelimit/config, here under `rules_root`."""
    return {
        "LOG_LEVEL": "debug",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": redis_url.removeprefix("redis://"),
        "USE_STATSD": "false",
        "RUNTIME_ROOT": str(rules_root),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_WATCH_ROOT": "false",
        "RUNTIME_IGNOREDOTFILES": "true",
        "LOCAL_CACHE_SIZE_IN_BYTES": "1048576",
        "NEAR_LIMIT_RATIO": "0.8",
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": "0",
        # Loopback and free ports for the test (a chart keeps 0.0.0.0:8080/8081).
        "HOST": "127.0.0.1",
        "PORT": "0",
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": "0",
    }


async def test_a_helm_chart_deployment_runs_unchanged(tmp_path: Path, redis_url: str) -> None:
    """`ratelimit` with no arguments and only a chart's variables loads the rules from
    RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config, counts on the Redis at REDIS_URL, is healthy, and
    serves /rlconfig on the debug port; it logs which variables it read."""
    config = tmp_path / "ratelimit" / "config"
    config.mkdir(parents=True)
    (config / "config.yaml").write_text(RULES)
    async with reference_process(helm_chart_env(tmp_path, redis_url)) as sidecar:
        started = sidecar.started
        assert (started["rules"], started["backend"]) == ("files", "redis")
        async with client(started["grpc_port"]) as rls:
            ip = [("remote_address", "10.0.0.1")]
            codes = [
                (await rls.should_rate_limit(request("helm", ip))).overall_code for _ in range(3)
            ]
        assert codes == [Code.OK, Code.OK, Code.OVER_LIMIT]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{started['http_port']}/healthcheck") as got:
                assert (got.status, await got.text()) == (200, "OK")
            async with http.get(f"http://127.0.0.1:{started['debug_port']}/rlconfig") as got:
                assert await got.text() == (
                    "helm.remote_address: unit=MINUTE requests_per_unit=2, shadow_mode: false, "
                    "quota_mode: false\n"
                )
    [read] = sidecar.events("reference_settings")
    assert "REDIS_URL" in read["read"] and "RUNTIME_ROOT" in read["read"]
    assert {e["variable"] for e in sidecar.events("reference_setting_differs")} == {
        "DEBUG_HOST", "DEBUG_PORT", "LOCAL_CACHE_SIZE_IN_BYTES",
    }  # fmt: skip
    assert not sidecar.events("reference_setting_not_supported")


async def test_ratelimit_without_redis_url_says_what_to_set(tmp_path: Path) -> None:
    """The reference's default Redis is twemproxy's Unix socket, which the sidecar cannot use:
    `ratelimit` stops with exit status 2 and names the variables to set."""
    async with reference_process({"RUNTIME_ROOT": str(tmp_path)}, wait=False) as sidecar:
        assert await sidecar.process.wait() == 2
    assert "REDIS_URL is not set" in sidecar.output()
    assert "REDIS_SOCKET_TYPE=tcp" in sidecar.output()


def serve(env: dict[str, str], *argv: str) -> dict[str, object]:
    """`serve --reference-env`'s settings from `env` and `argv`."""
    args = cli.parse_args(["serve", "--reference-env", *argv], env)
    return vars(args)


#: What a developer's shell may export for another project: none of it is `serve`'s business.
OTHER_PROJECT = {
    "REDIS_URL": "redis://cache.other-project:6379/x",
    "HOST": "203.0.113.7",
    "PORT": "3000",
    "LOG_LEVEL": "loud",
}


def test_serve_reads_the_references_variables_only_when_asked() -> None:
    """Without --reference-env (or RLS_REFERENCE_ENV=true), `serve` reads none of the
    reference's variables, even ones it could not use; with it, it reads them as `ratelimit`
    does."""
    args = cli.parse_args(["serve", "--config", "x"], OTHER_PROJECT)
    assert (args.backend, args.http_address, args.log_level) == (
        "memory://", "0.0.0.0:8080", "info",
    )  # fmt: skip
    assert args.reference_unread == ["HOST", "LOG_LEVEL", "PORT", "REDIS_URL"]
    env = {**OTHER_PROJECT, "LOG_LEVEL": "warn", "REDIS_URL": "cache:6379"}
    for asked in (["--reference-env"], []):
        environ = env if asked else {**env, "RLS_REFERENCE_ENV": "true"}
        args = cli.parse_args(["serve", "--config", "x", *asked], environ)
        assert (args.backend, args.http_address, args.log_level) == (
            "redis://cache:6379", "203.0.113.7:3000", "warning",
        )  # fmt: skip
        assert args.reference_unread == []


async def test_serve_started_from_a_shell_with_other_exports_serves_on_its_flags(
    tmp_path: Path,
) -> None:
    """`serve` (what `make run` runs) started with a REDIS_URL it cannot use and a HOST
    exported serves on its own addresses and memory://, logs the names it left unread, and
    the names of the RLS_* variables it read."""
    rules = write_rules(tmp_path)
    args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]  # fmt: skip
    env = {**OTHER_PROJECT, "RLS_BACKEND": "memory://"}
    async with serve_process(args, env) as served, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{served.http_port}/healthcheck"
        async with http.get(url) as got:
            assert got.status == 200
    [unread] = [e for e in served.events() if e.get("event") == "reference_settings_not_read"]
    assert unread["variables"] == ["HOST", "LOG_LEVEL", "PORT", "REDIS_URL"]
    [read] = [e for e in served.events() if e.get("event") == "rls_settings"]
    assert read["read"] == ["RLS_BACKEND"]
    [started] = [e for e in served.events() if e.get("event") == "started"]
    assert started["backend"] == "memory"


def test_the_start_up_log_shows_what_was_read_with_secrets_hidden() -> None:
    """Names and values of the reference's variables read; passwords, in AUTH variables and
    in Redis URIs, and xDS headers (which may carry tokens) as ***."""
    env = {
        "REDIS_URL": "redis://user:hunter2@r:6379/1",
        "REDIS_AUTH": "hunter3",
        "PORT": "9090",
        "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "authorization:Bearer t0ken",
        "UNRELATED": "x",
    }
    assert settings.shown(env) == {
        "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "***",
        "PORT": "9090",
        "REDIS_AUTH": "***",
        "REDIS_URL": "redis://user:***@r:6379/1",
    }


def test_a_name_one_typo_from_a_reference_variable_is_taken_for_it() -> None:
    """A name set that is not the reference's but one typo from one is reported with the one
    meant; neighbours that are not typos (HOSTNAME, Envoy Gateway's GRPC_SERVER_TLS_CA_CERT)
    and the reference's own names are not."""
    env = {
        "RUNTIME_SUBDIRECTROY": "ratelimit",
        "LOGLEVEL": "debug",
        "REDIS_UR": "r:6379",
        "HOSTNAME": "pod-1",
        "GRPC_SERVER_TLS_CA_CERT": "/certs/ca.crt",
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "PATH": "/bin",
    }
    assert settings.misspelled(env) == [
        ("LOGLEVEL", "LOG_LEVEL"),
        ("REDIS_UR", "REDIS_URL"),
        ("RUNTIME_SUBDIRECTROY", "RUNTIME_SUBDIRECTORY"),
    ]


async def test_ratelimit_warns_of_misspelled_settings_before_what_they_cause(
    tmp_path: Path, redis_url: str
) -> None:
    """RUNTIME_SUBDIRECTROY and RLS_CONFG are each warned about at start, naming the variable
    meant, before the rules directory they left at its default is found missing."""
    env = {**helm_chart_env(tmp_path, redis_url), "RLS_CONFG": str(tmp_path)}
    env["RUNTIME_SUBDIRECTROY"] = env.pop("RUNTIME_SUBDIRECTORY")
    async with reference_process(env, wait=False) as sidecar:
        assert await sidecar.process.wait() == 1
    warned = {(e["variable"], e["did_you_mean"]) for e in sidecar.events("unknown_setting")}
    assert warned == {
        ("RUNTIME_SUBDIRECTROY", "RUNTIME_SUBDIRECTORY"),
        ("RLS_CONFG", "RLS_CONFIG"),
    }
    assert (
        sidecar.lines[-1]
        == f"{tmp_path}/config: error loading config file: no such file or directory"
    )


async def test_a_setting_that_cannot_be_used_stops_ratelimit_with_one_line() -> None:
    """`ratelimit` names itself, in one line naming the variable, and a typo that explains
    it; no usage of `serve`."""
    env = {"REDIS_UR": "r:6379", "RUNTIME_ROOT": "/nowhere"}
    async with reference_process(env, wait=False) as sidecar:
        assert await sidecar.process.wait() == 2
    [line] = sidecar.lines
    assert line.startswith("ratelimit: REDIS_URL is not set: ")
    assert line.endswith("(REDIS_UR is set: did you mean REDIS_URL?)")


def test_ratelimit_help_is_short_and_says_how_it_differs_from_serve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ratelimit --help` fits a screen and names what differs from `serve`: the variables
    read, and its defaults for the rules, Redis and statsd."""
    assert cli.reference_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 30
    for said in ("--reference-env", "/srv/runtime_data/current/config", "REDIS_URL", "USE_STATSD"):
        assert said in out


def test_listeners_runtime_and_redis_map_onto_flags() -> None:
    """Addresses join HOST and PORT (a Unix socket wins for gRPC; IPv6 gets brackets), the
    rules directory joins the RUNTIME_* parts, and REDIS_* make one backend URL."""
    args = serve(
        {
            "HOST": "::1",
            "PORT": "9080",
            "GRPC_UDS": "/run/rls.sock",
            "GRPC_PORT": "9081",
            "RUNTIME_ROOT": "/data",
            "RUNTIME_SUBDIRECTORY": "ratelimit",
            "REDIS_TYPE": "cluster",
            "REDIS_URL": "r1:7000,r2:7000",
            "REDIS_AUTH": "user:p@ss",
            "REDIS_TLS": "true",
            "REDIS_TLS_CACERT": "/certs/ca.crt",
            "REDIS_TIMEOUT": "250ms",
            "USE_PROMETHEUS": "true",
            "PROMETHEUS_ADDR": ":19001",
            "PROMETHEUS_PATH": "/stats/prometheus",
            "LOG_LEVEL": "WARN",
            "LOG_FORMAT": "json",
            "SHADOW_MODE": "True",
            "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "1",
            "LOCAL_CACHE_SIZE_IN_BYTES": "0",
            "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "t",
            "MERGE_DOMAIN_CONFIG": "true",
        }
    )
    assert (args["http_address"], args["grpc_address"]) == ("[::1]:9080", "unix:/run/rls.sock")
    assert args["config"] == ["/data/ratelimit/config"]
    assert args["backend"] == (
        "rediss+cluster://user:p%40ss@r1:7000,r2:7000"
        "?ssl_ca_certs=%2Fcerts%2Fca.crt&ssl_cert_reqs=required"
    )
    assert args["redis_timeout_ms"] == 250
    assert (args["metrics_address"], args["metrics_path"]) == ("0.0.0.0:19001", "/stats/prometheus")
    assert (args["log_level"], args["log_format"]) == ("warning", "json")
    assert (args["shadow_mode"], args["rejected_hits"], args["over_limit_cache"]) == (
        True,
        "skip",
        0,
    )
    assert args["health_requires_config"] is True
    assert args["merge_domain_config"] is True
    assert args["xds_server"] is None


def test_xds_variables_map_onto_the_xds_flags() -> None:
    """CONFIG_TYPE=GRPC_XDS_SOTW takes the rules from CONFIG_GRPC_XDS_SERVER_URL (RUNTIME_* then
    name no rules directory), with the node, headers, TLS files and back-off as given."""
    args = serve(
        {
            "CONFIG_TYPE": "GRPC_XDS_SOTW",
            "RUNTIME_ROOT": "/data",
            "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit",
            "CONFIG_GRPC_XDS_NODE_METADATA": "cluster=edge,broken,zone=a=b",
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "X-Tenant:blue,authorization:Bearer x",
            "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": "/certs/tls.crt",
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": "/certs/tls.key",
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": "/certs/ca.crt",
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "envoy-gateway",
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL": "1m30s",
            "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL": "2s",
            "XDS_CLIENT_BACKOFF_JITTER": "false",
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES": "8388608",
            "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        }
    )
    options = cli.serve.xds_flags.options(cli.parse_args(["serve"], {"RLS_XDS_SERVER": "x:1"}))
    assert options is not None and options.server == "x:1" and options.backoff_jitter
    assert args["config"] is None
    assert args["xds_server"] == "localhost:18000"
    assert args["xds_node_id"] == "envoy-ratelimit"
    assert args["xds_node_metadata"] == ["cluster=edge", "zone=a=b"]
    assert args["xds_header"] == ["X-Tenant:blue", "authorization:Bearer x"]
    assert (args["xds_tls"], args["xds_server_name"]) == (True, "envoy-gateway")
    assert (args["xds_cert"], args["xds_key"], args["xds_ca"]) == (
        "/certs/tls.crt", "/certs/tls.key", "/certs/ca.crt",
    )  # fmt: skip
    assert (args["xds_retry_seconds"], args["xds_backoff_seconds"]) == (90.0, 2.0)
    assert (args["xds_backoff_no_jitter"], args["xds_max_message_bytes"]) == (True, 8_388_608)
    assert args["force_start_without_initial_config"] is True
    built = cli.serve.xds_flags.options(
        cli.parse_args(
            ["serve", "--reference-env"],
            {
                "CONFIG_TYPE": "GRPC_XDS_SOTW",
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "X-Tenant:blue",
                "CONFIG_GRPC_XDS_NODE_METADATA": "a=1",
            },
        )
    )
    assert built is not None
    assert (tuple(built.headers), dict(built.node_metadata)) == (
        (("x-tenant", "blue"),),
        {"a": "1"},
    )


def test_rls_variables_and_flags_win_over_the_references() -> None:
    """A flag, then its RLS_ variable, then the reference's variable: the reference's are read
    last, and a flag set otherwise leaves its reference variables unread (even bad ones)."""
    env = {
        "PORT": "9999",
        "RLS_HTTP_ADDRESS": "127.0.0.1:7070",
        "REDIS_URL": "redis:6379",
        "BACKEND_TYPE": "memcache",
        "RUNTIME_ROOT": "/data",
    }
    args = serve(env, "--backend", "memory://", "--config", "rules/")
    assert (args["http_address"], args["backend"], args["config"]) == (
        "127.0.0.1:7070", "memory://", ["rules/"],
    )  # fmt: skip


def test_sentinel_settings_map_onto_a_sentinel_url() -> None:
    """REDIS_TYPE=sentinel: REDIS_URL is the master's name then the Sentinels, REDIS_AUTH the
    master's password, REDIS_SENTINEL_AUTH the Sentinels' (`user:password` or a password);
    REDIS_TLS speaks TLS to both. The per-second store reads its own variables the same way."""
    args = serve(
        {
            "REDIS_TYPE": "sentinel",
            "REDIS_URL": "mymaster,s1:26379,s2:26379",
            "REDIS_AUTH": "m@ster",
            "REDIS_SENTINEL_AUTH": "watcher:s&cret",
            "REDIS_TLS": "true",
            "REDIS_PERSECOND": "true",
            "REDIS_PERSECOND_TYPE": "SENTINEL",
            "REDIS_PERSECOND_URL": "persecond,s3:26379",
            "REDIS_PERSECOND_SENTINEL_AUTH": "only-a-password",
        },
        "--config",
        "x",
    )
    assert args["backend"] == (
        "rediss+sentinel://:m%40ster@s1:26379,s2:26379/mymaster"
        "?sentinel_username=watcher&sentinel_password=s%26cret&ssl_cert_reqs=required"
    )
    assert args["backend_per_second"] == (
        "redis+sentinel://s3:26379/persecond?sentinel_password=only-a-password"
    )
    for url in (args["backend"], args["backend_per_second"]):
        assert isinstance(url, str)
        validate_url(url)
        open_backend(url)  # parses, connects nothing


@pytest.mark.parametrize(
    ("env", "backend"),
    [
        ({"REDIS_URL": "r:6379"}, "redis://r:6379"),
        ({"REDIS_URL": "redis://r:6379/11"}, "redis://r:6379/11"),
        ({"REDIS_URL": "redis://:pw@r:6379"}, "redis://:pw@r:6379"),
        ({"REDIS_URL": "redis://u:p%40ss@r:6379/2"}, "redis://u:p%40ss@r:6379/2"),
        ({"REDIS_URL": "redis://r:6379?db=3&password=pw"}, "redis://:pw@r:6379/3"),
        ({"REDIS_URL": "redis://:url@r:6379", "REDIS_AUTH": "env"}, "redis://:env@r:6379"),
        ({"REDIS_URL": "rediss://r:6380"}, "rediss://r:6380?ssl_cert_reqs=required"),
        (
            {"REDIS_URL": "redis://:pw@r1:7000,redis://r2:7000", "REDIS_TYPE": "cluster"},
            "redis+cluster://:pw@r1:7000,r2:7000",
        ),
        (
            {"REDIS_URL": "m,redis://:spw@s1:26379", "REDIS_TYPE": "sentinel"},
            "redis+sentinel://s1:26379/m?sentinel_password=spw",
        ),
    ],
    ids=["host-port", "uri-db", "uri-password", "uri-user", "uri-query", "auth-wins", "rediss",
         "cluster", "sentinel"],
)  # fmt: skip
def test_redis_url_takes_every_form_the_references_client_takes(
    env: dict[str, str], backend: str
) -> None:
    """REDIS_URL is HOST:PORT or a `redis://` URI, as the reference's Redis client (radix)
    reads it: the URI's user, password and database (in the path, or ?username=, ?password=,
    ?db=) apply, REDIS_AUTH winning over its credentials; on a Sentinel's address they are
    the Sentinels'. `rediss://` means TLS."""
    url = serve(env, "--config", "x")["backend"]
    assert url == backend
    validate_url(backend)


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("redis://127.0.0.1:6379/x", "REDIS_URL='redis://127.0.0.1:6379/x': database must be"),
        ("redis://:secret@r:port", "REDIS_URL='redis://:***@r:port': bad port in 'r:port'"),
        ("r:99999", "REDIS_URL='r:99999': bad port in 'r:99999'"),
    ],
    ids=["database", "port-with-password", "port"],
)
def test_a_redis_url_that_cannot_be_used_is_quoted_as_written(
    written: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message quotes REDIS_URL as the user wrote it (its password hidden), never the URL
    it was turned into (no 'redis://redis://')."""
    with pytest.raises(SystemExit):
        serve({"REDIS_URL": written}, "--config", "x")
    err = capsys.readouterr().err
    assert message in err
    assert "redis://redis://" not in err and "secret" not in err


async def test_a_redis_uri_with_a_database_counts_there(tmp_path: Path, redis_url: str) -> None:
    """`ratelimit` with REDIS_URL=redis://HOST:PORT/11 serves, and its counters are in
    database 11 of that Redis, none in database 0."""
    config = tmp_path / "ratelimit" / "config"
    config.mkdir(parents=True)
    (config / "config.yaml").write_text(RULES)
    env = {**helm_chart_env(tmp_path, redis_url), "REDIS_URL": f"{redis_url}/11"}
    async with reference_process(env) as sidecar, client(sidecar.started["grpc_port"]) as rls:
        answer = await rls.should_rate_limit(request("helm", [("remote_address", "10.0.0.9")]))
    assert answer.overall_code == Code.OK
    host, port = redis_url.removeprefix("redis://").split(":")
    eleven = redis.Redis(host=host, port=int(port), db=11)
    try:
        assert eleven.dbsize() >= 1
        eleven.flushdb()
    finally:
        eleven.close()
    zero = redis.Redis(host=host, port=int(port), db=0)
    try:
        assert zero.keys("rl{*") == []
    finally:
        zero.close()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BACKEND_TYPE": "memcache"}, "BACKEND_TYPE=memcache: Memcache is not supported"),
        ({"REDIS_URL": "r:6379", "REDIS_TYPE": "sentinel"}, "expected MASTER_NAME,SENTINEL_HOST"),
        ({"REDIS_URL": "/var/run/redis.sock"}, "Redis over a Unix socket is not supported"),
        ({"REDIS_URL": "r:6379", "REDIS_TLS": "maybe"}, "REDIS_TLS='maybe': expected true or false"),
        ({"REDIS_URL": "r:6379", "REDIS_TIMEOUT": "10"}, "REDIS_TIMEOUT='10': expected a duration"),
        ({"PORT": "http"}, "PORT='http': expected a whole number"),
        ({"CONFIG_TYPE": "GRPC_XDS_DELTA"}, "CONFIG_TYPE='GRPC_XDS_DELTA': expected one of FILE"),
        ({"LOG_LEVEL": "loud"}, "LOG_LEVEL='loud'"),
        ({"RLS_CONFIG": "a", "CONFIG_TYPE": "GRPC_XDS_SOTW"}, "--config and --xds-server exclude"),
        ({"STATSD_PROTOCOL": "quic"}, "STATSD_PROTOCOL='quic': expected tcp or udp"),
        ({"STATSD_PORT": "99999", "USE_STATSD": "true"}, "STATSD_PORT=99999: not a port number"),
        ({"STATS_FLUSH_INTERVAL": "0s"}, "STATS_FLUSH_INTERVAL='0s': must be more than 0"),
        ({"EXTRA_TAGS": "a:b,c"}, "EXTRA_TAGS='a:b,c': expected key:value pairs"),
        ({"GRPC_SERVER_USE_TLS": "yes"}, "GRPC_SERVER_USE_TLS='yes': expected true or false"),
        ({"TRACING_EXPORTER_PROTOCOL": "zipkin"}, "TRACING_EXPORTER_PROTOCOL='zipkin': expected"),
        ({"TRACING_SAMPLING_RATE": "half"}, "TRACING_SAMPLING_RATE='half': expected a number"),
        ({"REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR": "yes"},
         "REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR='yes': expected true or false"),
    ],
    ids=["memcache", "sentinel", "unix", "bad-bool", "bad-duration", "bad-port", "config-type",
         "log-level", "both-sources", "statsd-protocol", "statsd-port", "flush-interval",
         "extra-tags", "use-tls", "tracing-protocol", "sampling-rate", "close-on-readonly"],
)  # fmt: skip
def test_a_reference_variable_that_cannot_be_used_stops_the_start(
    env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit status 2 with the variable, its value and the reason, before anything listens."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(
            ["serve", "--reference-env", *(["--config", "x"] if "RLS_CONFIG" not in env else [])],
            env,
        )
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_close_connection_on_readonly_is_accepted_true_or_false() -> None:
    """REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR (the reference's PR #1191) starts the sidecar
    whether true or false, under `serve --reference-env` and `ratelimit`, and is shown among
    the variables read; true is what the sidecar does on every topology, so only false is
    reported as done differently."""
    for value in ("true", "false", "TRUE", "0", "1", "f"):
        env = {"REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR": value, "REDIS_URL": "r:6379"}
        assert serve(env, *CONFIG)["backend"] == "redis://r:6379"
        reference = cli.parse_args(["serve"], env, reference_defaults=True)
        assert reference.backend == "redis://r:6379"
        assert reference.reference_applied["REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR"] == value
    differs = {"REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR": "false"}
    assert [v.name for v in settings.ignored(differs)] == list(differs)
    assert settings.ignored({"REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR": "true"}) == []


def test_refunds_come_from_enable_negative_hits() -> None:
    """ENABLE_NEGATIVE_HITS=true sets --negative-hits; refunds are off by default, as in the
    reference's #1230."""
    assert serve({}, *CONFIG)["negative_hits"] is False
    assert serve({"ENABLE_NEGATIVE_HITS": "false"}, *CONFIG)["negative_hits"] is False
    assert serve({"ENABLE_NEGATIVE_HITS": "true"}, *CONFIG)["negative_hits"] is True
    env = {"ENABLE_NEGATIVE_HITS": "1", "RLS_BACKEND": "memory://"}
    assert cli.parse_args(["serve"], env, reference_defaults=True).negative_hits is True
    assert cli.parse_args(["serve", *CONFIG, "--negative-hits"], {}).negative_hits is True


def test_calendar_months_come_from_use_calendar_month_rate_limit() -> None:
    """USE_CALENDAR_MONTH_RATE_LIMIT=true sets --calendar-months (false by default, as in the
    reference), under `serve --reference-env` and `ratelimit`; a value that is not a boolean
    stops the start."""
    assert serve({}, *CONFIG)["calendar_months"] is False
    assert serve({"USE_CALENDAR_MONTH_RATE_LIMIT": "false"}, *CONFIG)["calendar_months"] is False
    assert serve({"USE_CALENDAR_MONTH_RATE_LIMIT": "true"}, *CONFIG)["calendar_months"] is True
    env = {"USE_CALENDAR_MONTH_RATE_LIMIT": "1", "RLS_BACKEND": "memory://"}
    assert cli.parse_args(["serve"], env, reference_defaults=True).calendar_months is True
    assert cli.parse_args(["serve", *CONFIG], env).calendar_months is False  # not asked
    with pytest.raises(SystemExit):
        serve({"USE_CALENDAR_MONTH_RATE_LIMIT": "calendar"}, *CONFIG)


def test_statsd_tls_and_tracing_variables_read_as_the_reference_reads_them() -> None:
    """Under `ratelimit` statsd goes to localhost:8125 over TCP unless USE_STATSD=false (the
    reference's default is true), under `serve` only when asked; DISABLE_STATS turns it off.
    GRPC_SERVER_TLS_CA_CERT (Envoy Gateway's) is not the reference's: TLS without client
    certificates. A sampling rate outside 0..1 is its nearest bound, as the reference's
    sampler takes it."""
    memory = {"RLS_BACKEND": "memory://"}
    statsd = cli.parse_args(["serve"], memory, reference_defaults=True).statsd
    assert statsd is not None
    assert (statsd.host, statsd.port, statsd.protocol, statsd.format) == (
        "localhost", 8125, "tcp", "statsd",
    )  # fmt: skip
    for env in ({"USE_STATSD": "false"}, {"DISABLE_STATS": "true"}):
        assert cli.parse_args(["serve"], {**memory, **env}, reference_defaults=True).statsd is None
        assert cli.parse_args(["serve", "--config", "x", "--reference-env"], env).statsd is None
    assert cli.parse_args(["serve", "--config", "x"], {}).statsd is None

    tls = {
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": "/certs/tls.crt",
        "GRPC_SERVER_TLS_KEY": "/certs/tls.key",
        "GRPC_SERVER_TLS_CA_CERT": "/certs/ca.crt",
    }
    files = cli.serve.tls_files(cli.parse_args(["serve", "--config", "x", "--reference-env"], tls))
    assert files is not None
    assert (str(files.cert), str(files.key), files.client_ca) == (
        "/certs/tls.crt", "/certs/tls.key", None,
    )  # fmt: skip
    assert "GRPC_SERVER_TLS_CA_CERT" not in {v.name for v in settings.ignored(tls)}

    for raw, rate in (("2", 1.0), ("-0.5", 0.0), ("0.3", 0.3)):
        assert (
            serve({"TRACING_SAMPLING_RATE": raw}, "--config", "x")["tracing_sampling_rate"] == rate
        )


#: A rules path, which `serve` requires of any command line.
CONFIG = ("--config", "rules")


def test_response_header_and_metadata_variables_map_onto_their_flags() -> None:
    """LIMIT_RESPONSE_HEADERS_ENABLED and RESPONSE_DYNAMIC_METADATA turn on --response-headers
    and --response-dynamic-metadata; the three header names are read with the headers on, as
    the reference reads them, and left at their defaults otherwise."""
    args = serve(
        {
            "LIMIT_RESPONSE_HEADERS_ENABLED": "true",
            "LIMIT_LIMIT_HEADER": "X-Limit",
            "LIMIT_REMAINING_HEADER": "X-Left",
            "LIMIT_RESET_HEADER": "X-Reset",
            "RESPONSE_DYNAMIC_METADATA": "1",
        },
        *CONFIG,
    )
    assert (args["response_headers"], args["response_dynamic_metadata"]) == (True, True)
    names = (
        args["response_limit_header"],
        args["response_remaining_header"],
        args["response_reset_header"],
    )
    assert names == ("X-Limit", "X-Left", "X-Reset")
    off = serve(
        {"LIMIT_RESPONSE_HEADERS_ENABLED": "false", "LIMIT_LIMIT_HEADER": "Bad Name"}, *CONFIG
    )
    assert (off["response_headers"], off["response_dynamic_metadata"]) == (False, False)
    assert off["response_limit_header"] == "RateLimit-Limit"
    # RLS_* and the flags still win over the reference's names.
    flagged = serve(
        {"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_LIMIT_HEADER": "X-Limit"},
        *CONFIG,
        "--response-limit-header",
        "X-Quota",
    )
    assert flagged["response_limit_header"] == "X-Quota"


def test_all_descriptors_headers_come_from_limit_all_descriptors_headers_enabled() -> None:
    """LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED turns on --response-headers-all-descriptors,
    without LIMIT_RESPONSE_HEADERS_ENABLED too, as the reference reads it; a value that is not
    a boolean stops the start."""
    assert serve({}, *CONFIG)["response_headers_all_descriptors"] is False
    args = serve({"LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED": "true"}, *CONFIG)
    assert (args["response_headers_all_descriptors"], args["response_headers"]) == (True, False)
    off = serve({"LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED": "false"}, *CONFIG)
    assert off["response_headers_all_descriptors"] is False
    with pytest.raises(SystemExit):
        serve({"LIMIT_ALL_DESCRIPTORS_HEADERS_ENABLED": "all"}, *CONFIG)


def test_a_response_header_name_that_is_not_a_token_stops_the_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A header name with a space, from the reference's variable or the flag, is refused with
    exit status 2, naming where it came from."""
    with pytest.raises(SystemExit) as exited:
        serve(
            {"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_RESET_HEADER": "Rate Reset"}, *CONFIG
        )
    assert exited.value.code == 2
    assert "LIMIT_RESET_HEADER='Rate Reset': 'Rate Reset' is not an HTTP header name" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        serve({}, *CONFIG, "--response-limit-header", "a:b")
    assert "'a:b' is not an HTTP header name" in capsys.readouterr().err


def test_set_variables_the_sidecar_does_not_honour_are_listed_for_the_log() -> None:
    """A variable asking for something the sidecar does not do, or does otherwise, is reported;
    one at a value that asks for nothing (USE_STATSD=false, QUOTA_MODE=false), and variables
    not the reference's, are not."""
    env = {
        "QUOTA_MODE": "true",
        "LIMIT_RESPONSE_HEADERS_ENABLED": "true",
        "GRPC_SERVER_USE_TLS": "true",
        "USE_STATSD": "false",
        "NEAR_LIMIT_RATIO": "0.9",
        "REDIS_POOL_SIZE": "50",
        "EXPIRATION_JITTER_MAX_SECONDS": "60",
        "HOME": "/root",
        "REDIS_URL": "redis:6379",
    }
    reported = {v.name: v.support for v in settings.ignored(env)}
    assert reported == {
        "QUOTA_MODE": settings.Support.UNSUPPORTED,
        "NEAR_LIMIT_RATIO": settings.Support.UNSUPPORTED,
        "EXPIRATION_JITTER_MAX_SECONDS": settings.Support.DIFFERENT,
        "REDIS_POOL_SIZE": settings.Support.DIFFERENT,
    }
    assert "USE_STATSD" not in reported
    assert "LIMIT_RESPONSE_HEADERS_ENABLED" not in reported  # supported: --response-headers
    assert "GRPC_SERVER_USE_TLS" not in reported  # supported: TLS on the gRPC port
    assert "HOME" not in reported and "REDIS_URL" not in reported


def test_every_reference_variable_is_in_the_table_and_in_readme() -> None:
    """The table covers exactly the variables the reference reads, and README shows it as
    `settings.markdown()` renders it (regenerate README's table from it after a change)."""
    assert sorted(v.name for v in settings.VARIABLES) == sorted(
        REFERENCE_VARIABLES + LATER_VARIABLES + OTEL_VARIABLES
    )
    assert {v.name for v in settings.VARIABLES if v.standard} == set(OTEL_VARIABLES)
    read = {name for flag in settings.FLAGS for name in flag.reads}
    supported = {v.name for v in settings.VARIABLES if v.support is settings.Support.SUPPORTED}
    # A supported variable is read by some flag, except the ones that only qualify another,
    # and the exporter's own.
    assert supported - read <= {"USE_PROMETHEUS", *EXPORTER_VARIABLES}
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- settings table -->\n(.*?)<!-- end of settings table -->", readme, re.S)
    assert table is not None, "README.md lost its settings table markers"
    assert table.group(1) == settings.markdown()
