"""Usage counting (`sidecar.core.usage`): what the rules declare, what a day of traffic counts on
every backend, in the decision's own script call, and how it reads back."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from support.callbacks import should_rate_limit
from support.clock import Clock
from support.servers import RedisCluster, RedisServer

from sidecar.algorithms import hyperloglog
from sidecar.core import config, usage
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.model import Code, Descriptor, Entry, Hit, Request, Unit, Window
from sidecar.reports import usage as usage_api
from sidecar.storage import scripts
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend
from sidecar.telemetry import metrics

RULES = """\
domain: open
usage:
  - by: [app]
  - by: [app, interface]
  - by: [app]
    unique: user
descriptors:
  - key: app
    rate_limit: {unit: day, requests_per_unit: 1000}
    descriptors:
      - key: interface
        rate_limit: {unit: minute, requests_per_unit: 100000}
"""
#: Distinct users per app in the scripted day, and the app over its daily limit.
USERS = {"shop": 1500, "maps": 400, "tiny": 30}
CROWDED = "tiny"
INTERFACES = ("orders", "search", "pay")


def call(app: str, interface: str, user: str, hits_addend: int | None = None) -> Request:
    """What an open platform's gateway sends: the app, the app's interface, the app's user."""
    return Request(
        "open",
        (
            Descriptor((Entry("app", app),), hits_addend),
            Descriptor((Entry("app", app), Entry("interface", interface)), hits_addend),
            Descriptor((Entry("app", app), Entry("user", user)), hits_addend),
        ),
    )


def scripted_day() -> list[tuple[str, str, str]]:
    """The day's calls, (app, interface, user), shuffled: every user of each app calls a few
    times; the crowded app calls past its limit of 1000 a day."""
    rng = random.Random(23)
    calls = []
    for app, users in USERS.items():
        for n in range(users):
            for _ in range(1 + n % 3):
                calls.append((app, rng.choice(INTERFACES), f"{app}-user-{n}"))
    calls += [(CROWDED, "pay", f"{CROWDED}-user-{n % 30}") for n in range(1100)]
    rng.shuffle(calls)
    return calls


async def test_a_scripted_day_gives_the_three_statistics_on_every_backend(
    make_limiter: Callable[..., Limiter], clock: Clock
) -> None:
    """Calls per app per day and per app and interface are exact, admitted and refused apart,
    and unique users per app within 2%, read back from the backend as `/v1/usage` reads them;
    a check (hits_addend 0) counts nothing."""
    limiter = make_limiter(RULES)
    expected: Counter[tuple[str, ...]] = Counter()
    for app, interface, user in scripted_day():
        decision = await should_rate_limit(limiter, call(app, interface, user))
        outcome = "refused" if decision.overall_code == Code.OVER_LIMIT else "admitted"
        expected[(app, outcome)] += 1
        expected[(app, interface, outcome)] += 1
    await should_rate_limit(limiter, call("shop", "orders", "checker", hits_addend=0))
    assert expected[(CROWDED, "refused")] > 0

    domain = limiter.rules.domains["open"]
    assert domain.usage is not None
    day = domain.usage.today(int(clock() * 1000))
    by_app = await usage.report(limiter.backend, "open", domain.usage, ("app",), [day], 10)  # type: ignore[arg-type]
    (today,) = by_app["days"]
    assert today["day"] == day.isoformat()
    assert {row["key"]["app"]: (row["admitted"], row["refused"]) for row in today["top"]} == {
        app: (expected[(app, "admitted")], expected[(app, "refused")]) for app in USERS
    }
    for row in today["top"]:
        users = USERS[row["key"]["app"]]
        assert abs(row["unique"]["user"] - users) <= 0.02 * users, row

    by_interface = await usage.report(
        limiter.backend,
        "open",
        domain.usage,
        ("app", "interface"),
        [day],
        100,  # type: ignore[arg-type]
    )
    (today,) = by_interface["days"]
    assert {
        (row["key"]["app"], row["key"]["interface"]): (row["admitted"], row["refused"])
        for row in today["top"]
    } == {
        (app, interface): (
            expected[(app, interface, "admitted")],
            expected[(app, interface, "refused")],
        )
        for app in USERS
        for interface in INTERFACES
        if expected[(app, interface, "admitted")] + expected[(app, interface, "refused")]
    }


# --- The rules ---------------------------------------------------------------------------------


def test_usage_counts_each_by_once_with_its_unique_keys() -> None:
    """Dimensions sharing `by` count calls once; their `unique` keys gather under it; the day
    and the retention are the domain's."""
    domain = config.parse(
        RULES.replace(
            "  - by: [app]\n    unique: user\n",
            "  - {by: [app], unique: user, timezone: Asia/Shanghai, retention_days: 30}\n",
        )
        .replace(
            "  - by: [app, interface]\n",
            "  - {by: [app, interface], timezone: Asia/Shanghai, retention_days: 30}\n",
        )
        .replace(
            "  - by: [app]\n", "  - {by: [app], timezone: Asia/Shanghai, retention_days: 30}\n", 1
        ),
        "rules.yaml",
    )
    assert domain.usage is not None
    assert domain.usage.counted == (("app",), ("app", "interface"))
    assert domain.usage.uniques == {("app",): ("user",), ("app", "interface"): ()}
    assert (domain.usage.timezone, domain.usage.retention_days) == ("Asia/Shanghai", 30)
    # 2026-11-24T16:30Z is the 25th in Shanghai; kept from then for 30 days.
    now_ms = 1_795_537_800_000
    assert domain.usage.today(now_ms).isoformat() == "2026-11-25"
    assert len(domain.usage.days(now_ms)) == 30


def test_a_request_counts_the_first_value_of_each_key_and_its_largest_hits_addend() -> None:
    """Values come from the request's entries in order (any descriptor); the count is the
    request's largest `hits_addend`; a check counts nothing; a request missing a `by` key does
    not count in that dimension."""
    parsed = config.parse(RULES, "rules.yaml")
    assert parsed.usage is not None
    checked = call("shop", "pay", "u1", hits_addend=0)
    assert usage.tally("open", parsed.usage, checked, None) is None
    weighed = Request(
        "open",
        (
            Descriptor((Entry("app", "shop"),), 3),
            Descriptor((Entry("app", "maps"), Entry("user", "u")), 1),
        ),
    )
    tally = usage.tally("open", parsed.usage, weighed, None)
    assert tally is not None
    hits = tally.at(1_795_537_800_000)
    assert [(h.field, h.previous_field, h.hits) for h in hits] == [
        (b"app|shop|a", b"app|shop|r", 3),
        (b"u", b"", 3),
    ]
    assert hits[0].key == b"rl{open|app|shop}|%u|20261124"
    assert hits[1].key == b"rl{open|app|shop}|%h|20261124|app|shop|user"
    assert hits[0].end_ms == 1_795_537_800_000 - 1_795_537_800_000 % 86_400_000 + 7 * 86_400_000


# --- HyperLogLog -------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("members", [0, 1, 200, 3_000, 3_100, 40_000])
def test_the_memory_hyperloglog_counts_exactly_as_redis_pfcount(
    redis_server: RedisServer, members: int
) -> None:
    """Same hash, same registers, same estimator: PFCOUNT and the memory backend's count agree
    to the unit, sparse and dense."""
    values = [f"member-{n}".encode() for n in range(members)]
    registers = hyperloglog.new()
    for value in values:
        registers, _ = hyperloglog.add(registers, value)
    with redis_server.client() as client:
        client.delete("hll")
        for start in range(0, members, 1_000):
            client.pfadd("hll", *values[start : start + 1_000])
        assert hyperloglog.count(registers) == client.pfcount("hll")
        client.delete("hll")


# --- No extra command ---------------------------------------------------------------------------

#: What the scripts run on the server (INFO commandstats counts a script's commands too).
SCRIPTED = {
    "get",
    "hget",
    "incrby",
    "expire",
    "hincrby",
    "pfadd",
    "pexpireat",
    "pttl",
    "pexpire",
    "hgetall",
    "hdel",
    "set",
}


def _commandstats(nodes: list[RedisServer]) -> Counter[str]:
    calls: Counter[str] = Counter()
    for node in nodes:
        with node.client() as client:
            for name, stats in client.info("commandstats").items():
                calls[name.removeprefix("cmdstat_")] += int(stats["calls"])
    return calls


@pytest.mark.parametrize(
    "server",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
)
async def test_usage_adds_no_command_to_a_request_beyond_its_script_call(
    server: str, request: pytest.FixtureRequest
) -> None:
    """With usage declared, each request is still one EVALSHA (all its descriptors share the
    app's hash slot), and every other command the servers ran was run by that script."""
    cluster = server == "cluster"
    url = request.getfixturevalue("cluster_url" if cluster else "redis_url")
    store: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_cluster" if cluster else "redis_server"
    )
    domain = config.parse(RULES, "rules.yaml")
    backend = open_backend(url, timeout_ms=1000)
    limiter = Limiter(Rules({domain.name: domain}), backend)
    await should_rate_limit(limiter, call("warm", "pay", "u"))  # the scripts are loaded
    for node in store.nodes:
        with node.client() as client:
            client.config_resetstat()
    calls = scripted_day()[:300]
    for app, interface, user in calls:
        await should_rate_limit(limiter, call(app, interface, user))
    seen = _commandstats(store.nodes)
    assert seen["evalsha"] == len(calls)
    assert seen["eval"] == 0
    others = {name for name in seen if name not in SCRIPTED and name != "evalsha"}
    await backend.close()
    assert others <= {"info", "config|resetstat", "cluster|slots", "cluster|shards"}, seen


def test_a_request_with_usage_runs_the_decide_script_never_the_count_script() -> None:
    """count.lua only adds and cannot tell admitted from refused: a request whose hits carry
    usage is decided by decide.lua, which judges the request before it counts it."""
    parsed = config.parse(RULES, "rules.yaml")
    assert parsed.usage is not None
    tally = usage.tally("open", parsed.usage, call("shop", "pay", "u"), None)
    assert tally is not None
    counter = Hit(b"rl{open|app|shop}|86400|0", 1, Window(5, Unit.DAY), ttl=86_400)
    assert scripts.counts([counter], scripts.MODE_ADD)
    assert not scripts.counts([counter, *tally.at(1_795_537_800_000)], scripts.MODE_ADD)


async def test_prometheus_gets_only_the_top_keys_of_each_dimension(clock: Clock) -> None:
    """`/metrics` carries today's top N keys per dimension (calls admitted and refused, unique
    users), read in the background; the other keys, and single users, never become series."""
    domain = config.parse(RULES, "rules.yaml")
    backend = MemoryBackend()
    rules = Rules({domain.name: domain})
    limiter = Limiter(rules, backend, clock=clock)
    for app, interface, user in scripted_day():
        await should_rate_limit(limiter, call(app, interface, user))
    top = usage_api.TopKeys(lambda: rules, backend, 2, clock)
    await top.refresh()
    registry = CollectorRegistry()
    registry.register(metrics.UsageCollector(top))
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.render(registry).decode().splitlines()
        if line.startswith("ratelimit_sidecar_usage")
    }
    calls = [name for name in samples if name.startswith("ratelimit_sidecar_usage_calls{")]
    assert len(calls) == 2 * 2 * 2  # two dimensions, two keys each, admitted and refused
    shop = 'domain="open",by="app",key="app=shop"'
    # The shop's 3,000 calls, 1,000 within its daily limit.
    assert samples[f'ratelimit_sidecar_usage_calls{{{shop},outcome="admitted"}}'] == 1_000
    assert samples[f'ratelimit_sidecar_usage_calls{{{shop},outcome="refused"}}'] == 2_000
    assert samples[f'ratelimit_sidecar_usage_unique{{{shop},unique="user"}}'] == pytest.approx(
        1_500, rel=0.02
    )
    assert not any("maps" in name or "user-" in name for name in samples)


@pytest.mark.parametrize(
    "server",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
)
async def test_requests_refused_from_the_over_limit_cache_count_as_refused(
    server: str, request: pytest.FixtureRequest, clock: Clock
) -> None:
    """A request the over-limit cache refuses without a backend call still counts, as refused:
    its usage goes with the refused hits the cache adds afterwards, so the counts stay exact."""
    url = request.getfixturevalue("cluster_url" if server == "cluster" else "redis_url")
    domain = config.parse(RULES, "rules.yaml")
    backend = open_backend(url, timeout_ms=1000)
    limiter = Limiter(Rules({domain.name: domain}), backend, clock=clock, over_limit_cache=1_000)
    outcomes: Counter[Code] = Counter()
    for n in range(1_300):
        decision = await should_rate_limit(limiter, call(CROWDED, "pay", f"u{n % 50}"))
        outcomes[decision.overall_code] += 1
    assert limiter.over_limit_cache is not None
    # What the cache still holds goes out now, ahead of the reads below on the same connection.
    limiter.over_limit_cache.flush()
    counted = domain.usage
    assert counted is not None
    report = await usage.report(
        backend, "open", counted, ("app",), [counted.today(int(clock() * 1000))], 10
    )  # type: ignore[arg-type]
    rows = {row["key"]["app"]: row for row in report["days"][0]["top"]}
    await backend.close()
    assert (rows[CROWDED]["admitted"], rows[CROWDED]["refused"]) == (1_000, 300)
    assert outcomes[Code.OVER_LIMIT] == 300
    assert limiter.stats.rules["open.app"].over_limit_with_local_cache > 0
