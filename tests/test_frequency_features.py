"""Frequency caps as ad servers run them, on every backend (memory, Redis, Redis Cluster): caps
per event type, cooldowns, windows from the first event, lifetime caps and caps counted across a
person's identifiers; exactly-once records for each, and bad input refused whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from support.callbacks import should_rate_limit
from support.clock import Clock

from sidecar import config
from sidecar.errors import InvalidRequest
from sidecar.frequency.caps import Candidate, FrequencyCaps, Impression, Recorded, Verdict
from sidecar.limiter import Limiter
from sidecar.model import UNLIMITED_REMAINING, Code, Descriptor, Entry, Request
from sidecar.rules import Rules
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend

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
