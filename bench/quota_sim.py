"""The quota allocator past this machine: hundreds of simulated gateways sharing one bucket.

Each gateway is Envoy's `rate_limit_quota` filter as a fluid: requests arrive at its demand
(requests per second), its current assignment admits them (a token bucket starts full when the
assignment changes or is sent as a reset, keeps its tokens when it is sent again unchanged; no
assignment or an
expired one denies, as `no_assignment_behavior: DENY_ALL` would), and every reporting interval
(each gateway at its own phase; 5 s by default, as Envoy 1.40 does) it reports what it allowed
and denied. The server side is the sidecar's: the reports go into the window's `used`,
`sidecar.quota.allocator.allocate` decides the reporting gateway's next assignment from every
gateway's `Holder`, and each report costs the backend two operations (one script adds the usage
and reads the holders, one writes the gateway's holder), as `sidecar.quota.store` does on Redis;
an assignment cut below its share is decided again `RETRY_MS` later, and a lease predicted spent
before the gateway's next report gets its dry push (`Assignment.dry_ms`), as the service does.

Scenarios (every one at about three times the limit):
- skewed: demand Zipf-like over the gateways (the busiest asks ~60× the median), steady;
- bursty: every gateway switches on (4× its mean) and off at random, a few seconds each;
- shifting: skewed, then at half time the ranking flips (the busiest become the quietest).

Printed per scenario: the worst window's overshoot (admitted above the limit, in % of it), the
mean and the least use of the limit; fairness, Jain's index of admitted/demanded over the
gateways (1 when every gateway admits the same fraction of its demand), per window, mean and
worst; the time to
converge after the shift (until Jain's index over one-second slices is back at 0.95 or more);
and backend operations per request, against one per request for the RLS path.

    .venv/bin/python -m bench.quota_sim [--gateways 300] [--seconds 240] [--limit 60000]
                                        [--window 60] [--report-interval 5] [--ttl 6]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `python bench/quota_sim.py`: make the `sidecar` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.quota.allocator import (
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
from sidecar.quota.service import RETRY_MS

#: Simulation step: demand changes and gateways report on these boundaries.
STEP_MS = 100
#: Backend operations per report of one bucket (see the module docstring).
OPS_PER_REPORT = 2


@dataclass
class Gateway:
    """One Envoy's side of one bucket, as a fluid (see the module docstring)."""

    demand: float
    assignment: Assignment | None = None
    expires_ms: int = 0
    tokens: float = 0.0
    allowed: float = 0.0
    denied: float = 0.0
    reported_ms: int = 0
    #: The fraction of a request admitted but not reported yet (reports are whole requests).
    carry: float = 0.0
    holder: Holder | None = None
    #: What it admitted and was asked for, by window start and by STEP_MS slice.
    windows: dict[int, float] = field(default_factory=dict)
    asked_windows: dict[int, float] = field(default_factory=dict)

    def run(self, start_ms: int, end_ms: int, window_ms: int) -> None:
        """Admit requests from `start_ms` to `end_ms`, split at window boundaries and expiry."""
        while start_ms < end_ms:
            cut = min(end_ms, start_ms - start_ms % window_ms + window_ms)
            if self.expires_ms > start_ms:
                cut = min(cut, self.expires_ms)
            self._admit(start_ms, cut, window_ms)
            start_ms = cut

    def _admit(self, start_ms: int, end_ms: int, window_ms: int) -> None:
        seconds = (end_ms - start_ms) / 1000
        asked = self.demand * seconds
        assignment = self.assignment if self.expires_ms > start_ms else None
        if assignment is None or assignment.blanket is Blanket.DENY_ALL:
            admitted = 0.0
        elif assignment.blanket is Blanket.ALLOW_ALL:
            admitted = asked
        else:
            rate = assignment.rate
            admitted = min(asked, self.tokens + rate * seconds)
            self.tokens = min(assignment.max_tokens, self.tokens + rate * seconds - admitted)
        window = start_ms - start_ms % window_ms
        self.windows[window] = self.windows.get(window, 0.0) + admitted
        self.asked_windows[window] = self.asked_windows.get(window, 0.0) + asked
        self.allowed += admitted
        self.denied += asked - admitted

    def receive(self, assignment: Assignment, now_ms: int) -> None:
        """Take a new assignment: Envoy keeps its token bucket when the bucket sent is the one it
        has and it is not a reset; a reset (a new lease block) starts full. (Envoy 1.40 starts
        any other changed bucket as full as the one it had, a fraction the fluid does not track:
        the sidecar sends every new lease block as a reset, and a paced bucket's burst is small.)
        """
        old = self.assignment if self.expires_ms > now_ms else None
        same_bucket = (
            not assignment.reset
            and old is not None
            and old.blanket is assignment.blanket is Blanket.TOKEN_BUCKET
            and (old.tokens_per_fill, old.fill_interval, old.max_tokens)
            == (assignment.tokens_per_fill, assignment.fill_interval, assignment.max_tokens)
        )
        if not same_bucket:
            self.tokens = float(assignment.max_tokens)
        self.assignment = assignment
        self.expires_ms = now_ms + assignment.ttl_ms


@dataclass
class Server:
    """The sidecars' side: the window's `used` and every gateway's Holder, as the store keeps
    them, and the operations the store would have run."""

    budget: Budget
    ttl_ms: int
    used: dict[int, int] = field(default_factory=dict)
    holders: dict[str, Holder] = field(default_factory=dict)
    operations: int = 0
    #: Constrained assignments to decide again, by gateway: when (as the service does).
    retries: dict[str, int] = field(default_factory=dict)
    #: When each gateway's lease is predicted spent (a retry due then is a dry push), and the
    #: interval between its last two reports.
    dry_at: dict[str, int] = field(default_factory=dict)
    intervals: dict[str, int] = field(default_factory=dict)

    def report(self, name: str, gateway: Gateway, now_ms: int) -> None:
        window = now_ms - now_ms % self.budget.window_ms
        # Envoy reports whole requests: the fluid's fraction waits for the next report.
        whole = math.floor(gateway.allowed + gateway.carry)
        gateway.carry += gateway.allowed - whole
        current = self.holders.get(name)
        allowed = counted(current, whole, window, now_ms)
        self.used[window] = self.used.get(window, 0) + allowed
        holds = 0.0
        if not self.budget.pace:
            _, holds = lease_owed(current, allowed, window, now_ms, report=True)
        elapsed = (now_ms - gateway.reported_ms) / 1000 if gateway.reported_ms else 0
        demand = (gateway.allowed + gateway.denied) / elapsed if elapsed else None
        if elapsed:
            self.intervals[name] = now_ms - gateway.reported_ms
        gateway.allowed = gateway.denied = 0.0
        gateway.reported_ms = now_ms
        others = [h for n, h in self.holders.items() if n != name]
        assignment, holder = allocate(
            self.budget,
            name,
            demand,
            others,
            self.used[window],
            now_ms,
            self.ttl_ms,
            current=current,
            holds=holds,
            next_report_ms=now_ms + self.intervals[name] if name in self.intervals else None,
        )
        self.holders[name] = holder
        self.operations += OPS_PER_REPORT
        gateway.receive(assignment, now_ms)
        self.schedule(name, assignment, now_ms)

    def schedule(
        self, name: str, assignment: Assignment, now_ms: int, retried: bool = False
    ) -> None:
        """A constrained assignment is decided again soon (once per report); a lease that ends
        with its window, as the window turns; one predicted spent before the next report, then
        (as the service does)."""
        self.dry_at.pop(name, None)
        if assignment.constrained and not retried:
            self.retries[name] = now_ms + RETRY_MS
        elif assignment.turns:
            self.retries[name] = now_ms + assignment.ttl_ms
        elif assignment.spent:  # the next window's, as it begins
            self.retries[name] = now_ms + assignment.ttl_ms - WINDOW_GRACE_MS
        else:
            self.retries.pop(name, None)
        if assignment.dry_ms is not None:
            self.dry_at[name] = now_ms + assignment.dry_ms
            self.retries[name] = min(self.retries.get(name, self.dry_at[name]), self.dry_at[name])

    def retry(self, now_ms: int, fleet: Sequence[Gateway]) -> None:
        """Decide again the assignments due by `now_ms` (without a report): constrained ones, and
        leases as their window turns."""
        for name, due in list(self.retries.items()):
            if due > now_ms:
                continue
            del self.retries[name]
            current = self.holders[name]
            window = now_ms - now_ms % self.budget.window_ms
            others = [h for n, h in self.holders.items() if n != name]
            assignment, self.holders[name] = allocate(
                self.budget,
                name,
                None,
                others,
                self.used.get(window, 0),
                now_ms,
                self.ttl_ms,
                owed=(
                    owed_since(current, window, now_ms)
                    if self.budget.pace
                    else lease_owed(current, 0, window, now_ms, report=False)[0]
                ),
                current=current,
                next_report_ms=(
                    current.reported_ms + self.intervals[name] if name in self.intervals else None
                ),
                dry=self.dry_at.get(name, now_ms + 1) <= now_ms,
            )
            self.operations += OPS_PER_REPORT
            fleet[int(name)].receive(assignment, now_ms)
            self.schedule(name, assignment, now_ms, retried=True)


Demand = Callable[[int, int, random.Random], float]


def skewed(count: int, total: float) -> list[float]:
    """Zipf-like demand (exponent 1.1) over `count` gateways, summing to `total`."""
    weights = [1 / (rank + 1) ** 1.1 for rank in range(count)]
    scale = total / sum(weights)
    return [w * scale for w in weights]


@dataclass
class Result:
    name: str
    worst_overshoot: float
    mean_use: float
    #: The least-used window's use of the limit.
    worst_use: float
    mean_jain: float
    worst_jain: float
    converge_s: float | None
    operations_per_request: float
    seconds: float


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


def simulate(
    name: str,
    demands: Callable[[int], list[float]],
    *,
    gateways: int,
    seconds: int,
    budget: Budget,
    report_ms: int,
    ttl_ms: int,
    shift_ms: int | None,
    seed: int = 1,
    settle: int = 1,
) -> Result:
    """Run one scenario; `demands(t_ms)` gives every gateway's demand from `t_ms` on; the first
    `settle` windows are left out of the result."""
    rng = random.Random(seed)
    began = time.perf_counter()
    start = 1_700_000_040_000 - 1_700_000_040_000 % budget.window_ms
    fleet = [Gateway(0.0) for _ in range(gateways)]
    phases = [rng.randrange(0, report_ms // STEP_MS) * STEP_MS for _ in range(gateways)]
    server = Server(budget, ttl_ms)
    slices: list[float] = []
    converged: float | None = None
    asked_total = 0.0
    for step in range(seconds * 1000 // STEP_MS):
        now = start + step * STEP_MS
        for gateway, demand in zip(fleet, demands(step * STEP_MS), strict=True):
            gateway.demand = demand
        for index, gateway in enumerate(fleet):
            # A gateway's first request is reported at once; then every report_ms.
            due = (step * STEP_MS - phases[index]) % report_ms == 0 and step * STEP_MS >= phases[
                index
            ]
            if due and (gateway.reported_ms or gateway.demand > 0):
                server.report(str(index), gateway, now)
        server.retry(now, fleet)
        before = [(g.allowed, g.denied) for g in fleet]
        for gateway in fleet:
            gateway.run(now, now + STEP_MS, budget.window_ms)
        shares = []
        for gateway, (allowed, denied) in zip(fleet, before, strict=True):
            asked = gateway.allowed + gateway.denied - allowed - denied
            asked_total += asked
            if asked > 0:
                shares.append((gateway.allowed - allowed) / asked)
        slices.append(jain(shares))
        if shift_ms is not None and converged is None and step * STEP_MS >= shift_ms:
            # Converged once a whole second of slices is fair again.
            last = slices[-(1000 // STEP_MS) :]
            if min(last) >= 0.95 and (step * STEP_MS - shift_ms) >= 1000:
                converged = (step * STEP_MS - shift_ms) / 1000 - 1
    # Whole windows, past the first `settle` (where every gateway is new).
    end = start + seconds * 1000
    windows = [
        w
        for w in sorted({w for g in fleet for w in g.windows})
        if start + (settle - 1) * budget.window_ms < w <= end - budget.window_ms
    ]
    overshoot, use, fairness = [], [], []
    assert budget.limit is not None
    for window in windows:
        admitted = sum(g.windows.get(window, 0.0) for g in fleet)
        overshoot.append(max(0.0, admitted - budget.limit) / budget.limit)
        use.append(admitted / budget.limit)
        fairness.append(
            jain(
                [
                    g.windows.get(window, 0.0) / g.asked_windows[window]
                    for g in fleet
                    if g.asked_windows.get(window, 0.0) > 0
                ]
            )
        )
    return Result(
        name,
        max(overshoot, default=0.0),
        sum(use) / max(1, len(use)),
        min(use, default=1.0),
        sum(fairness) / max(1, len(fairness)),
        min(fairness, default=1.0),
        converged,
        server.operations / asked_total if asked_total else 0.0,
        time.perf_counter() - began,
    )


def scenarios(
    gateways: int, total: float, seconds: int, seed: int
) -> list[tuple[str, Callable[[int], list[float]], int | None]]:
    """(name, demand over time, when the demand shifts) for each scenario."""
    base = skewed(gateways, total)
    flipped = list(reversed(base))
    half = seconds * 1000 // 2
    rng = random.Random(seed)
    mean = total / gateways
    # Bursty: each gateway on (4× the mean) or off, switching with probability 1/30 a step.
    state = [rng.random() < 0.25 for _ in range(gateways)]
    cache: dict[int, list[float]] = {}

    def bursty(t_ms: int) -> list[float]:
        if t_ms not in cache:
            for i in range(gateways):
                if rng.random() < 1 / 30:
                    state[i] = not state[i] if rng.random() < 0.5 else rng.random() < 0.25
            cache.clear()
            cache[t_ms] = [4 * mean if on else 0.0 for on in state]
        return cache[t_ms]

    return [
        ("skewed", lambda t: base, None),
        ("bursty", bursty, None),
        ("shifting", lambda t: base if t < half else flipped, half),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quota_sim", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gateways", type=int, default=300)
    parser.add_argument("--seconds", type=int, default=240)
    parser.add_argument("--limit", type=int, default=60_000, help="requests per window")
    parser.add_argument("--window", type=int, default=60, help="window, seconds")
    parser.add_argument(
        "--report-interval",
        type=float,
        default=5.0,
        help="seconds (Envoy 1.40's, whatever its config says)",
    )
    parser.add_argument("--ttl", type=float, default=6.0, help="assignment_time_to_live, seconds")
    parser.add_argument("--load", type=float, default=3.0, help="demand over the limit's pace")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--pace", action="store_true", help="a `pace: true` rule's budget (else leased)"
    )
    args = parser.parse_args(argv)
    budget = Budget(args.limit, args.window * 1000, pace=args.pace)
    total = args.load * args.limit / args.window
    print(
        f"{args.gateways} gateways, limit {args.limit} per {args.window} s, demand "
        f"{args.load:g}× ({total:,.0f}/s), reports every {args.report_interval:g} s, "
        f"TTL {args.ttl:g} s, {args.seconds} s each, {'paced' if args.pace else 'leased'}"
    )
    print(
        f"{'scenario':<10} {'overshoot':>9} {'use':>6} {'least':>6} {'jain':>6} {'worst':>6} "
        f"{'converge':>9} {'ops/req':>8} {'RLS ops/req':>11} {'took':>6}"
    )
    only = {n for n in args.only.split(",") if n}
    for name, demands, shift in scenarios(args.gateways, total, args.seconds, args.seed):
        if only and name not in only:
            continue
        result = simulate(
            name,
            demands,
            gateways=args.gateways,
            seconds=args.seconds,
            budget=budget,
            report_ms=int(args.report_interval * 1000),
            ttl_ms=int(args.ttl * 1000),
            shift_ms=shift,
            seed=args.seed,
        )
        converge = (
            "-"
            if shift is None
            else ("never" if result.converge_s is None else f"{result.converge_s:.1f} s")
        )
        print(
            f"{name:<10} {result.worst_overshoot:>8.2%} {result.mean_use:>6.1%} "
            f"{result.worst_use:>6.1%} "
            f"{result.mean_jain:>6.3f} {result.worst_jain:>6.3f} {converge:>9} "
            f"{result.operations_per_request:>8.4f} {1:>11} {result.seconds:>5.0f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
