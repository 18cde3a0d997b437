"""The Python and the Lua rendering of every algorithm agree, hit for hit.

Generated request sequences (time steps, descriptors, costs including checks, costs above 1 and
refunds) run against the pure decision (`sidecar.algorithms.decide` over a plain dict), the memory backend,
a real Redis and a real Redis Cluster, which must all answer with the same Outcomes. The windows
mix every algorithm: plain and borrowing fixed windows, sliding windows, token buckets with burst
and borrowing, calendar days, weeks and months in zones with DST changes (New York, Berlin) and
without (Shanghai), and descriptors with several windows; counters are stored a key each or as
fields of a grouped hash, a descriptor's nesting plain windows packed in one field or not. Start times sit just before window boundaries and DST changes, so
sequences cross them.

Every example uses keys of its own (the domain carries the example's number) instead of flushing.
Simulated time may be far from the real clock, which is harmless: keys name their windows, and the
TTLs Redis counts in real time are at least several seconds (no second-long plain windows, and
buckets refill slowly), far longer than an example runs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import date, datetime

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.callbacks import apply
from support.model_store import Model

from sidecar.algorithms import hyperloglog, packing
from sidecar.core import counters, usage
from sidecar.core.keys import descriptor_prefix, field_head, group_key, hash_tag
from sidecar.model import Algorithm, Hit, Limit, Outcome, Role, Unit, Window
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

TIMEOUT_MS = 2_000

# Window kinds, drawn family by family so that every algorithm gets its share. No plain window is
# shorter than a minute and no bucket refills faster than a token per 8.6 s, so every TTL Redis
# counts in real time lasts far longer than an example runs.
PLAIN = (
    Window(5, Unit.MINUTE),
    Window(3, Unit.MINUTE, unit_multiplier=10),
    Window(20, Unit.HOUR),
    Window(0, Unit.MINUTE),
)
BORROWING = (
    Window(4, Unit.MINUTE, borrow=2),
    Window(3, Unit.SECOND, unit_multiplier=30, borrow=1),
    Window(10, Unit.HOUR, unit_multiplier=2, borrow=10),
)
SLIDING = (
    Window(3, Unit.SECOND, Algorithm.SLIDING_WINDOW, unit_multiplier=30),
    Window(6, Unit.MINUTE, Algorithm.SLIDING_WINDOW, unit_multiplier=5),
    Window(7, Unit.HOUR, Algorithm.SLIDING_WINDOW),
    Window(4, Unit.DAY, Algorithm.SLIDING_WINDOW),
)
BUCKETS = (
    Window(5, Unit.MINUTE, Algorithm.TOKEN_BUCKET, burst=8, borrow=3),
    Window(7, Unit.MINUTE, Algorithm.TOKEN_BUCKET),
    Window(3, Unit.HOUR, Algorithm.TOKEN_BUCKET, unit_multiplier=2, burst=1, borrow=2),
    Window(2, Unit.SECOND, Algorithm.TOKEN_BUCKET, unit_multiplier=30, burst=4, borrow=4),
)
CALENDAR = (
    Window(8, Unit.DAY, calendar=True, timezone="America/New_York"),
    Window(6, Unit.DAY, calendar=True, timezone="America/New_York", borrow=3),
    Window(9, Unit.WEEK, calendar=True, timezone="America/New_York"),
    Window(15, Unit.MONTH, calendar=True, timezone="America/New_York"),
    Window(10, Unit.WEEK, calendar=True, timezone="Europe/Berlin", week_start=6),
    Window(5, Unit.DAY, calendar=True, timezone="Europe/Berlin", borrow=5),
    Window(5, Unit.DAY, calendar=True, timezone="Asia/Shanghai"),
    Window(12, Unit.MONTH, calendar=True, timezone="Asia/Shanghai", borrow=4),
)
#: Windows anchored on events: one from the first event, cooldowns, lifetimes to a flight end
#: (one inside the starts below, one past some of them) with and without a TTL.
ANCHORED = (
    Window(3, Unit.MINUTE, Algorithm.FIRST_EVENT, unit_multiplier=10),
    Window(1, Unit.HOUR, Algorithm.COOLDOWN),
    Window(1, Unit.MINUTE, Algorithm.COOLDOWN, unit_multiplier=5),
    Window(4, Unit.YEAR, Algorithm.LIFETIME, unit_multiplier=0, ends=1_781_535_600),
    Window(2, Unit.HOUR, Algorithm.LIFETIME, ends=1_772_949_600),
)

# Just before local midnights, DST changes and month ends, in UTC.
STARTS = (
    "2026-06-15T12:34:56.789+00:00",
    "2026-03-08T04:00:00+00:00",  # New York: the 23-hour day starts at 05:00 UTC
    "2026-03-08T06:30:00+00:00",  # New York springs forward at 07:00 UTC
    "2026-11-01T03:30:00+00:00",  # New York: the 25-hour day starts at 04:00 UTC
    "2026-11-01T05:30:00+00:00",  # New York falls back at 06:00 UTC
    "2026-03-28T22:30:00+00:00",  # Berlin: Sunday 29 March starts (a 23-hour day, week_start)
    "2026-10-24T21:30:00+00:00",  # Berlin: Sunday 25 October starts (a 25-hour day)
    "2026-01-31T15:00:00+00:00",  # Shanghai: February starts at 16:00 UTC
    "2026-02-28T15:30:00+00:00",  # Shanghai: March starts at 16:00 UTC
    "2026-03-31T23:00:00+00:00",  # New York: April starts at 04:00 UTC
)


@dataclass(frozen=True)
class Descriptor:
    """A rule's windows (one group) and how its outcome weighs on the request."""

    windows: tuple[Window, ...]
    role: Role


@dataclass(frozen=True)
class Step:
    """A request `after_ms` after the previous one: (descriptor index, cost) pairs."""

    after_ms: int
    hits: tuple[tuple[int, int], ...]
    all_or_nothing: bool


@dataclass(frozen=True)
class Scenario:
    start: str
    offset_ms: int
    one_slot: bool  # all descriptors share a hash tag: one script call per request
    grouped: bool  # counters are fields of a hash per first entry (`group_counters`)
    descriptors: tuple[Descriptor, ...]
    steps: tuple[Step, ...]
    #: Each request also counts usage (`sidecar.core.usage`): a count per descriptor it carries,
    #: admitted or refused, and a unique member; only where every hit shares one slot, as a
    #: request's usage hits share its first counter's (see `usage_hits`).
    usage: bool = False
    #: Grouped counters pack a descriptor's nesting plain windows in one field
    #: (`group_counters: packed`, `sidecar.algorithms.packing`).
    packed: bool = False


_windows = st.one_of(
    *(
        st.sampled_from(family)
        for family in (PLAIN, BORROWING, SLIDING, BUCKETS, CALENDAR, ANCHORED)
    )
)
_descriptors = st.builds(
    Descriptor,
    windows=st.lists(_windows, min_size=1, max_size=3, unique_by=counters.kind).map(tuple),
    role=st.sampled_from([Role.BLOCKING, Role.BLOCKING, Role.SHADOW, Role.QUOTA]),
)
#: Below 0, a refund (`is_negative_hits`): the hits given back.
_costs = st.sampled_from([0, 1, 1, 1, 2, 3, 9, -1, -2, -9])


#: Descriptors whose windows all pack in one field: 5, 10 and 60 minutes nest.
_packed_descriptors = st.builds(
    Descriptor,
    windows=st.lists(st.sampled_from(PLAIN[:3]), min_size=2, max_size=3, unique=True).map(tuple),
    role=st.sampled_from([Role.BLOCKING, Role.SHADOW, Role.QUOTA]),
)


@st.composite
def _scenarios(
    draw: st.DrawFn,
    kinds: st.SearchStrategy[Descriptor] = _descriptors,
    packed: bool | None = None,
) -> Scenario:
    descriptors = draw(st.lists(kinds, min_size=1, max_size=3).map(tuple))
    # The pace follows one of the windows (a bucket's period): requests come often enough to
    # fill it and far enough apart to cross into the next one.
    window = draw(st.sampled_from([w for d in descriptors for w in d.windows]))
    length_ms = window.seconds * 1000
    if draw(st.booleans()):
        # Round times land on exact fractions of windows and tokens, where the two renderings
        # would round differently if their float expressions did.
        twentieths = st.one_of(st.just(0), st.integers(0, 4), st.integers(0, 24))
        after_ms = twentieths.map(lambda n: n * length_ms // 20)
        offset_ms = draw(st.integers(0, 20)) * length_ms // 20
    else:
        after_ms = st.integers(0, length_ms // draw(st.sampled_from([1, 4, 16])))
        offset_ms = draw(st.integers(0, length_ms))
    step = st.builds(
        Step,
        after_ms=after_ms,
        hits=st.lists(
            st.tuples(st.integers(0, len(descriptors) - 1), _costs), min_size=1, max_size=3
        ).map(tuple),
        all_or_nothing=st.booleans(),
    )
    return Scenario(
        start=draw(st.sampled_from(STARTS)),
        offset_ms=-offset_ms,
        one_slot=draw(st.booleans()),
        grouped=packed or draw(st.booleans()),
        descriptors=descriptors,
        steps=draw(st.lists(step, min_size=1, max_size=25).map(tuple)),
        usage=draw(st.booleans()),
        packed=draw(st.booleans()) if packed is None else packed,
    )


_example_ids = itertools.count()


def requests(scenario: Scenario) -> list[tuple[list[Hit], bool, int]]:
    """The scenario's requests as (hits, all_or_nothing, now_ms), with keys of its own.

    As the limiter does, a request's descriptors are numbered by their place in it (their
    group) and each contributes one hit per window of its rule, in the scenario's layout.
    """
    domain = f"parity{next(_example_ids)}"
    parts = [
        [("tenant", "t"), ("d", str(i))] if scenario.one_slot else [("d", str(i))]
        for i in range(len(scenario.descriptors))
    ]
    now_ms = int(datetime.fromisoformat(scenario.start).timestamp() * 1000) + scenario.offset_ms
    result = []
    for step in scenario.steps:
        now_ms += step.after_ms
        hits = []
        for group, (index, cost) in enumerate(step.hits):
            role = scenario.descriptors[index].role
            windows = scenario.descriptors[index].windows
            if scenario.grouped and scenario.packed:
                limit = Limit(windows, packing=packing.plan(windows))
                key, head = group_key(domain, parts[index]), field_head(parts[index])
                hits += counters.grouped_hits(key, head, limit, cost, group, role, now_ms)
                continue
            for window in windows:
                if scenario.grouped:
                    key, head = group_key(domain, parts[index]), field_head(parts[index])
                    hit = counters.field_hit(key, head, window, cost, group, role, now_ms)
                else:
                    prefix = descriptor_prefix(domain, parts[index])
                    hit = counters.window_hit(prefix, window, cost, group, role, now_ms)
                hits.append(hit)
        if scenario.usage and scenario.one_slot:
            hits += usage_hits(hits[0].key, step.hits)
        result.append((hits, step.all_or_nothing, now_ms))
    return result


#: When usage keys expire (PEXPIREAT): past the real time, which Redis counts, and past every
#: simulated time of an example, which the memory backend counts (sequences of month windows
#: run up to two years from their start).
_USAGE_END_MS = int(time.time() * 1000) + 4 * 365 * 86_400_000
_DAY = date(2026, 6, 15)


def usage_hits(first_key: bytes, steps: tuple[tuple[int, int], ...]) -> list[Hit]:
    """A request's usage hits beside its first counter: one count per descriptor index it
    carries (its largest cost; none for a check or a request of refunds), and that index as a
    unique member."""
    head = f"rl{{{hash_tag(first_key).decode()}}}"
    cost = max(c for _, c in steps)
    if cost <= 0:
        return []
    hits = []
    for index in sorted({i for i, _ in steps}):
        name = b"d|%d" % index
        hits.append(
            Hit(usage.count_key(head, _DAY), cost, usage.USAGE_WINDOW, role=Role.USAGE,
                end_ms=_USAGE_END_MS, field=name + b"|a", previous_field=name + b"|r")
        )  # fmt: skip
    unique = usage.unique_key(head, _DAY, ["t"], ["t"], "d")
    member = str(steps[0][0]).encode()
    hits.append(
        Hit(unique, cost, usage.USAGE_WINDOW, role=Role.UNIQUE, end_ms=_USAGE_END_MS, field=member)
    )
    return hits


async def assert_same_usage(
    scenario: Scenario, model: Model, stores: dict[str, Model | Backend]
) -> None:
    """Every store holds the model's usage counts and unique counts after the scenario."""
    counted = {
        where: value
        for where, value in model.values.items()
        if isinstance(where, tuple) and b"|%u|" in where[0]
    }
    uniques = sorted(
        where for where in model.values if isinstance(where, bytes) and b"|%h|" in where
    )
    for name, store in stores.items():
        found = await store.usage_hashes("rl{parity*|%u|*")  # type: ignore[union-attr]
        held = {(key, field): value for key, fields in found for field, value in fields.items()}
        mine = {
            where: value for where, value in held.items() if where[0] in {k for k, _ in counted}
        }
        assert mine == counted, f"{name}'s usage counts differ from the model's"
        got = await store.usage_unique([[key] for key in uniques])  # type: ignore[union-attr]
        assert got == [hyperloglog.count(model.values[key]) for key in uniques], name  # type: ignore[arg-type]


async def assert_agree(scenario: Scenario, stores: dict[str, Model | Backend]) -> None:
    """Every store answers every request of `scenario` with the model's Outcomes."""
    model = Model()
    for number, (hits, all_or_nothing, now_ms) in enumerate(requests(scenario)):
        expected = await apply(model, hits, all_or_nothing, now_ms)
        for name, store in stores.items():
            got = await apply(store, hits, all_or_nothing, now_ms)
            assert got == expected, f"{name} differs from the model at request {number}: {hits}"
    if scenario.usage and scenario.one_slot:
        await assert_same_usage(scenario, model, stores)


#: A refund between two charges on a counter that does not exist: the charge of 9 is refused (the
#: minute window admits at most 6), so the day counter it would have raised stays missing and
#: the refund gives nothing back; the charge of 1 after it is admitted and counts.
REFUND_ON_A_MISSING_COUNTER = Scenario(
    start=STARTS[0],
    offset_ms=0,
    one_slot=False,
    grouped=False,
    descriptors=(
        Descriptor(
            (
                Window(4, Unit.MINUTE, borrow=2),
                Window(6, Unit.DAY, calendar=True, timezone="America/New_York", borrow=3),
            ),
            Role.BLOCKING,
        ),
    ),
    steps=(
        Step(0, ((0, 0),), all_or_nothing=False),
        Step(0, ((0, 9), (0, -1), (0, 1)), all_or_nothing=False),
        Step(0, ((0, 0),), all_or_nothing=False),
    ),
)

#: A bucket and an anchored window beside a borrowing minute that refuses a charge of 9: the
#: refused charge must not reach their stored state through the request's later hits on them
#: (a refund, a charge), which were judged with it as added.
REFUSED_CHARGE_THEN_MORE = Scenario(
    start=STARTS[0],
    offset_ms=0,
    one_slot=True,
    grouped=False,
    descriptors=(
        Descriptor(
            (
                Window(4, Unit.MINUTE, borrow=2),
                Window(5, Unit.MINUTE, Algorithm.TOKEN_BUCKET, burst=8, borrow=3),
                Window(10, Unit.MINUTE, Algorithm.FIRST_EVENT, unit_multiplier=10),
            ),
            Role.BLOCKING,
        ),
    ),
    steps=(
        Step(0, ((0, 9), (0, -1), (0, 1)), all_or_nothing=False),
        Step(0, ((0, 0),), all_or_nothing=False),
        Step(1_000, ((0, 2), (0, 9), (0, -1), (0, 1)), all_or_nothing=False),
        Step(0, ((0, 0),), all_or_nothing=False),
    ),
)

_settings = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
async def redis_backend(redis_url: str) -> AsyncIterator[Backend]:
    backend = open_backend(redis_url, timeout_ms=TIMEOUT_MS)
    yield backend
    await backend.close()


@pytest.fixture
async def cluster_backend(cluster_url: str) -> AsyncIterator[Backend]:
    backend = open_backend(cluster_url, timeout_ms=TIMEOUT_MS)
    yield backend
    await backend.close()


@settings(_settings, max_examples=100)
@given(scenario=_scenarios())
@example(scenario=REFUND_ON_A_MISSING_COUNTER)
@example(scenario=REFUSED_CHARGE_THEN_MORE)
async def test_memory_backend_matches_the_model(scenario: Scenario) -> None:
    """The memory backend, which evicts expired values, answers as the model that keeps them."""
    await assert_agree(scenario, {"memory": MemoryBackend()})


@pytest.mark.redis
@settings(_settings, max_examples=100)
@given(scenario=_scenarios())
@example(scenario=REFUND_ON_A_MISSING_COUNTER)
@example(scenario=REFUSED_CHARGE_THEN_MORE)
async def test_redis_matches_the_model(scenario: Scenario, redis_backend: Backend) -> None:
    """The Lua script on Redis answers every request exactly as the Python decision does."""
    await assert_agree(scenario, {"memory": MemoryBackend(), "redis": redis_backend})


@pytest.mark.redis
@settings(_settings, max_examples=100)
@given(scenario=_scenarios(_packed_descriptors, packed=True))
async def test_packed_fields_agree_on_redis_and_memory(
    scenario: Scenario, redis_backend: Backend
) -> None:
    """Windows sharing a packed field are judged, counted and refunded alike by the Lua script
    and the Python decision, across their boundaries."""
    await assert_agree(scenario, {"memory": MemoryBackend(), "redis": redis_backend})


@pytest.mark.cluster
@settings(_settings, max_examples=50)
@given(scenario=_scenarios())
@example(scenario=REFUND_ON_A_MISSING_COUNTER)
@example(scenario=REFUSED_CHARGE_THEN_MORE)
async def test_cluster_matches_the_model(scenario: Scenario, cluster_backend: Backend) -> None:
    """Redis Cluster, one script call per slot and two phases across slots, answers as the model."""
    await assert_agree(scenario, {"cluster": cluster_backend})


# A 7-per-minute bucket that these hits leave at 1.0000666…: refilled in floats for exactly its
# reset time (51,428 ms, the TTL of its state), it comes to 6.999999999999999, not 7.
BUCKET_AT_EXPIRY = Scenario(
    start=STARTS[0],
    offset_ms=0,
    one_slot=True,
    grouped=False,
    descriptors=(Descriptor((Window(7, Unit.MINUTE, Algorithm.TOKEN_BUCKET),), Role.BLOCKING),),
    steps=tuple(
        Step(after_ms, ((0, cost),), all_or_nothing=False)
        for after_ms, cost in [(0, 3), (6_733, 2), (1_839, 2), (51_428, 0)]
    ),
)


@pytest.mark.redis
@pytest.mark.parametrize("grouped", [False, True], ids=["keys", "grouped"])
async def test_a_bucket_is_full_the_moment_its_state_expires(
    redis_backend: Backend, grouped: bool
) -> None:
    """At its reset time a bucket is full, whether its state is gone (memory evicts it then) or
    still stored (Redis expires it by its own clock, a little later)."""
    scenario = replace(BUCKET_AT_EXPIRY, grouped=grouped)
    model = Model()
    outcomes = [await apply(model, *request) for request in requests(scenario)]
    assert outcomes[-1] == [Outcome(False, 7, 0, True, 7)]
    await assert_agree(scenario, {"memory": MemoryBackend(), "redis": redis_backend})


async def test_a_refused_charge_reaches_no_state_through_later_hits_on_it() -> None:
    """A bucket's and an event window's state counts only the hits applied: the charge of 9
    that the borrowing minute refuses is in neither, though the later refund and charge of the
    request were judged with it as added; each is left with the charge of 1 alone."""
    model = Model()
    outcomes = [await apply(model, *request) for request in requests(REFUSED_CHARGE_THEN_MORE)]
    minute, bucket, event = outcomes[1]
    assert (minute.remaining, bucket.remaining, event.remaining) == (5, 7, 9)


def _limits(model: Model) -> dict[object, object]:
    """The values of limits' counters, buckets and windows: no usage count or unique count."""
    return {
        where: value
        for where, value in model.values.items()
        if not (isinstance(where, tuple) and b"|%u|" in where[0])
        and not (isinstance(where, bytes) and b"|%h|" in where)
    }


@settings(_settings, max_examples=300)
@given(scenario=_scenarios())
async def test_what_is_stored_is_the_applied_hits_alone(scenario: Scenario) -> None:
    """After every request the model stores what its applied hits alone, applied one by one,
    store: a hit that is not applied reaches no counter, bucket or window, even through the
    later hits of its request that were judged with it as added."""
    model, replay = Model(), Model()
    for hits, all_or_nothing, now_ms in requests(scenario):
        outcomes = await apply(model, hits, all_or_nothing, now_ms)
        for hit, outcome in zip(hits, outcomes, strict=True):
            if outcome.applied and hit.role < Role.USAGE:
                replay.force([hit], now_ms)
        assert _limits(model) == _limits(replay), hits


@settings(_settings, max_examples=200)
@given(
    limit=st.integers(0, 4),
    role=st.sampled_from([Role.BLOCKING, Role.SHADOW, Role.QUOTA]),  # the roles of limits
    grouped=st.booleans(),
    steps=st.lists(
        st.tuples(st.integers(-3, 3), st.booleans(), st.integers(0, 40_000)), min_size=1
    ),
)
async def test_memory_answers_one_plain_window_as_the_model(
    limit: int, role: Role, grouped: bool, steps: list[tuple[int, bool, int]]
) -> None:
    """The memory backend's shortcut for a request of one plain window (the reference's case)
    answers as the model: checks, costs above the limit, refunds, all-or-nothing, every role,
    both layouts, across window ends."""
    window = Window(limit, Unit.MINUTE)
    parts = [("d", "x")]
    model, memory = Model(), MemoryBackend()
    now_ms = 1_800_000_000_000
    for cost, all_or_nothing, after_ms in steps:
        now_ms += after_ms
        if grouped:
            key, head = group_key("p", parts), field_head(parts)
            hit = counters.field_hit(key, head, window, cost, 0, role, now_ms)
        else:
            hit = counters.window_hit(descriptor_prefix("p", parts), window, cost, 0, role, now_ms)
        expected = await apply(model, [hit], all_or_nothing, now_ms)
        assert await apply(memory, [hit], all_or_nothing, now_ms) == expected
