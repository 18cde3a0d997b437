"""Prepared requests (`sidecar.decision.plan`) and the packed script call: the work done once per request
body must give exactly the answers of doing it on every call."""

from __future__ import annotations

import hiredis
from envoy.service.ratelimit.v3.rls_pb2 import (  # type: ignore[import-untyped]
    RateLimitRequest,
    RateLimitResponse,
)
from support.callbacks import service_call
from support.clock import Clock

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.decision.plan import prepare
from sidecar.model import Algorithm, Code, Descriptor, Entry, Hit, Request, Role, Unit, Window
from sidecar.rls.service import SEEN_BODIES, RateLimitService
from sidecar.storage.memory import MemoryBackend
from sidecar.storage.scripts import apply_command, counts, packed_command

RULES = """
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: app
    rate_limits:
      - {unit: second, requests_per_unit: 100}
      - {unit: day, requests_per_unit: 1000, calendar: true, timezone: Asia/Shanghai}
  - key: bucket
    rate_limit: {algorithm: token_bucket, unit: second, requests_per_unit: 5}
"""


def _rules(text: str = RULES) -> Rules:
    rules = Rules()
    domain = config.parse(text, "rules.yaml")
    rules.domains[domain.name] = domain
    return rules


def _plan(key: str) -> tuple[Rules, Request]:
    return _rules(), Request("d", (Descriptor((Entry(key, "v"),)),))


def test_plain_epoch_hits_are_kept_for_their_whole_window() -> None:
    """A plain epoch window's hits are the same objects for every call of the window, and new
    ones name the next window's counter."""
    rules, request = _plan("user")
    windows = prepare(rules, request).counted[0].windows
    first = windows.at(120_000)
    assert windows.at(150_500) is first
    assert windows.at(179_999) is first
    following = windows.at(180_000)
    assert following is not first
    assert following[0].key.endswith(b"|60|180")
    assert (following[0].start_ms, following[0].end_ms) == (180_000, 240_000)


def test_hits_whose_ttl_counts_down_are_rebuilt_every_second() -> None:
    """A calendar window's ttl runs to its end, so its hits hold for one second only."""
    rules, request = _plan("app")
    windows = prepare(rules, request).counted[0].windows
    first = windows.at(1_800_000_000_100)
    assert windows.at(1_800_000_000_999) is first
    later = windows.at(1_800_000_001_000)
    assert later is not first
    assert later[1].ttl == first[1].ttl - 1


def test_a_token_buckets_hits_never_change() -> None:
    """A token bucket has no window: its hit is built once."""
    rules, request = _plan("bucket")
    windows = prepare(rules, request).counted[0].windows
    assert windows.at(1_000) is windows.at(9_000_000_000)


def test_a_clock_that_goes_back_gets_the_earlier_windows_hits() -> None:
    """Hits are rebuilt when the time falls before the window they were made for."""
    rules, request = _plan("user")
    windows = prepare(rules, request).counted[0].windows
    windows.at(180_000)
    assert windows.at(179_000)[0].key.endswith(b"|60|120")


async def test_a_reload_makes_cached_plans_stale() -> None:
    """A body seen under the old rules is matched again under the new ones."""
    limiter = Limiter(_rules(), MemoryBackend(), clock=Clock(1_000.0))
    service = RateLimitService(limiter)
    message = RateLimitRequest(domain="d")
    entry = message.descriptors.add().entries.add()
    entry.key, entry.value = "user", "u"
    body = message.SerializeToString()
    before = RateLimitResponse.FromString(await service_call(service, body))
    assert before.statuses[0].current_limit.requests_per_unit == 2
    limiter.rules = _rules(RULES.replace("requests_per_unit: 2}", "requests_per_unit: 7}"))
    after = RateLimitResponse.FromString(await service_call(service, body))
    assert after.statuses[0].current_limit.requests_per_unit == 7
    assert after.overall_code == Code.OK


def _body(user: str) -> bytes:
    message = RateLimitRequest(domain="d")
    entry = message.descriptors.add().entries.add()
    entry.key, entry.value = "user", user
    body: bytes = message.SerializeToString()
    return body


def test_a_body_is_kept_on_its_second_sighting() -> None:
    """A body seen once leaves no plan behind; seen again, its plan is kept, and every later
    call with the same bytes reuses it."""
    service = RateLimitService(Limiter(_rules(), MemoryBackend(), clock=Clock(1_000.0)))
    body = _body("u")
    first, second, third = (service._plan(body) for _ in range(3))
    assert first is not second
    assert third is second
    assert service._plan(_body("u")) is second  # the same bytes in another object


def test_bodies_seen_once_keep_no_plan() -> None:
    """Distinct bodies (a user each, as most of a gateway's traffic) keep no plan in the cache,
    and the hashes that remember them stay within their bound."""
    service = RateLimitService(Limiter(_rules(), MemoryBackend(), clock=Clock(1_000.0)))
    for number in range(SEEN_BODIES + 10):
        service._plan(_body(f"user-{number}"))
    assert not service._plans
    assert len(service._seen) <= SEEN_BODIES


def test_a_body_not_in_the_usual_encoding_is_planned_as_protobuf_reads_it() -> None:
    """A body the direct reading leaves to protobuf (here, an unknown field after the usual
    ones) is planned from protobuf's reading: the same descriptors, the same plan."""
    service = RateLimitService(Limiter(_rules(), MemoryBackend(), clock=Clock(1_000.0)))
    usual = service._plan(_body("u")).request
    unusual = service._plan(_body("u") + b"\x22\x00").request
    assert unusual == usual


def test_packed_script_call_is_hiredis_packing_of_the_arguments() -> None:
    """The packer's bytes are exactly what hiredis packs for `apply_command`, whatever the hits hold
    (every algorithm, grouped fields, non-ASCII bytes, a role), for either script, in both
    modes and repeatedly."""
    hits = [
        Hit(
            b"rl{d|u|\xc3\xa9}|60|0", 3, Window(5, Unit.MINUTE), 0, Role.QUOTA, b"k", 60, 0, 60_000
        ),
        Hit(b"b", 1, Window(5, Unit.SECOND, Algorithm.TOKEN_BUCKET, burst=7, borrow=2), 1),
        Hit(
            b"h",
            0,
            Window(9, Unit.HOUR, Algorithm.SLIDING_WINDOW),
            2,
            Role.SHADOW,
            b"p",
            7,
            1_000,
            3_601_000,
            b"f|x",
            b"f|y",
        ),
        Hit(b"w", 2, Window(9, Unit.DAY, borrow=4), 3, Role.BLOCKING, b"w0", 172_801, 5, 9),
    ]
    # Hits that only add to plain windows' own counters: count.lua's call in mode 0.
    adding = [
        Hit(b"rl{d|u|\xc3\xa9}|60|0", 3, Window(5, Unit.MINUTE), 0, Role.QUOTA, ttl=60),
        Hit(b"x" * 300, 1, Window(0, Unit.DAY, calendar=True), 1, ttl=86_400),
        Hit(b"rl{d|u|\xc3\xa9}|60|0", 2, Window(5, Unit.MINUTE), 2, ttl=60),
    ]
    assert counts(adding, 0) and not counts(adding, 1) and not counts(hits, 0)
    for request in (hits, adding):
        for mode in (0, 1, 0):
            for now_ms in (0, 1_800_000_000_123):
                expected = hiredis.pack_command(tuple(apply_command(request, mode, now_ms)))
                assert packed_command(request, mode, now_ms) == expected
                for hit in request:  # a call on one hit, kept whole (but for decide's mode, time)
                    expected = hiredis.pack_command(tuple(apply_command([hit], mode, now_ms)))
                    assert packed_command([hit], mode, now_ms) == expected


def test_an_overrides_stats_key_names_an_empty_value_by_its_key_alone() -> None:
    """A `limit` override is named by every entry, `key_value`, or the key alone when the
    value is empty, as the reference names it (`domain.k1_v1.k2`)."""
    from sidecar.model import Override

    rules = _rules()
    descriptor = Descriptor((Entry("k1", "v1"), Entry("k2", "")), None, Override(5, Unit.MINUTE))
    plan = prepare(rules, Request(next(iter(rules.domains)), (descriptor,)))
    (counted,) = plan.counted
    assert counted.match.metric_key == f"{next(iter(rules.domains))}.k1_v1.k2"
