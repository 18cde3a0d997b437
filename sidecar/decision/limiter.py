"""The use case: decide one ShouldRateLimit request.

prepare (once per request body and rules, `sidecar.decision.plan`): validate, judge it by the allow and
deny lists (a listed request is answered and counted in stats, and touches no counter), match
each descriptor to a rule, drop replaced and unlimited rules, name the counters → decide (every
call): one `backend.apply` for all remaining counters → per-descriptor statuses →
`overall_code` (shadow and quota modes) → stats. The clock is injected; nothing here knows
about protobuf, gRPC or Redis.

`decide` is the decision, through callbacks (`_begin` before the store is waiting,
`_finish` after; `sidecar.loop.callbacks.awaited` for a coroutine). A straight plan
(`Plan.straight`: each counted descriptor one window, all blocking), the usual request, skips
`_begin`'s lookups while no counter is known to be over; every decision is read back by the
same `_finish`.

One module past the usual size because it is one decision written once, in the order a call
runs it (`_begin`, the store, `_finish`, the failure modes); the compiled build compiles it
whole, so the hot path's calls between these steps stay native.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, TypeVar

import structlog

from sidecar.algorithms import fixed_window
from sidecar.core.lists import Listed
from sidecar.core.rules import Rules
from sidecar.decision.over_limit_cache import Added, OverLimitCache
from sidecar.decision.plan import Counted, Plan, prepare
from sidecar.decision.stats import RuleStats, Stats
from sidecar.errors import InvalidRequest, NegativeHitsRefused, Overloaded, StorageError
from sidecar.model import (
    Code,
    Decision,
    DescriptorStatus,
    Hit,
    Outcome,
    Request,
    Role,
    Window,
    new,
)
from sidecar.storage import Backend
from sidecar.storage.memory import MemoryBackend

FailureMode = Literal["allow", "deny", "local"]
T = TypeVar("T")
RejectedHits = Literal["count", "skip"]

log = structlog.get_logger("sidecar.limiter")

#: Distinct windows whose local share `--failure-mode local` keeps (the rules' windows, so a few
#: hundred at most; past this the shares are worked out afresh, which only costs time).
LOCAL_WINDOWS: Final = 4096

#: The codes every call writes. On Python 3.11 an enum member read through its class
#: (`Code.OK`) is a Python-level descriptor call, a dozen times the cost of a global's read.
_OK: Final = Code.OK
_OVER_LIMIT: Final = Code.OVER_LIMIT


@dataclass(frozen=True, slots=True)
class Settings:
    """How the limiter treats over-limit results and backend failures.

    shadow_mode: global shadow mode, an OVER_LIMIT request is answered OK (statuses unchanged).
    rejected_hits: "count" adds rejected hits like the reference; "skip" makes a request that
    ends OVER_LIMIT add nothing to any counter.
    failure_mode: on a backend error, "allow" answers OK with no limit; "deny" answers
    OVER_LIMIT for every limited descriptor; "local" decides the call on counters in this
    process's memory, each window's limit divided by `local_divisor` (the number of sidecars
    that share the backend's counters, so that together they admit about the limit; the app
    learns it from the backend under `--local-divisor auto`: `Limiter.share_with`), and
    goes back to the shared counters as soon as the backend answers again. A call the backend refuses as Overloaded (it has
    as many calls in flight as it answers in time) is not a backend error: it is raised to
    the transport, which answers UNAVAILABLE, and never answered by the failure mode.
    negative_hits: take refunds (`is_negative_hits`, see `sidecar.algorithms.refunds`); off, and
    under rejected_hits "skip", a request carrying one is refused (`refunds_allowed`).
    """

    shadow_mode: bool = False
    rejected_hits: RejectedHits = "count"
    failure_mode: FailureMode = "allow"
    #: Under failure_mode "local": how many sidecars share the counters (each enforces
    #: limit / local_divisor, rounded down, at least 1 of a limit that is not 0).
    local_divisor: int = 1
    #: Refunds (`is_negative_hits`) are taken (`--negative-hits`, ENABLE_NEGATIVE_HITS); off,
    #: a request carrying one is refused (`NegativeHitsRefused`).
    negative_hits: bool = False

    def __post_init__(self) -> None:
        if self.local_divisor < 1:
            raise ValueError(f"local_divisor must be at least 1, not {self.local_divisor}")


def local_share(limit: int, divisor: int) -> int:
    """One sidecar's share of `limit` when `divisor` sidecars enforce it apart: rounded down,
    so that together they admit no more than the limit, except that a limit that is not 0 keeps
    at least 1 (a share of 0 would turn a small limit into a block)."""
    if limit <= 0:
        return limit
    return max(1, limit // divisor)


class Limiter:
    """Decides ShouldRateLimit requests: the rules served (`rules`, replaced on a reload), the
    backend their counters live in, and how over-limit answers and backend failures are
    treated (`Settings`).

    `prepare` makes a request's plan (cached by the service per body); `decide` decides a
    plan with at most one backend call, through a callback. Beside the backend it keeps the
    over-limit cache (windows known to be over, answered without a call), and under
    `--failure-mode local` this process's own counters, used while the backend fails.
    """

    def __init__(
        self,
        rules: Rules,
        backend: Backend,
        *,
        settings: Settings | None = None,
        stats: Stats | None = None,
        clock: Callable[[], float] = time.time,
        over_limit_cache: int = 0,
    ) -> None:
        self.rules = rules
        self.backend = backend
        self.settings = settings or Settings()
        self.stats = stats or Stats()
        self._clock = clock
        self._backend_failing = False
        #: A request that ends OVER_LIMIT adds nothing (`--rejected-hits skip`, not in shadow).
        self._all_or_nothing = (
            self.settings.rejected_hits == "skip" and not self.settings.shadow_mode
        )
        #: Plain windows known to be over, answered without waiting for the backend (None:
        #: off), their hits added to it afterwards through `apply`.
        self.over_limit_cache = (
            OverLimitCache(over_limit_cache, self._count_refused)
            if over_limit_cache and backend.name != "memory"
            else None
        )
        #: The cache as decisions use it: not with `--rejected-hits skip`, where a refused
        #: request must still be judged as a whole.
        self._cache = self.over_limit_cache if self.settings.rejected_hits == "count" else None
        #: `--failure-mode local`: the counters of this process, used while the backend fails
        #: (bounded as the memory backend is: each expires with its window).
        self.local: MemoryBackend | None = (
            MemoryBackend() if self.settings.failure_mode == "local" else None
        )
        #: Each window of the rules and its local share (at most LOCAL_WINDOWS).
        self._local_windows: dict[Window, Window] = {}
        #: What limits are divided by under "local" (see `share_with`).
        self.local_divisor = self.settings.local_divisor

    def share_with(self, sidecars: int) -> None:
        """Under `--failure-mode local`, divide limits by `sidecars` from now on: how many were
        last seen sharing the counters (`--local-divisor auto`, see `sidecar.storage.peers`)."""
        sidecars = max(1, sidecars)
        if sidecars != self.local_divisor:
            log.info("local_divisor", sidecars=sidecars, was=self.local_divisor)
            self.local_divisor = sidecars
            self._local_windows = {}

    def prepare(self, request: Request) -> Plan:
        """The plan of `request` under the current rules (see `sidecar.decision.plan`); raises
        InvalidRequest, counted as a service error, for a request that breaks the protocol."""
        try:
            plan = prepare(self.rules, request)
            if plan.refunds:
                refunds_allowed(self.settings)
        except InvalidRequest as exc:
            self.stats.refused(exc)
            raise
        return plan

    def decide(
        self,
        plan: Plan,
        encode: Callable[[Decision], T],
        done: Callable[[T | Exception], None],
    ) -> None:
        """Decide a prepared request (prepared against `self.rules`: see `prepare`), through a
        callback (the one form, see `sidecar.loop.callbacks`): `done` gets the decision as `encode`
        writes it (the transport's bytes), or the exception the call ended with once the store
        has answered (Overloaded, or a bug); at once when no store call is needed, else when
        the store answers. What goes wrong before that is raised here."""
        cache = self._cache
        if plan.positions and (cache is None or not cache.ends):  # a straight plan
            # The usual request (`Plan.straight`), with nothing known to be over: what `_begin`
            # would hand on, without its lookups.
            self.stats.total_requests += 1
            now_ms = int(self._clock() * 1000)
            # `_gather`'s straight branch, written out here: gathered by `_gather`, the usual
            # request measured 65,425 instructions a call against 64,981 written out (compiled,
            # memory backend; bench.instructions), 0.7% more.
            counted = plan.positions
            if len(counted) == 1:
                hits = counted[0][0].windows.at(now_ms)
            else:
                hits = [item.windows.at(now_ms)[0] for item, _ in counted]
            statuses = list(plan.statuses)
            waiting = _Waiting(self, plan, statuses, [], counted, hits, now_ms, encode, done)
        else:
            begun = self._begin(plan, encode, done)
            if isinstance(begun, Decision):
                done(encode(begun))
                return
            waiting = begun
        if cache is not None and cache.pending:
            cache.flush()  # ahead of this call, as they came before it
        self.backend.apply(waiting.hits, self._all_or_nothing, waiting.now_ms, waiting)

    def _begin(
        self, plan: Plan, encode: Callable[[Decision], Any], done: Callable[[Any], None]
    ) -> Decision | _Waiting:
        """The decision when no store call is needed, else what to ask the store."""
        stats = self.stats
        stats.total_requests += 1
        if not plan.known_domain:
            request = plan.request
            stats.domain_not_found[request.domain] += len(request.descriptors)
            return Decision(_OK, plan.statuses)
        counted_all = plan.counted
        usage = plan.usage
        if not counted_all:
            listed = plan.listed
            if listed is not None:
                return self._listed(plan, listed)
            if usage is None:
                return Decision(_OK, plan.statuses)
            # Nothing to judge, but the call is counted in the domain's usage.
            now_ms = int(self._clock() * 1000)
            hits = usage.at(now_ms)
            return _Waiting(self, plan, list(plan.statuses), [], (), hits, now_ms, encode, done)

        now_ms = int(self._clock() * 1000)
        statuses = list(plan.statuses)
        judged: list[tuple[bool, Role]] = []  # (over, role) of descriptors judged without a call
        cache = self._cache
        if cache is not None and (not cache.ends or plan.refunds):
            # Nothing is known to be over: no lookups. A refund is never refused: a request
            # with one asks the store about every descriptor.
            cache = None
        counted, hits = self._gather(plan, now_ms, cache, statuses, judged)
        if usage is not None:
            # A descriptor refused from the over-limit cache refuses the request (unless it is a
            # shadow or quota one: then the call's answer decides).
            refused = any(role is Role.BLOCKING for _, role in judged)
            if not hits:
                assert cache is not None  # only the cache judges without a call
                cache.queue(usage.at(now_ms, refused=True))
                return self._overall(judged, statuses)
            hits = hits + usage.at(now_ms, refused)  # `hits` may be the windows' own list
        if not hits:
            return self._overall(judged, statuses)
        return _Waiting(self, plan, statuses, judged, counted, hits, now_ms, encode, done)

    def _gather(
        self,
        plan: Plan,
        now_ms: int,
        cache: OverLimitCache | None,
        statuses: list[DescriptorStatus],
        judged: list[tuple[bool, Role]],
    ) -> tuple[Sequence[tuple[Counted, int]], list[Hit]]:
        """The hits one store call sends for `plan`'s counted descriptors at `now_ms`, and each
        descriptor with the position of its first hit among them: the one way a decision
        gathers its hits (`decide` writes out the straight branch, for speed). A
        descriptor `cache` knows to be over sends none: its status is set in `statuses` and its
        (over, role) added to `judged`. `cache` None: no lookups.

        With no lookups, a descriptor of one window sends its windows' own list (no copy), and a
        straight plan's positions are its own."""
        if cache is None and plan.positions:  # straight: one window each, positions known
            counted = plan.positions
            if len(counted) == 1:
                return counted, counted[0][0].windows.at(now_ms)
            return counted, [item.windows.at(now_ms)[0] for item, _ in counted]
        items = plan.counted
        if cache is None and len(items) == 1:
            return ((items[0], 0),), items[0].windows.at(now_ms)
        gathered: list[tuple[Counted, int]] = []
        hits: list[Hit] = []
        for item in items:
            windows = item.windows.at(now_ms)
            if cache is not None and (status := self._cached(cache, item, windows, now_ms)):
                statuses[item.index] = status
                judged.append((True, item.match.limit.role))
                continue
            gathered.append((item, len(hits)))
            hits += windows
        return gathered, hits

    def _listed(self, plan: Plan, listed: Listed) -> Decision:
        """The answer of a request an allow or deny list decided (`sidecar.core.lists`), counted by
        its list and by nothing else."""
        if listed.denied:
            self.stats.denied_by_list[listed.stat] += 1
        else:
            self.stats.allowed_by_list[listed.stat] += 1
        return self._answer(listed.denied, list(plan.statuses))

    def _finish(self, waiting: _Waiting, outcomes: list[Outcome]) -> Decision:
        """The decision once the store has answered `outcomes` for `waiting.hits`."""
        if self._backend_failing:
            self._recovered()
        if waiting.plan.refunds:
            _refunded(waiting, outcomes, self._cache)
        return self._read(waiting, waiting.hits, outcomes, self._cache)

    def _read(
        self,
        waiting: _Waiting,
        hits: list[Hit],
        outcomes: list[Outcome],
        cache: OverLimitCache | None,
    ) -> Decision:
        """The decision `outcomes` give for `hits` (`waiting.hits`, or their local shares); the
        windows found over go to `cache`.

        Each descriptor reports its most restrictive window; a descriptor of one window (every
        descriptor of a straight plan, the usual request) reports its one hit's outcome, read
        in one pass with no look at the others."""
        statuses = waiting.statuses
        judged = waiting.judged
        now_ms = waiting.now_ms
        rules = self.stats.rules
        # Every descriptor blocks: the request is over exactly when one is, so the (over, role)
        # of each need not be kept for `_overall` (a tuple and an append per descriptor saved).
        blocking_only = waiting.plan.blocking_only
        any_over = False
        for item, first in waiting.counted:
            found = item.match
            limit = found.limit
            count = len(limit.windows)
            chosen = first
            if count > 1:
                chosen += most_restrictive(outcomes[first : first + count])
            over, remaining, reset_ms, _, left_before = outcomes[chosen]
            window = hits[chosen].window
            if not blocking_only:
                judged.append((over, limit.role))
            allowed = window.requests_per_unit
            before = allowed - left_before
            shadow = limit.shadow_mode
            rules[found.metric_key].record(
                allowed, before if before > 0 else 0, item.cost, over, shadow
            )
            statuses[item.index] = new(
                DescriptorStatus,
                (
                    _OVER_LIMIT if over and not shadow else _OK,
                    limit,
                    remaining,
                    # Rounded up: Envoy rounds it down for Retry-After, and a client that waits
                    # that long must find the hit admitted (see the algorithms' wait_ms).
                    -(-reset_ms // 1000),
                    window,
                ),
            )
            if over:
                any_over = True
                if limit.penalty is not None:
                    # Its outcome follows its windows'; a window it blocks is not over for the
                    # over-limit cache, which would answer it with the window's end.
                    _penalised(rules[found.metric_key], outcomes[first + count], item.cost)
                elif cache is not None:
                    for position in range(first, first + count):
                        hit = hits[position]
                        if outcomes[position].over and hit.window.plain:
                            cache.put(hit.counter, hit.end_ms, now_ms)
        if blocking_only:
            # `judged` holds only the descriptors answered from the over-limit cache: over.
            return self._answer(any_over or bool(judged), statuses)
        return self._overall(judged, statuses)

    def _recovered(self) -> None:
        """The store answers again after a failure: said once."""
        self._backend_failing = False
        log.info("backend_recovered", backend=self.backend.name)

    def _overall(
        self, judged: list[tuple[bool, Role]], statuses: list[DescriptorStatus]
    ) -> Decision:
        """`overall_code` from the descriptors' outcomes, then global shadow mode."""
        over = fixed_window.request_is_over([o for o, _ in judged], [r for _, r in judged])
        return self._answer(over, statuses)

    def _answer(self, over: bool, statuses: list[DescriptorStatus]) -> Decision:
        """The decision for a request that is `over` or not, after global shadow mode."""
        if over:
            if not self.settings.shadow_mode:
                return new(Decision, (_OVER_LIMIT, tuple(statuses)))
            self.stats.global_shadow_mode += 1
        return new(Decision, (_OK, tuple(statuses)))

    def _cached(
        self, cache: OverLimitCache, item: Counted, windows: list[Hit], now_ms: int
    ) -> DescriptorStatus | None:
        """The status of a descriptor one of whose plain windows is known to be over, if any
        (its hits are added to the store after the answer: see `OverLimitCache.refuse`)."""
        refused = cache.refuse(windows, now_ms)
        if refused is None:
            return None
        hit, end = refused
        limit = item.match.limit
        rule = self.stats.rules[item.match.metric_key]
        rule.record(hit.limit, hit.limit, hit.hits, True, limit.shadow_mode)
        rule.over_limit_with_local_cache += hit.hits
        return DescriptorStatus(
            _OK if limit.shadow_mode else _OVER_LIMIT,
            limit,
            0,
            -(-(end - now_ms) // 1000),
            hit.window,
        )

    def _count_refused(self, hits: list[Hit]) -> None:
        """Add `hits`, which the over-limit cache refused, to the store (see `OverLimitCache`);
        the reply tells the cache which of them were reset meanwhile (`Added`)."""
        cache = self.over_limit_cache
        assert cache is not None  # only the cache refuses hits to add
        self.backend.apply(hits, False, int(self._clock() * 1000), Added(cache, hits))

    def _on_backend_failure(self, exc: StorageError, waiting: _Waiting) -> Decision:
        """Answer by the failure mode; log the first failure of a run, not every request.

        Descriptors already judged without the backend (known to be over) keep their answer.
        Under "local" the hits are decided on this process's counters, each window at its local
        share; the over-limit cache learns nothing from them (they are not the shared counters).
        """
        self.stats.backend_error += 1
        if not self._backend_failing:
            self._backend_failing = True
            log.warning(
                "backend_failure",
                backend=self.backend.name,
                error=str(exc),
                failure_mode=self.settings.failure_mode,
            )
        if self.local is not None:
            return self._decide_locally(self.local, waiting)
        statuses, judged, hits, now_ms = (
            waiting.statuses,
            waiting.judged,
            waiting.hits,
            waiting.now_ms,
        )
        if self.settings.failure_mode == "deny":
            for item, first in waiting.counted:
                limit = item.match.limit
                if limit.role is Role.SHADOW:
                    continue
                judged.append((True, Role.BLOCKING))
                hit = hits[first]
                statuses[item.index] = DescriptorStatus(
                    Code.OVER_LIMIT, limit, 0, -(-(hit.end_ms - now_ms) // 1000), hit.window
                )
        return self._overall(judged, statuses)

    def _decide_locally(self, local: MemoryBackend, waiting: _Waiting) -> Decision:
        """`waiting.hits` decided on `local`'s counters at each window's local share; the
        statuses report the share, which is the limit this sidecar enforces meanwhile."""
        shares = self._local_windows
        if len(shares) > LOCAL_WINDOWS:
            shares.clear()
        divisor = self.local_divisor
        local_hits = []
        now_ms = waiting.now_ms
        for hit in waiting.hits:
            window = hit.window
            share = shares.get(window)
            if share is None:
                share = shares[window] = dataclasses.replace(
                    window,
                    requests_per_unit=local_share(window.requests_per_unit, divisor),
                    burst=None if window.burst is None else local_share(window.burst, divisor),
                    borrow=window.borrow // divisor,
                )
            local_hits.append(dataclasses.replace(hit, window=share))
        answered: list[list[Outcome] | Exception] = []
        local.apply(local_hits, self._all_or_nothing, now_ms, answered.append)
        (outcomes,) = answered
        if isinstance(outcomes, Exception):  # a bug in the memory backend: raised as one
            raise outcomes
        self.stats.local_decisions += 1
        if waiting.plan.refunds:
            _refunded(waiting, outcomes, None)
        return self._read(waiting, local_hits, outcomes, None)


def refunds_allowed(settings: Settings) -> None:
    """Raise NegativeHitsRefused unless a sidecar with `settings` takes refunds: with
    `negative_hits` on, and rejected hits counted (under `skip` a refused request adds nothing,
    yet Envoy refunds it at its stream's end too, so the refund would give back what was never
    counted)."""
    if settings.rejected_hits == "skip":
        raise NegativeHitsRefused(
            "is_negative_hits (a refund) is not taken by a sidecar run with --rejected-hits "
            "skip: a request it refused added nothing, but Envoy refunds it too"
        )
    if not settings.negative_hits:
        raise NegativeHitsRefused(
            "is_negative_hits (a refund) is off: run serve with --negative-hits "
            "(ENABLE_NEGATIVE_HITS=true) to take refunds"
        )


def _penalised(rule: RuleStats, penalty: Outcome, cost: int) -> None:
    """Count a penalty's outcome (`sidecar.algorithms.penalty`) in its rule's stats: a block
    started (`applied`), or the hits a block refused (`over`; a shadow rule's would-be)."""
    if penalty.applied:
        rule.penalty_blocks += 1
    elif penalty.over:
        rule.over_limit_with_penalty += cost


def _refunded(waiting: _Waiting, outcomes: list[Outcome], cache: OverLimitCache | None) -> None:
    """Read the outcomes of a plan's refunds as refunds: never over (a refund of 0, a check,
    may have found its counter full), and a plain window a refund took back under its limit
    forgotten by the over-limit cache (another sidecar's cache knows nothing of it)."""
    hits = waiting.hits
    for item, first in waiting.counted:
        if not item.refund:
            continue
        for position in range(first, first + len(item.match.limit.windows)):
            outcome = outcomes[position]
            if outcome.over:
                outcomes[position] = outcome._replace(over=False)
            hit = hits[position]
            if cache is not None and outcome.remaining > 0 and hit.window.plain:
                cache.forget(hit.counter)


class Judged(Protocol):
    """What `most_restrictive` compares: an Outcome, or a window a frequency-cap check judged."""

    @property
    def over(self) -> bool: ...

    @property
    def remaining(self) -> int: ...

    @property
    def reset_ms(self) -> int: ...


def most_restrictive(outcomes: Sequence[Judged]) -> int:
    """The window a descriptor reports, by its position among the descriptor's `outcomes`: of
    those over their limit, the one whose reset is latest (an over window's reset is when it
    would admit the hit, and the descriptor is admitted only once all of them do: its
    `duration_until_reset`, Envoy's Retry-After, must be the longest); else the one with least
    left."""
    chosen = 0
    over = False
    for position, outcome in enumerate(outcomes):
        if outcome.over:
            if not over or outcome.reset_ms > outcomes[chosen].reset_ms:
                chosen, over = position, True
        elif not over and outcome.remaining < outcomes[chosen].remaining:
            chosen = position
    return chosen


class _Waiting:
    """A decision asking the store: what `Limiter._begin` (or the straight path) hands on, and
    what `Limiter.decide` hands the backend to call with its answer.

    It holds the plan, the statuses so far, the (over, role) of descriptors judged without the
    store, the counted descriptors with the position of their first hit, the hits, the time,
    and the caller's `encode` and `done`. An object rather than a closure: compiled, a closure
    and its environment refer to each other, so every call left a cycle of six objects to the
    garbage collector (about 2,000 instructions a call on the memory backend).
    """

    __slots__ = (
        "counted",
        "done",
        "encode",
        "hits",
        "judged",
        "limiter",
        "now_ms",
        "plan",
        "statuses",
    )

    def __init__(
        self,
        limiter: Limiter,
        plan: Plan,
        statuses: list[DescriptorStatus],
        judged: list[tuple[bool, Role]],
        counted: Sequence[tuple[Counted, int]],
        hits: list[Hit],
        now_ms: int,
        encode: Callable[[Decision], Any],
        done: Callable[[Any], None],
    ) -> None:
        self.limiter = limiter
        self.plan = plan
        self.statuses = statuses
        self.judged = judged
        self.counted = counted
        self.hits = hits
        self.now_ms = now_ms
        self.encode = encode
        self.done = done

    def __call__(self, outcomes: list[Outcome] | Exception) -> None:
        """Hand `done` the decision the store's `outcomes` give (encoded), or the exception the
        call ended with: StorageError is answered by the failure mode, Overloaded (refused, not
        failed: never the failure mode) and a bug are handed on."""
        limiter = self.limiter
        answer: Any
        try:
            if isinstance(outcomes, list):
                answer = self.encode(limiter._finish(self, outcomes))
            elif isinstance(outcomes, StorageError):
                answer = self.encode(limiter._on_backend_failure(outcomes, self))
            else:
                if isinstance(outcomes, Overloaded):
                    limiter.stats.refused(outcomes)
                answer = outcomes
        except Exception as exc:
            answer = exc
        self.done(answer)
