"""Rules over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW`): the sidecar as a client of a control plane the
tests start (tests/support/control_plane.py), over real sockets and mTLS, as Envoy Gateway runs the
reference: pushes are served, bad pushes are NACKed and change nothing, a control plane restart
is survived."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from support.certs import write_certificate
from support.control_plane import ControlPlane, pack
from support.reference_process import reference_process
from support.sidecars import Client, client, request

from sidecar.model import Code
from sidecar.proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2 as rls_conf
from sidecar.runner.app import App, Options
from sidecar.storage.memory import MemoryBackend
from sidecar.xds.client import XdsOptions, backoff_delay

#: Generous: a push is served within milliseconds; the deadline only bounds a failure.
DEADLINE = 10.0


def limit_config(
    name: str, domain: str, key: str, requests: int, unit: int = rls_conf.MINUTE
) -> rls_conf.RateLimitConfig:
    return rls_conf.RateLimitConfig(
        name=name,
        domain=domain,
        descriptors=[
            rls_conf.RateLimitDescriptor(
                key=key,
                rate_limit=rls_conf.RateLimitPolicy(unit=unit, requests_per_unit=requests),
            )
        ],
    )


async def served_limit(rls: Client, domain: str, key: str) -> int | None:
    """The limit the sidecar applies to (key, probe) now, asked with hits_addend 0 (a check that
    consumes nothing); None when no rule matches."""
    message = request(domain, [(key, "probe")])
    message.descriptors[0].hits_addend.SetInParent()
    status = (await rls.should_rate_limit(message)).statuses[0]
    return status.current_limit.requests_per_unit if status.HasField("current_limit") else None


async def until_served(rls: Client, domain: str, key: str, expected: int | None) -> float:
    """Poll until the sidecar applies `expected`; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while (got := await served_limit(rls, domain, key)) != expected:
        assert loop.time() - began < DEADLINE, f"still {got}, expected {expected}"
        await asyncio.sleep(0.01)
    return loop.time() - began


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """Two self-signed certificates, each the other side's CA: the control plane's (for
    localhost and 127.0.0.1) and the rate limit service's client certificate."""
    (tmp_path / "control-plane").mkdir()
    (tmp_path / "ratelimit").mkdir()
    server_cert, server_key = write_certificate(tmp_path / "control-plane")
    client_cert, client_key = write_certificate(tmp_path / "ratelimit", "envoy-ratelimit")
    return {
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
    }


@pytest.fixture
async def control_plane(pki: dict[str, Path]) -> AsyncIterator[ControlPlane]:
    plane = ControlPlane(tls=(pki["server_cert"], pki["server_key"], pki["client_cert"]))
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


def envoy_gateway_env(plane: ControlPlane, pki: dict[str, Path], redis_url: str) -> dict[str, str]:
    """The environment of Envoy Gateway's `envoy-ratelimit` Deployment (its
    internal/infrastructure/kubernetes/ratelimit/resource.go), pointed at the tests' control
    plane, Redis and certificates, on loopback ports the kernel picks. As there, the gRPC port's
    certificate is the one the xDS client presents, and the CA is named GRPC_SERVER_TLS_CA_CERT,
    a variable the reference does not read (its client CA is GRPC_CLIENT_TLS_CACERT)."""
    return {
        "RUNTIME_ROOT": "/data",
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "LOG_LEVEL": "info",
        "USE_STATSD": "false",
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": f"localhost:{plane.port}",
        "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit",
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": str(pki["client_cert"]),
        "GRPC_SERVER_TLS_KEY": str(pki["client_key"]),
        "GRPC_SERVER_TLS_CA_CERT": str(pki["server_cert"]),
        "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": str(pki["client_cert"]),
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": str(pki["client_key"]),
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": str(pki["server_cert"]),
        "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": redis_url.removeprefix("redis://"),
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": "127.0.0.1:0",
        "PROMETHEUS_MAPPER_YAML": "/etc/statsd-exporter/conf.yaml",
        # Loopback and free ports for the test (the Deployment keeps the defaults, :8080/:8081).
        "HOST": "127.0.0.1",
        "PORT": "0",
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": "0",
        # A control plane restart is retried within a test's patience (defaults: 3 s and 10 s).
        "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL": "100ms",
        "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL": "100ms",
        "XDS_CLIENT_BACKOFF_MAX_INTERVAL": "1s",
    }


async def test_envoy_gateway_deployment_takes_pushed_rules_over_mtls(
    control_plane: ControlPlane, pki: dict[str, Path], redis_url: str
) -> None:
    """`ratelimit` with Envoy Gateway's environment starts without rules, connects over mTLS
    with its node id, serves each valid push (ACKed with its version), NACKs a bad push with
    the error and keeps serving the rules it had, and keeps them through a control plane
    restart until the new control plane's rules arrive. Its gRPC port is TLS without client
    certificates, as the reference's is under these variables."""
    env = envoy_gateway_env(control_plane, pki, redis_url)
    tls = grpc.ssl_channel_credentials(root_certificates=pki["client_cert"].read_bytes())
    async with reference_process(env) as sidecar, client(sidecar.started["grpc_port"], tls) as rls:
        assert sidecar.started["rules"] == "xds"
        assert sidecar.started["tls"] == "tls"  # no client certificate asked for
        assert await served_limit(rls, "eg", "user") is None  # no rules yet: unknown domain, OK

        first = await control_plane.answer("")  # the subscription
        assert first.peer_common_name == "envoy-ratelimit"  # the client certificate (mTLS)
        assert first.request.node.id == "envoy-ratelimit"
        assert (
            first.request.type_url
            == "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
        )
        assert list(first.request.resource_names) == []  # every RateLimitConfig (wildcard)

        nonce = control_plane.push("v1", pack(limit_config("eg/user", "eg", "user", 2)))
        took = await until_served(rls, "eg", "user", 2)
        ack = await control_plane.answer(nonce)
        assert (ack.request.version_info, ack.request.HasField("error_detail")) == ("v1", False)
        assert took < DEADLINE
        user = [("user", "alice")]
        codes = [(await rls.should_rate_limit(request("eg", user))).overall_code for _ in range(3)]
        assert codes == [Code.OK, Code.OK, Code.OVER_LIMIT]

        bad = rls_conf.RateLimitConfig(
            name="eg/bad",
            domain="eg",
            descriptors=[
                rls_conf.RateLimitDescriptor(
                    key="user", rate_limit=rls_conf.RateLimitPolicy(requests_per_unit=5)
                )
            ],
        )
        nonce = control_plane.push("v2", pack(bad))
        nack = await control_plane.answer(nonce)
        assert nack.request.version_info == "v1"
        assert nack.request.error_detail.message == (
            "xds:eg/bad: descriptors[0].rate_limit.unit: invalid rate limit unit 'unknown' "
            "(expected one of: second, minute, hour, day, week, month, year)"
        )
        assert await served_limit(rls, "eg", "user") == 2
        assert (await rls.should_rate_limit(request("eg", user))).overall_code == Code.OVER_LIMIT

        await control_plane.stop()
        await asyncio.sleep(0.3)  # a few reconnection attempts fail meanwhile
        assert await served_limit(rls, "eg", "user") == 2
        control_plane.push("v3", pack(limit_config("eg/user", "eg", "user", 7)))
        await control_plane.start()
        await until_served(rls, "eg", "user", 7)
        assert control_plane.streams == 2

        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"http://127.0.0.1:{sidecar.started['http_port']}/healthcheck"
            ) as got:
                assert (got.status, await got.text()) == (200, "OK")
            metrics = f"http://127.0.0.1:{sidecar.started['metrics_port']}/metrics"
            async with http.get(metrics) as got:
                text = await got.text()
        assert "ratelimit_service_config_load_success 2\n" in text
        assert "ratelimit_service_config_load_error 1\n" in text

    ignored = {event["variable"] for event in sidecar.events("reference_setting_differs")}
    assert "PROMETHEUS_MAPPER_YAML" in ignored
    assert not sidecar.events("reference_setting_not_supported")


@asynccontextmanager
async def xds_app(
    plane: ControlPlane, **options: Any
) -> AsyncIterator[tuple[App, asyncio.Task[None]]]:
    """The app in this process taking rules from `plane` (plain text), its start as a task:
    without force_start it returns only once the first rules are applied."""
    xds = XdsOptions(
        server=f"127.0.0.1:{plane.port}",
        connect_retry=0.05,
        backoff_initial=0.05,
        backoff_max=0.2,
        **options.pop("xds", {}),
    )
    app = App(
        Options(
            config=[], grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", xds=xds, **options
        ),
        backend=MemoryBackend(),
    )
    start = asyncio.create_task(app.start())
    try:
        yield app, start
    finally:
        if not start.done():
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
        await app.stop(grace=1.0)


@pytest.fixture
async def plain_plane() -> AsyncIterator[ControlPlane]:
    plane = ControlPlane()
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


async def test_the_sidecar_waits_for_its_first_valid_rules_and_names_itself(
    plain_plane: ControlPlane,
) -> None:
    """Without FORCE_START_WITHOUT_INITIAL_CONFIG the sidecar listens only once rules arrived;
    a first push that is not valid is NACKed (version still empty) and it goes on waiting. The
    stream carries the node's id and metadata and the extra headers."""
    options = {
        "node_id": "rls-1",
        "node_metadata": {"cluster": "edge", "zone": "a"},
        "headers": (("x-tenant", "blue"), ("authorization", "Bearer t0k3n")),
    }
    async with xds_app(plain_plane, xds=options) as (app, start):
        subscription = await plain_plane.answer("")
        assert subscription.request.node.id == "rls-1"
        assert dict(subscription.request.node.metadata) == {"cluster": "edge", "zone": "a"}
        assert subscription.request.node.user_agent_name == "ratelimit-sidecar"
        assert subscription.metadata["x-tenant"] == "blue"
        assert subscription.metadata["authorization"] == "Bearer t0k3n"

        bad = rls_conf.RateLimitConfig(
            name="empty-key", domain="d", descriptors=[rls_conf.RateLimitDescriptor()]
        )
        nack = await plain_plane.answer(plain_plane.push("1", pack(bad)))
        assert nack.request.version_info == ""
        assert (
            nack.request.error_detail.message
            == "xds:empty-key: descriptors[0]: descriptor has empty key (add 'key: NAME')"
        )
        await asyncio.sleep(0.2)
        assert not start.done()

        ack = await plain_plane.answer(plain_plane.push("2", pack(limit_config("d", "d", "k", 3))))
        assert ack.request.version_info == "2"
        await asyncio.wait_for(start, DEADLINE)
        async with client(app.grpc_port) as rls:
            assert await served_limit(rls, "d", "k") == 3
        assert (app.stats.config_load_success, app.stats.config_load_error) == (1, 1)


async def test_health_follows_the_loaded_rules_when_told_to(plain_plane: ControlPlane) -> None:
    """With HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED (`--health-requires-config`) /healthcheck
    fails until rules with a domain are served, and again when a push removes every domain."""
    async with (
        xds_app(plain_plane, xds={"force_start": True}, health_requires_config=True) as (
            app,
            start,
        ),
        aiohttp.ClientSession() as http,
    ):
        await asyncio.wait_for(start, DEADLINE)
        url = f"http://127.0.0.1:{app.http_port}/healthcheck"

        async def health() -> tuple[int, str]:
            async with http.get(url) as got:
                return got.status, await got.text()

        assert await health() == (500, "Internal Server Error: no rules loaded\n")
        await plain_plane.answer(plain_plane.push("1", pack(limit_config("d", "d", "k", 3))))
        assert await health() == (200, "OK")
        await plain_plane.answer(plain_plane.push("2", []))
        assert await health() == (500, "Internal Server Error: no rules loaded\n")


async def test_a_response_of_another_type_or_a_duplicate_domain_is_nacked(
    plain_plane: ControlPlane,
) -> None:
    """Resources that are not RateLimitConfig, and two resources declaring one domain, are
    refused as a whole, the way two rules files with one domain are."""
    async with xds_app(plain_plane, xds={"force_start": True}) as (app, start):
        await asyncio.wait_for(start, DEADLINE)
        await plain_plane.answer(plain_plane.push("1", pack(limit_config("a", "d", "k", 3))))

        other = plain_plane.push(
            "2", [], type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster"
        )
        assert (
            "not 'type.googleapis.com/ratelimit"
            in (await plain_plane.answer(other)).request.error_detail.message
        )
        twice = plain_plane.push(
            "3", pack(limit_config("a", "d", "k", 4), limit_config("b", "d", "j", 5))
        )
        nack = await plain_plane.answer(twice)
        assert nack.request.error_detail.message == (
            "xds:b: domain: duplicate domain 'd' in config file (already declared in xds:a)"
        )
        assert nack.request.version_info == "1"
        assert app.rules.dump() == [
            "d.k: unit=MINUTE requests_per_unit=3, shadow_mode: false, quota_mode: false"
        ]


def test_a_resource_reads_as_its_rules_file_would() -> None:
    """Every field of RateLimitConfig lands where its YAML twin does; proto3's empty value
    and UNKNOWN unit mean absent, as the reference reads them."""
    from google.protobuf import struct_pb2

    from sidecar.xds import convert

    metadata = struct_pb2.Struct()
    metadata.update({"tier": "gold", "weights": [1, 2]})
    message = rls_conf.RateLimitConfig(
        name="r",
        domain="d",
        descriptors=[
            rls_conf.RateLimitDescriptor(
                key="k",
                value="",
                shadow_mode=True,
                quota_mode=True,
                detailed_metric=True,
                metadata=metadata,
                rate_limit=rls_conf.RateLimitPolicy(
                    unit=rls_conf.WEEK,
                    requests_per_unit=0,
                    name="weekly",
                    replaces=[rls_conf.RateLimitReplace(name="daily")],
                ),
                descriptors=[
                    rls_conf.RateLimitDescriptor(
                        key="path",
                        value="/api/*",
                        rate_limit=rls_conf.RateLimitPolicy(unlimited=True),
                    )
                ],
            )
        ],
    )
    assert convert.document(message) == {
        "domain": "d",
        "descriptors": [
            {
                "key": "k",
                "rate_limit": {
                    "unit": "week",
                    "requests_per_unit": 0,
                    "name": "weekly",
                    "replaces": [{"name": "daily"}],
                },
                "shadow_mode": True,
                "detailed_metric": True,
                "quota_mode": True,
                "metadata": {"tier": "gold", "weights": [1.0, 2.0]},
                "descriptors": [
                    {"key": "path", "value": "/api/*", "rate_limit": {"unlimited": True}}
                ],
            }
        ],
    }
    rules = convert.rules(pack(message))
    assert rules.domains["d"].source == "xds:r"


def test_resources_of_one_domain_add_up_with_merge_domain_config() -> None:
    """MERGE_DOMAIN_CONFIG applies to resources as to files: two resources of one domain are
    refused without it, and add their descriptors with it."""
    first = rls_conf.RateLimitConfig(name="a", domain="d")
    first.descriptors.add(key="k")
    second = rls_conf.RateLimitConfig(name="b", domain="d")
    second.descriptors.add(key="k2")
    from sidecar.errors import ConfigError
    from sidecar.xds import convert

    resources = pack(first, second)
    with pytest.raises(ConfigError, match="duplicate domain 'd'"):
        convert.rules(resources)
    rules = convert.rules(resources, merge=True)
    assert [n.label for n in rules.domains["d"].root.nodes()] == ["k", "k2"]


@pytest.mark.parametrize(
    ("attempt", "jitter", "draw", "expected"),
    [
        (0, False, 0.0, 10.0),  # the reference's defaults: 10 s, factor 0.5, max 60 s ...
        (5, False, 0.0, 10.0),  # ... never grow (0.5^n is clamped up to the first wait)
        (5, True, 1.0, 10.0),
    ],
)
def test_backoff_follows_the_references_formula(
    attempt: int, jitter: bool, draw: float, expected: float
) -> None:
    """XDS_CLIENT_BACKOFF_*: initial × factor^attempt, jittered between initial and that,
    within [initial, max]."""
    assert backoff_delay(attempt, 10.0, 60.0, 0.5, jitter, lambda: draw) == expected


def test_backoff_grows_by_its_factor_up_to_the_maximum() -> None:
    """A factor above 1 grows the wait; jitter draws within [initial, computed]; max caps it."""
    waits = [backoff_delay(n, 1.0, 60.0, 2.0, False) for n in range(8)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert backoff_delay(3, 1.0, 60.0, 2.0, True, lambda: 0.5) == 4.5
    assert backoff_delay(10_000, 1.0, 60.0, 2.0, False) == 60.0


def test_the_rate_limit_config_messages_keep_the_references_numbers() -> None:
    """The messages keep the reference's package, names and field numbers: what control planes
    send (tests/test_frequency_proto.py checks the stubs are what `make proto` writes)."""
    numbers = {
        message.full_name: {f.name: f.number for f in message.fields}
        for message in rls_conf.DESCRIPTOR.message_types_by_name.values()
    }
    assert numbers == {
        "ratelimit.config.ratelimit.v3.RateLimitConfig": {"name": 1, "domain": 2, "descriptors": 3},
        "ratelimit.config.ratelimit.v3.RateLimitDescriptor": {
            "key": 1, "value": 2, "rate_limit": 3, "descriptors": 4, "shadow_mode": 5,
            "detailed_metric": 6, "quota_mode": 7, "metadata": 8,
        },
        "ratelimit.config.ratelimit.v3.RateLimitPolicy": {
            "unit": 1, "requests_per_unit": 2, "unlimited": 3, "name": 4, "replaces": 5,
        },
        "ratelimit.config.ratelimit.v3.RateLimitReplace": {"name": 1},
    }  # fmt: skip
    units = {v.name: v.number for v in rls_conf.RateLimitUnit.DESCRIPTOR.values}
    assert units == {
        "UNKNOWN": 0,
        "SECOND": 1,
        "MINUTE": 2,
        "HOUR": 3,
        "DAY": 4,
        "WEEK": 7,
        "MONTH": 5,
        "YEAR": 6,
    }


async def test_sigterm_stops_a_sidecar_still_waiting_for_its_first_rules(
    plain_plane: ControlPlane,
) -> None:
    """Without FORCE_START_WITHOUT_INITIAL_CONFIG and before any push, the sidecar listens on
    nothing yet; SIGTERM still ends it at once with status 0."""
    env = {
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{plain_plane.port}",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": "127.0.0.1:1",
        "HOST": "127.0.0.1",
        "PORT": "0",
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": "0",
    }
    async with reference_process(env, wait=False) as sidecar:
        await plain_plane.answer("")  # subscribed, waiting for rules
        sidecar.process.terminate()
        assert await asyncio.wait_for(sidecar.process.wait(), DEADLINE) == 0
    assert not sidecar.started
    assert sidecar.events("xds_waiting_for_rules")
