"""An operator's view of one descriptor's counters: what they hold and what a check would be
answered now (`state`), and their deletion (`reset`), so that "why is X refused, and until
when?" is answered, and the limit lifted, without knowing how counter keys are built.

A descriptor is named as Envoy names it, a domain and its entries, and goes down the decision
path's own steps: `plan.validate`'s bounds, `matching.match` to its rule, `plan.descriptor_hits`
to its counters' keys (`core.keys` escapes every value, so a crafted value names a counter of
its own domain and descriptor, never another's). The hits cost 0, a check: `state` reads their
counters in one backend call per hash slot and judges them in Python exactly as the script's
read-only mode does (`algorithms.decide`), as a frequency-cap check does; nothing is written.
`reset` deletes each window's counter and the previous window's (a borrowing window's debt, a
sliding window's weight), or a token bucket's state, which leaves it full, and the rule's
penalty (`sidecar.algorithms.penalty`: its block and strikes); `reset_penalty` lifts the penalty
alone. `state` shows the penalty apart from the windows.

What it cannot see: the hits an `approximate` window's sidecars have not synced yet, a
`leased` window's blocks other sidecars hold (a reset drops the serving sidecar's leases; the
others' run until they run out or their window ends, `sidecar.storage.leases`), and a
per-descriptor `limit` override Envoy sends (its counters are named by the entries alike, so a
reset reaches them; the state reports the rules' limit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sidecar.algorithms import packing, penalty, token_bucket
from sidecar.algorithms.decide import Address, State, address, decide
from sidecar.algorithms.penalty import Block
from sidecar.algorithms.token_bucket import Bucket
from sidecar.core.matching import Match, match
from sidecar.core.rules import Rules
from sidecar.decision.limiter import most_restrictive
from sidecar.decision.plan import descriptor_hits, validate
from sidecar.errors import UnknownDomain
from sidecar.model import Algorithm, Descriptor, Entry, Hit, Penalty, Request, Window
from sidecar.storage import Backend
from sidecar.storage.aggregation import Aggregated
from sidecar.storage.per_second import PerSecond


@dataclass(frozen=True, slots=True)
class Located:
    """A descriptor found in the rules: its rule (None when none applies) and, for a limited
    rule, its windows' hits of cost 0 at `now_ms`."""

    domain: str
    entries: tuple[Entry, ...]
    found: Match | None
    hits: tuple[Hit, ...]
    now_ms: int

    @property
    def addresses(self) -> list[Address]:
        """Every value its windows read: each counter and the previous window's, once."""
        where = [address(hit.key, hit.field) for hit in self.hits]
        # A token bucket under its own key has no previous (`Hit.previous` empty).
        where += [address(hit.previous, hit.previous_field) for hit in self.hits if hit.previous]
        return list(dict.fromkeys(where))

    def describe(self) -> dict[str, Any]:
        """The descriptor and its rule, as the answers show them."""
        found = self.found
        answer: dict[str, Any] = {
            "domain": self.domain,
            "entries": [{"key": e.key, "value": e.value} for e in self.entries],
            "rule": None,
        }
        if found is not None:
            limit = found.limit
            answer["rule"] = {
                "key": limit.rule_key,
                "name": limit.name,
                "unlimited": limit.unlimited,
                "shadow_mode": limit.shadow_mode,
                "quota_mode": limit.quota_mode,
                "replaces": list(limit.replaces),
            }
            # The entries its counters are named by: a `share_threshold` wildcard puts its
            # pattern there, and every value it matches shares those counters.
            answer["counted_as"] = [{"key": k, "value": v} for k, v in found.counter_parts]
        return answer


def locate(rules: Rules, domain: str, entries: Sequence[Entry], now_ms: int) -> Located:
    """`entries` of `domain` matched to their rule, as ShouldRateLimit matches a descriptor.
    Raises InvalidRequest for a descriptor the service would refuse, UnknownDomain for a domain
    the rules do not declare."""
    entries = tuple(entries)
    validate(Request(domain, (Descriptor(entries),)))
    tree = rules.domains.get(domain)
    if tree is None:
        known = ", ".join(sorted(rules.domains)) or "none"
        raise UnknownDomain(f"no domain {domain!r} in the rules (domains: {known})")
    found = match(tree, entries) if entries else None
    hits: tuple[Hit, ...] = ()
    if found is not None and not found.limit.unlimited:
        hits = tuple(descriptor_hits(domain, found, 0, 0, now_ms))
    return Located(domain, entries, found, hits, now_ms)


def store_of(backend: Backend, located: Located) -> Backend:
    """Where the decision path keeps this descriptor's counters: the per-second store for a
    descriptor whose windows are all in seconds, when there is one."""
    if isinstance(backend, Aggregated):
        backend = backend.backend  # its read is the store's; its unsynced hits are not read
    if isinstance(backend, PerSecond) and located.found is not None:
        return backend.store_for(located.found.limit.windows)
    return backend


async def state(backend: Backend, located: Located) -> dict[str, Any]:
    """What the descriptor's counters hold and what a check (`hits_addend: 0`) would be
    answered now: `code`, `limit_remaining`, `duration_until_reset` (seconds, as Envoy gets it)
    and `reset_at` of the window the answer reports, then every window on its own. Raises
    StorageError when the backend fails."""
    answer = located.describe()
    hits, now_ms = located.hits, located.now_ms
    answer["windows"] = []
    if not hits:
        answer["code"] = "OK"
        return answer
    where = located.addresses
    values = dict(zip(where, await store_of(backend, located).read(where, now_ms), strict=True))
    outcomes, _ = decide(values.get, hits, now_ms, False, read_only=True)
    windows = answer["windows"]
    limit = located.found.limit if located.found is not None else None
    if limit is not None and limit.penalty is not None:
        # The last hit is the penalty's (`plan.descriptor_hits`): shown apart, not a window.
        answer["penalty"] = _penalty(limit.penalty, values.get(hits[-1].key), now_ms)
        hits, outcomes = hits[:-1], outcomes[:-1]
    for hit, outcome in zip(hits, outcomes, strict=True):
        windows.append(
            {
                **_window(hit.window),
                **_stored(hit, values, now_ms),
                "over": outcome.over,
                "limit_remaining": outcome.remaining,
                "duration_until_reset": -(-outcome.reset_ms // 1000),
                "reset_at": _iso(now_ms + outcome.reset_ms),
            }
        )
    chosen = windows[most_restrictive(outcomes)]
    assert located.found is not None
    shadow = located.found.limit.shadow_mode
    answer["code"] = "OVER_LIMIT" if chosen["over"] and not shadow else "OK"
    answer["would_be_over"] = chosen["over"]
    for name in ("limit_remaining", "duration_until_reset", "reset_at"):
        answer[name] = chosen[name]
    answer["current_limit"] = {
        "requests_per_unit": chosen["requests_per_unit"],
        "unit": chosen["unit"],
        "name": chosen["name"],
    }
    return answer


async def reset(backend: Backend, located: Located) -> int:
    """Delete the descriptor's counters (every window's, and the previous window's where it is
    read); returns how many existed. Raises StorageError when the backend fails."""
    where = located.addresses
    if not where:
        return 0
    return await backend.reset(where)


async def reset_penalty(backend: Backend, located: Located) -> int:
    """Lift the descriptor's penalty (`sidecar.algorithms.penalty`): its block and strikes,
    leaving its counters; returns 1 when there was one. Raises StorageError when the backend
    fails."""
    found = located.found
    if found is None or found.limit.penalty is None or not located.hits:
        return 0
    return await store_of(backend, located).reset([located.hits[-1].key])


def _penalty(rule: Penalty, stored: State | None, now_ms: int) -> dict[str, Any]:
    """A penalty as the operator reads it: the rule's terms, and the descriptor's block (until
    when, at which step of the escalation, after how many trips in a row) if it has one."""
    block = penalty.remembered(stored if isinstance(stored, Block) else None, rule, now_ms)
    answer: dict[str, Any] = {
        "block_seconds": rule.block_ms / 1000,
        "escalate": rule.escalate,
        "max_seconds": rule.max_ms / 1000,
        "forget_after_seconds": rule.forget_after_ms / 1000,
        "blocked": penalty.blocked(block, now_ms),
        "strikes": 0,
        "level": 0,
    }
    if block is not None:
        answer["strikes"] = block.strikes
        answer["level"] = penalty.level(rule, block.strikes)
        answer["blocked_until"] = _iso(block.until_ms)
        answer["block_left_seconds"] = max(0, -(-(block.until_ms - now_ms) // 1000))
    return answer


def _window(window: Window) -> dict[str, Any]:
    described: dict[str, Any] = {
        "name": window.name,
        "algorithm": window.algorithm.value,
        "unit": window.unit.name.lower(),
        "unit_multiplier": window.unit_multiplier,
        "requests_per_unit": window.requests_per_unit,
    }
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        described["burst"] = window.capacity
    if window.borrow:
        described["borrow"] = window.borrow
    if window.calendar:
        described["calendar"] = True
        described["timezone"] = window.timezone
    return described


def _stored(hit: Hit, values: dict[Address, State | None], now_ms: int) -> dict[str, Any]:
    """What the window's counters hold: `count` in the current window (and `previous`, the
    window before, where the algorithm reads it) with its bounds; a bucket's `tokens` now."""
    current = values.get(address(hit.key, hit.field))
    window = hit.window
    if window.algorithm is Algorithm.TOKEN_BUCKET:
        bucket = token_bucket.refill(
            current if isinstance(current, Bucket) else None,
            now_ms,
            window.requests_per_unit,
            window.seconds * 1000,
            window.capacity,
        )
        # Below zero while in debt (`borrow`).
        return {"tokens": math.floor(bucket.tokens * 1000) / 1000}
    count = current if isinstance(current, int) else 0
    if (
        hit.packed is not None
    ):  # the window's share of a packed field (`sidecar.algorithms.packing`)
        count = packing.count(hit.packed, count)
    stored: dict[str, Any] = {
        "count": count,
        "window_start": _iso(hit.start_ms),
        "window_end": _iso(hit.end_ms),
    }
    if not window.plain:
        previous = values.get(address(hit.previous, hit.previous_field))
        stored["previous"] = previous if isinstance(previous, int) else 0
    return stored


def _iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).isoformat(timespec="seconds")
