"""Allow and deny lists (`sidecar.core.lists`): what a list file holds and how it matches, every error
naming file, path and fix, the decision on every backend (denied: OVER_LIMIT and no counter
touched; allowed: OK and nothing counted), the stats, and lists reloading with the rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families
from support.callbacks import should_rate_limit
from support.clock import Clock
from support.sidecars import client, request, running_app

from sidecar.core import config, lists
from sidecar.core.lists import Networks
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.decision.stats import Stats
from sidecar.errors import ConfigError
from sidecar.model import Code, Descriptor, Entry, Request
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.telemetry.metrics import Latency
from sidecar.telemetry.statsd import Deltas

FIXTURES = Path(__file__).parent / "config" / "lists"

ERRORS = {
    "lists_not_a_list.yaml": (
        "lists: lists must be a list of maps like {key: remote_address, match: cidr, deny: "
        "denied.txt} (or remove 'lists')"
    ),
    "list_unknown_key.yaml": (
        "lists[0]: unknown key 'denny' in a list (allowed: key, match, deny, allow)"
    ),
    "list_without_file.yaml": "lists[0]: a list needs a file: deny: PATH, allow: PATH, or both",
    "list_bad_match.yaml": "lists[0].match: match must be cidr or exact, not 'prefix'",
    "list_key_repeated.yaml": (
        "lists[1].key: key 'user' has its lists at lists[0] already (put deny and allow there)"
    ),
    "list_missing_file.yaml": (
        f"lists[0].deny: error loading list file {FIXTURES / 'no-such-list.txt'}: No such file "
        "or directory (fix the path, relative to the rules file)"
    ),
}
#: Errors in a list file name the list file and the line.
LIST_FILE_ERRORS = {
    "list_bad_network.yaml": (
        "bad-network.txt",
        "line 4: '10.0.0.300' is not a network: write an address or ADDRESS/PREFIX, like "
        "10.0.0.0/8 or 2001:db8::/32",
    ),
    "list_host_bits.yaml": (
        "host-bits.txt",
        "line 2: '10.1.2.3/16' has host bits set (did you mean 10.1.0.0/16?)",
    ),
    "list_bad_prefix.yaml": (
        "bad-prefix.txt",
        "line 1: '192.168.0.0/33': the prefix length must be a number from 0 to 32",
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_a_bad_list_declaration_names_the_rules_file_path_and_fix(name: str) -> None:
    """Each broken declaration fails to load with the whole expected message."""
    path = FIXTURES / name
    with pytest.raises(ConfigError) as info:
        config.load([path])
    assert str(info.value) == f"{path}: {ERRORS[name]}"


@pytest.mark.parametrize("name", sorted(LIST_FILE_ERRORS))
def test_a_bad_list_entry_names_the_list_file_its_line_and_fix(name: str) -> None:
    """A bad entry in a list file fails the load, naming that file and the line."""
    list_file, message = LIST_FILE_ERRORS[name]
    with pytest.raises(ConfigError) as info:
        config.load([FIXTURES / name])
    assert str(info.value) == f"{FIXTURES / list_file}: {message}"


def test_every_list_fixture_is_asserted() -> None:
    """No fixture file is left without an asserted message."""
    assert {p.name for p in FIXTURES.glob("*.yaml")} == set(ERRORS) | set(LIST_FILE_ERRORS)


def test_rules_over_xds_may_not_name_lists() -> None:
    """Lists are files on the sidecar's disk: rules pushed over xDS that name them are refused."""
    with pytest.raises(ConfigError) as info:
        config.parse_mapping({"domain": "d", "lists": [{"key": "u", "deny": "u.txt"}]}, "xds:d")
    assert str(info.value) == (
        "xds:d: lists: lists are files the sidecar reads with its rules files: declare them in "
        "a rules file (--config), not over xDS"
    )


def test_merged_files_declare_a_domains_lists_in_one(tmp_path: Path) -> None:
    """Under --merge-domain-config, a merged domain keeps the lists of the file naming them,
    and only one of its files may name lists."""
    (tmp_path / "u.txt").write_text("mallory\n")
    (tmp_path / "a.yaml").write_text("domain: d\nlists: [{key: u, deny: u.txt}]\n")
    (tmp_path / "b.yaml").write_text("domain: d\nlists: [{key: v, deny: u.txt}]\n")
    (tmp_path / "c.yaml").write_text("domain: d\ndescriptors: [{key: k, value: v}]\n")
    merged = config.load([tmp_path / "a.yaml", tmp_path / "c.yaml"], merge=True)
    held = merged.domains["d"].lists
    assert held is not None and held.held("u", "deny") == frozenset({"mallory"})
    with pytest.raises(ConfigError) as info:
        config.load([tmp_path / "a.yaml", tmp_path / "b.yaml"], merge=True)
    assert str(info.value) == (
        f"{tmp_path / 'b.yaml'}: lists: lists of domain 'd' are declared in "
        f"{tmp_path / 'a.yaml'} already (declare them in one file)"
    )


def networks(*lines: str) -> Networks:
    """The networks of a list file of `lines`, parsed as `lists.read` parses them."""
    return Networks(lists._network(line, "n.txt", number) for number, line in enumerate(lines, 1))


def test_a_network_list_holds_ipv4_and_ipv6_networks_and_single_addresses() -> None:
    """An address matches the networks it lies in and its own entry; anything that is not an
    address matches nothing; an IPv4-mapped IPv6 address matches as its IPv4 address."""
    held = networks("10.0.0.0/8", "192.168.1.7", "2001:db8::/32", "::1", "0.0.0.0/32")
    assert "10.255.3.4" in held
    assert "11.0.0.0" not in held
    assert "192.168.1.7" in held and "192.168.1.8" not in held
    assert "2001:db8:ffff::1" in held and "2001:db9::" not in held
    assert "::1" in held and "::2" not in held
    assert "::ffff:10.1.2.3" in held
    for value in ("", "alice", "10.0.0.1/8", "10.0.0", "1.2.3.4\x00", "2001:db8::1%eth0"):
        assert value not in held
    assert len(held) == 5


def test_a_whole_address_family_and_mapped_networks() -> None:
    """`0.0.0.0/0` holds every IPv4 address and no IPv6 one; `::ffff:10.0.0.0/104` is 10/8."""
    assert "203.0.113.9" in networks("0.0.0.0/0")
    assert "2001:db8::1" not in networks("0.0.0.0/0")
    mapped = networks("::ffff:10.0.0.0/104")
    assert "10.9.9.9" in mapped and "11.0.0.1" not in mapped


def test_a_lookup_asks_one_set_per_prefix_length_not_per_entry() -> None:
    """100,000 networks of two prefix lengths are two sets: a lookup asks at most two, however
    long the list (the cost `bench/lists.py` measures)."""
    entries = (f"10.{n >> 8 & 255}.{n & 255}.0/24" for n in range(50_000))
    hosts = (f"172.{16 + (n >> 16)}.{n >> 8 & 255}.{n & 255}" for n in range(50_000))
    held = Networks(lists._network(line, "n.txt", 1) for line in (*entries, *hosts))
    assert len(held) == 100_000
    assert held.probes == (2, 0)
    assert "10.195.79.1" in held and "10.195.80.1" not in held
    assert "172.16.195.79" in held and "172.16.195.80" not in held


# --- the decision on every backend -----------------------------------------------------------

RULES = """\
domain: lists
lists:
  - key: remote_address
    match: cidr
    deny: denied-networks.txt
    allow: trusted-networks.txt
  - key: user
    deny: denied-users.txt
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
"""


def write(directory: Path, rules: str = RULES) -> Path:
    (directory / "denied-networks.txt").write_text("# blocked\n203.0.113.0/24\n2001:db8:bad::/48\n")
    (directory / "trusted-networks.txt").write_text("10.0.0.0/8\n203.0.113.0/24\n")
    (directory / "denied-users.txt").write_text("mallory\n")
    path = directory / "rules.yaml"
    path.write_text(rules)
    return path


def call(*descriptors: tuple[tuple[str, str], ...]) -> Request:
    return Request(
        "lists", tuple(Descriptor(tuple(Entry(k, v) for k, v in d)) for d in descriptors)
    )


def address(value: str) -> tuple[tuple[str, str], ...]:
    return (("remote_address", value),)


def user(value: str) -> tuple[tuple[str, str], ...]:
    return (("user", value),)


@pytest.fixture
async def limiters(
    backend_url: str, clock: Clock, tmp_path: Path
) -> AsyncIterator[Callable[[bool], Limiter]]:
    """``make(with_lists)``: a limiter on the backend under test, with the rules above or the
    same rules without their lists; every limiter shares one backend, so counters carry over."""
    backend: Backend = open_backend(backend_url, timeout_ms=1000)
    with_lists = config.load([write(tmp_path)])
    plain = config.parse(_without_lists(RULES), "plain.yaml")

    def make(listed: bool) -> Limiter:
        rules = with_lists if listed else Rules({plain.name: plain})
        return Limiter(rules, backend, settings=Settings(), clock=clock)

    yield make
    await backend.close()


def _without_lists(text: str) -> str:
    head, _, rest = text.partition("lists:\n")
    return head + rest[rest.index("descriptors:") :]


async def codes(limiter: Limiter, made: Request, calls: int) -> list[Code]:
    return [(await should_rate_limit(limiter, made)).overall_code for _ in range(calls)]


async def test_a_denied_request_is_over_limit_and_touches_no_counter(
    limiters: Callable[[bool], Limiter],
) -> None:
    """A denied address or user is OVER_LIMIT on its descriptor, every time; its counters, and
    those of the request's other descriptors, are untouched: the same calls without the lists
    get the whole limit of 2."""
    listed = limiters(True)
    denied = call(address("203.0.113.9"), user("carol"))
    for _ in range(3):
        decision = await should_rate_limit(listed, denied)
        assert decision.overall_code is Code.OVER_LIMIT
        assert [s.code for s in decision.statuses] == [Code.OVER_LIMIT, Code.OK]
        assert decision.statuses[0].limit is None
    assert await codes(listed, call(user("mallory")), 3) == [Code.OVER_LIMIT] * 3
    assert await codes(listed, call(address("2001:db8:bad::7")), 1) == [Code.OVER_LIMIT]
    assert listed.stats.denied_by_list == {"lists.remote_address": 4, "lists.user": 3}
    assert listed.stats.rules == {}

    plain = limiters(False)
    assert await codes(plain, denied, 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]
    assert await codes(plain, call(user("mallory")), 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]


async def test_an_allowed_request_is_ok_and_counted_nowhere(
    limiters: Callable[[bool], Limiter],
) -> None:
    """A trusted address is OK however often it calls, with every descriptor of the request
    left uncounted: without the lists, its counters still hold their whole limit."""
    listed = limiters(True)
    trusted = call(address("10.1.2.3"), user("dave"))
    assert await codes(listed, trusted, 5) == [Code.OK] * 5
    assert listed.stats.allowed_by_list == {"lists.remote_address": 5}
    assert listed.stats.rules == {}
    # An address on no list is judged by the rules.
    assert await codes(listed, call(address("192.0.2.1")), 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]

    plain = limiters(False)
    assert await codes(plain, trusted, 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]


async def test_deny_comes_before_allow_across_the_request(
    limiters: Callable[[bool], Limiter],
) -> None:
    """An address on both lists is denied; so is a trusted address whose request also names a
    denied user, whichever descriptor comes first."""
    listed = limiters(True)
    assert await codes(listed, call(address("203.0.113.1")), 1) == [Code.OVER_LIMIT]
    both = await should_rate_limit(listed, call(address("10.0.0.1"), user("mallory")))
    assert both.overall_code is Code.OVER_LIMIT
    assert [s.code for s in both.statuses] == [Code.OK, Code.OVER_LIMIT]
    reversed_ = await should_rate_limit(listed, call(user("mallory"), address("10.0.0.1")))
    assert [s.code for s in reversed_.statuses] == [Code.OVER_LIMIT, Code.OK]
    assert listed.stats.allowed_by_list == {}


async def test_global_shadow_mode_answers_a_denied_request_ok(
    backend_url: str, clock: Clock, tmp_path: Path
) -> None:
    """Under global shadow mode a denied request is answered OK (and counted as shadowed), as
    any OVER_LIMIT request is; it is still counted as denied."""
    backend = open_backend(backend_url, timeout_ms=1000)
    try:
        limiter = Limiter(
            config.load([write(tmp_path)]),
            backend,
            settings=Settings(shadow_mode=True),
            clock=clock,
        )
        assert await codes(limiter, call(user("mallory")), 2) == [Code.OK, Code.OK]
        assert limiter.stats.global_shadow_mode == 2
        assert limiter.stats.denied_by_list == {"lists.user": 2}
    finally:
        await backend.close()


# --- stats -----------------------------------------------------------------------------------


def test_statsd_sends_each_lists_decisions_beside_the_rules_stats() -> None:
    """`ratelimit.service.rate_limit.<domain>.<key>.denied_by_list|allowed_by_list`, as what
    grew since the last flush."""
    stats = Stats()
    deltas = Deltas(stats, Latency())
    stats.denied_by_list["gateway.remote_address"] += 3
    stats.allowed_by_list["gateway.user"] += 1
    sent = {(s.name, s.value) for s in deltas.take()}
    assert ("ratelimit.service.rate_limit.gateway.remote_address.denied_by_list", 3) in sent
    assert ("ratelimit.service.rate_limit.gateway.user.allowed_by_list", 1) in sent
    stats.denied_by_list["gateway.remote_address"] += 1
    assert {(s.name, s.value) for s in deltas.take()} == {
        ("ratelimit.service.rate_limit.gateway.remote_address.denied_by_list", 1)
    }


# --- reloading -------------------------------------------------------------------------------


async def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until `condition()` holds (the poll runs every 0.05 s in these tests)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the change was never picked up"
        await asyncio.sleep(0.02)


async def served_codes(port: int, *descriptors: tuple[tuple[str, str], ...]) -> Code:
    async with client(port) as rls:
        answer = await rls.call(request("lists", *[list(d) for d in descriptors]))
        return Code(answer.overall_code)


async def metric_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    return {
        (family.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def replace(path: Path, text: str) -> None:
    """Write `path` at once, as a ConfigMap update swaps it (a poll never sees half of it)."""
    (path.parent / f".{path.name}.new").write_text(text)
    (path.parent / f".{path.name}.new").replace(path)


async def test_a_deny_list_update_reaches_requests_within_the_reload_interval(
    tmp_path: Path,
) -> None:
    """Adding a user to the deny list file while serving refuses that user from the next poll
    on, with no change to the rules file, and so does a second update; each update is one
    reload; /metrics counts the denied calls."""
    path = write(tmp_path)
    denied = tmp_path / "denied-users.txt"
    async with running_app(path, config_poll_seconds=0.05) as app:
        assert await served_codes(app.grpc_port, user("eve")) == Code.OK
        replace(denied, "mallory\neve\n")
        await eventually(lambda: app.stats.config_load_success == 2)
        assert await served_codes(app.grpc_port, user("eve")) == Code.OVER_LIMIT
        assert await served_codes(app.grpc_port, user("mallory")) == Code.OVER_LIMIT
        assert await served_codes(app.grpc_port, user("frank")) == Code.OK
        replace(denied, "frank\n")
        await eventually(lambda: app.stats.config_load_success == 3)
        assert await served_codes(app.grpc_port, user("frank")) == Code.OVER_LIMIT
        assert await served_codes(app.grpc_port, user("eve")) == Code.OK
        samples = await metric_samples(app.http_port)
    labels = (("domain", "lists"), ("key1", "user"))
    assert samples[("ratelimit_service_rate_limit_denied_by_list", labels)] == 3
    assert samples[("ratelimit_service_rate_limit_allowed_by_list", labels)] == 0


async def test_a_broken_list_changes_nothing_and_is_counted_and_logged_once(
    tmp_path: Path,
) -> None:
    """A list file broken while serving is a failed load: config_load_error counts it, one
    warning names the file and line, and the lists served before go on deciding; fixing the
    file serves the new list."""
    path = write(tmp_path)
    networks_file = tmp_path / "denied-networks.txt"
    async with running_app(path, config_poll_seconds=0.05) as app:
        with structlog.testing.capture_logs() as logs:
            replace(networks_file, "198.51.100.0/24\n198.51.100.300\n")
            await eventually(lambda: app.stats.config_load_error == 1)
            # Touched again, still broken: counted again, not logged again.
            replace(networks_file, "198.51.100.0/24\n198.51.100.300\n\n")
            await eventually(lambda: app.stats.config_load_error == 2)
        warnings = [e for e in logs if e["event"] == "config_load_error"]
        assert [w["error"] for w in warnings] == [
            f"{networks_file}: line 2: '198.51.100.300' is not a network: write an address or "
            "ADDRESS/PREFIX, like 10.0.0.0/8 or 2001:db8::/32"
        ]
        assert await served_codes(app.grpc_port, address("203.0.113.5")) == Code.OVER_LIMIT
        assert await served_codes(app.grpc_port, address("198.51.100.5")) == Code.OK
        replace(networks_file, "198.51.100.0/24\n")
        await eventually(lambda: app.stats.config_load_success == 2)
        assert await served_codes(app.grpc_port, address("198.51.100.5")) == Code.OVER_LIMIT
        assert await served_codes(app.grpc_port, address("203.0.113.5")) == Code.OK  # trusted
        assert app.stats.config_load_success == 2
