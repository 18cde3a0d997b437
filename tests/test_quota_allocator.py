"""The quota allocator: fair shares of a bucket's budget, blanket rules, and its overshoot bound."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.quota_sim import Gateway, simulate, skewed
from sidecar.quota.allocator import (
    LEASE_FILL_INTERVAL,
    LEASE_RATE,
    MAX_FILL_INTERVAL,
    WINDOW_GRACE_MS,
    Assignment,
    Blanket,
    Budget,
    Holder,
    allocate,
    counted,
    lease_owed,
    owed_since,
)

MINUTE = 60_000
#: A minute window's start, and 10 s into it.
START = 1_700_000_040_000
NOW = START + 10_000
TTL = 5_000


def holder(envoy: str, demand: float | None, rate: float = 0.0, burst: int = 0) -> Holder:
    return Holder(envoy, demand, NOW - 1_000, NOW - 1_000, rate, burst, NOW + TTL)


def test_unlimited_rule_allows_all() -> None:
    """An unlimited rule gets ALLOW_ALL, committing nothing."""
    got, stored = allocate(Budget(None, MINUTE), "a", 5.0, [], 0, NOW, TTL)
    assert got == Assignment(Blanket.ALLOW_ALL, TTL)
    assert stored.commitment(START, START + MINUTE) == 0


def test_spent_budget_denies_all_until_the_window_ends() -> None:
    """Once the window's reports reach the limit, DENY_ALL lives until the window's end and a
    second more (the service replaces it as the window turns), not a whole TTL past it."""
    got, _ = allocate(Budget(100, MINUTE, pace=True), "a", 5.0, [], 100, START + 58_000, TTL)
    assert got == Assignment(Blanket.DENY_ALL, 2_000 + WINDOW_GRACE_MS, spent=True)


def test_shadow_mode_allows_all_and_reports_what_it_would_enforce() -> None:
    """In shadow mode Envoy gets ALLOW_ALL; the assignment that would have been enforced comes
    with it (for metrics), and is the one stored, so later decisions are those that would have
    been made."""
    budget = Budget(600, MINUTE, shadow_mode=True, pace=True)
    got, stored = allocate(budget, "a", 30.0, [], 98, NOW, TTL)
    assert got.blanket is Blanket.ALLOW_ALL
    assert got.enforced is not None and got.enforced.rate == 10
    assert stored.rate == 10
    spent, _ = allocate(budget, "a", 30.0, [], 600, NOW, TTL)
    assert spent.enforced is not None and spent.enforced.blanket is Blanket.DENY_ALL


def test_a_report_spanning_the_window_start_counts_what_was_admissible_since() -> None:
    """A report whose interval began in the previous window adds to this window's used no more
    than the assignment let the Envoy admit since the start: its burst and 4/s for 3 s here.
    A report within the window, or after the assignment expired, counts whole."""
    current = Holder("a", 4.0, START - 2_000, START - 2_000, 4.0, 4, START + 8_000)
    assert counted(current, 20, START, START + 3_000) == 16
    assert counted(current, 10, START, START + 3_000) == 10
    assert counted(current, 50, START - 60_000, START + 3_000) == 50
    assert counted(current, 50, START, START + 9_000) == 50


def test_a_lone_envoy_gets_the_budget_paced_over_the_window() -> None:
    """One Envoy, 600 a minute, 98 used after 10 s: 502 left, less the 2 tokens its bucket
    starts with, over 50 s is 10 per second."""
    got, _ = allocate(Budget(600, MINUTE, pace=True), "a", 30.0, [], 98, NOW, TTL)
    assert got.blanket is Blanket.TOKEN_BUCKET
    assert got.rate == 10
    assert (got.tokens_per_fill, got.fill_interval, got.max_tokens) == (10, 1, 6)


def test_shares_follow_demand() -> None:
    """Two Envoys asked for 10/s and 30/s share the pace 1:3, so both admit the same fraction of
    what they are asked."""
    budget = Budget(1_200, MINUTE, pace=True)
    first, _ = allocate(budget, "a", 10.0, [holder("b", 30.0)], 198, NOW, TTL)
    second, _ = allocate(budget, "b", 30.0, [holder("a", 10.0)], 198, NOW, TTL)
    # 1,000 left (less a new bucket's 2 tokens) over 50 s: 20/s, a quarter and three quarters.
    assert first.rate == 5
    assert second.rate == 15


def test_an_idle_envoys_share_goes_to_the_busy_one() -> None:
    """An Envoy that reported no demand keeps a trickle (a token a minute, to see its next
    request), and the busy one gets the rest of the pace."""
    budget = Budget(1_200, MINUTE, pace=True)
    idle, _ = allocate(budget, "idle", 0.0, [holder("busy", 30.0)], 198, NOW, TTL)
    busy, _ = allocate(budget, "busy", 30.0, [holder("idle", 0.0)], 198, NOW, TTL)
    assert (idle.tokens_per_fill, idle.fill_interval, idle.max_tokens) == (1, MAX_FILL_INTERVAL, 2)
    assert busy.rate == 20


def test_a_new_envoy_gets_the_average_share_at_once() -> None:
    """A new Envoy (demand unknown) beside two known ones counts as an average one: a third."""
    budget = Budget(1_200, MINUTE, pace=True)
    others = [holder("b", 10.0), holder("c", 20.0)]
    got, _ = allocate(budget, "new", None, others, 0, START, TTL)
    assert got.rate == 20 / 3 or abs(got.rate - 20 / 3) < 0.2


def test_others_commitments_are_never_promised_twice() -> None:
    """Whatever the demand, an assignment fits in the budget left after what the other live
    Envoys' assignments may still admit: here 30 left, 25 committed, so 5 at most."""
    budget = Budget(100, MINUTE, pace=True)
    other = Holder("b", 100.0, NOW, NOW, 1.0, 5, NOW + 20_000)  # 5 + 1/s * 20 s = 25
    got, stored = allocate(budget, "a", 100.0, [other], 70, NOW, 20_000)
    assert stored.commitment(START, START + MINUTE) <= 5
    assert got.blanket is Blanket.TOKEN_BUCKET


def test_nothing_left_after_commitments_denies() -> None:
    """When the others' commitments take what is left, the Envoy gets DENY_ALL (not the budget
    spent: it keeps its TTL and comes back at its next report)."""
    other = Holder("b", 100.0, NOW, NOW, 1.0, 5, NOW + 20_000)
    got, _ = allocate(Budget(100, MINUTE, pace=True), "a", 100.0, [other], 75, NOW, TTL)
    assert got == Assignment(Blanket.DENY_ALL, TTL, constrained=True)


def test_expired_holders_hold_only_what_they_may_have_admitted_unreported() -> None:
    """An Envoy whose assignment expired (gone, or disconnected) without reporting again holds
    what that assignment let it admit in this window, and nothing in a later one; it has no
    share of the pace."""
    budget = Budget(600, MINUTE, pace=True)
    gone = Holder("b", 100.0, NOW - 9_000, NOW - 4_000, 20.0, 20, NOW - 1_000)
    got, _ = allocate(budget, "a", 30.0, [gone], 98, NOW, TTL)
    # 502 left, 20 + 20/s * 3 s = 80 of it held; the pace: (502 - 60 probably admitted - a new
    # bucket's 2 tokens) / 50 s.
    assert got.rate == 8.8
    earlier = Holder("b", 100.0, START - 9_000, START - 9_000, 50.0, 50, START - 1)
    got, _ = allocate(budget, "a", 30.0, [earlier], 98, NOW, TTL)
    assert got.rate == 10


def test_a_steady_target_keeps_the_assignment() -> None:
    """A current rate up to 10% above the target is sent again, so Envoy keeps its bucket (a
    changed one would start full: a new burst); one below the target is not (kept, it would
    leave budget unspent report after report)."""
    budget = Budget(600, MINUTE, pace=True)
    above = Holder("a", 30.0, NOW - 1_000, NOW - 1_000, 10.1, 9, NOW + 4_000)
    got, _ = allocate(budget, "a", 30.0, [], 98, NOW, TTL, current=above)
    assert (got.rate, got.max_tokens) == (10.1, 9)
    below = Holder("a", 30.0, NOW - 1_000, NOW - 1_000, 9.9, 9, NOW + 4_000)
    got, _ = allocate(budget, "a", 30.0, [], 98, NOW, TTL, current=below)
    assert (got.rate, got.max_tokens) == (10, 6)


def test_slow_rates_are_whole_tokens_over_whole_seconds() -> None:
    """Envoy reads whole seconds of fill_interval: a pace of 0.3/s is sent as 3 tokens every
    10 s, and one of 0.32/s as 8 every 25 s."""
    got, _ = allocate(Budget(117, MINUTE, pace=True), "a", 1.0, [], 100, NOW, TTL)
    assert (got.tokens_per_fill, got.fill_interval) == (3, 10)
    got, _ = allocate(Budget(1_000, MINUTE, pace=True), "a", 1.0, [], 982, NOW, TTL)
    assert (got.tokens_per_fill, got.fill_interval) == (8, 25)


def test_a_refresh_counts_what_the_envoy_may_have_admitted_since_its_report() -> None:
    """A refresh without a report owes the old assignment's burst and rate since it was made,
    or since the window began when it was made in an earlier window (what it owed then too)."""
    current = Holder("a", 10.0, NOW - 2_000, NOW - 2_000, 4.0, 4, NOW + 3_000)
    assert owed_since(current, START, NOW) == 4 + 4.0 * 2
    refreshed = Holder("a", 10.0, NOW - 2_000, NOW - 1_000, 4.0, 4, NOW + 3_000, owed=5.0)
    assert owed_since(refreshed, START, NOW) == 5 + 4 + 4.0 * 1
    assert owed_since(refreshed, NOW - 500, NOW) == 4 + 4.0 * 0.5


# --- Leases (the default) ------------------------------------------------------------------

HOUR = 3_600_000


def test_a_lone_envoy_leases_all_that_is_left() -> None:
    """One Envoy whose demand is not known yet, 300 an hour, 1 reported: a bucket of the 299
    left that never refills in its term (one token every 10**8 s), so a burst is admitted up to
    the limit at once, as a fixed window admits it."""
    got, stored = allocate(Budget(300, HOUR), "a", None, [], 1, START + 600_000, TTL)
    assert (got.blanket, got.max_tokens) == (Blanket.TOKEN_BUCKET, 299)
    assert (got.tokens_per_fill, got.fill_interval) == (1, LEASE_FILL_INTERVAL)
    assert stored.commitment(START, START + HOUR) == 299


def test_leases_share_what_is_left_by_demand_as_the_window_turns() -> None:
    """Three Envoys asked for 30, 60 and 90 a second, each pushed its lease as a 600-per-10 s
    window starts: blocks of 100, 200 and 300, each its demand's share, together the limit."""
    window = 10_000
    start = START - START % window
    holders = {
        name: Holder(name, demand, start - 3_000, start - 3_000, 0.0, 0, start + 1_000)
        for name, demand in (("a", 30.0), ("b", 60.0), ("c", 90.0))
    }
    blocks = []
    for name in "abc":
        others = [h for n, h in holders.items() if n != name]
        owed, _ = lease_owed(holders[name], 0, start, start, report=False)
        got, holders[name] = allocate(
            Budget(600, window), name, None, others, 0, start, 6_000, owed=owed,
            current=holders[name],
        )  # fmt: skip
        blocks.append(got.max_tokens)
    assert blocks == [100, 200, 300]


def test_a_lease_covers_the_demand_until_the_next_report() -> None:
    """A known demand of 10 a second is leased what covers it for a TTL (50), not the whole of
    what is left: the rest stays for the other Envoys."""
    got, _ = allocate(Budget(600, MINUTE), "a", 10.0, [], 100, NOW, TTL)
    assert got.max_tokens == 50


def test_a_bucket_that_may_hold_more_than_a_new_block_is_kept() -> None:
    """At a report, what the Envoy's bucket may still hold (100 leased, 30 counted since: 70)
    against what a new block would give: its demand of 10 a second over a TTL, 50, is less, so
    the bucket is sent unchanged (Envoy keeps its tokens) and commits the 70; a demand of 50 a
    second gets a new block, all that is left (100)."""
    current = Holder("a", 50.0, NOW - 5_000, NOW - 5_000, LEASE_RATE, 100, NOW + 1_000)
    owed, holds = lease_owed(current, 30, START, NOW, report=True)
    assert (owed, holds) == (0, 70)
    got, stored = allocate(Budget(300, HOUR), "a", 10.0, [], 200, NOW, TTL, owed=owed,
                           current=current, holds=holds)  # fmt: skip
    assert (got.max_tokens, got.tokens_per_fill, got.fill_interval) == (100, 1, LEASE_FILL_INTERVAL)
    assert stored.commitment(START, START + HOUR) == 70
    got, stored = allocate(Budget(300, HOUR), "a", 50.0, [], 200, NOW, TTL, owed=owed,
                           current=current, holds=holds)  # fmt: skip
    assert got.max_tokens == 99  # all that is left, one less than the bucket Envoy has
    assert stored.commitment(START, START + HOUR) == 99


def test_a_new_block_differs_from_the_bucket_envoy_has() -> None:
    """Envoy keeps a bucket sent unchanged: a new block the size of the current one is sent one
    smaller, so that Envoy starts it full."""
    current = Holder("a", 10.0, NOW - 5_000, NOW - 5_000, LEASE_RATE, 50, NOW + 1_000)
    owed, holds = lease_owed(current, 50, START, NOW, report=True)
    got, _ = allocate(Budget(600, MINUTE), "a", 10.0, [], 100, NOW, TTL, owed=owed,
                      current=current, holds=holds)  # fmt: skip
    assert got.max_tokens == 49


def test_a_lease_never_outlives_its_window() -> None:
    """A lease made 2 s before its window ends lives to the end (not its 6 s TTL), and the next
    window's is pushed as the window turns: nothing of this window's lease is left to commit in
    the next one."""
    got, stored = allocate(Budget(600, MINUTE), "a", 10.0, [], 100, START + 58_000, 6_000)
    assert (got.ttl_ms, got.turns) == (2_000, True)
    assert stored.expires_ms == START + MINUTE
    assert stored.commitment(START + MINUTE, START + 2 * MINUTE) == 0


# --- The overshoot bound, on random fleets -------------------------------------------------


events = st.lists(
    st.tuples(
        st.integers(0, 5),  # which Envoy
        st.integers(1, 4_000),  # ms after the previous event
        st.booleans(),  # a report (True) or a refresh without one
        st.floats(0, 200),  # the Envoy's demand from now on
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 400),
    window_ms=st.sampled_from([1_000, 10_000, 60_000]),
    ttl_ms=st.integers(1_000, 20_000),
    envoys=st.integers(1, 6),
    offset=st.integers(0, 59_999),
    script=events,
    pace=st.booleans(),
)
def test_no_window_admits_more_than_its_limit(
    limit: int,
    window_ms: int,
    ttl_ms: int,
    envoys: int,
    offset: int,
    script: list[tuple[int, int, bool, float]],
    pace: bool,
) -> None:
    """Whatever the demand and whenever Envoys report or get refreshed, the requests admitted
    in a window (counted when admitted) stay within the limit, leased or paced, when Envoys
    deny without an assignment and get each assignment at once (the bound's other terms are
    then zero)."""
    budget = Budget(limit, window_ms, pace=pace)
    fleet = [Gateway(0.0) for _ in range(envoys)]
    used: dict[int, int] = {}
    now = START + offset
    for which, step, report, demand in script:
        envoy = fleet[which % envoys]
        later = now + step
        for each in fleet:
            each.run(now, later, window_ms)
        now = later
        window = now - now % window_ms
        name = str(which % envoys)
        others = [e.holder for e in fleet if e.holder is not None and e is not envoy]
        if report:
            # Whole requests, as Envoy reports them (the fluid's fractions rounded up).
            allowed = counted(envoy.holder, math.ceil(envoy.allowed), window, now)
            owed, holds = 0.0, 0.0
            if not pace:
                owed, holds = lease_owed(envoy.holder, allowed, window, now, report=True)
            used[window] = used.get(window, 0) + allowed
            elapsed = (now - envoy.reported_ms) / 1000 if envoy.reported_ms else 0
            asked = (envoy.allowed + envoy.denied) / elapsed if elapsed else None
            envoy.allowed = envoy.denied = 0.0
            envoy.reported_ms = now
            assignment, envoy.holder = allocate(
                budget,
                name,
                asked,
                others,
                used[window],
                now,
                ttl_ms,
                owed=owed,
                current=envoy.holder,
                holds=holds,
            )
        elif envoy.holder is not None:
            if pace:
                owed = owed_since(envoy.holder, window, now)
            else:
                owed, _ = lease_owed(envoy.holder, 0, window, now, report=False)
            assignment, envoy.holder = allocate(
                budget,
                name,
                None,
                others,
                used.get(window, 0),
                now,
                ttl_ms,
                owed=owed,
                current=envoy.holder,
            )
        else:
            continue
        envoy.demand = demand
        envoy.receive(assignment, now)
    for each in fleet:
        each.run(now, now + 2 * window_ms, window_ms)
    for window in {w for e in fleet for w in e.windows}:
        admitted = sum(e.windows.get(window, 0.0) for e in fleet)
        assert admitted <= limit + 1e-6 * limit, (window, admitted)


def test_a_simulated_fleet_shares_the_limit_fairly() -> None:
    """Forty gateways with skewed demand at three times a 6,000-a-minute limit, reporting every
    second: no window past the limit, at least 95% of it used, and every gateway admitting
    about the same fraction of its demand (Jain's index at least 0.95)."""
    result = simulate(
        "skewed",
        lambda t: skewed(40, 300.0),
        gateways=40,
        seconds=180,
        budget=Budget(6_000, MINUTE, pace=True),
        report_ms=1_000,
        ttl_ms=5_000,
        shift_ms=None,
    )
    assert result.worst_overshoot == 0
    assert result.mean_use >= 0.95
    assert result.worst_jain >= 0.95
