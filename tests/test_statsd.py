"""statsd and DogStatsD: the reference's stat names and values, sent in batches to a listener
the test runs (TCP for statsd, UDP for DogStatsD), with EXTRA_TAGS and mogrifiers."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from support.sidecars import client, request, running_app, serve_process, write_rules

from sidecar import cli
from sidecar.decision.stats import Stats
from sidecar.telemetry.metrics import Latency
from sidecar.telemetry.statsd import (
    Deltas,
    Encoder,
    Mogrifier,
    StatsdError,
    StatsdReporter,
    StatsdSettings,
    mogrifiers_from_env,
    pack,
    parse_duration,
)

RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
"""
RULE = "ratelimit.service.rate_limit.test.user"
TIMER = "ratelimit_server.ShouldRateLimit.response_time"


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    return write_rules(tmp_path, RULES)


class Received:
    """What a statsd listener got: every payload (TCP reads or UDP datagrams) as it came."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.connections = 0
        self.port = 0

    def lines(self) -> list[str]:
        return b"".join(self.payloads).decode().splitlines()

    def counters(self) -> Counter[str]:
        """Counter values by name, summed over flushes (the timer left out)."""
        found: Counter[str] = Counter()
        for line in self.lines():
            name, _, rest = line.partition(":")
            value, kind = rest.split("|")[:2]
            if kind == "c":
                found[name + "|" + "|".join(rest.split("|")[2:])] += int(value)
        return found

    def timer_calls(self, name: str = TIMER) -> float:
        """Calls the timer lines stand for: each line's 1/sample rate."""
        total = 0.0
        for line in self.lines():
            if line.startswith(name + ":"):
                rate = re.search(r"\|@([\d.e-]+)", line)
                total += 1 / float(rate[1]) if rate else 1
        return total


@asynccontextmanager
async def tcp_listener() -> AsyncIterator[Received]:
    received = Received()

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.connections += 1
        while chunk := await reader.read(65_536):
            received.payloads.append(chunk)
        writer.close()

    server = await asyncio.start_server(take, "127.0.0.1", 0)
    received.port = server.sockets[0].getsockname()[1]
    async with server:
        yield received


@asynccontextmanager
async def udp_listener() -> AsyncIterator[Received]:
    received = Received()

    class Take(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            received.payloads.append(data)

    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        Take, local_addr=("127.0.0.1", 0)
    )
    received.port = transport.get_extra_info("sockname")[1]
    try:
        yield received
    finally:
        transport.close()


async def settle(received: Received, seconds: float = 0.2) -> None:
    await asyncio.sleep(seconds)  # let the last bytes of the final flush be read


async def the_issue_example(port: int) -> None:
    """7 calls for one user on a 5/minute limit and 3 for another."""
    async with client(port) as rls:
        for user, calls in (("alice", 7), ("bob", 3)):
            for _ in range(calls):
                await rls.should_rate_limit(request("test", [("user", user)]))


async def test_statsd_over_tcp_sends_the_reference_names_and_values_in_one_batch(
    rules: Path,
) -> None:
    """7 calls on a 5/minute `user` limit and 3 for another user give total_hits 10,
    within_limit 8, over_limit 2 and near_limit 1 (NEAR_LIMIT_RATIO 0.8), as the reference's
    statsd sink sends them: one line per counter that grew, EXTRA_TAGS folded into the name,
    and all of it in one write at the flush, not one per request."""
    async with tcp_listener() as received:
        settings = StatsdSettings(
            port=received.port, flush_interval=3600, tags=(("zone", "eu.west:1"), ("env", "prod"))
        )
        async with running_app(rules, statsd=settings) as app:
            await the_issue_example(app.grpc_port)
            reporter = app.assembly.statsd
        await settle(received)
    assert reporter is not None and reporter.sent == 1
    assert received.connections == 1
    tags = ".__env=prod.__zone=eu_west_1"
    assert received.counters() == {
        f"{RULE}.total_hits{tags}|": 10,
        f"{RULE}.within_limit{tags}|": 8,
        f"{RULE}.over_limit{tags}|": 2,
        f"{RULE}.near_limit{tags}|": 1,
        f"ratelimit.service.config_load_success{tags}|": 1,
        f"ratelimit_server.ShouldRateLimit.total_requests{tags}|": 10,
    }
    assert received.timer_calls(TIMER + tags) == pytest.approx(10)


async def test_dogstatsd_over_udp_sends_tags_and_applies_the_first_matching_mogrifier(
    rules: Path,
) -> None:
    """DogStatsD: EXTRA_TAGS as tags, and a mogrifier that turns the rule's name into
    `ratelimit.service.rate_limit.<stat>` tagged with its domain and descriptor; names no
    mogrifier matches keep their name and the extra tags."""
    env = {
        "DOG_STATSD_MOGRIFIER_DESCRIPTOR_PATTERN": r"^ratelimit\.service\.rate_limit\.([^.]+)\.(.+)\.([^.]+)$",
        "DOG_STATSD_MOGRIFIER_DESCRIPTOR_NAME": "ratelimit.service.rate_limit.$3",
        "DOG_STATSD_MOGRIFIER_DESCRIPTOR_TAGS": "domain:$1,descriptor:$2",
    }
    async with udp_listener() as received:
        settings = StatsdSettings(
            port=received.port,
            protocol="udp",
            format="dogstatsd",
            flush_interval=3600,
            tags=(("env", "prod"),),
            mogrifiers=mogrifiers_from_env(["DESCRIPTOR"], env),
        )
        async with running_app(rules, statsd=settings) as app:
            await the_issue_example(app.grpc_port)
        await settle(received)
    assert len(received.payloads) == 1  # one datagram: it all fits in 1,432 bytes
    tagged = "|#env:prod,domain:test,descriptor:user"
    assert received.counters() == {
        f"ratelimit.service.rate_limit.total_hits{tagged}": 10,
        f"ratelimit.service.rate_limit.within_limit{tagged}": 8,
        f"ratelimit.service.rate_limit.over_limit{tagged}": 2,
        f"ratelimit.service.rate_limit.near_limit{tagged}": 1,
        "ratelimit.service.config_load_success|#env:prod": 1,
        "ratelimit_server.ShouldRateLimit.total_requests|#env:prod": 10,
    }


def test_counters_are_sent_as_what_grew_since_the_last_flush_and_only_when_they_grew() -> None:
    """As gostats latches them: each flush sends the increase of each counter that grew, and
    a flush after nothing happened sends nothing."""
    stats, latency = Stats(), Latency()
    deltas = Deltas(stats, latency)
    stats.rules["d.k_v"].record(10, 0, 3, over=False, shadow=False)
    stats.total_requests += 3
    for _ in range(3):
        latency.observe(0.0003)
    first = {(s.name, s.value, s.kind, s.rate) for s in deltas.take()}
    assert first == {
        ("ratelimit.service.rate_limit.d.k_v.total_hits", 3, "c", 1.0),
        ("ratelimit.service.rate_limit.d.k_v.within_limit", 3, "c", 1.0),
        ("ratelimit_server.ShouldRateLimit.total_requests", 3, "c", 1.0),
        (TIMER, 0.5, "ms", 1 / 3),
    }
    assert deltas.take() == []
    stats.rules["d.k_v"].record(10, 3, 1, over=False, shadow=False)
    assert [(s.name, s.value) for s in deltas.take()] == [
        ("ratelimit.service.rate_limit.d.k_v.total_hits", 1),
        ("ratelimit.service.rate_limit.d.k_v.within_limit", 1),
    ]


def test_lines_are_packed_into_datagrams_of_at_most_the_limit() -> None:
    """UDP payloads never pass 1,432 bytes (no fragmentation); every line is sent whole."""
    lines = [f"ratelimit.service.rate_limit.d.k_{i}.total_hits:1|c\n".encode() for i in range(200)]
    payloads = pack(lines, 1_432)
    assert all(len(p) <= 1_432 for p in payloads)
    assert b"".join(payloads) == b"".join(lines)
    assert len(payloads) > 1
    taken = 0
    for payload in payloads[:-1]:  # each datagram is as full as the next whole line allows
        taken += payload.count(b"\n")
        assert len(payload) + len(lines[taken]) > 1_432


def test_names_and_tags_cannot_break_the_line_format() -> None:
    """A descriptor value with ':', '|' or a newline in its metric key, and a tag value with
    '.', ':' or '|', are sent with '_' in their place."""
    from sidecar.telemetry.statsd import Stat

    plain = Encoder(StatsdSettings(tags=(("k", "a.b|c:d"),)))
    assert plain.encode(Stat("r.d.k_a:b|c\nd.total_hits", 2, "c")) == (
        b"r.d.k_a_b_c_d.total_hits.__k=a_b_c_d:2|c\n"
    )
    dog = Encoder(StatsdSettings(format="dogstatsd", protocol="udp", tags=(("k", "v"),)))
    assert dog.encode(Stat("n", 1.5, "ms", rate=0.25)) == b"n:1.5|ms|@0.25|#k:v\n"


async def test_a_statsd_that_is_down_loses_only_its_stats_and_is_found_again(
    rules: Path,
) -> None:
    """With nothing listening, a flush drops its stats (counted, logged once); once a listener
    is there, the next flush connects and sends what grew since."""
    async with tcp_listener() as probe:
        port = probe.port
    stats = Stats()
    reporter = StatsdReporter(StatsdSettings(port=port), stats)
    stats.total_requests = 1
    await reporter.flush()
    assert reporter.dropped == 1 and reporter.sent == 0
    server_received: list[bytes] = []

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65_536):
            server_received.append(chunk)
        writer.close()

    server = await asyncio.start_server(take, "127.0.0.1", port)
    async with server:
        stats.total_requests = 3
        await reporter.flush()
        await reporter.stop()
        await asyncio.sleep(0.2)
    assert reporter.sent == 1
    assert b"".join(server_received) == b"ratelimit_server.ShouldRateLimit.total_requests:2|c\n"


def test_the_reference_variables_turn_statsd_on_as_the_flags_do() -> None:
    """USE_STATSD=true with STATSD_HOST, STATSD_PORT, STATSD_PROTOCOL, STATS_FLUSH_INTERVAL
    and EXTRA_TAGS; USE_DOG_STATSD=true (UDP) with USE_DOG_STATSD_MOGRIFIERS; neither: off.
    Both at once is refused, as the reference refuses two sinks."""
    base = ["serve", "--config", "r", "--reference-env"]
    env = {
        "USE_STATSD": "true",
        "STATSD_HOST": "stats.local",
        "STATSD_PORT": "9125",
        "STATSD_PROTOCOL": "udp",
        "STATS_FLUSH_INTERVAL": "1m30s",
        "EXTRA_TAGS": "env:prod,zone:a",
    }
    settings = cli.parse_args(base, env).statsd
    assert settings == StatsdSettings(
        host="stats.local",
        port=9125,
        protocol="udp",
        flush_interval=90.0,
        tags=(("env", "prod"), ("zone", "a")),
    )
    flags = cli.parse_args(
        [*base, "--statsd-address", "stats.local:9125", "--statsd-protocol", "udp",
         "--stats-flush-interval", "90", "--stats-tags", "env:prod,zone:a"],
        {},
    ).statsd  # fmt: skip
    assert flags == settings
    assert cli.parse_args(base, {}).statsd is None
    assert cli.parse_args(base, {"STATSD_HOST": "x"}).statsd is None
    dog = cli.parse_args(
        base,
        {
            "USE_DOG_STATSD": "true",
            "USE_DOG_STATSD_MOGRIFIERS": "A",
            "DOG_STATSD_MOGRIFIER_A_PATTERN": "^x$",
            "DOG_STATSD_MOGRIFIER_A_NAME": "y",
        },
    ).statsd
    assert dog is not None
    assert (dog.host, dog.port, dog.protocol, dog.format) == ("localhost", 8125, "udp", "dogstatsd")
    assert [m.name for m in dog.mogrifiers] == ["y"]
    with pytest.raises(SystemExit):
        cli.parse_args(base, {"USE_STATSD": "true", "USE_DOG_STATSD": "true"})


def test_bad_statsd_settings_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """A duration, tags or a mogrifier that cannot be read stop `serve` with exit status 2
    and the variable named."""
    base = ["serve", "--config", "r", "--statsd-address", "127.0.0.1:8125", "--reference-env"]
    cases = {
        "expected a duration": {"STATS_FLUSH_INTERVAL": "soon"},
        "expected key:value pairs": {"EXTRA_TAGS": "novalue"},
        "DOG_STATSD_MOGRIFIER_M_PATTERN: no pattern": {
            "RLS_STATSD_FORMAT": "dogstatsd",
            "USE_DOG_STATSD_MOGRIFIERS": "M",
        },
        "is sent over udp": {"RLS_STATSD_FORMAT": "dogstatsd", "RLS_STATSD_PROTOCOL": "tcp"},
    }
    for expected, env in cases.items():
        with pytest.raises(SystemExit) as caught:
            cli.parse_args(base, env)
        assert caught.value.code == 2
        assert expected in capsys.readouterr().err
    with pytest.raises(StatsdError):
        parse_duration("0s")
    assert parse_duration("500ms") == 0.5


def test_a_mogrifier_fills_its_name_and_tags_from_the_pattern_groups() -> None:
    """`$0` is the whole match, `$N` group N, and a `$N` past the groups stays as written."""
    mogrifier = Mogrifier(re.compile(r"^a\.(\w+)\.(\w+)$"), "m.$2", (("g", "$1"), ("x", "$9")))
    assert mogrifier.apply("a.b.c") == ("m.c", ["g:b", "x:$9"])
    assert mogrifier.apply("z.b.c") is None


async def test_serve_with_the_reference_variables_flushes_dogstatsd_every_interval(
    rules: Path,
) -> None:
    """`serve` with USE_DOG_STATSD=true, STATSD_PORT and STATS_FLUSH_INTERVAL=200ms sends the
    calls' stats while it runs, each flush one datagram, not one per call."""
    async with udp_listener() as received:
        env = {
            "USE_DOG_STATSD": "true",
            "STATSD_HOST": "127.0.0.1",
            "STATSD_PORT": str(received.port),
            "STATS_FLUSH_INTERVAL": "200ms",
        }
        args = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
                "--http-address", "127.0.0.1:0", "--reference-env"]  # fmt: skip
        async with serve_process(args, env) as served:
            await the_issue_example(served.grpc_port)
            async with asyncio.timeout(10):
                while received.counters().get(f"{RULE}.total_hits|") != 10:
                    await asyncio.sleep(0.05)
    assert received.counters()[f"{RULE}.over_limit|"] == 2
    assert received.counters()[f"{RULE}.within_limit|"] == 8
    assert len(received.payloads) < 10
