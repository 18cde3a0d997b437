"""Fixed windows: the reference's algorithm, and windows that may borrow from the next one.

A window of `W` seconds (`unit` × `unit_multiplier`) starts at ``floor(now / W) * W``, so a
minute resets on the minute (UTC) and a "month" is a 30-day block counted from the epoch;
calendar windows (`calendar: true`) follow a time zone's wall clock instead (see `windows.py`).
Each window has one counter.

At the limit: a hit of cost `c` on a counter at `used` is OVER_LIMIT when ``used + c > limit``, so a
cost above the limit is always rejected. A check (cost 0) consumes nothing and answers whether
one more hit would be admitted: OVER_LIMIT as soon as ``used >= limit``. (The reference waits for
``used > limit``, which lets Envoy's check-then-report pattern serve limit + 1.)

Rejected hits, plain windows: every hit is added, admitted or not, as the reference does (Envoy's
report-after-the-fact pattern needs it: a report is a fact). With `--rejected-hits skip` a
request that ends OVER_LIMIT adds nothing to any of its counters.

Borrowing (`borrow: B`): a window may admit up to ``limit + B``; whatever it admits above `limit`
is a debt that the next window repays: a window that starts in debt admits only
``limit - debt`` and may not borrow itself. So 1000/hour with borrow 300 admits 1,300 in hour 1,
700 in hour 2 and up to 1,300 in hour 3. A debt is remembered for one window only, which is why
`borrow` may not exceed `limit`; counters live two windows. A borrowing window never counts a
rejected hit.

`limit_remaining` is what the window still admits: ``limit - used`` (borrowing:
``limit + B - used``, or ``limit - debt - used`` in debt), never below 0.
`duration_until_reset` is the time until the window ends (``W - now % W`` for epoch windows),
on OK and on OVER_LIMIT alike for a plain window: the next window admits any cost up to the
limit. A borrowing window that refuses a hit reports the time until it would be admitted, if
nothing else is counted: the window's end when the next window, in debt by what this one
borrowed, still admits the cost; else the next window's end, once the borrowed part is repaid.
A cost no window admits (above the limit, or above ``limit + B`` when borrowing) reports the
window's end.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.model import Hit, Role


def judge(previous: int, current: int, cost: int, limit: int, borrow: int) -> tuple[bool, int, int]:
    """(over, remaining if not applied, remaining if applied) for a hit of `cost` on a window at
    `current`, whose previous window ended at `previous` (read only when `borrow`)."""
    capacity = limit
    if borrow:
        debt = max(0, previous - limit)
        capacity = limit - debt if debt > 0 else limit + borrow
    need = cost if cost > 0 else 1
    over = current + need > capacity
    return over, max(0, capacity - current), max(0, capacity - current - cost)


def next_window_wait(current: int, cost: int, limit: int, borrow: int) -> bool:
    """Whether a borrowing window that refuses a hit of `cost` at `current` makes it wait past
    the next window (see the module): the next window starts in debt for whatever `current`
    borrowed, and admits ``limit - debt``, or ``limit + borrow`` without one."""
    need = cost if cost > 0 else 1
    debt = current - limit
    return need <= limit + borrow and need > (limit - debt if debt > 0 else limit + borrow)


def request_is_over(over: Sequence[bool], roles: Sequence[Role]) -> bool:
    """A request's overall outcome from its descriptors' outcomes, as the reference's `overall_code`.

    Any over-limit BLOCKING descriptor makes it OVER_LIMIT; QUOTA descriptors do only when the
    request has at least one and all of them are over; SHADOW descriptors never do.
    """
    quota_seen = False
    quota_all_over = True
    for is_over, role in zip(over, roles, strict=True):
        if role is Role.BLOCKING:
            if is_over:
                return True
        elif role is Role.QUOTA:
            quota_seen = True
            quota_all_over = quota_all_over and is_over
    return quota_seen and quota_all_over


def groups_over(hits: Sequence[Hit], over: Sequence[bool]) -> tuple[dict[int, bool], bool]:
    """Each descriptor's outcome and the request's, from each hit's `over`: a descriptor (the
    hits of one `group`) is over when any of its windows is, and the request as
    `request_is_over` finds it. Usage hits (roles USAGE and UNIQUE) are no limit: they count in
    neither (their `group` is 0, a descriptor's too)."""
    group_over: dict[int, bool] = {}
    group_role: dict[int, Role] = {}
    for hit, is_over in zip(hits, over, strict=True):
        if hit.role >= Role.USAGE:
            continue
        group_over[hit.group] = group_over.get(hit.group, False) or is_over
        group_role[hit.group] = hit.role
    return group_over, request_is_over(
        list(group_over.values()), [group_role[g] for g in group_over]
    )
