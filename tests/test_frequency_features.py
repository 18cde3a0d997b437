"""Frequency caps as ad servers run them, on every backend (memory, Redis, Redis Cluster): caps
per event type, cooldowns, windows from the first event, lifetime caps and caps counted across a
person's identifiers; exactly-once records for each, and bad input refused whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar.algorithms.decide import Address, State
from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.errors import InvalidRequest
from sidecar.frequency.caps import Candidate, FrequencyCaps, Impression, Recorded, Verdict
from sidecar.model import UNLIMITED_REMAINING, Code, Dedupe, Descriptor, Entry, Hit, Request
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.base import Applied

DAY = 86_400

EVENTS = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 3}
        descriptors:
          - key: event
            value: click
            rate_limit: {unit: day, requests_per_unit: 1}
          - key: event
            value: view
            rate_limit: {unit: day, requests_per_unit: 2}
      - key: campaign
        descriptors:
          - key: event
            value: click
            rate_limit: {unit: day, requests_per_unit: 2}
"""


@dataclass
class Sidecar:
    """The API and Envoy's path over one backend, on one clock."""

    caps: FrequencyCaps
    limiter: Limiter

    async def record(self, *impressions: Impression) -> list[Recorded]:
        return await self.caps.record("ads", impressions)

    async def check(self, user: str, *ads: Candidate, event: str = "impression") -> list[Verdict]:
        return await self.caps.check("ads", user, ads, event)


@pytest.fixture
async def make_sidecar(backend_url: str, clock: Clock) -> AsyncIterator[Callable[[str], Sidecar]]:
    """Sidecars with the given rules on the backend under test."""
    opened: list[Backend] = []

    def make(rules: str) -> Sidecar:
        domain = config.parse(rules, "rules.yaml")
        loaded = Rules({domain.name: domain})
        backend = open_backend(backend_url, timeout_ms=2_000)
        opened.append(backend)
        return Sidecar(
            FrequencyCaps(loaded, backend, clock=clock), Limiter(loaded, backend, clock=clock)
        )

    yield make
    for backend in opened:
        await backend.close()


# --- Event types -------------------------------------------------------------------------------


async def test_each_event_counts_on_its_own_caps(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """Two impressions and a click of one ad: the impression cap (3 a day) has 1 left, the click
    cap (1 a day) refuses a second click, the view cap is untouched; the campaign's click cap
    counts the click too, and Envoy's ShouldRateLimit on (user, ad, event) shares the counter."""
    sidecar = make_sidecar(EVENTS)
    reset = DAY - int(clock.now) % DAY
    recorded = await sidecar.record(
        Impression("i1", "u1", "a1", "c1"),
        Impression("i2", "u1", "a1", "c1"),
        Impression("k1", "u1", "a1", "c1", event="click"),
    )
    assert [r.counted for r in recorded] == [True] * 3

    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, reset)]
    assert await sidecar.check("u1", Candidate("a1"), event="click") == [
        Verdict("a1", False, 0, reset)
    ]
    assert await sidecar.check("u1", Candidate("a1"), event="view") == [
        Verdict("a1", True, 2, reset)
    ]
    # Another ad of the campaign: its own click cap is fresh, the campaign's has 1 of 2 left.
    assert await sidecar.check("u1", Candidate("a2", "c1"), event="click") == [
        Verdict("a2", True, 1, reset)
    ]
    envoy = Request(
        "ads",
        (Descriptor((Entry("user", "u1"), Entry("ad", "a1"), Entry("event", "click")), 0),),
    )
    assert (await should_rate_limit(sidecar.limiter, envoy)).overall_code is Code.OVER_LIMIT


async def test_an_event_a_descriptor_does_not_cap_is_unlimited_there(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """Views of a campaign that caps clicks only: the ad's view cap counts them, the campaign
    limits nothing; an ad with no rule for views at all (`premium` caps impressions only) is
    unlimited for them."""
    sidecar = make_sidecar(
        EVENTS.replace(
            "      - key: campaign\n",
            "      - key: ad\n        value: premium\n"
            "        rate_limit: {unit: day, requests_per_unit: 1}\n      - key: campaign\n",
        )
    )
    await sidecar.record(
        Impression("v1", "u1", "a1", "c1", event="view"),
        Impression("v2", "u1", "premium", "c1", event="view"),
    )
    assert await sidecar.check(
        "u1", Candidate("a1", "c1"), Candidate("premium", "c1"), event="view"
    ) == [
        Verdict("a1", True, 1, DAY - int(clock.now) % DAY),
        Verdict("premium", True, UNLIMITED_REMAINING, 0),
    ]


async def test_ids_count_once_per_event(make_sidecar: Callable[[str], Sidecar]) -> None:
    """An impression and a click may share the ad server's id and both count; a click
    recorded again (alone or twice in a batch) is a duplicate and changes nothing."""
    sidecar = make_sidecar(EVENTS)
    first = await sidecar.record(
        Impression("auction-7", "u1", "a1"),
        Impression("auction-7", "u1", "a1", event="click"),
        Impression("auction-7", "u1", "a1", event="click"),
    )
    again = await sidecar.record(Impression("auction-7", "u1", "a1", event="click"))
    assert [r.counted for r in first + again] == [True, True, False, False]
    impressions, clicks, views = [
        (await sidecar.check("u1", Candidate("a1"), event=event))[0].remaining
        for event in ("impression", "click", "view")
    ]
    assert (impressions, clicks, views) == (2, 0, 2)


async def test_an_event_the_rules_do_not_declare_is_refused_and_counts_nothing(
    make_sidecar: Callable[[str], Sidecar],
) -> None:
    """A record naming an undeclared event refuses its whole batch, naming the field; a check
    for one is refused too."""
    sidecar = make_sidecar(EVENTS)
    with pytest.raises(
        InvalidRequest,
        match=r"^impressions\[1\].event: event 'like' is not declared by the rules of domain "
        r"'ads' \(declare it with 'key: event' below 'key: ad', or send 'impression'\)$",
    ):
        await sidecar.record(
            Impression("i1", "u1", "a1", event="click"), Impression("i2", "u1", "a1", event="like")
        )
    with pytest.raises(InvalidRequest, match=r"^event: event 'like' is not declared"):
        await sidecar.check("u1", Candidate("a1"), event="like")
    with pytest.raises(InvalidRequest, match=r"^impressions\[0\].event must be a non-empty"):
        await sidecar.record(Impression("i3", "u1", "a1", event=""))
    assert (await sidecar.check("u1", Candidate("a1"), event="click"))[0].remaining == 1
    assert (await sidecar.record(Impression("i1", "u1", "a1", event="click")))[0].counted


# --- Cooldowns ---------------------------------------------------------------------------------

COOLDOWNS = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limits:
          - {unit: day, requests_per_unit: 5}
          - {algorithm: cooldown, unit: minute, unit_multiplier: 10}
      - key: campaign
        rate_limit: {algorithm: cooldown, unit: minute, unit_multiplier: 30}
"""


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "own keys"])
async def test_the_second_impression_inside_a_cooldown_is_refused_until_it_has_run(
    make_sidecar: Callable[[str], Sidecar], clock: Clock, grouped: bool
) -> None:
    """10 minutes between two impressions of an ad: one allowed (remaining 1: the cooldown
    admits one), refused 4 minutes after it with 360 s to go, allowed again at 10 minutes
    while the daily cap goes on counting; the same check judges both."""
    rules = COOLDOWNS if grouped else COOLDOWNS.replace("    group_counters: true\n", "")
    sidecar = make_sidecar(rules)
    start = clock.now
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, 600)]
    await sidecar.record(Impression("i1", "u1", "a1"))

    clock.now = start + 240
    assert await sidecar.check("u1", Candidate("a1"), Candidate("a2")) == [
        Verdict("a1", False, 0, 360),
        Verdict("a2", True, 1, 600),
    ]
    clock.now = start + 599.5
    assert (await sidecar.check("u1", Candidate("a1")))[0] == Verdict("a1", False, 0, 1)
    clock.now = start + 600
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, 600)]
    await sidecar.record(Impression("i2", "u1", "a1"))
    day = Request("ads", (Descriptor((Entry("user", "u1"), Entry("ad", "a1")), 0),))
    decision = await should_rate_limit(sidecar.limiter, day)
    assert decision.overall_code is Code.OVER_LIMIT  # Envoy's path sees the cooldown too


async def test_an_impression_recorded_inside_a_cooldown_restarts_it(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """Impressions are facts: one served inside the cooldown (a race between two auctions)
    counts, and the cooldown runs from it, the latest; its id recorded again changes nothing."""
    sidecar = make_sidecar(COOLDOWNS)
    start = clock.now
    await sidecar.record(Impression("i1", "u1", "a1"))
    clock.now = start + 300
    assert [r.counted for r in await sidecar.record(Impression("i2", "u1", "a1"))] == [True]
    clock.now = start + 420
    assert [r.counted for r in await sidecar.record(Impression("i2", "u1", "a1"))] == [False]
    clock.now = start + 700
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", False, 0, 200)]
    clock.now = start + 900
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, 600)]


async def test_a_campaign_cooldown_refuses_its_other_ads(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """A campaign's 30-minute cooldown: after one impression of the campaign, another of its
    ads is refused with the campaign's time to go, an ad of no campaign is not."""
    sidecar = make_sidecar(COOLDOWNS)
    start = clock.now
    await sidecar.record(Impression("i1", "u1", "a1", "c1"))
    clock.now = start + 1_000
    assert await sidecar.check("u1", Candidate("a2", "c1"), Candidate("a2")) == [
        Verdict("a2", False, 0, 800),
        Verdict("a2", True, 1, 600),
    ]


# --- Windows from the first event, lifetime caps -------------------------------------------------

ANCHORED = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {algorithm: first_event, unit: hour, unit_multiplier: 24, requests_per_unit: 2}
      - key: ad
        value: onboarding
        rate_limit: {algorithm: lifetime, requests_per_unit: 3, ends: ENDS}
      - key: ad
        value: trial
        rate_limit: {algorithm: lifetime, requests_per_unit: 1, unit: day, unit_multiplier: 90}
"""


def anchored_rules(ends: float) -> str:
    return ANCHORED.replace("ENDS", str(int(ends)))


async def test_a_window_from_the_first_event_resets_24_hours_after_it(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """2 per 24 hours from the first impression: before any, the window would be 24 h; the
    first impression at 17:00 opens it, a second at 23:00 fills it, and it refuses until 17:00
    the next day, whatever the clock's midnight; then the next impression opens a new one."""
    sidecar = make_sidecar(anchored_rules(clock.now + 400 * DAY))
    start = clock.now
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 2, DAY)]
    await sidecar.record(Impression("i1", "u1", "a1"))
    clock.now = start + 6 * 3600
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, 18 * 3600)]
    await sidecar.record(Impression("i2", "u1", "a1"), Impression("i2", "u1", "a1"))
    clock.now = start + DAY - 1
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", False, 0, 1)]
    clock.now = start + DAY
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 2, DAY)]
    await sidecar.record(Impression("i3", "u1", "a1"))
    clock.now = start + DAY + 60
    assert await sidecar.check("u1", Candidate("a1")) == [Verdict("a1", True, 1, DAY - 60)]


async def test_a_lifetime_cap_counts_until_its_flight_ends(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """3 impressions of the onboarding ad, ever, for a flight ending in 10 days: the third is
    the last allowed, the cap refuses for the rest of the flight (reset: the flight's end);
    past its end the state is gone and the cap limits nothing."""
    ends = clock.now + 10 * DAY
    sidecar = make_sidecar(anchored_rules(ends))
    flight = int(ends - clock.now)
    await sidecar.record(*[Impression(f"i{n}", "u1", "onboarding") for n in range(3)])
    assert await sidecar.check("u1", Candidate("onboarding")) == [
        Verdict("onboarding", False, 0, flight)
    ]
    clock.now += 9 * DAY
    assert (await sidecar.check("u1", Candidate("onboarding")))[0].allowed is False
    clock.now = ends
    assert await sidecar.check("u1", Candidate("onboarding")) == [Verdict("onboarding", True, 3, 0)]
    await sidecar.record(Impression("late", "u1", "onboarding"))
    assert await sidecar.check("u1", Candidate("onboarding")) == [Verdict("onboarding", True, 3, 0)]


async def test_a_lifetime_cap_with_a_ttl_ends_that_long_after_the_first_impression(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """1 impression of the trial ad per 90 days from the first: refused for 90 days, then
    forgotten."""
    sidecar = make_sidecar(anchored_rules(clock.now + 400 * DAY))
    start = clock.now
    await sidecar.record(Impression("t1", "u2", "trial"))
    clock.now = start + 89 * DAY
    assert await sidecar.check("u2", Candidate("trial")) == [Verdict("trial", False, 0, DAY)]
    clock.now = start + 90 * DAY
    assert await sidecar.check("u2", Candidate("trial")) == [Verdict("trial", True, 1, 90 * DAY)]


# --- Identities: caps counted across a person's identifiers --------------------------------------

PERSONS = """
domain: ads
descriptors:
  - key: user
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: device
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 4}
  - key: person
    identifiers: [user, device, cookie]
    group_counters: true
    descriptors:
      - key: ad
        rate_limit: {unit: day, requests_per_unit: 3}
        descriptors:
          - key: event
            value: click
            rate_limit: {unit: day, requests_per_unit: 1}
      - key: campaign
        rate_limit: {unit: day, requests_per_unit: 6}
"""

#: One person as the ad server knows them: a login, a phone, a browser cookie.
P = (("user", "u1"), ("device", "d1"), ("cookie", "c1"))
#: Another person.
Q = (("user", "u2"), ("device", "d2"), ("cookie", "c2"))


def seen(id_: str, ad: str, *identities: tuple[str, str], event: str = "impression") -> Impression:
    """An impression named by `identities` alone (no `user` field)."""
    return Impression(id_, "", ad, event=event, identities=identities)


async def check_as(
    sidecar: Sidecar, identities: tuple[tuple[str, str], ...], *ads: Candidate, event: str = ""
) -> list[Verdict]:
    return await sidecar.caps.check("ads", "", ads, event or "impression", identities)


class ReadCounter:
    """A backend that counts its reads (a check is one read: one round trip per hash slot);
    a wrapper, since a compiled backend cannot be patched."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.reads = 0

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        self.backend.apply(hits, all_or_nothing, now_ms, done)

    async def read(self, addresses: Sequence[Address], now_ms: int) -> list[State | None]:
        self.reads += 1
        return await self.backend.read(addresses, now_ms)

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        return await self.backend.record(batches, now_ms)

    async def ping(self) -> bool:
        return await self.backend.ping()

    async def close(self) -> None:
        await self.backend.close()


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "own keys"])
async def test_impressions_under_two_identifiers_of_a_person_count_against_their_cap(
    make_sidecar: Callable[[str], Sidecar], clock: Clock, grouped: bool
) -> None:
    """3 a day per person: an impression seen as P's cookie and one as P's phone leave P 1,
    and a check naming all of P's identifiers answers it in one read; Q, who shares nothing
    with P, still has 3; a third impression under P's login fills the cap."""
    rules = PERSONS if grouped else PERSONS.replace("    group_counters: true\n", "")
    sidecar = make_sidecar(rules)
    reads = ReadCounter(sidecar.caps.backend)
    sidecar.caps.backend = reads
    reset = DAY - int(clock.now) % DAY
    await sidecar.record(seen("i1", "a1", ("cookie", "c1")), seen("i2", "a1", ("device", "d1")))

    assert await check_as(sidecar, P, Candidate("a1")) == [Verdict("a1", True, 1, reset)]
    assert reads.reads == 1
    assert await check_as(sidecar, Q, Candidate("a1")) == [Verdict("a1", True, 3, reset)]
    # The phone's own cap (4 a day) counted its one impression: 3 left, the person has 1.
    assert await check_as(sidecar, (("device", "d1"),), Candidate("a1")) == [
        Verdict("a1", True, 2, reset)
    ]

    await sidecar.record(Impression("i3", "u1", "a1", identities=(("cookie", "c1"),)))
    assert await check_as(sidecar, P, Candidate("a1"), Candidate("a2")) == [
        Verdict("a1", False, 0, reset),
        Verdict("a2", True, 3, reset),
    ]
    assert (await check_as(sidecar, Q, Candidate("a1")))[0].allowed is True


async def test_identifiers_linked_later_merge_their_counts(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """Two impressions seen as a cookie and as a phone not yet known to be one person: each
    alone counts 1; once a login links them, a check naming all three sums both, with no
    write on linking; a check naming one of them sees only its own again."""
    sidecar = make_sidecar(PERSONS)
    reset = DAY - int(clock.now) % DAY
    await sidecar.record(seen("i1", "a1", ("cookie", "c9")), seen("i2", "a1", ("device", "d9")))
    for alone in (("cookie", "c9"), ("device", "d9")):
        assert (await check_as(sidecar, (alone,), Candidate("a1")))[0].remaining == 2
    linked = (("user", "u9"), ("device", "d9"), ("cookie", "c9"))
    assert await check_as(sidecar, linked, Candidate("a1")) == [Verdict("a1", True, 1, reset)]
    assert (await check_as(sidecar, (("cookie", "c9"),), Candidate("a1")))[0].remaining == 2


async def test_a_record_across_identifiers_counts_each_part_once(
    make_sidecar: Callable[[str], Sidecar],
) -> None:
    """Recorded again, an impression is a duplicate; recorded first under the login alone and
    then under the login and the phone (a retry that learned more), only the phone's part is
    new: the person's cap counts it once, the phone's own cap once."""
    sidecar = make_sidecar(PERSONS)
    both = (("user", "u1"), ("device", "d1"))
    first = await sidecar.record(Impression("i1", "u1", "a1"))
    retry = await sidecar.record(Impression("i1", "", "a1", identities=both))
    again = await sidecar.record(Impression("i1", "", "a1", identities=both))
    assert [r.counted for r in first + retry + again] == [True, True, False]
    assert (await check_as(sidecar, P, Candidate("a1")))[0].remaining == 2
    assert (await check_as(sidecar, (("device", "d1"),), Candidate("a1")))[0].remaining == 3


async def test_events_count_across_a_persons_identifiers(
    make_sidecar: Callable[[str], Sidecar], clock: Clock
) -> None:
    """One click a day per person: a click on the phone refuses clicks for the person, named
    by all identifiers, while impressions are untouched; the campaign cap counts across too."""
    sidecar = make_sidecar(PERSONS)
    reset = DAY - int(clock.now) % DAY
    await sidecar.record(seen("k1", "a1", ("device", "d1"), event="click"))
    assert await check_as(sidecar, P, Candidate("a1"), event="click") == [
        Verdict("a1", False, 0, reset)
    ]
    assert (await check_as(sidecar, P, Candidate("a1")))[0].remaining == 3
    await sidecar.record(
        *[Impression(f"c{n}", "", f"b{n}", "camp", identities=(P[n % 3],)) for n in range(6)]
    )
    assert await check_as(sidecar, P, Candidate("b9", "camp")) == [Verdict("b9", False, 0, reset)]
    assert (await check_as(sidecar, Q, Candidate("b9", "camp")))[0].allowed is True


@pytest.mark.parametrize(
    ("identities", "message"),
    [
        (
            (("email", "x@y"),),
            r"^impressions\[1\]\.identities\.email: unknown identifier kind 'email' \(the rules "
            r"declare: cookie, device, user\)$",
        ),
        (
            (("cookie", ""),),
            r"^impressions\[1\]\.identities\.cookie must be a non-empty string$",
        ),
        (
            (("cookie", "c" * 8_193),),
            r"^impressions\[1\]\.identities\.cookie is too long",
        ),
        (
            tuple((f"k{n}", "v") for n in range(9)),
            r"^impressions\[1\]\.identities: too many identifiers: 10 \(at most 8\)$",
        ),
        (
            (("user", "u1"),),
            r"^impressions\[1\]\.identities\.user: identifier kind 'user' named twice$",
        ),
    ],
)
async def test_bad_identifiers_are_refused_and_count_nothing(
    make_sidecar: Callable[[str], Sidecar],
    identities: tuple[tuple[str, str], ...],
    message: str,
) -> None:
    """An unknown identifier kind, an empty or overlong value, too many identifiers or one
    named twice refuse the whole record, naming the field; a check is refused alike."""
    sidecar = make_sidecar(PERSONS)
    with pytest.raises(InvalidRequest, match=message):
        await sidecar.record(
            Impression("i1", "u1", "a1"), Impression("i2", "u1", "a1", identities=identities)
        )
    with pytest.raises(InvalidRequest, match=message.replace(r"impressions\[1\]\.", "")):
        await sidecar.caps.check("ads", "u1", [Candidate("a1")], "impression", identities)
    assert (await check_as(sidecar, P, Candidate("a1")))[0].remaining == 3
