"""How a frequency-cap check names, reads and judges a user's counters, in one pass.

A check of 50 ads naming three identifiers holds about two hundred caps and must answer within an
auction's budget, so it builds no Hit per window and runs no script: it reads every counter in
one backend call (`Backend.read`: one HMGET per identifier's hash, all sent at once) and judges
them here, exactly as the script's read-only mode would.

What a cap's windows need at one instant is the same for every descriptor of its rule: a
`Shape` (per limit, worked out once a second and kept by the caller for every check in that
second) holds each window's field suffix, packed slot, limit and reset. So adding a cap is
concatenating its head with those suffixes, and a cap is a few entries in the `Check`'s
parallel lists (its shape, where its counters start under each identifier it sums, its role,
then its verdict), not an object with lists of its own. A cap with nothing counted yet (most
ads of a check) takes its Shape's verdict, judged once. Plain and packed windows are judged
from their counts, summed over the identifiers a cap counts across
(`sidecar.frequency.identities`); any other window (token bucket, sliding, borrowing, anchored)
becomes a Hit judged by `decide`, under one identifier only (loading the rules refuses it in a
cap counted across identifiers).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.algorithms import fixed_window, packing
from sidecar.algorithms.decide import Address, State, address, decide
from sidecar.algorithms.fixed_window import request_is_over
from sidecar.core.counters import field_hit, packed_field, plain_suffix, window_hit
from sidecar.core.keys import descriptor_prefix
from sidecar.decision.limiter import most_restrictive
from sidecar.model import UNLIMITED_REMAINING, Hit, Limit, Outcome, Role, Slot, Window

#: Read on every verdict: compiled, an enum member read through its class is a Python call.
_BLOCKING, _SHADOW = Role.BLOCKING, Role.SHADOW


class Judged:
    """A window (or a cap, by its most restrictive window) as a check finds it: over (one more
    hit would not be admitted), what it still admits, and the ms until it resets counted from
    the start of the check's second (as a `Shape` knows it).

    (A class, not a named tuple: compiled, it is made without a Python call.)"""

    __slots__ = ("over", "remaining", "reset_ms")

    def __init__(self, over: bool, remaining: int, reset_ms: int) -> None:
        self.over = over
        self.remaining = remaining
        self.reset_ms = reset_ms


class Shape:
    """What every cap of one limit needs in one second (`now`, Unix seconds): the suffixes of
    the counters it reads (a packed field's once), and per window in the limit's order (address
    offset, packed slot or None, limit, ms from `now` to its reset), the offset ``-1 - k`` for
    the k-th window judged by `decide`."""

    __slots__ = ("fresh", "others", "suffixes", "windows")

    def __init__(self, limit: Limit, grouped: bool, now: int) -> None:
        self.suffixes: list[bytes] = []
        self.windows: list[tuple[int, Slot | None, int, int]] = []
        # The windows judged by `decide`, from a Hit per cap.
        self.others: list[Window] = []
        slots: dict[int, Slot] = {}
        name = b""
        field = -1
        packed = limit.packing if grouped else None
        if packed is not None:
            windows = tuple(limit.windows[index] for index in packed.windows)
            name, _, found = packed_field("", packed, windows, now)
            slots = dict(zip(packed.windows, found, strict=True))
        for position, window in enumerate(limit.windows):
            slot = slots.get(position)
            if slot is not None:
                # A window of the packed field: its count is unpacked from the field's value.
                if field < 0:
                    field = len(self.suffixes)
                    self.suffixes.append(b"|" + name)
                reset_ms = (window.seconds - now % window.seconds) * 1000
                self.windows.append((field, slot, window.requests_per_unit, reset_ms))
            elif window.plain:
                suffix, _, end = plain_suffix(window, now, grouped)
                self.windows.append(
                    (len(self.suffixes), None, window.requests_per_unit, (end - now) * 1000)
                )
                self.suffixes.append(suffix.encode())
            else:
                self.windows.append((-1 - len(self.others), None, 0, 0))
                self.others.append(window)
        # The verdict when nothing is counted yet (most ads of a check), judged once.
        fresh = []
        for _, _, allowed, reset_ms in self.windows:
            over, left, _ = fixed_window.judge(0, 0, 0, allowed, 0)
            fresh.append(Judged(over, left, reset_ms))
        self.fresh = _chosen(fresh)


class Check:
    """The counters of one check: name each `identifier` it reads, `add` each cap (a
    descriptor's limit under the identifiers it counts across), read `addresses`, `judge` the
    values, then ask each ad's `verdict` from its caps."""

    def __init__(self, domain: str, now_ms: int, shapes: dict[int, Shape]) -> None:
        """`shapes`: the Shapes of this second so far, by limit number and grouping (see
        `add`), which `add` completes; the caller keeps them for the other checks of the
        second."""
        self.domain = domain
        self.now_ms = now_ms
        # The ms since the start of the second, which Shapes count resets from.
        self._into = now_ms % 1000
        self.addresses: list[Address] = []
        # Per identifier: the head of its keys, and its hash (for grouped counters).
        self._heads: list[tuple[str, bytes]] = []
        self._shapes = shapes
        # Per cap: its shape, where its counters start under each identifier it sums, the
        # position of its first Hit (-1: none), its role; and once judged, its verdict.
        self._shape: list[Shape] = []
        self._bases: list[tuple[int, ...]] = []
        self._first_hit: list[int] = []
        self._roles: list[Role] = []
        self._judged: list[Judged] = []
        self._hits: list[Hit] = []

    def identifier(self, first: tuple[str, str]) -> int:
        """Read counters of the identifier `first` (its kind and its counters' value); its
        position, by which `add` names it."""
        head = descriptor_prefix(self.domain, [first])
        self._heads.append((head, head.encode()))
        return len(self._heads) - 1

    def add(
        self, limit: Limit, number: int, grouped: bool, name: bytes, members: Sequence[int]
    ) -> int:
        """The cap of `limit` (the caller's `number` for it, the same for every check) on the
        descriptor whose counters `name` names, grouped or not, summed over the identifiers
        `members`; its position, by which `verdict` names it."""
        known = number * 2 + grouped
        shape = self._shapes.get(known)
        if shape is None:
            shape = self._shapes[known] = Shape(limit, grouped, self.now_ms // 1000)
        addresses = self.addresses
        bases = []
        for member in members:
            prefix, key = self._heads[member]
            bases.append(len(addresses))
            if grouped:
                for suffix in shape.suffixes:
                    addresses.append((key, name + suffix))
            else:
                start = key + b"|" + name
                for suffix in shape.suffixes:
                    addresses.append(start + suffix)
        first_hit = -1
        if shape.others:
            first_hit = len(self._hits)
            prefix, key = self._heads[members[0]]
            head = name.decode()
            for window in shape.others:
                if grouped:
                    hit = field_hit(key, head, window, 0, 0, limit.role, self.now_ms)
                else:
                    hit = window_hit(f"{prefix}|{head}", window, 0, 0, limit.role, self.now_ms)
                self._hits.append(hit)
                addresses.append(address(hit.key, hit.field))
                addresses.append(address(hit.previous, hit.previous_field))
        self._shape.append(shape)
        self._bases.append((bases[0],) if len(bases) == 1 else tuple(bases))
        self._first_hit.append(first_hit)
        self._roles.append(limit.role)
        return len(self._shape) - 1

    def judge(self, values: Sequence[State | None]) -> None:
        """Judge every cap added from the values read at `addresses`."""
        outcomes: list[Outcome] = []
        if self._hits:
            stored = dict(zip(self.addresses, values, strict=True))
            outcomes, _ = decide(stored.get, self._hits, self.now_ms, False, read_only=True)
        count = packing.count
        judge = fixed_window.judge
        judged, into = self._judged, self._into
        for shape, bases, first_hit in zip(self._shape, self._bases, self._first_hit, strict=True):
            if first_hit < 0 and not _stored(values, bases, len(shape.suffixes)):
                # Nothing counted on this cap yet (most ads of a check): judged once a second.
                judged.append(shape.fresh)
                continue
            states = []
            for offset, slot, allowed, reset_ms in shape.windows:
                if offset < 0:
                    outcome = outcomes[first_hit - 1 - offset]
                    states.append(Judged(outcome.over, outcome.remaining, outcome.reset_ms + into))
                    continue
                total = 0
                for base in bases:
                    value = values[base + offset]
                    if isinstance(value, int) and value:
                        total += value if slot is None else count(slot, value)
                over, left, _ = judge(0, total, 0, allowed, 0)
                states.append(Judged(over, left, reset_ms))
            judged.append(_chosen(states))

    def verdict(self, caps: Sequence[int]) -> tuple[bool, int, int]:
        """(allowed, remaining, reset seconds) of an ad with these caps (its own and its
        campaign's under each identifier, and those counted across identifiers), as Envoy would
        judge a request carrying all their descriptors: remaining and reset from the most
        restrictive window that can block (4294967295 and 0 when none can)."""
        judged, roles = self._judged, self._roles
        if len(caps) == 1 and roles[caps[0]] is _BLOCKING:
            # The common case, said shortly: one blocking cap blocks when it is over.
            best = judged[caps[0]]
            return not best.over, best.remaining, -((self._into - best.reset_ms) // 1000)
        allowed = not request_is_over(
            [judged[cap].over for cap in caps], [roles[cap] for cap in caps]
        )
        chosen = [judged[cap] for cap in caps if roles[cap] is not _SHADOW]
        if not chosen:
            return allowed, UNLIMITED_REMAINING, 0
        best = _chosen(chosen)
        return allowed, best.remaining, -((self._into - best.reset_ms) // 1000)


def _stored(values: Sequence[State | None], bases: tuple[int, ...], width: int) -> bool:
    """Whether any of the `width` values from each of `bases` holds a count."""
    for base in bases:
        for index in range(base, base + width):
            if values[index]:
                return True
    return False


def _chosen(states: list[Judged]) -> Judged:
    """The most restrictive of `states` (a cap's windows, or an ad's caps)."""
    return states[0] if len(states) == 1 else states[most_restrictive(states)]
