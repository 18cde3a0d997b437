"""Grouped counters in storage: one small hash per user in Redis (fields of ended windows pruned,
listpack encoding kept, the hash expiring when its user goes idle), ids beside it in the same
slot, window codes that never collide, and the pure decision, memory, Redis and Redis Cluster
agreeing hit for hit on grouped windows and exactly-once records."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import available_timezones

import pytest
import redis
from support.callbacks import apply
from support.clock import Clock
from support.model_store import Model
from support.servers import RedisServer

from sidecar.algorithms import windows
from sidecar.algorithms.windows import FIELD_GRACE
from sidecar.core import config
from sidecar.core.counters import code, field_hit, kind, zone_code
from sidecar.core.keys import base36, dedupe_key, field_head, group_key, keep_until_id
from sidecar.core.rules import Rules
from sidecar.frequency.caps import Candidate, FrequencyCaps, Impression
from sidecar.model import Algorithm, Dedupe, Hit, Role, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

RULES = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 3}
          - {unit: month, requests_per_unit: 10}
      - key: campaign
        rate_limit: {algorithm: token_bucket, unit: hour, requests_per_unit: 6, burst: 2}
"""

DAY = 86_400
MONTH = 30 * DAY


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def store(request: pytest.FixtureRequest) -> tuple[str, list[RedisServer]]:
    """A Redis or a Redis Cluster, emptied: its URL and the servers holding data."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_server").nodes
    return request.getfixturevalue("cluster_url"), request.getfixturevalue("redis_cluster").nodes


@contextmanager
def holder(nodes: Sequence[RedisServer], key: bytes) -> Iterator[redis.Redis]:
    """A client of the node that holds `key`."""
    for node in nodes:
        with node.client() as client:
            try:
                held = client.exists(key)
            except redis.exceptions.ResponseError:  # MOVED: another node owns the slot
                continue
            if held:
                yield client
                return
    raise AssertionError(f"no node holds {key!r}")


def all_keys(nodes: Sequence[RedisServer]) -> set[bytes]:
    found: set[bytes] = set()
    for node in nodes:
        with node.client() as client:
            found.update(client.keys("*"))
    return found


@pytest.fixture
async def caps(store: tuple[str, list[RedisServer]], clock: Clock) -> AsyncIterator[FrequencyCaps]:
    domain = config.parse(RULES, "rules.yaml")
    backend = open_backend(store[0], timeout_ms=2_000)
    yield FrequencyCaps(Rules({"ads": domain}), backend, clock=clock)
    await backend.close()


async def test_a_users_counters_are_one_listpack_hash_beside_its_ids(
    caps: FrequencyCaps, store: tuple[str, list[RedisServer]], clock: Clock
) -> None:
    """20 ads with a day and a month window are 40 fields of one hash named by the user's hash
    tag, each field `ad|<ad>|<code><keep-until>`; the ids are one more key in the same slot."""
    clock.now = (clock.now // MONTH) * MONTH + 3 * DAY + 100
    now = int(clock.now)
    await caps.record("ads", [Impression(f"imp-{n}", "u1", f"a{n}") for n in range(20)])

    hash_key = b"rl{ads|user|u1}"
    ids_key = b"rl{ads|user|u1}|%ids|" + base36(now // DAY).encode()
    assert all_keys(store[1]) == {hash_key, ids_key}
    day_end = keep_until_id(now - now % DAY + DAY, precise=False)
    month_end = keep_until_id(now - now % MONTH + MONTH, precise=False)
    assert len(day_end) == 5
    with holder(store[1], hash_key) as client:
        assert client.hgetall(hash_key) == {
            f"ad|a{n}|{c}{end}".encode(): b"1"
            for n in range(20)
            for c, end in (("d", day_end), ("M", month_end))
        }
        assert client.object("encoding", hash_key) == b"listpack"
        assert client.hgetall(ids_key) == {f"imp-{n}".encode(): b"1" for n in range(20)}
        assert client.object("encoding", ids_key) == b"listpack"


async def test_fields_of_ended_windows_are_pruned_and_the_hash_expires_with_its_last_window(
    caps: FrequencyCaps, store: tuple[str, list[RedisServer]], clock: Clock
) -> None:
    """A field created on a new day removes yesterday's fields (not the month's), the hash stays
    a listpack, and its expiry covers the month's field plus the grace, no more: a user who goes
    idle leaves nothing behind once the last window has ended."""
    start = (clock.now // MONTH) * MONTH + 3 * DAY + 100
    clock.now = start
    await caps.record("ads", [Impression(f"imp-{n}", "u1", f"a{n}") for n in range(3)])
    clock.now = start + DAY
    await caps.record("ads", [Impression("next-day", "u1", "a0")])

    now = int(clock.now)
    hash_key = b"rl{ads|user|u1}"
    month_end = now - now % MONTH + MONTH
    with holder(store[1], hash_key) as client:
        fields = client.hgetall(hash_key)
        ttl_ms = client.pttl(hash_key)
        encoding = client.object("encoding", hash_key)
    day_field = f"ad|a0|d{keep_until_id(now - now % DAY + DAY, False)}".encode()
    month = keep_until_id(month_end, False)
    assert fields == {
        day_field: b"1",
        **{f"ad|a{n}|M{month}".encode(): b"2" if n == 0 else b"1" for n in range(3)},
    }
    assert encoding == b"listpack"
    # Set when the month's fields were created, a (simulated) day earlier; Redis counts real time.
    expected_ms = (month_end + FIELD_GRACE - int(start)) * 1000
    assert expected_ms - 5_000 < ttl_ms <= expected_ms


async def test_a_grouped_bucket_keeps_its_keep_until_in_its_value(
    caps: FrequencyCaps, store: tuple[str, list[RedisServer]], clock: Clock
) -> None:
    """A token bucket's field ends in `_` and its value carries the Unix ms when it is full
    again; once that time and the grace have passed, the next new field prunes it."""
    clock.now = (clock.now // DAY) * DAY + 100
    await caps.record("ads", [Impression("i1", "u1", "a1", "c1")])
    hash_key = b"rl{ads|user|u1}"
    bucket_field = b"campaign|c1|th6/2_"
    with holder(store[1], hash_key) as client:
        tokens, stamp, drawn, keep = client.hget(hash_key, bucket_field).split()
    assert (float(tokens), float(drawn)) == (1.0, 0.0)
    # One token back in 600 s: full again 600 s after the hit.
    assert int(float(keep)) == int(float(stamp)) + 600_000 == int(clock.now * 1000) + 600_000

    clock.now += 600 + FIELD_GRACE
    await caps.record("ads", [Impression("i2", "u1", "a2")])
    with holder(store[1], hash_key) as client:
        assert not client.hexists(hash_key, bucket_field)
    # Pruned or not, a bucket that refilled is full: the campaign admits its burst of 2.
    assert (await caps.check("ads", "u1", [Candidate("new", "c1")]))[0].remaining == 2


ANCHORED_RULES = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {algorithm: first_event, unit: hour, unit_multiplier: 24, requests_per_unit: 2}
          - {algorithm: cooldown, unit: minute, unit_multiplier: 10}
      - key: campaign
        rate_limit: {algorithm: lifetime, requests_per_unit: 5, ends: ENDS}
"""


async def test_anchored_windows_keep_their_count_and_end_until_they_end(
    store: tuple[str, list[RedisServer]], clock: Clock
) -> None:
    """A first-event window, a cooldown and a lifetime cap are one field each, named by their
    kind and `^`, holding "<count> <end ms>"; the hash lives as long as the longest of them,
    and a field created after one has ended (plus the grace) prunes it: storage ends with the
    window."""
    now = int(clock.now)
    ends = now + 2 * DAY
    domain = config.parse(ANCHORED_RULES.replace("ENDS", str(ends)), "rules.yaml")
    backend = open_backend(store[0], timeout_ms=2_000)
    try:
        caps = FrequencyCaps(Rules({"ads": domain}), backend, clock=clock)
        await caps.record("ads", [Impression("i1", "u1", "a1", "c1")])
        hash_key = b"rl{ads|user|u1}"
        now_ms = now * 1000
        lifetime = f"campaign|c1|l{base36(ends)}.^".encode()
        with holder(store[1], hash_key) as client:
            assert client.hgetall(hash_key) == {
                b"ad|a1|f24h^": f"1 {now_ms + DAY * 1000}".encode(),
                b"ad|a1|k10m^": f"1 {now_ms + 600_000}".encode(),
                lifetime: f"1 {ends * 1000}".encode(),
            }
            assert 2 * DAY * 1000 - 5_000 < client.pttl(hash_key) <= 2 * DAY * 1000
        clock.now = now + 600 + FIELD_GRACE
        await caps.record("ads", [Impression("i2", "u1", "a2")])
        with holder(store[1], hash_key) as client:
            fields = client.hgetall(hash_key)
        assert b"ad|a1|k10m^" not in fields  # its cooldown ended: pruned
        assert b"ad|a1|f24h^" in fields and lifetime in fields
    finally:
        await backend.close()


async def test_without_group_counters_counters_keep_one_key_each(
    store: tuple[str, list[RedisServer]], clock: Clock
) -> None:
    """The flag is opt-in: without it every counter is its own string key, as in the reference."""
    domain = config.parse(RULES.replace("    group_counters: true\n", ""), "rules.yaml")
    backend = open_backend(store[0], timeout_ms=2_000)
    try:
        caps = FrequencyCaps(Rules({"ads": domain}), backend, clock=clock)
        now = int(clock.now)
        await caps.record("ads", [Impression("i1", "u1", "a1")])
    finally:
        await backend.close()
    prefix = "rl{ads|user|u1}"
    assert all_keys(store[1]) == {
        f"{prefix}|ad|a1|86400|{now - now % DAY}".encode(),
        f"{prefix}|ad|a1|2592000|{now - now % MONTH}".encode(),
        f"{prefix}|%ids|{base36(now // DAY)}".encode(),
    }


async def test_memory_forgets_grouped_counters_of_ended_windows(clock: Clock) -> None:
    """The memory backend drops a grouped counter when Redis would prune its field."""
    backend = MemoryBackend()
    domain = config.parse(RULES, "rules.yaml")
    caps = FrequencyCaps(Rules({"ads": domain}), backend, clock=clock)
    clock.now = (clock.now // MONTH) * MONTH + 3 * DAY + 100
    await caps.record("ads", [Impression("i1", "u1", "a1")])
    assert len(backend) == 3  # day, month, the ids
    clock.now += DAY + FIELD_GRACE
    await caps.check("ads", "u1", [Candidate("a1")])
    assert len(backend) == 2


def test_window_codes_are_short_and_tell_kinds_apart() -> None:
    """Every kind of window gets a code of its own, a few characters long; time zones get three
    characters of a hash, which collide for exactly one pair of IANA zones (loading refuses a
    tree holding both)."""
    kinds = [
        Window(1, unit, algorithm, multiplier, borrow=borrow)
        for unit in Unit
        for multiplier in (1, 5)
        for algorithm, borrow in (
            (Algorithm.FIXED_WINDOW, 0),
            (Algorithm.FIXED_WINDOW, 1),
            (Algorithm.SLIDING_WINDOW, 0),
        )
    ]
    kinds += [
        Window(rate, unit, Algorithm.TOKEN_BUCKET, burst=burst)
        for unit in (Unit.SECOND, Unit.HOUR)
        for rate, burst in ((1, 10), (11, 0), (1, None), (110, None))
        if burst != 0
    ]
    kinds += [
        Window(1, unit, calendar=True, timezone=zone, week_start=week, borrow=borrow)
        for unit in (Unit.DAY, Unit.WEEK, Unit.MONTH, Unit.YEAR)
        for zone in ("UTC", "Asia/Shanghai", "America/New_York")
        for week in ((0, 6) if unit is Unit.WEEK else (0,))
        for borrow in (0, 1)
    ]
    codes = {code(w): kind(w) for w in kinds}
    assert len(codes) == len({kind(w) for w in kinds}) == len(kinds)
    assert (code(Window(3, Unit.DAY)), code(Window(4, Unit.MONTH))) == ("d", "M")
    assert max(len(c) for c in codes if not c.startswith("t")) <= 7

    zones = sorted(available_timezones())
    by_code: dict[str, list[str]] = {}
    for zone in zones:
        by_code.setdefault(zone_code(zone), []).append(zone)
    assert [names for names in by_code.values() if len(names) > 1] == [
        ["Africa/Addis_Ababa", "America/Iqaluit"]
    ]


# --- The pure decision, memory, Redis and Redis Cluster agree on grouped counters -------------

PARITY_WINDOWS = (
    Window(3, Unit.HOUR),
    Window(0, Unit.HOUR),
    Window(4, Unit.MINUTE, unit_multiplier=30),
    Window(6, Unit.HOUR, unit_multiplier=2, borrow=3),
    Window(5, Unit.HOUR, Algorithm.SLIDING_WINDOW),
    Window(5, Unit.HOUR, Algorithm.TOKEN_BUCKET, burst=8, borrow=3),
    Window(2, Unit.HOUR, Algorithm.TOKEN_BUCKET),
    Window(6, Unit.DAY, calendar=True, timezone="America/New_York"),
    Window(5, Unit.DAY, calendar=True, timezone="America/New_York", borrow=2),
    Window(9, Unit.MONTH, calendar=True, timezone="Asia/Shanghai", borrow=4),
    Window(2, Unit.HOUR, Algorithm.FIRST_EVENT),
    Window(1, Unit.MINUTE, Algorithm.COOLDOWN, unit_multiplier=45),
    Window(3, Unit.YEAR, Algorithm.LIFETIME, unit_multiplier=0, ends=1_772_950_000),
)

# Just before Shanghai's February and New York's 23-hour day.
PARITY_STARTS = ("2026-01-31T15:40:00+00:00", "2026-03-08T04:40:00+00:00")


@dataclass(frozen=True)
class Step:
    now_ms: int
    record: bool
    # (user, ad, window indexes, cost, impression id)
    parts: tuple[tuple[str, str, tuple[int, ...], int, str], ...]
    all_or_nothing: bool = False


def parity_steps(seed: int, start: str) -> list[Step]:
    rng = random.Random(seed)
    now_ms = int(datetime.fromisoformat(start).timestamp() * 1000)
    steps = []
    ids = [f"imp-{n}" for n in range(12)]
    for _ in range(80):
        now_ms += rng.choice((0, 0, 1_000, 37_000, 600_000, 1_900_000))
        parts = tuple(
            (
                rng.choice(("u1", "u2")),
                rng.choice(("a1", "a2", "a|3")),
                tuple(sorted(rng.sample(range(len(PARITY_WINDOWS)), rng.randint(1, 3)))),
                rng.choice((0, 1, 1, 2, 5)),
                rng.choice(ids),
            )
            for _ in range(rng.randint(1, 4))
        )
        steps.append(Step(now_ms, rng.random() < 0.4, parts, rng.random() < 0.3))
    return steps


def hits_of(parts: Sequence[tuple[str, str, tuple[int, ...], int, str]], now_ms: int) -> list[Hit]:
    hits = []
    for group, (user, ad, indexes, cost, _) in enumerate(parts):
        entries = [("user", user), ("ad", ad)]
        key, head = group_key("par", entries), field_head(entries)
        for index in indexes:
            hits.append(
                field_hit(key, head, PARITY_WINDOWS[index], cost, group, Role.BLOCKING, now_ms)
            )
    return hits


def batches_of(step: Step, horizon_s: int) -> list[tuple[list[Hit], Dedupe]]:
    """One batch per user, as `FrequencyCaps.record` builds them (cost at least 1)."""
    by_user: dict[str, list[tuple[str, str, tuple[int, ...], int, str]]] = {}
    for part in step.parts:
        by_user.setdefault(part[0], []).append(
            (part[0], part[1], part[2], max(1, part[3]), part[4])
        )
    bucket = step.now_ms // 1000 // horizon_s
    return [
        (
            hits_of(parts, step.now_ms),
            Dedupe(
                dedupe_key("par", ("user", user), bucket),
                dedupe_key("par", ("user", user), bucket - 1),
                tuple(part[4] for part in parts),
                ((bucket + 2) * horizon_s + 60) * 1000 - step.now_ms,
            ),
        )
        for user, parts in by_user.items()
    ]


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
async def parity_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        url = "memory://"
    else:
        url = request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")
    backend = open_backend(url, timeout_ms=2_000)
    yield backend
    await backend.close()


@pytest.mark.parametrize("start", PARITY_STARTS)
@pytest.mark.parametrize("seed", range(3))
async def test_grouped_counters_agree_with_the_pure_decision(
    parity_backend: Backend, seed: int, start: str
) -> None:
    """Checks, hits (all-or-nothing or not) and exactly-once records on grouped windows of every
    algorithm, across hour, day, DST and month boundaries, answer exactly as the model; a
    one-hour dedupe horizon makes ids come back as time goes on."""
    model = Model()
    for number, step in enumerate(parity_steps(seed, start)):
        if step.record:
            batches = batches_of(step, 3_600)
            expected_ids = await model.record(batches, step.now_ms)
            got_ids = await parity_backend.record(batches, step.now_ms)
            assert got_ids == expected_ids, f"step {number}: {step}"
        else:
            hits = hits_of(step.parts, step.now_ms)
            expected = await apply(model, hits, step.all_or_nothing, step.now_ms)
            got = await apply(parity_backend, hits, step.all_or_nothing, step.now_ms)
            assert got == expected, f"step {number}: {step}"
    # The state the records left is the model's too: every window checked once more.
    for user in ("u1", "u2"):
        for ad in ("a1", "a2", "a|3"):
            parts = ((user, ad, tuple(range(len(PARITY_WINDOWS))), 0, ""),)
            hits = hits_of(parts, step.now_ms)
            assert await apply(parity_backend, hits, False, step.now_ms) == await apply(
                model, hits, False, step.now_ms
            )


def test_grouped_fields_name_the_window_instance() -> None:
    """A plain window's field ends in its end; a borrowing one's in the next window's end, and
    its previous field in its own end; all fields of a user share one hash."""
    now_ms = 1_767_225_600_000 + 5_000  # 2026-01-01T00:00:05Z
    key, head = (
        group_key("d", [("user", "u"), ("ad", "a")]),
        field_head([("user", "u"), ("ad", "a")]),
    )
    plain = field_hit(key, head, Window(1, Unit.DAY), 1, 0, Role.BLOCKING, now_ms)
    borrowing = field_hit(key, head, Window(1, Unit.DAY, borrow=1), 1, 0, Role.BLOCKING, now_ms)
    day_end = 1_767_225_600 + DAY
    assert key == b"rl{d|user|u}"
    # 2026-01-02 is 2,193 days after 2020-01-01: 3,157,920 minutes, "1voo0" in base 36.
    assert keep_until_id(day_end, precise=False) == "1voo0"
    assert (plain.field, plain.previous_field) == (b"ad|a|d1voo0",) * 2
    assert plain.ttl == DAY - 5 + FIELD_GRACE
    assert borrowing.field == f"ad|a|d+{keep_until_id(day_end + DAY, False)}".encode()
    assert borrowing.previous_field == b"ad|a|d+1voo0"
    seconds = field_hit(
        key, head, Window(1, Unit.SECOND, unit_multiplier=30), 1, 0, Role.BLOCKING, now_ms
    )
    assert seconds.field == f"ad|a|30s.{base36(1_767_225_630)}".encode()
    assert windows.bounds(Window(1, Unit.DAY), now_ms // 1000) == (day_end - DAY, day_end)
