"""Fixed windows aligned to the Unix epoch: the reference's algorithm.

A window of `W` seconds starts at ``floor(now / W) * W`` and ends `W` seconds later, so every
minute window resets on the minute (UTC) and a "month" is a 30-day block counted from the epoch.
Each window has one counter.

At the limit: a hit of cost `h` on a counter at `before` is OVER_LIMIT when ``before + h > limit``;
a cost larger than the limit is therefore always rejected.
A check (`h == 0`) consumes nothing and answers whether one more hit would be admitted:
OVER_LIMIT as soon as ``before >= limit`` (the reference waits for ``before > limit``, which lets
Envoy's check-then-report pattern serve limit + 1).

Rejected hits: by default every hit is added, rejected or not (the reference's behaviour, which
Envoy's report-after-the-fact pattern needs). With all-or-nothing (`--rejected-hits skip`) a
request whose outcome is OVER_LIMIT adds nothing to any of its counters.

`limit_remaining` is ``max(0, limit - after)``; `duration_until_reset` is ``W - now % W`` seconds.
The same decisions are made in Lua by `lua/fixed_window.lua`; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.model import Count, Hit, Role


def window_start(now: float, window_seconds: int) -> int:
    """Start of the epoch-aligned window holding `now`."""
    second = int(now)
    return second - second % window_seconds


def duration_until_reset(now: float, window_seconds: int) -> int:
    """Whole seconds until the window holding `now` ends, as the reference computes it."""
    return window_seconds - int(now) % window_seconds


def is_over(before: int, hits: int, limit: int) -> bool:
    """Whether adding `hits` to a counter at `before` breaks `limit` (a check asks for one more)."""
    if hits == 0:
        return before >= limit
    return before + hits > limit


def request_is_over(over: Sequence[bool], roles: Sequence[Role]) -> bool:
    """A request's overall outcome from its counters' outcomes, as the reference's `overall_code`.

    Any over-limit BLOCKING counter makes it OVER_LIMIT; QUOTA counters do only when the request
    has at least one and all of them are over; SHADOW counters never do.
    """
    quota_seen = False
    quota_all_over = True
    for is_hit_over, role in zip(over, roles, strict=True):
        if role is Role.BLOCKING:
            if is_hit_over:
                return True
        elif role is Role.QUOTA:
            quota_seen = True
            quota_all_over = quota_all_over and is_hit_over
    return quota_seen and quota_all_over


def remaining(count: Count, hits: int, limit: int) -> int:
    """`limit_remaining` after this request: what is left once the applied hits are counted."""
    after = count.before + hits if count.applied else count.before
    return max(0, limit - after)


def step(stored: Sequence[int], hits: Sequence[Hit], all_or_nothing: bool) -> list[Count]:
    """Decide one request's counters from their stored values; the memory backend's core.

    `stored[i]` is hit i's counter as stored before the request. A key may appear twice in one
    request: the later hit sees the earlier one as added, as in the Lua script.
    Returns one Count per hit, in order; the caller adds ``hits`` to every counter marked applied.
    """
    pending: dict[bytes, int] = {}
    befores = []
    for value, hit in zip(stored, hits, strict=True):
        before = pending.get(hit.key, value)
        befores.append(before)
        pending[hit.key] = before + hit.hits
    applied = True
    if all_or_nothing:
        over = [is_over(b, h.hits, h.limit) for b, h in zip(befores, hits, strict=True)]
        applied = not request_is_over(over, [h.role for h in hits])
    return [Count(b, applied) for b in befores]
