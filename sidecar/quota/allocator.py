"""How a bucket's global limit is shared between the Envoys that enforce it: a pure function of
(limit, window, reports, now) that gives one Envoy its next quota assignment.

The rule's `requests_per_unit` is the bucket's budget for each epoch-aligned window (a minute
rule: `limit` requests from hh:mm:00 to hh:mm:59, whatever algorithm the rule names). Envoys
report, every `reporting_interval`, how many requests they allowed and denied; the sidecars add
the allowed ones to the window's `used` and keep one `Holder` per Envoy: what it was asked for
(its demand, in requests per second) and what it was last assigned.

Two ways to hand the budget out, by the rule:

- Leases (the default): each Envoy's assignment is a block of the window's budget, a token
  bucket whose `max_tokens` is the block and that does not refill (one token per
  `LEASE_FILL_INTERVAL` seconds, a whole token never within an assignment's term), so the
  window's budget is spent as fast as the fleet asks for it, as the same rule means through
  ShouldRateLimit (`_lease` below).
- Pace (a rule's `pace: true`): each Envoy's token bucket refills at its share of the pace that
  spends what is left of the window evenly until it ends.

A lease: the block is the Envoy's share (its demand over the fleet's, as below) of what the
window has left once what the others probably spent since their last report is out, and no
more than its demand covers until its next block, a fifth more (`LEASE_MARGIN`): until its next
report (due an interval like its last one after it, and `REPORT_SLACK_MS`), or the window's end
if that comes first (the last blocks of a window are what its end leaves time for); the first
block of a window, whose Envoy's next report also counts what it admitted at the earlier
window's end, no more than its demand spends until that report; at least `MIN_BURST` while the budget lasts, so an idle Envoy can
admit its next request and report its demand; a new Envoy, whose demand is not known yet,
takes its share of what is left at once (alone, the whole of it); the Envoys that share are
those whose lease ended within a TTL too (as a window turns, each is about to get the next). A
lease never outlives its window: its TTL ends with the window, and the service pushes the next
window's lease as the window turns. At each decision the Envoy either keeps its bucket (sent
again unchanged, Envoy keeps its tokens: when it may still hold what a new block would give,
and not more than its demand spends until its next block, or when no new block fits) or gets
a new block, sent as a reset (Envoy 1.40 starts a changed token bucket as full as the one it
replaces, so a block sent to an Envoy whose bucket ran dry would admit nothing: see
`convert.assignment_actions`). A bucket that may hold more than its demand spends until its
next block gives the surplus back, a smaller block in its place. A block its Envoy's demand
spends before its next report is renewed as it runs out: a dry push (`Assignment.dry_ms`)
gives a new block from what no one holds, or, when the others hold it all, is tried again
after another Envoy's next report (which may give some back).

Leases never promise the budget twice, counted in whole requests (a token bucket admits a
request per whole token, and a lease's never fills one in its term): a new block fits in
``limit - used - owed - the other Envoys' commitments`` (`owed`: at a refresh, what the Envoy
may have admitted since its last report), and a kept bucket commits what it may still hold
(at a report: what it was given less what the reports counted since, `holds`), so
``used + every commitment`` bounds what the window admits. One thing a report cannot tell: of
what it counts, how much the Envoy's old bucket admitted after the report was sent and before
its new block arrived (a new block replaces the old bucket on arrival; the old one's remainder
may be spent meanwhile). What its demand admits in `REPLACE_LATENCY_MS` (at most what the old
bucket may hold) stays owed until the Envoy's next report counts it; a window admits at most
its limit plus what an Envoy admits past that latency (keeping the whole remainder owed instead
would hold every replaced bucket's remainder until the next report, a block per Envoy that the
others cannot use meanwhile). A kept bucket is only sent while its assignment has `KEEP_MARGIN_MS` left to live (one that
reached Envoy after the old one expired would start full).

Under-admission (what a window leaves unspent while asked for more): what the leases hold when
it ends (blocks are what their demand spends until the next block, the last ones until the
window's end), what the Envoys that ran dry could not get while the others held the rest (until
a dry push finds it), and what an Envoy admitted after its last report of the previous window,
which the report spanning the turn counts in this one (up to its first block here; a lease that
ended with the previous window counts nothing of it). The bound, tested on random fleets by
`tests/test_quota_allocator.py` (one to five Envoys reporting every 5 s at their own phases,
steady demand from 1.5 to 4 times the limit, 10 s and 60 s windows): every window from the
second in which every demand is known admits at least 94% of its limit, and at least 98% of a
limit of 600 or more a window (the simulation's worst of 300 such fleets: 94.7%, five Envoys
sharing 60 per 10 s, where a block of `MIN_BURST` is already a thirtieth of the limit; 99.3%
among the 202 from 600 up; none of 747 windows of 300 other random fleets below 95%, the worst
96.2%). A demand that changes between reports is covered only as far as the margin goes: in the
same simulation, fleets whose demands each swing by up to 60% every second left 61 of 747
windows below 95%, the worst at 85.8%, for half again as many decisions as without dry pushes
and surplus returns (60 windows, the worst at 76.7%) or with neither these nor blocks sized to
the next report (85, at 60.1%). Through real Envoys, `tests/test_quota_e2e.py`: 599 or 600 of
600 per window, shared by demand.

Pacing: each Envoy gets a token bucket (`tokens_per_fill` every `fill_interval`, at most
`max_tokens` at once) whose rate is its share of the budget's pace:

- Pace: what the whole fleet may admit per second from now on to spend what is left of the
  window's budget evenly until the window ends (`left / seconds_left`, `left` net of what the
  other Envoys have admitted but not reported yet). A fleet that was idle early in the window
  may use the rest faster later, as a fixed window would admit it. An assignment that will
  still run after the window ends (the Envoy's next report is due later, one interval like its
  last one from now) has the nominal pace (`limit / window`) for that part, weighted by time
  (the nominal pace outright if it runs longer after the end than before): what a window left
  unspent does not eat into the next, nor does a window spent early starve it.
- Share: the Envoy's demand over the fleet's demand, so every Envoy admits the same fraction of
  what it is asked for (Jain's index of admitted/demanded is 1 in steady state). An Envoy that
  went idle reports a demand of 0 and gives its share to the busy ones at its next report; a
  new Envoy, whose demand is not known yet, gets the average share at once.
- The rate is rounded down to what Envoy's token bucket can express (a whole number of tokens
  every whole number of seconds), and every live Envoy keeps at least a token a minute and a
  bucket of two (so an idle one can admit its next request and report its demand) while the
  budget lasts.

The budget is never promised twice. Each Envoy's assignment commits, in this window, at most
``max_tokens + rate * seconds`` from when it was assigned to when it expires or the window
ends (a token bucket never admits more over a span: it starts with at most `max_tokens`), plus
`owed`, what an Envoy may have admitted since its last report under an assignment replaced
without one (a refresh). A new assignment is cut down until
``used + owed + its commitment + the other live Envoys' commitments <= limit``; when nothing
fits, the Envoy gets `DENY_ALL`, and once the window's budget is spent every Envoy gets
`DENY_ALL` until the window ends (and `WINDOW_GRACE_MS` more: the service refreshes it as the
window turns, or its next report brings a token bucket).

Overshoot bound (`tests/test_quota_allocator.py` checks it on random report sequences): counted
by when Envoys admitted them, the requests a window admits are at most ``limit`` plus
- what Envoys admit with no assignment or an expired one (their `no_assignment_behavior` and
  `expired_assignment_behavior`: set them to `DENY_ALL`, or a small token bucket, to keep this
  small; a new bucket's first request is one of these);
- what an Envoy admits under its old assignment between a new one being sent and received (its
  old rate times the network latency; a lease's, past `REPLACE_LATENCY_MS`).
Usage is counted in the window in which it is reported, but a report that spans a window's
start counts in it no more than the Envoy's assignment let it admit since that start
(`counted`): never less than it admitted there, so never looser.
Below the limit, each Envoy's rate is its demand scaled up to the pace, so a demand that holds
between reports is admitted whole; one that jumps waits for the next report.

Unlimited rules get `ALLOW_ALL`. In shadow mode the assignment is `ALLOW_ALL` and the one that
would have been enforced is returned beside it, for metrics and logs (and kept as the Envoy's
holder, so the next decisions are the ones that would have been made).

One module past the usual size because the paced and the leased allocations share one budget, what
every holder has committed, which both must read to never hand out past the limit.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

#: The longest `fill_interval` used for slow rates: one token a minute at least while the budget
#: allows, so that a live Envoy can always admit a request and report its demand.
MAX_FILL_INTERVAL = 60
#: A token bucket holds about this many seconds of its rate (at least `MIN_BURST` tokens), and
#: at most `BURST_SHARE` of the window: what a freshly assigned bucket lets through at once. Small,
#: since every assignment commits it.
BURST_SECONDS = 1.0
BURST_SHARE = 0.01
#: The least `max_tokens`: a bucket that holds one token wastes what fills while it is full
#: and the next request is on its way (under steady demand above the rate, about a sixth of
#: the rate, measured through Envoy); with room for two the fill carries over.
MIN_BURST = 2
#: A spent budget's DENY_ALL lasts this long past the window's end: the service replaces it as
#: the window turns, and one that lapsed a moment before would leave Envoy to its
#: `expired_assignment_behavior` in between.
WINDOW_GRACE_MS = 1_000
#: A current rate at most this fraction above the new target is kept: Envoy starts a new, full
#: bucket whenever its assignment changes, and a full bucket is burst. (Never a rate below the
#: target: kept, it would leave budget unspent report after report.)
STEADY = 0.1
#: A lease's token bucket fills one token per this many seconds (about three years): Envoy's
#: bucket must fill (`tokens_per_fill` above 0), and at this rate it never fills a whole token
#: within an assignment's term. Under 10**9, for the nanos `convert` repeats it in.
LEASE_FILL_INTERVAL = 100_000_000
LEASE_RATE = 1 / LEASE_FILL_INTERVAL
#: A lease's bucket is kept (sent again unchanged: Envoy keeps its tokens) only while its
#: assignment has this long to live; one that reached Envoy after it expired would start full.
KEEP_MARGIN_MS = 500
#: A lease covers its Envoy's demand until its next report (or the window's end) this much over:
#: a demand that rises a little between reports is covered, and a bucket holding more than that
#: at a report gives the surplus back (see `_lease`).
LEASE_MARGIN = 0.2
#: A report arrives this long after it is due (Envoy's timer, the network, the decision), and a
#: block that lasts until then lasts until the next block.
REPORT_SLACK_MS = 200
#: A lease predicted to run dry before its Envoy's next report gets a new block pushed this long
#: after its predicted end (its demand spent its tokens): late rather than early, for a push
#: replaces the bucket and would waste what an early one still held.
DRY_SLACK_MS = 100
#: A bucket replaced at a report may admit what it still holds until the new assignment reaches
#: Envoy: this long at its demand is kept owed until the next report counts what it did admit.
REPLACE_LATENCY_MS = 100


class Blanket(enum.Enum):
    """Envoy's `RateLimitStrategy.BlanketRule`, plus the token bucket case."""

    ALLOW_ALL = "allow_all"
    DENY_ALL = "deny_all"
    TOKEN_BUCKET = "token_bucket"


@dataclass(frozen=True, slots=True)
class Budget:
    """A bucket's global limit: `limit` requests per epoch-aligned window of `window_ms`.

    `limit` None: the rule is `unlimited`. `shadow_mode`: decided and reported, never enforced.
    `pace`: the rule's `pace: true`, the budget paced over the window (else leased).
    """

    limit: int | None
    window_ms: int
    shadow_mode: bool = False
    pace: bool = False

    def window(self, now_ms: int) -> tuple[int, int]:
        """The start and the end (Unix ms) of the window that holds `now_ms`."""
        start = now_ms - now_ms % self.window_ms
        return start, start + self.window_ms


@dataclass(frozen=True, slots=True)
class Assignment:
    """A quota assignment, as Envoy gets it.

    For a token bucket: `tokens_per_fill` tokens every `fill_interval` seconds (a whole number:
    Envoy 1.40 reads only the seconds), at most `max_tokens` at once. `ttl_ms` is its
    `assignment_time_to_live`. `enforced` is the assignment shadow mode did not send (else None).
    `spent`: a DENY_ALL because the window's budget is spent, until the window ends.
    `constrained`: less than the Envoy's share, for the other Envoys' assignments left no more
    room; deciding again once they have reported (and released it) gives it its share.
    `turns`: a lease whose TTL ends with its window: the next window's lease is pushed as the
    window turns.
    `dry_ms`: a lease that its Envoy's demand spends before its next report: decide again this
    many ms from now (a push with `dry=True`), when the block has run out, or when another
    Envoy's report may have given budget back (None: the next report will do).
    """

    blanket: Blanket
    ttl_ms: int
    tokens_per_fill: int = 0
    fill_interval: int = 1
    max_tokens: int = 0
    enforced: Assignment | None = None
    spent: bool = False
    constrained: bool = False
    turns: bool = False
    dry_ms: int | None = None
    reset: bool = False

    @property
    def rate(self) -> float:
        """Tokens per second (0 for a blanket rule)."""
        if self.blanket is not Blanket.TOKEN_BUCKET:
            return 0.0
        return self.tokens_per_fill / self.fill_interval


@dataclass(frozen=True, slots=True)
class Holder:
    """What the sidecars know of one Envoy's use of one bucket (all times Unix ms).

    `demand`: requests per second it was asked for (allowed and denied) over its last reporting
    interval; None before its second report. `reported_ms`: when its last report arrived.
    `assigned_ms`, `rate`, `burst`, `expires_ms`: its current assignment (rate and burst 0 for a
    blanket rule). `owed`: at most what it admitted between its last report (or the window's
    start, if later) and `assigned_ms`, under an assignment replaced by a refresh (0 after a
    report; see `owed_since`). A kept lease bucket's `owed` is what it may still hold (and
    owed before) less its `max_tokens`, below 0 when it holds less: its commitment is then what
    it may still hold (see `lease_owed`).
    """

    envoy: str
    demand: float | None
    reported_ms: int
    assigned_ms: int
    rate: float
    burst: int
    expires_ms: int
    owed: float = 0.0

    def live(self, now_ms: int) -> bool:
        return self.expires_ms > now_ms

    def filled(self, span_ms: float) -> float:
        """What its bucket fills in `span_ms`: ``rate * seconds``; a lease's in whole tokens
        (none in its term), for Envoy admits a request per whole token."""
        fill = self.rate * span_ms / 1000
        return math.floor(fill + 1e-9) if self.rate == LEASE_RATE else fill

    def commitment(self, start_ms: int, end_ms: int) -> float:
        """The most its assignment (and `owed`) lets it admit in the window [start, end) that is
        not reported yet: ``owed + burst + rate * seconds`` from the assignment (or the window's
        start) to its expiry (or the window's end)."""
        # `owed` was admitted before the assignment: in this window only if that is in it.
        owed = self.owed if self.assigned_ms > start_ms else 0.0
        since = max(self.assigned_ms, start_ms)
        until = min(self.expires_ms, end_ms)
        if until <= since:
            return owed
        return owed + self.burst + self.filled(until - since)

    def unreported(self, now_ms: int, start_ms: int) -> float:
        """What it probably admitted in this window since its last report (its rate since then)."""
        since = max(self.assigned_ms, start_ms)
        owed = self.owed if self.assigned_ms > start_ms else 0.0
        return owed + self.rate * max(0, min(now_ms, self.expires_ms) - since) / 1000


def allocate(
    budget: Budget,
    envoy: str,
    demand: float | None,
    others: Iterable[Holder],
    used: int,
    now_ms: int,
    ttl_ms: int,
    *,
    owed: float = 0.0,
    current: Holder | None = None,
    holds: float = 0.0,
    next_report_ms: int | None = None,
    dry: bool = False,
) -> tuple[Assignment, Holder]:
    """The next assignment of `envoy`, and its Holder to store.

    `demand`: its requests per second since its last report (None when unknown: a new Envoy,
    or a refresh). `others`: the other Envoys' Holders (an expired one still commits what it
    may have admitted unreported, but has no share). `used`: what the window's reports allowed
    so far (`counted`), this Envoy's included. `owed`: what it may have admitted since its last
    report and in this window (0 when this is its report; `owed_since` for a refresh).
    `current`: its Holder before this call, whose assignment is kept when it is at most
    `STEADY` above the new target and still fits. `ttl_ms` is at least a second.
    Leases only: `next_report_ms`, when its next report is due (None: a TTL from now); `dry`, a
    push to an Envoy whose lease was predicted spent (`Assignment.dry_ms`): it gets a new block
    if one fits, never its bucket again as though it still held it.
    """
    start, end = budget.window(now_ms)
    # An expired assignment commits what it let its Envoy admit before it expired and that
    # Envoy did not report yet; only live ones share the pace.
    held = [h for h in others if h.envoy != envoy]
    live = [h for h in held if h.live(now_ms)]
    reported_ms = now_ms if demand is not None or current is None else current.reported_ms
    # Until its next report, due an interval like its last one from now (a refresh: its TTL).
    interval = ttl_ms
    if demand is not None and current is not None and current.reported_ms < now_ms:
        interval = min(ttl_ms, now_ms - current.reported_ms)
    if demand is None and current is not None:
        demand = current.demand
    if budget.limit is None:
        allow = Assignment(Blanket.ALLOW_ALL, ttl_ms)
        return allow, Holder(envoy, demand, reported_ms, now_ms, 0.0, 0, now_ms + ttl_ms)
    left = budget.limit - used
    if left <= 0:
        # Spent: deny until the window ends, when the budget comes back.
        chosen = Assignment(Blanket.DENY_ALL, end - now_ms + WINDOW_GRACE_MS, spent=True)
    elif not budget.pace:
        # Leases end with their window: the Envoys whose lease ended within a TTL are still
        # sharing (as the window turns, each is about to get the next one).
        sharing = [h for h in held if h.expires_ms + ttl_ms > now_ms]
        due = now_ms + ttl_ms if next_report_ms is None else next_report_ms
        # Every Envoy reports at this interval (Envoy's, not per bucket): this one's last, or
        # a TTL when not known.
        period = due - reported_ms if due > reported_ms else ttl_ms
        chosen, owed = _lease(
            budget, left, demand, sharing, held, owed, holds, now_ms, ttl_ms, current,
            (due, period, dry),
        )  # fmt: skip
    else:
        room = _room(budget, left, owed, held, now_ms, ttl_ms)
        pace = _pace(left, held, owed, now_ms, start, end)
        if now_ms + interval > end:
            # It runs on into the next window until the next report: there at the nominal pace,
            # whatever is left here (a window the fleet left unspent must not eat into the next
            # one, nor one it spent early starve it). Weighted by time, unless it runs longer
            # there than here: one rate cannot be both, and the next window's pace matters
            # more then. The room left here still caps it.
            nominal = budget.limit * 1000 / budget.window_ms
            here, there = end - now_ms, now_ms + interval - end
            if there >= here:
                pace = min(pace, nominal)
            else:
                pace = (pace * here + min(pace, nominal) * there) / (here + there)
        target = _share(demand, live) * pace
        kept = _kept(current, target, room, now_ms, ttl_ms)
        burst_seconds = min(BURST_SECONDS, BURST_SHARE * budget.window_ms / 1000)
        chosen = kept if kept is not None else _token_bucket(target, room, ttl_ms, burst_seconds)
    holder = Holder(
        envoy,
        demand,
        reported_ms,
        now_ms,
        chosen.rate,
        chosen.max_tokens,
        now_ms + chosen.ttl_ms,
        owed,
    )
    if budget.shadow_mode:
        # The holder is the enforced assignment's: the next decisions are the ones that would
        # have been made, and `counted` is told to count every report whole.
        return Assignment(Blanket.ALLOW_ALL, ttl_ms, enforced=chosen), holder
    return chosen, holder


def counted(current: Holder | None, allowed: int, start_ms: int, now_ms: int) -> int:
    """How many of a report's `allowed` requests to add to the `used` of the window that began
    at `start_ms`: all of them, except that a report spanning the window's start counts no more
    than the Envoy's live assignment let it admit since the start (its burst, its rate since
    the start or its assignment, and what it owed if that came after the start). Counting the
    whole report in the later window would be safe too, but Envoy 1.40 reports every 5 s: the
    later window would pay for up to 5 s of the earlier one's requests."""
    if current is None or current.reported_ms >= start_ms:
        return allowed
    if current.rate == LEASE_RATE and current.expires_ms <= start_ms:
        # A lease that ended with (or before) the earlier window admitted nothing in this one:
        # what its Envoy admitted since, it admitted by its expired_assignment_behavior (outside
        # the overshoot bound), counted at its demand (a report that came as the window turned,
        # before the next lease, would otherwise make this window pay for the earlier one's end).
        return min(allowed, math.ceil((current.demand or 0.0) * (now_ms - start_ms) / 1000))
    if current.expires_ms < now_ms:
        return allowed
    since = max(start_ms, current.assigned_ms)
    most = current.burst + current.filled(max(0, now_ms - since))
    if current.assigned_ms > start_ms:
        most += current.owed
    return min(allowed, math.ceil(most))


def owed_since(current: Holder, start_ms: int, now_ms: int) -> float:
    """At most what `current`'s Envoy admitted, since its last report and since the window's
    start, for a refresh at `now_ms` that replaces its assignment without a report: what it
    owed (if that came after the start), plus its bucket's burst and its rate from the
    assignment (or the start) to now (or to its expiry). What it admitted before the start
    belongs to a window that is over."""
    owed = current.owed if current.assigned_ms > start_ms else 0.0
    if current.rate <= 0:
        return owed
    since = max(current.assigned_ms, start_ms)
    seconds = max(0, min(now_ms, current.expires_ms) - since) / 1000
    return owed + current.burst + current.filled(seconds * 1000)


def lease_owed(
    current: Holder | None, counted: int, start_ms: int, now_ms: int, report: bool
) -> tuple[float, float]:
    """A leased bucket's (`owed`, `holds`) for `allocate`, in whole requests, in the window that
    began at `start_ms`. At a report, `holds`: what its bucket may still hold, what its
    assignment let it admit in the window (and what it owed before it) less what the report
    `counted` there, no more than its `max_tokens`; nothing is owed, the report counted it.
    (A report spanning the window's start may count there some of what was admitted before
    it: `used` then holds what the remainder lacks, and the two together still bound the
    window.) At a refresh (`report` False), `owed`: everything its assignments let it admit in
    the window since its last report. A lease that ended as the window began commits nothing
    in it."""
    if current is None or current.expires_ms <= start_ms:
        return 0.0, 0.0
    since = math.floor(owed_since(current, start_ms, now_ms) + 1e-9)
    if not report:
        return float(since), 0.0
    return 0.0, float(max(0, min(current.burst, since - counted)))


def _lease(
    budget: Budget,
    left: int,
    demand: float | None,
    sharing: list[Holder],
    held: list[Holder],
    owed: float,
    holds: float,
    now_ms: int,
    ttl_ms: int,
    current: Holder | None,
    reporting: tuple[int, int, bool],
) -> tuple[Assignment, float]:
    """The next lease of an Envoy, and the `owed` its Holder keeps (see the module docstring):
    a new block, its current bucket kept, or DENY_ALL when neither fits. `sharing`: the other
    Envoys whose demand shares the budget; `owed` and `holds` as `lease_owed` gives them;
    `reporting`: when its next report is due, the interval between reports, and whether this
    is a dry push."""
    due_ms, period_ms, dry = reporting
    start, end = budget.window(now_ms)
    owed_before = owed
    # Never past the window: the next one's lease is pushed as it begins, with nothing of this
    # one's left to commit there (Envoy's expired_assignment_behavior meanwhile, milliseconds).
    term = min(ttl_ms, end - now_ms)
    turns = term < ttl_ms
    room = _room(budget, left, owed, held, now_ms, term)
    # Its share of what is left once what the others probably spent since their last report
    # (and it since its own) is out: `left` still counts that, and a share of it would take
    # from the Envoys that report later (only the share: `room` bounds the block).
    spent = owed + sum(_spent(h, now_ms, start, end) for h in held)
    wanted = _share(demand, sharing) * max(0.0, left - spent)
    # What covers its demand until its next block: its next report, or the window's end.
    horizon_ms = min(max(0, due_ms - now_ms) + REPORT_SLACK_MS, term)
    margin = 1 + LEASE_MARGIN
    if current is not None and current.reported_ms < start:
        # Its next report counts what it admitted at the earlier window's end too, here up to
        # this block (`counted`): a block its demand just spends by then (a dry push if it runs
        # out sooner), so that this window pays for as little of the earlier one as it can.
        horizon_ms, margin = min(max(0, due_ms - now_ms), term), 1.0
    enough = math.inf if demand is None else demand * horizon_ms / 1000 * margin
    wanted = max(MIN_BURST, math.ceil(min(wanted, enough) - 1e-9))
    # A lease never fills a whole token in its term: its commitment is its block in every
    # window it overlaps (and `owed` in this one, already out of `room`).
    free = math.floor(min(free for free, _ in room) + 1e-9)
    block = min(wanted, free)
    constrained = block < wanted * (1 - STEADY)
    keep = (
        current is not None
        and current.rate == LEASE_RATE
        and current.expires_ms - now_ms >= KEEP_MARGIN_MS
        and room[0][0] >= holds - 1e-9
        and all(current.burst <= free + 1e-9 for free, _ in room[1:])
    )
    # A bucket that holds more than its demand spends before its next block gives the surplus
    # back (a new, smaller block replaces it), for the Envoys that run dry meanwhile to take.
    surplus = holds > enough + MIN_BURST
    # A dry push gives a new block if one fits; else the bucket stays as it is (it may still hold
    # a little, if the demand fell), not replaced by DENY_ALL.
    refill = block >= 1 if dry else block > min(owed + holds, current.burst if current else 0)
    if keep and current is not None and not surplus and (not refill or block < 1):
        # Kept, it commits what it may still hold (and what it owes): its Holder's `owed` is
        # that less its `max_tokens`.
        kept = Assignment(
            Blanket.TOKEN_BUCKET,
            term,
            1,
            LEASE_FILL_INTERVAL,
            current.burst,
            turns=turns,
            dry_ms=_dry_ms(0 if dry else holds, demand, sharing, now_ms, (due_ms, period_ms, end)),
        )
        return kept, owed + holds - current.burst
    # Replaced, the bucket may still admit what it holds until the new assignment reaches Envoy:
    # its demand over `REPLACE_LATENCY_MS`, kept owed until its next report counts it.
    if demand is None:
        owed += holds
    else:
        owed += min(holds, demand * REPLACE_LATENCY_MS / 1000)
    block = min(block, math.floor(free - (owed - owed_before) + 1e-9))
    if block < 1:
        dry_ms = _dry_ms(0, demand, sharing, now_ms, (due_ms, period_ms, end))
        deny = Assignment(Blanket.DENY_ALL, term, constrained=True, turns=turns, dry_ms=dry_ms)
        return deny, owed
    # Sent as a reset: Envoy starts it full, whatever bucket it had.
    fresh = Assignment(
        Blanket.TOKEN_BUCKET,
        term,
        1,
        LEASE_FILL_INTERVAL,
        block,
        constrained=constrained,
        turns=turns,
        dry_ms=_dry_ms(block, demand, sharing, now_ms, (due_ms, period_ms, end)),
        reset=True,
    )
    return fresh, owed


def _spent(holder: Holder, now_ms: int, start_ms: int, end_ms: int) -> float:
    """What a lease holder probably spent of its commitment in this window, unreported: its
    demand since its assignment (or the window's start), at most the commitment (0 when its
    demand is not known). An estimate, for shares only."""
    if holder.rate != LEASE_RATE or holder.demand is None:
        return 0.0
    since = max(holder.assigned_ms, start_ms)
    probably = holder.demand * max(0, min(now_ms, holder.expires_ms) - since) / 1000
    return min(holder.commitment(start_ms, end_ms), probably)


def _dry_ms(
    tokens: float,
    demand: float | None,
    sharing: list[Holder],
    now_ms: int,
    times: tuple[int, int, int],
) -> int | None:
    """When to push a new block (ms from now) to an Envoy whose bucket holds `tokens`, if its
    demand spends them before its next report and the window's end (`times`: when its next
    report is due, the interval between reports, and the window's end): as they run out; when
    they are out already, after the next report of another Envoy, which may give budget back.
    None: not before its next report."""
    due_ms, period_ms, end_ms = times
    if demand is None or demand <= 0:
        return None
    if tokens >= 1:
        lasts = tokens / demand * 1000 + DRY_SLACK_MS
        if now_ms + lasts >= min(due_ms, end_ms):
            return None
        at = now_ms + math.ceil(lasts)
    else:
        nexts = [h.reported_ms + period_ms for h in sharing if h.reported_ms + period_ms > now_ms]
        if not nexts:
            return None
        at = min(nexts) + REPORT_SLACK_MS
    return at - now_ms if at < min(due_ms, end_ms) else None


def _pace(left: int, held: list[Holder], owed: float, now_ms: int, start: int, end: int) -> float:
    """What the fleet may admit per second to spend `left` evenly by the window's end: net of
    what the Envoys probably admitted unreported, and of the bursts their buckets (and this
    Envoy's next one) commit, so that every Envoy's share of it fits in the room left."""
    unreported = owed + sum(h.unreported(now_ms, start) for h in held)
    bursts = MIN_BURST + sum(h.burst for h in held if h.expires_ms > now_ms)
    return max(0.0, left - unreported - bursts) / max(0.001, (end - now_ms) / 1000)


def _share(demand: float | None, live: list[Holder]) -> float:
    """This Envoy's fraction of the pace: its demand over the fleet's; an unknown demand
    (this Envoy's or another's) counts as the average known one (this Envoy's included), and a
    fleet with no demand at all shares equally."""
    known = [h.demand for h in live if h.demand is not None]
    everyone = known if demand is None else [demand, *known]
    average = sum(everyone) / len(everyone) if everyone else 0.0
    own = average if demand is None else demand
    total = own + sum(known) + (len(live) - len(known)) * average
    if total <= 0:
        return 1 / (len(live) + 1)
    return own / total


#: Per window an assignment overlaps: what is free in it, and for how many seconds it overlaps.
Room = list[tuple[float, float]]


def _room(
    budget: Budget,
    left: int,
    owed: float,
    held: list[Holder],
    now_ms: int,
    ttl_ms: int,
) -> Room:
    """What an assignment from `now_ms` for `ttl_ms` may commit in each window it overlaps:
    this window's budget left less `owed` and the others' commitments in it; each later
    window's whole budget less the others' commitments in it (nothing is reported there yet)."""
    assert budget.limit is not None
    start, end = budget.window(now_ms)
    room = []
    free = left - owed
    since = now_ms
    while since < now_ms + ttl_ms:
        free -= sum(h.commitment(start, end) for h in held)
        room.append((free, (min(end, now_ms + ttl_ms) - since) / 1000))
        start, end, since, free = end, end + budget.window_ms, end, budget.limit
    return room


def _fits(burst: int, rate: float, room: Room) -> bool:
    return all(burst + rate * seconds <= free for free, seconds in room)


def _kept(
    current: Holder | None, target: float, room: Room, now_ms: int, ttl_ms: int
) -> Assignment | None:
    """The current token bucket again, when it is at most `STEADY` above the target and still
    fits: Envoy keeps a bucket whose assignment is unchanged (no new burst)."""
    if current is None or current.rate <= 0 or not current.live(now_ms):
        return None
    if not target <= current.rate <= target * (1 + STEADY):
        return None
    tokens, interval = _fraction(current.rate)
    if tokens / interval != current.rate or not _fits(current.burst, current.rate, room):
        return None
    return Assignment(Blanket.TOKEN_BUCKET, ttl_ms, tokens, interval, current.burst)


def _token_bucket(target: float, room: Room, ttl_ms: int, burst_seconds: float) -> Assignment:
    """The largest token bucket at most `target` whose commitment fits in every window's room,
    with at least one token a minute; DENY_ALL when not even that fits."""
    # Fit burst + rate * seconds <= free in each window (burst: rate * burst_seconds, MIN_BURST
    # at least).
    wanted = max(target, 1 / MAX_FILL_INTERVAL)
    rate = wanted
    for free, seconds in room:
        rate = min(rate, (free - MIN_BURST) / seconds)
    # Cut below the target by the others' commitments: worth deciding again once they report.
    constrained = rate < wanted * (1 - STEADY)
    while rate >= 1 / MAX_FILL_INTERVAL:
        tokens, interval = _fraction(rate)
        burst = max(MIN_BURST, math.floor(tokens / interval * burst_seconds))
        if _fits(burst, tokens / interval, room):
            return Assignment(
                Blanket.TOKEN_BUCKET, ttl_ms, tokens, interval, burst, constrained=constrained
            )
        constrained = True
        rate = min((free - burst) / seconds for free, seconds in room)
        rate = min(rate, tokens / interval * (1 - 1e-9))
    return Assignment(Blanket.DENY_ALL, ttl_ms, constrained=True)


def _fraction(rate: float) -> tuple[int, int]:
    """`rate` rounded down to `tokens / seconds`, seconds a whole number up to
    `MAX_FILL_INTERVAL` (Envoy's unit); at least one token a minute."""
    if rate >= MAX_FILL_INTERVAL:
        return math.floor(rate), 1
    best = (1, MAX_FILL_INTERVAL)
    for interval in range(1, MAX_FILL_INTERVAL + 1):
        tokens = math.floor(rate * interval + 1e-9)
        if tokens >= 1 and tokens * best[1] > best[0] * interval:
            best = (tokens, interval)
    return best
