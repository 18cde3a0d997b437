"""The quota service end to end: real Envoys with the `rate_limit_quota` filter enforce the
assignments the sidecar's RLQS server (on Redis) gives them.

Every Envoy runs the gateway `envoy-config --rlqs-address` generates from the rules and a
sources file reading the `tenant` key from the `x-tenant` header. The clients name tenant
`acme`, so every request falls in one bucket, `{tenant: acme}`, whose rule allows 600 requests
per 10-second window; clients send uneven load (1:2:3 over the Envoys) at three times that.
Envoy denies a bucket that has no assignment yet, or an expired one (DENY_ALL fallbacks), so
the allocator's overshoot bound leaves only the network latency: each window admits at most the
limit, and (the load being three times it) about the limit, each Envoy about its demand's share.
h2load clients (one HTTP/2 connection each, one request at a time) send on a schedule; a request
is counted in the window in which its answer came back.

Windows are measured once every Envoy's demand is known (its second report, `LEARN` after the
load starts): the load runs until the end of the whole windows measured, no longer. Envoy 1.40
reports every 5 s whatever `reporting_interval` says (its source: a fixed 5,000 ms), so neither
the report interval nor a window of two reports can be shorter.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
from support.envoys import (
    HOST,
    Envoy,
    ProcessError,
    Sidecar,
    Upstream,
    free_port,
    get,
    steady_port,
)
from support.servers import RedisServer

from sidecar import cli
from sidecar.envoy_config import commands

LIMIT = 600
#: Seconds. Envoy 1.40 reports every 5 s, whatever `reporting_interval` says: a window holds two.
WINDOW = 10.0
#: Seconds from the load's start until every Envoy's demand is known: its first request is
#: reported at once, its second report 5 s later.
LEARN = 5.5
#: Requests per second over the limit's pace (LIMIT / WINDOW).
LOAD = 3.0
TENANT = "acme"
#: Where the rules' key comes from: every client names its tenant in a header.
SOURCES = "tenant: {header: x-tenant}\n"
#: The sidecar's assignment TTL, seconds: a report's interval and a second.
TTL = 6

RULES = f"""\
domain: quota
descriptors:
  - key: tenant
    value: {TENANT}
    rate_limit:
      unit: second
      unit_multiplier: {int(WINDOW)}
      requests_per_unit: {LIMIT}
"""


def envoy_config(
    rules: Path, sources: Path, rlqs: int, port: int, admin: int, upstream: int
) -> str:
    """The gateway `envoy-config --rlqs-address --failure-mode-deny --bootstrap` generates:
    the rate_limit_quota filter with one bucket per tenant, denying a bucket that has no
    assignment yet or an expired one."""
    argv = ["envoy-config", "--rules", str(rules), "--sources", str(sources),
            "--rlqs-address", f"{HOST}:{rlqs}", "--failure-mode-deny", "--bootstrap",
            "--listen", f"{HOST}:{port}", "--admin", f"{HOST}:{admin}",
            "--upstream", f"{HOST}:{upstream}"]  # fmt: skip
    return commands.generate(cli.parse_args(argv), argv)


@dataclass
class Fleet:
    sidecar: Sidecar
    upstream: Upstream
    workdir: Path
    envoy_binary: str
    rlqs_port: int
    envoys: list[tuple[Envoy, int]] = field(default_factory=list)

    def envoy(self) -> int:
        """Start one more Envoy on the generated config; returns its listener port."""
        port, admin = free_port(), free_port()
        index = len(self.envoys)
        config = self.workdir / f"envoy-{index}.yaml"
        config.write_text(
            envoy_config(
                self.workdir / "rules.yaml",
                self.workdir / "sources.yaml",
                self.rlqs_port,
                port,
                admin,
                self.upstream.port,
            )
        )
        envoy = Envoy(self.envoy_binary, config, admin, self.workdir / f"envoy-{index}.log")
        envoy.start()
        self.envoys.append((envoy, port))
        return port


@contextmanager
def running_fleet(
    envoy_binary: str,
    redis: RedisServer,
    workdir: Path,
    rules_text: str = RULES,
    sources: str = SOURCES,
) -> Iterator[Fleet]:
    """Redis (emptied) and the sidecar serving RLQS on it, on ports below the ephemeral range
    (it may be restarted on them), and an upstream answering 200; Envoys are started by the
    test (`Fleet.envoy`) and all stopped at its end."""
    redis.start()
    with redis.client() as client:
        client.flushall()
    rules = workdir / "rules.yaml"
    rules.write_text(rules_text)
    (workdir / "sources.yaml").write_text(sources)
    for attempt in range(3):
        rlqs_port = steady_port()
        sidecar = Sidecar(
            ["--config", str(rules), "--backend", redis.url,
             "--rlqs-address", f"{HOST}:{rlqs_port}", "--rlqs-assignment-ttl", str(TTL)],
            # Debug: the log has every assignment, for a failure to be read.
            steady_port(), steady_port(), workdir / "sidecar.log", log_level="debug",
        )  # fmt: skip
        try:
            sidecar.start()
            break
        except ProcessError:
            if attempt == 2:
                raise
    upstream = Upstream()
    upstream.start()
    running = Fleet(sidecar, upstream, workdir, envoy_binary, rlqs_port)
    try:
        yield running
    finally:
        for envoy, _ in running.envoys:
            envoy.stop()
        sidecar.stop()
        upstream.stop()


@pytest.fixture
def fleet(envoy_binary: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Fleet]:
    """A fleet on the session's Redis."""
    with running_fleet(envoy_binary, redis_server, tmp_path) as running:
        yield running


@dataclass
class Client:
    """h2load sending GETs to one Envoy at `rate` per second, on one HTTP/2 connection, one at a
    time, for `seconds`; `answers` holds (when each answer came, in Unix seconds, its status).

    A C client keeps its schedule on a busy machine, where a Python one pauses: a pause longer
    than a token bucket takes to fill wastes what fills meanwhile.
    """

    port: int
    rate: int
    seconds: int
    log: Path
    answers: list[tuple[float, int]] = field(default_factory=list)

    def run(self) -> None:
        argv = [
            "h2load", "-c", "1", "-m", "1", f"--rps={self.rate}", "-D", str(self.seconds),
            "-H", f"x-tenant: {TENANT}", f"--log-file={self.log}",
            f"http://{HOST}:{self.port}/orders",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=self.seconds + 60)
        assert done.returncode == 0, done.stdout + done.stderr
        for line in self.log.read_text().splitlines():
            started_us, status, took_us = line.split("\t")[:3]
            self.answers.append(((int(started_us) + int(took_us)) / 1e6, int(status)))


def drive(
    ports: Sequence[int], weights: Sequence[int], seconds: float, workdir: Path
) -> list[Client]:
    """Load every Envoy at its weight's share of LOAD × the limit's pace, for `seconds`."""
    total = LOAD * LIMIT / WINDOW
    clients = [
        Client(
            port,
            round(total * weight / sum(weights)),
            math.ceil(seconds),
            workdir / f"h2load-{i}.log",
        )
        for i, (port, weight) in enumerate(zip(ports, weights, strict=True))
    ]
    threads = [threading.Thread(target=c.run) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(c.answers for c in clients), "a client got no answer"
    return clients


def learned(whole: int) -> tuple[int, float]:
    """The first window that begins once the demand is known (`LEARN` from now), and the seconds
    from now to the end of the `whole`-th window from it on (and half a second)."""
    first = math.ceil((time.time() + LEARN) / WINDOW)
    return first, (first + whole) * WINDOW - time.time() + 0.5


def windows(clients: Sequence[Client], first: int) -> dict[int, list[tuple[int, int]]]:
    """Per whole window of the run from `first` on (the last, cut short, left out): per client,
    (admitted, asked)."""
    starts = sorted({int(at // WINDOW) for c in clients for at, _ in c.answers})
    counted: dict[int, list[tuple[int, int]]] = {}
    for window in [w for w in starts[:-1] if w >= first]:
        row = []
        for client in clients:
            statuses = [s for at, s in client.answers if int(at // WINDOW) == window]
            row.append((statuses.count(200), len(statuses)))
        counted[window] = row
    return counted


def report(counted: dict[int, list[tuple[int, int]]]) -> str:
    return "\n".join(
        f"window {w}: admitted {[a for a, _ in row]} of {[n for _, n in row]} "
        f"(total {sum(a for a, _ in row)})"
        for w, row in counted.items()
    )


def check(counted: dict[int, list[tuple[int, int]]]) -> None:
    """Each window admits the limit, ±5%, and never more than it (its load at least one and a
    half times the limit)."""
    assert counted, "no whole window measured"
    for window, row in counted.items():
        asked = sum(n for _, n in row)
        admitted = sum(a for a, _ in row)
        assert asked >= 1.5 * LIMIT, f"window {window}: only {asked} sent\n{report(counted)}"
        assert admitted <= LIMIT, f"window {window}\n{report(counted)}"
        assert admitted >= 0.95 * LIMIT, f"window {window}\n{report(counted)}"


def test_one_envoy_admits_the_limit_per_window(fleet: Fleet) -> None:
    """One Envoy at three times the limit admits the limit in a window, ±5% and never more; a
    request naming no tenant, or a tenant no rule limits, falls in no bucket and passes at
    once."""
    port = fleet.envoy()
    first, seconds = learned(1)
    counted = windows(drive([port], [1], seconds, fleet.workdir), first)
    print(report(counted))
    check(counted)
    for headers in ({}, {"x-tenant": "other"}):
        assert [get(port, "/orders", headers).status for _ in range(3)] == [200, 200, 200]


def test_three_envoys_share_the_limit_by_demand(fleet: Fleet) -> None:
    """Three Envoys loaded 1:2:3 at three times the limit: once their demand is known, every
    window admits the limit, ±5% and never more (an Envoy whose block runs out before its next
    report is pushed a new one, and each new block starts full), and each Envoy's share of what
    was admitted is its share of the demand, ±0.05."""
    ports = [fleet.envoy() for _ in range(3)]
    first, seconds = learned(2)
    counted = windows(drive(ports, [1, 2, 3], seconds, fleet.workdir), first)
    print(report(counted))
    check(counted)
    rows = list(counted.values())
    admitted = [sum(row[i][0] for row in rows) for i in range(3)]
    asked = [sum(row[i][1] for row in rows) for i in range(3)]
    for i in range(3):
        share = admitted[i] / sum(admitted)
        demanded = asked[i] / sum(asked)
        assert abs(share - demanded) <= 0.05, (i, admitted, asked, report(counted))


#: A rule of an hour, where pacing made a trickle of a burst (issue 32): leased, or paced.
HOURLY = """\
domain: quota
descriptors:
  - key: user
{pace}    rate_limit:
      unit: hour
      requests_per_unit: 300
"""
BURST = 1_000


@pytest.mark.parametrize("pace", [False, True], ids=["leased", "paced"])
def test_a_burst_spends_an_hourly_budget_at_once_unless_paced(
    envoy_binary: str, redis_server: RedisServer, tmp_path: Path, pace: bool
) -> None:
    """A fast burst of 1,000 requests from one user against `user: 300/hour` admits 300 (±5%),
    as the same rule admits through ShouldRateLimit: the Envoy's lease is what is left of the
    hour. With `pace: true` the hour's budget is paced over the hour instead: a trickle."""
    rules = HOURLY.format(pace="    pace: true\n" if pace else "")
    if time.time() % 3_600 > 3_600 - 60:  # a burst across the hour's turn would get two budgets
        time.sleep(3_600 - time.time() % 3_600 + 1)
    with running_fleet(
        envoy_binary, redis_server, tmp_path, rules, "user: {header: x-user}\n"
    ) as fleet:
        port = fleet.envoy()
        log = tmp_path / "h2load.log"
        argv = ["h2load", "-n", str(BURST), "-c", "4", "-m", "1", "-H", "x-user: alice",
                f"--log-file={log}", f"http://{HOST}:{port}/orders"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        statuses = [int(line.split("\t")[1]) for line in log.read_text().splitlines()]
    admitted = statuses.count(200)
    print(f"{'paced' if pace else 'leased'}: admitted {admitted} of {len(statuses)}")
    assert len(statuses) == BURST
    assert statuses.count(429) == BURST - admitted
    if pace:
        assert admitted < 30
    else:
        assert 285 <= admitted <= 315


def test_envoy_rides_out_a_sidecar_restart_and_a_redis_restart(
    envoy_binary: str, restartable_redis: RedisServer, tmp_path: Path
) -> None:
    """The sidecar killed for longer than the TTL: Envoy keeps admitting on its last assignment
    until it expires, then denies (its expired_assignment_behavior); the sidecar started again,
    Envoy reconnects and admits again. Redis restarted (its counts lost): nothing crashes, and
    the sidecar assigns token buckets again from the new Redis. The rule is paced, so that the
    last assignment still admits after the kill (a lease at three times the limit is spent in
    the window's first seconds, and would admit nothing more whether the sidecar ran or not)."""
    paced = RULES.replace("    rate_limit:", "    pace: true\n    rate_limit:")
    with running_fleet(envoy_binary, restartable_redis, tmp_path, paced) as fleet:
        # As long as the steps below take (7 + TTL + 2 + 6 + 6 s), and a second.
        client = Client(
            fleet.envoy(), round(LOAD * LIMIT / WINDOW), TTL + 22, tmp_path / "h2load.log"
        )
        load = threading.Thread(target=client.run)
        load.start()
        try:
            time.sleep(7)  # the first assignment, and a report
            fleet.sidecar.kill()
            killed = time.time()
            time.sleep(TTL + 2)
            fleet.sidecar.start()
            back = time.time()
            time.sleep(6)  # Envoy reconnects at its next report (every 5 s)
            restartable_redis.restart()
            redis_back = time.time()
            time.sleep(6)  # and reports again
        finally:
            load.join()
        assert fleet.sidecar.running
        assert all(envoy.running for envoy, _ in fleet.envoys)
        assigned_after_redis = [
            event
            for event in fleet.sidecar.events()
            if event.get("event") == "rlqs_assignment"
            and event.get("strategy") == "token_bucket"
            and _epoch(event["timestamp"]) > redis_back
        ]

    def admitted(since: float, until: float) -> int:
        return sum(1 for at, status in client.answers if since <= at < until and status == 200)

    assert admitted(killed + 0.5, killed + TTL - 1.5) > 0, "Envoy stopped at once"
    assert admitted(killed + TTL + 0.5, back) == 0, "Envoy admitted past its assignment's TTL"
    assert admitted(back, redis_back) > 0, "assignments did not resume"
    assert assigned_after_redis, "no assignment once Redis was back"


def _epoch(timestamp: str) -> float:
    """A log event's ISO 8601 UTC timestamp as Unix seconds."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
