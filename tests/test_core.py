"""Unit tests of the pure core: counter keys, fixed windows, stats accounting, the memory backend
and the limiter's validation and failure modes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.callbacks import apply, should_rate_limit

from sidecar.algorithms import fixed_window, windows
from sidecar.core import config, counters
from sidecar.core.keys import descriptor_prefix, fixed_window_key, hash_tag
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter, Settings
from sidecar.decision.stats import RuleStats
from sidecar.errors import InvalidRequest, StorageError
from sidecar.model import (
    Algorithm,
    Code,
    Descriptor,
    Entry,
    Hit,
    Outcome,
    Request,
    Role,
    Unit,
    Window,
)
from sidecar.storage.backends import open_backend
from sidecar.storage.base import Applied
from sidecar.storage.memory import MemoryBackend

parts_strategy = st.lists(
    st.tuples(st.text(max_size=6), st.text(max_size=6)), min_size=1, max_size=3
)


@given(st.text(max_size=5), parts_strategy, st.text(max_size=5), parts_strategy)
def test_counter_keys_never_collide(
    domain_a: str, parts_a: list[tuple[str, str]], domain_b: str, parts_b: list[tuple[str, str]]
) -> None:
    """Different (domain, entries) always give different keys, whatever characters values hold."""
    key_a = fixed_window_key(descriptor_prefix(domain_a, parts_a), 60, 120)
    key_b = fixed_window_key(descriptor_prefix(domain_b, parts_b), 60, 120)
    assert (key_a == key_b) == ((domain_a, parts_a) == (domain_b, parts_b))


@given(st.text(max_size=5), parts_strategy, parts_strategy)
def test_hash_tag_is_domain_and_first_entry(
    domain: str, parts: list[tuple[str, str]], tail: list[tuple[str, str]]
) -> None:
    """Counters sharing a domain and first entry share a hash tag (one cluster slot), even when
    values contain braces."""
    one = fixed_window_key(descriptor_prefix(domain, parts[:1]), 1, 0)
    more = fixed_window_key(descriptor_prefix(domain, parts[:1] + tail), 3600, 7200)
    assert hash_tag(one) == hash_tag(more)


def test_key_reads_well() -> None:
    """The key layout is documented: tag on domain and first entry, window length and start last."""
    key = fixed_window_key(descriptor_prefix("d", [("a", "x}|y"), ("b", "2")]), 60, 1200)
    assert key == b"rl{d|a|x%7D%7Cy}|b|2|60|1200"


def test_windows_align_to_the_epoch() -> None:
    """A window starts at floor(now / W) * W, and resets W - now % W seconds later."""
    assert windows.epoch_window(1234, 60) == (1200, 1260)
    assert windows.epoch_window(1_000_000, 3600) == (997_200, 1_000_800)
    hit = counters.window_hit("p", Window(5, Unit.MINUTE), 1, 0, Role.BLOCKING, 1_234_900)
    assert (hit.key, hit.end_ms - 1_234_900, hit.ttl) == (b"p|60|1200", 25_100, 61)
    assert (hit.start_ms, hit.end_ms) == (1_200_000, 1_260_000)


@pytest.mark.parametrize(
    "window", [Window(5, Unit.SECOND), Window(5, Unit.MINUTE), Window(5, Unit.DAY, calendar=True)]
)
@pytest.mark.parametrize("into", [0.0, 0.5, 0.999])
def test_a_plain_counter_outlives_its_window_by_a_second(window: Window, into: float) -> None:
    """A plain window's counter, created by a hit at any time in its window, lives at least one
    second past the window's end: a call that reaches the store late (queued, or from a sidecar
    whose clock runs behind) still finds the window's count instead of starting it afresh."""
    start_ms = 1_700_006_400_000  # a UTC midnight, so the start of every window above
    now_ms = start_ms + int(window.seconds * 1000 * into)  # `into` the window: start to end
    hit = counters.window_hit("p", window, 1, 0, Role.BLOCKING, now_ms)
    expires_ms = now_ms // 1000 * 1000 + hit.ttl * 1000
    assert hit.start_ms == start_ms
    assert expires_ms >= hit.end_ms + 1_000


@pytest.mark.parametrize(
    ("used", "hits", "limit", "over"),
    [
        (0, 1, 1, False),
        (1, 1, 1, True),
        (0, 3, 2, True),
        (1, 0, 2, False),
        (2, 0, 2, True),
        (0, 0, 0, True),
    ],
)
def test_fixed_window_judge(used: int, hits: int, limit: int, over: bool) -> None:
    """A hit is over when it would pass the limit; a check is over once the limit is reached."""
    assert fixed_window.judge(0, used, hits, limit, 0)[0] is over


def test_request_is_over_follows_roles() -> None:
    """Blocking counters block alone; quota counters only all together; shadow never."""
    B, S, Q = Role.BLOCKING, Role.SHADOW, Role.QUOTA
    assert fixed_window.request_is_over([True, False], [B, B])
    assert not fixed_window.request_is_over([True], [S])
    assert not fixed_window.request_is_over([True, False], [Q, Q])
    assert fixed_window.request_is_over([True, True], [Q, Q])
    assert not fixed_window.request_is_over([False, True], [B, S])


async def test_a_key_repeated_in_one_request_sees_its_earlier_hits() -> None:
    """A counter repeated in one request: the second hit sees the first as added."""
    window = Window(3, Unit.MINUTE)
    hits = [Hit(b"k", 2, window, group=0), Hit(b"k", 2, window, group=1)]
    outcomes = await apply(MemoryBackend(), hits, all_or_nothing=False, now_ms=0)
    assert [(o.over, o.remaining, o.applied) for o in outcomes] == [
        (False, 1, True),
        (True, 0, True),
    ]
    outcomes = await apply(MemoryBackend(), hits, all_or_nothing=True, now_ms=0)
    assert [(o.over, o.applied) for o in outcomes] == [(False, False), (True, False)]


# (limit, before, hits, after, over, over_limit, near_limit, within_limit): the reference's vectors.
NEAR_LIMIT_VECTORS = [
    (15, 10, 1, False, 0, 0, 1),
    (15, 12, 1, False, 0, 1, 1),
    (15, 15, 1, True, 1, 0, 0),
    (20, 2, 3, False, 0, 0, 3),
    (8, 5, 2, False, 0, 1, 2),
    (20, 16, 3, False, 0, 3, 3),
    (20, 19, 3, True, 2, 1, 0),
    (20, 15, 7, True, 2, 4, 0),
    (10, 27, 3, True, 3, 0, 0),
]


@pytest.mark.parametrize(("limit", "before", "hits", "over", "o", "n", "w"), NEAR_LIMIT_VECTORS)
def test_stats_accounting_matches_the_reference(
    limit: int, before: int, hits: int, over: bool, o: int, n: int, w: int
) -> None:
    """over_limit / near_limit / within_limit split hits exactly as the reference does."""
    stats = RuleStats()
    stats.record(limit, before, hits, over, shadow=False)
    assert (stats.total_hits, stats.over_limit, stats.near_limit, stats.within_limit) == (
        hits,
        o,
        n,
        w,
    )


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_memory_backend_evicts_expired_windows() -> None:
    """Counters of ended windows are dropped, so memory stays bounded by live windows."""
    backend = MemoryBackend()
    window = Window(5, Unit.MINUTE)
    for i in range(1000):
        await apply(backend, [Hit(f"k{i}".encode(), 1, window, ttl=60)], False, 1_000_000)
    assert len(backend) == 1000
    await apply(backend, [Hit(b"fresh", 1, window, ttl=60)], False, 1_061_000)
    assert len(backend) == 1


async def test_memory_token_bucket_state_expires_when_full() -> None:
    """A bucket's state lives until the bucket would be full again, then it is evicted."""
    backend = MemoryBackend()
    window = Window(10, Unit.SECOND, algorithm=Algorithm.TOKEN_BUCKET)
    await apply(backend, [Hit(b"b", 5, window)], False, 0)
    assert len(backend) == 1
    await apply(backend, [Hit(b"other", 0, window)], False, 499)
    assert len(backend) == 1
    await apply(backend, [Hit(b"other", 0, window)], False, 500)
    assert len(backend) == 0


async def test_memory_check_creates_nothing() -> None:
    """A check (0 hits) on an absent counter leaves no counter behind."""
    backend = MemoryBackend()
    outcomes = await apply(backend, [Hit(b"k", 0, Window(5, Unit.MINUTE))], False, 0)
    assert outcomes == [Outcome(False, 5, 0, True, 5)]
    assert len(backend) == 0


RULES = Rules(
    {
        "d": config.parse(
            """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: s
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
""",
            "d.yaml",
        )
    }
)


class FailingBackend:
    """A store that is down: every call fails as a real backend's timeout would."""

    name = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        self.calls += 1
        done(StorageError("timed out after 50 ms"))

    async def ping(self) -> bool:
        return False

    async def close(self) -> None:
        return None


def one(*pairs: tuple[str, str], hits: int | None = None) -> Descriptor:
    return Descriptor(tuple(Entry(k, v) for k, v in pairs), hits)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("", (one(("k", "v")),)), "rate limit domain must not be empty"),
        (Request("d", ()), "rate limit descriptor list must not be empty"),
        (
            Request("d", (one(("k", "v"), hits=2**64 - 1),)),
            "descriptors[0].hits_addend 18446744073709551615 exceeds 4294967295",
        ),
        (
            Request("d", (one(("k", "v" * 9000)),)),
            "descriptors[0]: entry too long (keys at most 256 characters, values at most 8192)",
        ),
        (Request("d", (one(("k", "v")),) * 129), "too many descriptors: 129 (at most 128)"),
    ],
)
async def test_invalid_requests_are_refused_and_change_nothing(
    request_: Request, message: str
) -> None:
    """Protocol violations raise InvalidRequest with a clear message and never reach the store."""
    backend = FailingBackend()
    limiter = Limiter(RULES, backend)
    with pytest.raises(InvalidRequest) as info:
        await should_rate_limit(limiter, request_)
    assert str(info.value) == message
    assert backend.calls == 0
    assert limiter.stats.service_error == 1


async def test_failure_mode_allow() -> None:
    """With the store down, failure mode allow answers OK with no limit and counts the error."""
    limiter = Limiter(RULES, FailingBackend())
    decision = await should_rate_limit(limiter, Request("d", (one(("k", "v")),)))
    assert decision.overall_code is Code.OK
    assert decision.statuses[0].limit is None
    assert limiter.stats.backend_error == 1


async def test_failure_mode_deny() -> None:
    """With the store down, failure mode deny answers OVER_LIMIT for limited descriptors, but a
    shadow rule still never denies."""
    limiter = Limiter(RULES, FailingBackend(), settings=Settings(failure_mode="deny"))
    decision = await should_rate_limit(limiter, Request("d", (one(("k", "v")), one(("x", "y")))))
    assert decision.overall_code is Code.OVER_LIMIT
    assert [s.code for s in decision.statuses] == [Code.OVER_LIMIT, Code.OK]
    shadow = await should_rate_limit(limiter, Request("d", (one(("s", "v")),)))
    assert shadow.overall_code is Code.OK


async def test_unlimited_and_unmatched_never_call_the_store() -> None:
    """Requests with no limited descriptor are answered without a backend call."""
    backend = FailingBackend()
    limiter = Limiter(RULES, backend)
    decision = await should_rate_limit(limiter, Request("d", (one(("none", "v")),)))
    assert decision.overall_code is Code.OK
    assert backend.calls == 0


async def test_the_memory_backend_keeps_at_most_max_counters_evicting_the_earliest_end() -> None:
    """With `max_counters` values held, storing one more evicts the value whose window ends
    first (an hour's window outlives a minute's), counted in `evicted`; the rest keep
    counting."""
    rules = Rules(
        {
            "d": config.parse(
                """
domain: d
descriptors:
  - key: minute
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: hour
    rate_limit: {unit: hour, requests_per_unit: 5}
""",
                "d.yaml",
            )
        }
    )
    backend = MemoryBackend(max_counters=3)
    limiter = Limiter(rules, backend, clock=lambda: 1_700_000_000.0)

    async def hit(key: str, value: str) -> int:
        decision = await should_rate_limit(limiter, Request("d", (one((key, value)),)))
        return decision.statuses[0].limit_remaining

    assert [await hit("hour", "a"), await hit("minute", "b"), await hit("hour", "c")] == [4] * 3
    assert len(backend) == 3 and backend.evicted == 0
    assert await hit("hour", "d") == 4  # the minute's counter ends first: it goes
    assert len(backend) == 3 and backend.evicted == 1
    assert await hit("hour", "a") == 3  # kept
    assert await hit("minute", "b") == 4  # evicted: it starts again


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("memory://?max_counters=0", "at least 1"),
        ("memory://?max_counters=lots", "at least 1"),
        ("memory://?size=5", "unknown query parameter 'size'"),
        ("memory://host", "no host or path"),
    ],
)
def test_a_bad_memory_url_is_refused_with_the_reason(url: str, reason: str) -> None:
    """`memory://` takes only `?max_counters=N`, a whole number of at least 1."""
    with pytest.raises(ValueError, match=reason):
        open_backend(url)
    assert open_backend("memory://?max_counters=7").max_counters == 7  # type: ignore[attr-defined]
