"""Leases (`sidecar.algorithms.lease`): the store's grants and one holder's lease, their rules
under any interleaving of holders, demands, renewals, deaths and returns (never past the
limit; under-admission within the stated bound; shares close to demand), and `lua/lease.lua`
agreeing with `settle` on a real Redis."""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.algorithms import lease, token_bucket
from sidecar.algorithms.lease import ADMITTED, OVER, WAIT, Lease, grant
from sidecar.storage.leases import CLOCK_MARGIN_MS, LATE_MS, SCRIPT


def test_a_block_is_the_want_or_two_thirds_of_what_is_left_down_to_single_units() -> None:
    """Two thirds of what is left (rounded up) cap a block, so the last units go one by one;
    nothing is granted once the window is spent, or to a holder that wants nothing."""
    assert grant(1000, 0, 50) == 50
    assert grant(1000, 0, 900) == 667
    assert [grant(10, taken, 100) for taken in (0, 7, 8, 9, 10, 12)] == [7, 2, 2, 1, 0, 0]
    assert grant(10, 0, 0) == 0


def test_settle_takes_the_return_off_first_and_never_goes_below_zero() -> None:
    """A holder's call gives back, then asks; `taken` never falls below 0."""
    assert lease.settle(10, 10, 4, 3) == (9, 3)
    assert lease.settle(10, 2, 5, 0) == (0, 0)


def test_a_lease_admits_what_it_holds_waits_for_more_and_refuses_once_the_window_is_spent() -> None:
    """Admitted from what is held; WAIT when nothing is held; OVER once the store said nothing is
    left, for a cost above the limit, and past the window's end; a check (cost 0) needs one unit
    held and spends nothing."""
    held = Lease(limit=10, end_ms=1000, first_want=3, now_ms=0)
    assert held.judge(1, 0) == WAIT
    assert held.due(lead_ms=100) and held.want(lease_ms=400, waiting=1) == 3
    held.asked(0)
    held.granted(3, left=7)
    assert [held.judge(1, 5) for _ in range(4)] == [ADMITTED, ADMITTED, ADMITTED, WAIT]
    assert held.judge(11, 5) == OVER
    held.asked(10)
    held.granted(2, left=0)
    assert held.judge(0, 10) == ADMITTED and held.held == 2
    assert held.judge(2, 10) == ADMITTED
    assert held.judge(0, 10) == OVER and held.judge(1, 10) == OVER
    late = Lease(limit=10, end_ms=1000, first_want=3, now_ms=0)
    assert late.judge(1, 1000) == OVER


def test_a_lease_asks_for_its_demand_over_lease_ms_and_gives_back_when_idle() -> None:
    """The rate measured between blocks sizes the next ask; a lease idle for lease_ms gives back
    what it holds."""
    held = Lease(limit=10_000, end_ms=60_000, first_want=5, now_ms=0)
    held.asked(0)
    held.granted(5, left=9_995)
    for _ in range(5):
        held.judge(1, 50)
    assert held.due(lead_ms=10)
    held.asked(100)  # 5 hits in 100 ms: 0.05 per ms
    assert held.want(lease_ms=1_000) == 50
    held.granted(50, left=9_945)
    assert not held.idle(now_ms=1_000, lease_ms=1_000)
    assert held.idle(now_ms=1_050, lease_ms=1_000)
    assert held.give_back() == 50 and held.held == 0 and held.taken == 5


@dataclass
class Holder:
    """One simulated sidecar: its lease, its demand per tick, and what it admitted."""

    lease: Lease
    demand: int
    admitted: int = 0
    asked: int = 0
    waiting: int = 0
    dead: bool = False
    largest: int = 0  # the most it held right after a block


@dataclass
class Store:
    limit: int
    taken: int = 0
    calls: int = 0
    lost: int = 0  # blocks that landed after their holder died
    in_flight: list[tuple[int, int, int, int]] = field(default_factory=list)  # (due, h, ret, want)


def simulate(
    limit: int,
    demands: list[int],
    window: int,
    lease_ms: int,
    delay: int,
    deaths: dict[int, int],
    stops: dict[int, int],
    seed: int,
) -> tuple[Store, list[Holder]]:
    """One window of `window` ticks (ms): each live holder gets `demand` hits a tick, judged on
    its lease as `sidecar.storage.leases` judges them; a renewal is answered `delay` ticks after
    it is sent; holder h dies at tick deaths[h] (what it holds is lost), and its demand stops at
    tick stops[h] (it goes idle and gives back). Returns the store and the holders."""
    order = random.Random(seed)
    store = Store(limit)
    lead = lease_ms // 4
    holders = [
        Holder(Lease(limit, window, lease.first_want(limit, window, lease_ms), 0), demand)
        for demand in demands
    ]

    def send(index: int, returned: int, want: int, now: int) -> None:
        store.calls += 1
        store.in_flight.append((now + delay, index, returned, want))

    def answer(now: int) -> None:
        landed = [call for call in store.in_flight if call[0] <= now]
        store.in_flight = [call for call in store.in_flight if call[0] > now]
        for _, index, returned, want in landed:
            store.taken, block = lease.settle(limit, store.taken, returned, want)
            holder = holders[index]
            if holder.dead:
                store.lost += block  # lost with the holder: stays taken
                continue
            holder.lease.granted(block, limit - store.taken)
            holder.largest = max(holder.largest, holder.lease.held)
            while holder.waiting:
                verdict = holder.lease.judge(1, now)
                holder.lease.wanted -= 1
                if verdict == WAIT:
                    break
                holder.waiting -= 1
                holder.admitted += verdict == ADMITTED

    for now in range(window):
        answer(now)
        live = [i for i, h in enumerate(holders) if not h.dead]
        order.shuffle(live)
        for index in live:
            holder = holders[index]
            if deaths.get(index) == now:
                holder.dead = True
                continue
            held = holder.lease
            if stops.get(index, window) > now:
                for _ in range(holder.demand):
                    holder.asked += 1
                    if holder.waiting:
                        holder.waiting += 1
                        held.wanted += 1
                        continue
                    verdict = held.judge(1, now)
                    if verdict == WAIT:
                        holder.waiting += 1
                    else:
                        holder.admitted += verdict == ADMITTED
            if holder.asked == 0:
                continue  # a sidecar leases a counter at its first hit
            if held.idle(now, lease_ms):
                held.asking = True
                send(index, held.give_back(), 0, now)
            elif held.end_ms > now and (holder.waiting or held.due(lead)) and not held.asking:
                if held.exhausted:
                    continue
                held.asked(now, lead)
                want = held.want(lease_ms, holder.waiting)
                send(index, 0, want, now)
    return store, holders


scenarios = st.fixed_dictionaries(
    {
        "limit": st.integers(1, 3_000),
        "demands": st.lists(st.integers(0, 20), min_size=1, max_size=5),
        "window": st.integers(50, 1_000),
        "lease_ms": st.integers(4, 200),
        "delay": st.integers(0, 5),
        "deaths": st.dictionaries(st.integers(0, 4), st.integers(0, 1_000), max_size=2),
        "stops": st.dictionaries(st.integers(0, 4), st.integers(0, 1_000), max_size=2),
        "seed": st.integers(0, 2**32 - 1),
    }
)


@settings(max_examples=400, deadline=None)
@given(scenarios)
def test_no_window_admits_past_its_limit_and_under_admission_stays_within_the_bound(
    scenario: dict[str, object],
) -> None:
    """Whatever the holders, demands, latencies, deaths and returns: the store never hands out
    more than the limit, nothing is admitted that was not handed out (the store's `taken` is
    exactly what holders spent and hold, what dead ones held, and returns on their way), and what the window leaves unadmitted while its
    demand went refused is at most what holders held (each at most its largest lease)."""
    store, holders = simulate(**scenario)  # type: ignore[arg-type]
    admitted = sum(h.admitted for h in holders)
    assert store.taken <= store.limit
    assert admitted <= store.limit
    assert admitted == sum(h.lease.spent for h in holders)
    assert all(h.lease.taken == h.lease.spent + h.lease.held for h in holders)
    in_flight_returns = sum(returned for _, _, returned, _ in store.in_flight)
    assert store.taken == sum(h.lease.taken for h in holders) + in_flight_returns + store.lost
    asked = sum(h.asked for h in holders)
    if asked > store.limit:
        under = store.limit - admitted
        in_flight_grants = sum(1 for *_, want in store.in_flight if want)
        lost = store.lost  # blocks that reached holders already dead
        bound = sum(h.largest for h in holders) + lost + in_flight_grants * store.limit
        assert under <= bound, (under, bound, [h.largest for h in holders])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 10), min_size=2, max_size=4),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
)
def test_busy_holders_admit_the_whole_limit_in_shares_close_to_their_demands(
    demands: list[int], delay: int, seed: int
) -> None:
    """Holders that stay busy past the limit (demand 4 times it): the window admits its
    limit exactly, and each holder's share of it is within 10 points of its share of the
    demand, in a handful of store calls per holder."""
    window = 1_000
    limit = sum(demands) * window // 4
    store, holders = simulate(limit, demands, window, 100, delay, {}, {}, seed)
    admitted = [h.admitted for h in holders]
    assert sum(admitted) == store.limit
    for holder, got in zip(holders, admitted, strict=True):
        assert abs(got / store.limit - holder.demand / sum(demands)) <= 0.10, (admitted, demands)
    assert store.calls <= 25 * len(holders), store.calls


# --- the Lua rendering ---------------------------------------------------------------------


def run_script(
    connection: redis.Redis,
    asks: list[tuple[bytes, int, int, int, int, int, int]],
    now_ms: int = 0,
    lease_ms: int = 1_000,
) -> list[int]:
    """`lease.lua` on `asks`: (key, kind, p1, p2, p3, returned, want) each."""
    args: list[object] = [CLOCK_MARGIN_MS, now_ms, lease_ms]
    for ask in asks:
        args += ask[1:]
    return list(connection.eval(SCRIPT, len(asks), *(a[0] for a in asks), *args))


# Each example writes counters of its own (a random prefix), so one emptied server serves all.
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 60)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 50),
)
def test_the_script_settles_as_settle_does(
    redis_url: str, calls: list[tuple[int, int, int]], limit: int
) -> None:
    """Random returns and asks on three counters: `lease.lua` grants what `settle` grants and
    keeps what it keeps."""
    start = int(time.time() * 1000) + 60_000  # a window starting after the server did
    prefix = f"lease-parity-{uuid.uuid4().hex}|".encode()
    taken = [0, 0, 0]
    with redis.Redis.from_url(redis_url) as connection:
        for counter, returned, want in calls:
            key = prefix + bytes([48 + counter])
            reply = run_script(
                connection,
                [(key, 0, limit, start, start + 60_000, returned, want)],
                now_ms=start - 60_000,
            )
            taken[counter], block = lease.settle(limit, taken[counter], returned, want)
            assert reply == [block, limit - taken[counter]]
            stored = connection.get(key)
            assert int(stored or 0) == taken[counter]


def test_a_restarted_server_lends_nothing_more_of_a_window_that_started_before_it(
    redis_url: str,
) -> None:
    """A counter the server does not have, of a window that started before the server did, is
    taken as spent (the server may have forgotten blocks still held); a window that started
    after it lends from zero."""
    with redis.Redis.from_url(redis_url) as connection:
        uptime_ms = int(connection.info("server")["uptime_in_seconds"]) * 1000
        now = int(time.time() * 1000)
        before = now - uptime_ms - 5 * CLOCK_MARGIN_MS
        after = now + CLOCK_MARGIN_MS
        assert run_script(
            connection,
            [
                (b"lease-restart|old", 0, 10, before, now + 60_000, 0, 4),
                (b"lease-restart|new", 0, 10, after, after + 60_000, 0, 4),
            ],
            now_ms=now,
        ) == [0, 0, 4, 6]
        assert connection.get(b"lease-restart|old") == b"10"
        connection.delete(b"lease-restart|old", b"lease-restart|new")


def test_a_renewal_that_finds_no_counter_long_after_its_window_grants_nothing(
    redis_url: str,
) -> None:
    """A window's counter lives LATE_MS past its window; a renewal that reaches the server later
    than that (queued behind others) and finds none takes the window as spent, since its counter
    may have expired with blocks still held: it grants nothing, where counting afresh would
    admit the limit twice."""
    with redis.Redis.from_url(redis_url) as connection:
        now = int(time.time() * 1000)
        start = now + CLOCK_MARGIN_MS  # after the server started: not a restart
        ends = now - LATE_MS - CLOCK_MARGIN_MS  # Redis' clock is past its end and LATE_MS
        ask = (b"lease-late", 0, 10, start, ends, 0, 4)
        assert run_script(connection, [ask], now_ms=now) == [0, 0]
        fresh = (b"lease-late", 0, 10, start, now + 60_000, 0, 4)
        assert run_script(connection, [fresh], now_ms=now) == [4, 6]
        assert 60_000 < connection.pttl(b"lease-late") <= 60_000 + LATE_MS
        connection.delete(b"lease-late")


@pytest.mark.parametrize("returned", [0, 3])
def test_a_return_to_a_counter_the_server_does_not_have_is_ignored(
    redis_url: str, returned: int
) -> None:
    """Giving back to a counter the server lost writes nothing (no negative count)."""
    with redis.Redis.from_url(redis_url) as connection:
        start = int(time.time() * 1000) + CLOCK_MARGIN_MS
        ask = (b"lease-gone", 0, 10, start, start + 60_000, returned, 0)
        assert run_script(connection, [ask], now_ms=start) == [0, 10]
        assert connection.get(b"lease-gone") is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 400), st.integers(0, 5), st.integers(0, 30)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 50),
    st.integers(1, 60),
)
def test_the_script_settles_a_token_bucket_as_settle_bucket_does(
    redis_url: str, calls: list[tuple[int, int, int]], rate: int, capacity: int
) -> None:
    """Random returns and asks on a token bucket of `rate` a second, at random moments: the
    script grants what `settle_bucket` grants, and leaves the bucket where it does (decide.lua's
    format, so exact and leased sidecars share it)."""
    key = f"lease-bucket-{uuid.uuid4().hex}".encode()
    now = int(time.time() * 1000) + 10_000  # long after the server started: nothing forgotten
    state = None
    with redis.Redis.from_url(redis_url) as connection:
        for elapsed, returned, want in calls:
            now += elapsed
            reply = run_script(
                connection, [(key, 1, rate, 1000, capacity, returned, want)], now_ms=now
            )
            after, block = lease.settle_bucket(state, now, rate, 1000, capacity, returned, want)
            if block or returned or state is None:
                state = after
            assert reply == [block, math.floor(after.tokens)]
            stored = connection.get(key)
            if stored is not None:
                tokens, stamp, _ = stored.split()
                assert (float(tokens), int(float(stamp))) == (state.tokens, state.stamp_ms)


def test_a_restarted_server_takes_a_bucket_it_forgot_as_empty_for_a_lease(redis_url: str) -> None:
    """A bucket the server does not have, asked for less than a lease after the server started,
    is empty (holders may still spend the tokens the server forgot it gave), not full."""
    with redis.Redis.from_url(redis_url) as connection:
        uptime_ms = int(connection.info("server")["uptime_in_seconds"]) * 1000
        now = int(time.time() * 1000)
        assert run_script(
            connection,
            [(b"lease-bucket-forgot", 1, 10, 1000, 10, 0, 5)],
            now_ms=now,
            lease_ms=uptime_ms + 60_000,
        ) == [0, 0]
        connection.delete(b"lease-bucket-forgot")
        later = now + 10_000  # a lease and the margin after the server started: full
        assert run_script(
            connection, [(b"lease-bucket-forgot", 1, 10, 1000, 10, 0, 5)], now_ms=later
        ) == [5, 5]
        connection.delete(b"lease-bucket-forgot")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2_000), st.integers(0, 100), st.integers(0, 1)),
        max_size=60,
    ),
    st.integers(1, 100),
    st.integers(1, 200),
)
def test_a_leased_bucket_never_gives_more_tokens_than_it_has(
    calls: list[tuple[int, int, int]], rate: int, capacity: int
) -> None:
    """Whatever the asks, the moments and the returns (at most what is held): no block is more
    than the bucket's whole tokens, the bucket never goes below zero, and over any run it gives
    out at most its capacity, plus its refill, plus what came back."""
    state = None
    now = 0
    held = given_out = returned_all = 0
    for elapsed, want, give_back in calls:
        now += elapsed
        returned = held if give_back else 0
        before = token_bucket.refill(state, now, rate, 1000, capacity)
        after, block = lease.settle_bucket(state, now, rate, 1000, capacity, returned, want)
        assert 0 <= block <= math.floor(min(capacity, before.tokens + returned))
        assert after.tokens >= 0
        state = after
        held += block - returned
        given_out += block
        returned_all += returned
        assert given_out <= capacity + rate * now / 1000 + returned_all
