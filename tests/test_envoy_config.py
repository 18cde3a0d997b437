"""`envoy-config` and the configs in envoy/: sources files, route rate_limits, and Envoy's verdict.

Every Envoy config in envoy/ goes through the real binary's `--mode validate`, and
envoy/gateway.yaml must be exactly what the command in its header prints.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.envoys import validate

from sidecar import cli
from sidecar.core import config
from sidecar.envoy_config import feeds, quota, sources
from sidecar.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
GATEWAY = ENVOY_DIR / "gateway.yaml"
SOURCES = ENVOY_DIR / "sources" / "gateway.yaml"
RULES = ENVOY_DIR / "rules"

RULES_TEXT = """\
domain: shop
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: app
    descriptors:
      - key: user
        descriptors:
          - key: interface
            rate_limit: {unit: hour, requests_per_unit: 1000}
      - key: user
        value: vip-*
        descriptors:
          - key: interface
            rate_limit: {unit: hour, requests_per_unit: 5000}
  - key: user
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 5}
"""

SOURCES_TEXT = """\
remote_address: remote_address
app: {header: x-app-id}
user: {header: x-user-id}
ad: {header: x-ad-id, count: on_success, routes: [ads]}
interface: route
"""


def generate(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    *args: str,
    rules: str = RULES_TEXT,
    sources_text: str = SOURCES_TEXT,
) -> Any:
    """Run `envoy-config` in this process and return its YAML as data."""
    (tmp_path / "rules.yaml").write_text(rules)
    (tmp_path / "sources.yaml").write_text(sources_text)
    argv = ["envoy-config", "--rules", str(tmp_path / "rules.yaml"),
            "--sources", str(tmp_path / "sources.yaml"), *args]  # fmt: skip
    status = cli.main(argv)
    output = capsys.readouterr()
    assert status == 0, output.err
    return yaml.safe_load(output.out)


def per_route(route: dict[str, Any]) -> list[dict[str, Any]]:
    config = route["typed_per_filter_config"]["envoy.filters.http.ratelimit"]
    assert config["@type"].endswith("ratelimit.v3.RateLimitPerRoute")
    return list(config["rate_limits"])


def keys(rate_limit: dict[str, Any]) -> list[str]:
    """The descriptor keys an entry's actions produce, in order."""
    found = []
    for action in rate_limit["actions"]:
        ((kind, spec),) = action.items()
        found.append("remote_address" if kind == "remote_address" else spec["descriptor_key"])
    return found


def assert_envoy_accepts(envoy_binary: str, bootstrap: Any, tmp_path: Path) -> None:
    """`envoy --mode validate` accepts the bootstrap."""
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = validate(envoy_binary, path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the configs in envoy/ --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(ENVOY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_envoy_config_in_envoy_folder_passes_envoy_validate(
    envoy_binary: str, path: Path
) -> None:
    """`envoy --mode validate` accepts every Envoy config in envoy/."""
    result = validate(envoy_binary, path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"configuration '{path}' OK" in result.stdout + result.stderr


def test_the_envoy_folder_holds_configs_and_no_python_package() -> None:
    """envoy/ has no __init__.py: it would shadow the `envoy` package of xds-protos."""
    assert not (ENVOY_DIR / "__init__.py").exists()


def test_gateway_yaml_is_exactly_what_its_generating_command_prints() -> None:
    """Running the command quoted in envoy/gateway.yaml's header again changes nothing."""
    text = GATEWAY.read_text()
    command = text.splitlines()[1].removeprefix("#").strip()
    argv = shlex.split(command)
    assert argv[:2] == ["ratelimit-sidecar", "envoy-config"] and "--bootstrap" in argv
    output = subprocess.run(
        [sys.executable, "-m", "sidecar", *argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert output.returncode == 0, output.stderr
    assert output.stdout == text


def test_gateway_rules_load_and_every_rule_has_a_source() -> None:
    """envoy/rules loads, and the gateway's sources cover every key of every rule."""
    domain = config.load([RULES]).domains["gateway"]
    feed = feeds.feed(domain, sources.load(SOURCES), [feeds.Route("ads", "/ads")])
    assert [d.keys for d in feed.routes[0].descriptors] == [
        ("app", "remote_address"),
        ("app", "user", "interface"),
        ("user", "ad"),
    ]


def test_gateway_sends_the_missions_descriptors() -> None:
    """The gateway's routes send app+IP, app+user+interface, and on the ads route user+ad,
    checked at request time and counted only for 2xx responses."""
    gateway = yaml.safe_load(GATEWAY.read_text())
    (listener,) = gateway["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    manager = chain["filters"][0]["typed_config"]
    assert manager["use_remote_address"] is True
    routes = {r["name"]: r for r in manager["route_config"]["virtual_hosts"][0]["routes"]}
    assert set(routes) == {"orders", "search", "ads"}
    for name, route in routes.items():
        limits = per_route(route)
        assert [keys(r) for r in limits[:2]] == [
            ["app", "remote_address"],
            ["app", "user", "interface"],
        ]
        assert limits[1]["actions"][2] == {
            "generic_key": {"descriptor_value": name, "descriptor_key": "interface"}
        }
    check, count = per_route(routes["ads"])[2:]
    assert keys(check) == keys(count) == ["user", "ad"]
    assert check["hits_addend"] == {"number": 0} and "apply_on_stream_done" not in check
    assert count["apply_on_stream_done"] is True
    assert count["hits_addend"] == {
        "format": "%CEL(response.code >= 200 && response.code < 300 ? 1 : 0)%"
    }
    filters = manager["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ratelimit",
        "envoy.filters.http.router",
    ]
    assert filters[0]["typed_config"] == {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": "gateway",
        "failure_mode_deny": False,
        "timeout": "0.100s",
        "rate_limited_as_resource_exhausted": True,
        "rate_limit_service": {
            "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}},
            "transport_api_version": "V3",
        },
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
    }
    clusters = {c["name"]: c for c in gateway["static_resources"]["clusters"]}
    sidecar = clusters["ratelimit"]
    address = sidecar["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address == {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}
    options = sidecar["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["explicit_http_config"] == {"http2_protocol_options": {}}


# --- envoy-config -----------------------------------------------------------------------------


def test_pieces_are_the_filter_the_cluster_and_one_entry_per_key_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without --bootstrap: the filter, the sidecar cluster and the routes' rate_limits, one
    entry per distinct key path of the rules (a value pattern adds none)."""
    pieces = generate(
        capsys, tmp_path, "--route", "api=/api", "--route", "ads=/ads", "--timeout-ms", "250"
    )
    assert list(pieces) == ["http_filters", "clusters", "routes"]
    assert pieces["http_filters"][0]["typed_config"]["domain"] == "shop"
    assert pieces["http_filters"][0]["typed_config"]["timeout"] == "0.250s"
    assert [c["name"] for c in pieces["clusters"]] == ["ratelimit"]
    api, ads = pieces["routes"]
    assert [keys(r) for r in per_route(api)] == [["remote_address"], ["app", "user", "interface"]]
    assert [keys(r) for r in per_route(ads)] == [
        ["remote_address"],
        ["app", "user", "interface"],
        ["user", "ad"],
        ["user", "ad"],
    ]


def test_default_route_matches_every_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With no --route, one route named 'default' for the prefix '/'."""
    pieces = generate(capsys, tmp_path, sources_text=SOURCES_TEXT.replace(", routes: [ads]", ""))
    (route,) = pieces["routes"]
    assert route["name"] == "default" and route["match"] == {"prefix": "/"}


def test_each_attribute_becomes_its_envoy_action(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """remote_address, path, route, header and generic_key each produce the matching action,
    and remote_address under another key name uses remote_address_match."""
    rules = """\
domain: d
descriptors:
  - key: ip
    descriptors:
      - key: page
        descriptors:
          - key: interface
            descriptors:
              - key: user
                descriptors:
                  - key: tier
                    descriptors:
                      - key: generic_key
                        rate_limit: {unit: second, requests_per_unit: 1}
"""
    sources_text = """\
ip: remote_address
page: path
interface: route
user: {header: x-user-id}
tier: {generic_key: free}
generic_key: {generic_key: checkout}
"""
    pieces = generate(capsys, tmp_path, "--route", "r=/", rules=rules, sources_text=sources_text)
    (rate_limit,) = per_route(pieces["routes"][0])
    assert rate_limit["actions"] == [
        {
            "remote_address_match": {
                "descriptor_value": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
                "descriptor_key": "ip",
                "address_matcher": {"invert_match": True},
            }
        },
        {"request_headers": {"header_name": ":path", "descriptor_key": "page"}},
        {"generic_key": {"descriptor_value": "r", "descriptor_key": "interface"}},
        {"request_headers": {"header_name": "x-user-id", "descriptor_key": "user"}},
        {"generic_key": {"descriptor_value": "free", "descriptor_key": "tier"}},
        {"generic_key": {"descriptor_value": "checkout"}},
    ]


def test_a_bootstrap_with_every_attribute_passes_envoy_validate(
    capsys: pytest.CaptureFixture[str], envoy_binary: str, tmp_path: Path
) -> None:
    """Envoy accepts every kind of action envoy-config writes, check-then-count included."""
    sources_text = SOURCES_TEXT.replace("remote_address: remote_address", "remote_address: path")
    sources_text += "extra: {generic_key: x}\n"
    bootstrap = generate(capsys, tmp_path, "--bootstrap", "--route", "api=/api", "--route", "ads=/ads",
        "--sidecar", "ratelimit.internal:8081", sources_text=sources_text,
    )  # fmt: skip
    clusters = {c["name"]: c["type"] for c in bootstrap["static_resources"]["clusters"]}
    assert clusters == {"upstream": "STATIC", "ratelimit": "STRICT_DNS"}
    assert_envoy_accepts(envoy_binary, bootstrap, tmp_path)


def test_a_unix_socket_sidecar_is_a_static_pipe_cluster_envoy_accepts(
    capsys: pytest.CaptureFixture[str], envoy_binary: str, tmp_path: Path
) -> None:
    """`--sidecar unix:PATH` (the injected sidecar's socket in a pod): the ratelimit cluster
    reaches a pipe at PATH, needs no resolver, still speaks HTTP/2, and Envoy accepts it."""
    socket = "/var/run/ratelimit-sidecar/rls.sock"
    bootstrap = generate(capsys, tmp_path, "--bootstrap", "--route", "api=/api",
        "--route", "ads=/ads", "--sidecar", f"unix:{socket}",
    )  # fmt: skip
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ratelimit"]
    assert cluster["type"] == "STATIC"
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": socket}}
    options = cluster["typed_extension_protocol_options"]
    assert "http2_protocol_options" in str(options)
    assert_envoy_accepts(envoy_binary, bootstrap, tmp_path)


def test_a_rule_key_without_a_source_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key of the rules with no line in the sources stops the command with the fix."""
    (tmp_path / "rules.yaml").write_text(RULES_TEXT)
    (tmp_path / "sources.yaml").write_text("remote_address: remote_address\n")
    status = cli.main(
        ["envoy-config", "--rules", str(tmp_path / "rules.yaml"),
         "--sources", str(tmp_path / "sources.yaml")]
    )  # fmt: skip
    assert status == 1
    assert capsys.readouterr().err == (
        f"{tmp_path / 'sources.yaml'}: descriptor key 'app' of rule 'shop.app.user.interface' "
        f"({tmp_path / 'rules.yaml'}) has no source (add a line such as 'app: {{header: x-app}}')\n"
    )


def test_a_source_on_an_unknown_route_is_an_error(tmp_path: Path) -> None:
    """`routes` may only name routes given with --route."""
    domain = config.parse(RULES_TEXT, "rules.yaml")
    with pytest.raises(ConfigError) as caught:
        feeds.feed(domain, sources.parse(SOURCES_TEXT, "s.yaml"), [feeds.Route("api", "/")])
    assert str(caught.value) == "s.yaml: ad.routes: unknown route 'ads' (the routes are: api)"


def test_several_domains_need_domain_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rules with two domains: --domain picks one; without it the command says so."""
    (tmp_path / "a.yaml").write_text(
        "domain: a\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
    )
    (tmp_path / "b.yaml").write_text("domain: b\n")
    sources_file = tmp_path.parent / f"{tmp_path.name}-sources.yaml"
    sources_file.write_text("user: {header: x-user-id}\n")
    argv = ["envoy-config", "--rules", str(tmp_path), "--sources", str(sources_file)]
    assert cli.main(argv) == 1
    assert (
        capsys.readouterr().err == f"{tmp_path}: several domains (a, b): choose one with --domain\n"
    )
    assert cli.main([*argv, "--domain", "a"]) == 0
    assert (
        yaml.safe_load(capsys.readouterr().out)["http_filters"][0]["typed_config"]["domain"] == "a"
    )


@pytest.mark.parametrize(
    "flag",
    [
        ["--route", "api"],
        ["--route", "api=api"],
        ["--sidecar", "nowhere"],
        ["--sidecar", "unix:rls.sock"],
        ["--sidecar", "unix:"],
        ["--timeout-ms", "0"],
        ["--rlqs-address", "8083"],
        ["--rlqs-address", "unix:/var/run/rlqs.sock"],
    ],
)
def test_malformed_flags_exit_2(tmp_path: Path, flag: list[str]) -> None:
    """A route without NAME=/PREFIX, an address without a port, a relative socket path, a
    zero timeout or an RLQS address that is not HOST:PORT (the sidecar serves RLQS on TCP
    only) is a usage error."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["envoy-config", "--rules", "r", "--sources", "s", *flag])
    assert caught.value.code == 2


# --- sources files ----------------------------------------------------------------------------


def test_sources_parse_every_form() -> None:
    """Plain attribute names, header, generic_key, attribute, count and routes."""
    parsed = sources.parse(
        "a: remote_address\nb: {header: x-b}\nc: {generic_key: 7}\n"
        "d: {attribute: route, count: on_success, routes: [x, y]}\n",
        "s.yaml",
    )
    assert list(parsed.keys.values()) == [
        sources.Source("a", sources.Attribute.REMOTE_ADDRESS),
        sources.Source("b", sources.Attribute.HEADER, "x-b"),
        sources.Source("c", sources.Attribute.GENERIC_KEY, "7"),
        sources.Source("d", sources.Attribute.ROUTE, "", sources.Count.ON_SUCCESS, ("x", "y")),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "",
            "s.yaml: a sources file maps each descriptor key to a request attribute (for example 'user: {header: x-user-id}')",
        ),
        (
            "- user\n",
            "s.yaml: a sources file maps each descriptor key to a request attribute (for example 'user: {header: x-user-id}')",
        ),
        (
            "user: [x]\n",
            "s.yaml: user: expected remote_address, path, route, {header: NAME} or {generic_key: VALUE}, got ['x']",
        ),
        (
            "ip: remote_adress\n",
            "s.yaml: ip: unknown attribute 'remote_adress' (did you mean 'remote_address'?)",
        ),
        (
            "ip: client\n",
            "s.yaml: ip: unknown attribute 'client' (expected remote_address, path, route, {header: NAME} or {generic_key: VALUE})",
        ),
        (
            "user: {headers: x-user}\n",
            "s.yaml: user: unknown option 'headers' (did you mean 'header'?)",
        ),
        (
            "user: {header: x, generic_key: y}\n",
            "s.yaml: user: give exactly one of header, generic_key or attribute for the value",
        ),
        (
            "user: {count: on_success}\n",
            "s.yaml: user: give exactly one of header, generic_key or attribute for the value",
        ),
        ("user: {header: ''}\n", "s.yaml: user.header: header must be a non-empty string"),
        (
            "user: {header: x, count: later}\n",
            "s.yaml: user.count: count must be on_request or on_success, got 'later'",
        ),
        (
            "user: {header: x, routes: ads}\n",
            "s.yaml: user.routes: routes must be a non-empty list of route names",
        ),
        ("user: {header: x\n", None),
    ],
)
def test_sources_errors_name_the_file_the_key_and_the_fix(text: str, message: str | None) -> None:
    """Each malformed sources file is refused with one message naming where and how to fix it."""
    with pytest.raises(ConfigError) as caught:
        sources.parse(text, "s.yaml")
    if message is None:
        assert str(caught.value).startswith("s.yaml: not valid YAML: ")
    else:
        assert str(caught.value) == message


# --- envoy-config --rlqs-address: the rate_limit_quota filter ---------------------------------

QUOTA_FILTER = "envoy.filters.http.rate_limit_quota"


def quota_config(filters: list[dict[str, Any]]) -> dict[str, Any]:
    (quota_filter,) = [f for f in filters if f["name"] == QUOTA_FILTER]
    config: dict[str, Any] = quota_filter["typed_config"]
    assert config["@type"].endswith("rate_limit_quota.v3.RateLimitQuotaFilterConfig")
    return config


def quota_buckets(config: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each matcher's (rule, predicate, bucket settings), in the order Envoy tries them."""
    return [
        (m["on_match"]["action"]["name"], m["predicate"], m["on_match"]["action"]["typed_config"])
        for m in config["bucket_matchers"]["matcher_list"]["matchers"]
    ]


def header_input(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
            "header_name": name,
        },
    }


def on_header(name: str, **value_match: Any) -> dict[str, Any]:
    return {"single_predicate": {"input": header_input(name), "value_match": value_match}}


def present(name: str) -> dict[str, Any]:
    return on_header(name, safe_regex={"google_re2": {}, "regex": ".+"})


def test_rlqs_pieces_are_the_quota_filter_the_rlqs_cluster_and_routes_without_limits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With --rlqs-address: the rate_limit_quota filter (domain, the rlqs cluster, one bucket
    per key path and route, narrower first, each with its keys' values read from the request),
    an HTTP/2 'rlqs' cluster at the address, and routes without rate_limits."""
    pieces = generate(capsys, tmp_path, "--route", "api=/api", "--route", "ads=/ads",
        "--rlqs-address", "127.0.0.1:8083",
    )  # fmt: skip
    assert [f["name"] for f in pieces["http_filters"]] == [QUOTA_FILTER]
    config = quota_config(pieces["http_filters"])
    assert config["domain"] == "shop"
    assert config["rlqs_server"] == {"envoy_grpc": {"cluster_name": "rlqs"}}
    (cluster,) = pieces["clusters"]
    assert cluster["name"] == "rlqs"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"] == {"socket_address": {"address": "127.0.0.1", "port_value": 8083}}
    options = cluster["typed_extension_protocol_options"]
    assert options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "explicit_http_config"
    ] == {"http2_protocol_options": {}}
    assert all("typed_per_filter_config" not in r for r in pieces["routes"])
    buckets = quota_buckets(config)
    assert [rule for rule, _, _ in buckets] == [
        "shop.app.user.interface",
        "shop.remote_address",
        "shop.app.user.interface",
        "shop.user.ad",
        "shop.remote_address",
    ]
    _, predicate, settings = buckets[0]
    assert predicate == {
        "and_matcher": {
            "predicate": [
                on_header(":path", prefix="/api"),
                # The ads route is not a prefix of /api, so no request of it is excluded.
                present("x-app-id"),
                present("x-user-id"),
            ]
        }
    }
    assert settings == {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings",
        "bucket_id_builder": {
            "bucket_id_builder": {
                "app": {"custom_value": header_input("x-app-id")},
                "user": {"custom_value": header_input("x-user-id")},
                "interface": {"string_value": "api"},
            }
        },
        "reporting_interval": "5s",
        "deny_response_settings": {
            "http_status": {"code": "TooManyRequests"},
            "grpc_status": {"code": 8},
        },
        "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}},
        "expired_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}},
    }
    # remote_address is always there: its bucket takes every request of the route the
    # narrower ones left.
    _, predicate, settings = buckets[1]
    assert predicate == on_header(":path", prefix="/api")
    assert settings["bucket_id_builder"]["bucket_id_builder"] == {
        "remote_address": {
            "custom_value": {
                "name": "source_ip",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"
                },
            }
        }
    }


def test_rlqs_header_states_what_differs_from_the_rate_limit_filter(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The output's header names, per route, the buckets a request counts in the first of,
    and each count: on_success key the quota filter cannot honour."""
    generate(capsys, tmp_path, "--route", "api=/api", "--route", "ads=/ads",
        "--rlqs-address", "127.0.0.1:8083",
    )  # fmt: skip
    (tmp_path / "rules.yaml").write_text(RULES_TEXT)
    argv = ["envoy-config", "--rules", str(tmp_path / "rules.yaml"),
            "--sources", str(tmp_path / "sources.yaml"), "--route", "api=/api",
            "--route", "ads=/ads", "--rlqs-address", "127.0.0.1:8083"]  # fmt: skip
    assert cli.main(argv) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")][3:]
    assert header == [
        "# Through the rate_limit_quota filter, unlike the rate_limit filter:",
        "#   On route 'api' a request counts in the first of these buckets it matches, and in "
        "no other: shop.app.user.interface, shop.remote_address.",
        "#   On route 'ads' a request counts in the first of these buckets it matches, and in "
        "no other: shop.app.user.interface, shop.user.ad, shop.remote_address.",
        "#   Key 'ad' has count: on_success, which the rate_limit_quota filter cannot do: "
        "every request in its buckets counts, served or not.",
    ]


def test_rlqs_failure_mode_deny_denies_a_bucket_without_a_live_assignment(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--failure-mode-deny with --rlqs-address: DENY_ALL before the first assignment and once
    one expired."""
    pieces = generate(capsys, tmp_path, "--rlqs-address", "127.0.0.1:8083", "--failure-mode-deny",
        sources_text=SOURCES_TEXT.replace(", routes: [ads]", ""),
    )  # fmt: skip
    for _, _, settings in quota_buckets(quota_config(pieces["http_filters"])):
        deny = {"fallback_rate_limit": {"blanket_rule": "DENY_ALL"}}
        assert settings["no_assignment_behavior"] == settings["expired_assignment_behavior"] == deny


def test_rlqs_buckets_ask_for_the_rules_values_and_the_route(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A rule's exact value is an exact match, a wildcard an RE2 regex over the whole value,
    a client address value a match on the source IP; a fixed value (generic_key, route) that
    no rule of the key path takes leaves the path without a bucket on that route; a route's
    buckets exclude the requests an earlier route with an overlapping prefix takes."""
    rules = """\
domain: d
descriptors:
  - key: plan
    value: gold
    descriptors:
      - key: user
        value: vip-*.x
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: plan
    value: silver
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: ip
    value: 10.0.0.1
    descriptors:
      - key: interface
        value: search
        rate_limit: {unit: second, requests_per_unit: 1}
"""
    sources_text = (
        "plan: {header: x-plan}\nuser: {header: x-user}\nip: remote_address\ninterface: route\n"
    )
    pieces = generate(capsys, tmp_path, "--route", "orders=/api/orders", "--route", "search=/api",
        "--rlqs-address", "127.0.0.1:8083", rules=rules, sources_text=sources_text,
    )  # fmt: skip
    buckets = quota_buckets(quota_config(pieces["http_filters"]))
    assert [rule for rule, _, _ in buckets] == [
        "d.plan_gold.user_vip-*.x",
        "d.plan_gold.user_vip-*.x",
        "d.ip_10.0.0.1.interface_search",
    ]
    orders, search, ip = (predicate for _, predicate, _ in buckets)
    either = {
        "or_matcher": {
            "predicate": [
                {
                    "and_matcher": {
                        "predicate": [
                            on_header("x-plan", exact="gold"),
                            on_header(
                                "x-user", safe_regex={"google_re2": {}, "regex": r"vip-.*\.x"}
                            ),
                        ]
                    }
                },
                {
                    "and_matcher": {
                        "predicate": [on_header("x-plan", exact="silver"), present("x-user")]
                    }
                },
            ]
        }
    }
    assert orders == {
        "and_matcher": {"predicate": [on_header(":path", prefix="/api/orders"), either]}
    }
    not_orders = {"not_matcher": on_header(":path", prefix="/api/orders")}
    assert search == {
        "and_matcher": {"predicate": [on_header(":path", prefix="/api"), not_orders, either]}
    }
    source_ip = {
        "name": "source_ip",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"
        },
    }
    assert ip == {
        "and_matcher": {
            "predicate": [
                on_header(":path", prefix="/api"),
                not_orders,
                {"single_predicate": {"input": source_ip, "value_match": {"exact": "10.0.0.1"}}},
            ]
        }
    }


def test_rlqs_a_bucket_no_request_could_reach_is_an_error_naming_both_rules(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two key paths that read the same headers: every request of the second falls in the
    first's bucket, so the second rule could never count; the command says so and how to fix."""
    rules = """\
domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - key: interface
        rate_limit: {unit: second, requests_per_unit: 1}
"""
    (tmp_path / "rules.yaml").write_text(rules)
    (tmp_path / "sources.yaml").write_text("user: {header: x-user-id}\ninterface: route\n")
    argv = ["envoy-config", "--rules", str(tmp_path / "rules.yaml"),
            "--sources", str(tmp_path / "sources.yaml"), "--rlqs-address", "127.0.0.1:8083"]  # fmt: skip
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == (
        f"{tmp_path / 'rules.yaml'}: rule 'd.user.interface' cannot be a rate_limit_quota bucket "
        "on route 'default': a request counts in one bucket only, and every request it could "
        "match falls first in the bucket of rule 'd.user' (read one of its keys from a request "
        "attribute the other does not need, or leave out --rlqs-address to feed the rules "
        "through the rate_limit filter, which checks every rule)\n"
    )
    assert cli.main(argv[:-2]) == 0


def test_an_rlqs_bootstrap_with_every_attribute_passes_envoy_validate(
    capsys: pytest.CaptureFixture[str], envoy_binary: str, tmp_path: Path
) -> None:
    """Envoy accepts the quota filter envoy-config writes: every attribute, exact values,
    wildcards, client address values, several routes, and the rlqs cluster by DNS name."""
    rules = (
        RULES_TEXT
        + """\
  - key: page
    value: /api/*
    descriptors:
      - key: extra
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: remote_address
    value: 10.0.0.1
    descriptors:
      - key: interface
        rate_limit: {unit: second, requests_per_unit: 1}
"""
    )
    bootstrap = generate(capsys, tmp_path, "--bootstrap", "--route", "api=/api", "--route", "ads=/ads",
        "--rlqs-address", "rlqs.internal:8083", "--failure-mode-deny",
        rules=rules.replace("  - key: remote_address\n    rate_limit", "  - key: client\n    rate_limit"),
        sources_text=SOURCES_TEXT + "page: path\nextra: {generic_key: x}\nclient: remote_address\n",
    )  # fmt: skip
    clusters = {c["name"]: c["type"] for c in bootstrap["static_resources"]["clusters"]}
    assert clusters == {"upstream": "STATIC", "rlqs": "STRICT_DNS"}
    assert_envoy_accepts(envoy_binary, bootstrap, tmp_path)


def test_rlqs_a_narrower_bucket_comes_before_a_broader_one_whatever_the_rules_order() -> None:
    """A bucket for one value of a header goes before the bucket for any value of it, though
    declared after it, so both get requests; the others keep the rules' order."""
    rules = """\
domain: d
descriptors:
  - key: plan
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: tier
    value: gold
    rate_limit: {unit: second, requests_per_unit: 1}
"""
    domain = config.parse(rules, "r.yaml")
    text = "plan: {header: x-plan}\nuser: {header: x-user}\ntier: {header: x-plan}\n"
    feed = feeds.feed(domain, sources.parse(text, "s.yaml"), [feeds.Route("r", "/")])
    assert [b.descriptor.rule for b in quota.buckets(feed)] == ["d.tier_gold", "d.plan", "d.user"]
