"""How a frequency-cap check names, reads and judges one user's counters, fast.

A check of 50 ads names about a hundred counters and must answer within an auction's budget, so
it does not build a Hit per window nor run the script: it reads every counter in one backend
call (`Backend.read`) and judges them in Python, exactly as the script's read-only mode would.
Plain fixed windows, nearly every cap, are named once per window kind (`plain_suffix`) and judged
by `fixed_window.judge` straight from their count; any other window becomes a Hit judged by
`decide`. What a descriptor below the user needs, whoever the user is, is a `Template`, which
callers keep from one check to the next. A check naming several identifiers makes a Check per
identifier, and a cap counted across them is a `Sum` of that cap in each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sidecar.algorithms import fixed_window, packing
from sidecar.algorithms.decide import Address, State, address, decide
from sidecar.algorithms.fixed_window import request_is_over
from sidecar.core.counters import field_hit, packed_field, plain_suffix, window_hit
from sidecar.core.keys import descriptor_prefix
from sidecar.decision.limiter import most_restrictive
from sidecar.model import UNLIMITED_REMAINING, Hit, Limit, Outcome, Role, Slot, Window


@dataclass(frozen=True, slots=True)
class Template:
    """A descriptor's caps below its first entry, whoever the user: the rule's limit, whether
    its tree groups counters, and the entries after the first as counter names carry them."""

    limit: Limit
    grouped: bool
    head: str


class Judged(NamedTuple):
    """A window as a check finds it: over (one more hit would not be admitted), what it still
    admits, and the ms until it resets."""

    over: bool
    remaining: int
    reset_ms: int


_NO_CAP = Judged(False, UNLIMITED_REMAINING, 0)


class Cap:
    """One descriptor's caps in a check, shared by every ad naming it: where each window is
    judged from, then whether any is over and which is the most restrictive."""

    __slots__ = ("chosen", "counters", "kind", "over", "role", "windows")

    def __init__(self, role: Role, kind: int) -> None:
        self.role = role
        # Which windows these are (caps of one rule are alike), for judging alike caps once.
        self.kind = kind
        # Per window, in the limit's order: (address index, limit, reset ms) when plain, else
        # the index of its Hit.
        self.windows: list[tuple[int, int, int] | int] = []
        # The address indexes of plain windows' counts, when every window is plain.
        self.counters: list[int] | None = []
        self.over = False
        self.chosen = _NO_CAP


class Check:
    """The counters of one user's check: `add` each descriptor's template, read `addresses`,
    `judge` the values, then ask each ad's `verdict`."""

    def __init__(self, domain: str, first: tuple[str, str], now_ms: int) -> None:
        self.now_ms = now_ms
        self.addresses: list[Address] = []
        # Where the user's counters live: its hash (grouped), or the head of its keys.
        self._user = descriptor_prefix(domain, [first])
        self._hash = self._user.encode()
        self._caps: list[Cap] = []
        self._hits: list[Hit] = []
        # Per (limit, grouped): each window's name suffix, limit and reset, None if not plain.
        self._specs: dict[tuple[int, bool], list[tuple[str, int, int] | None]] = {}
        # Per packed limit: its field's suffix, and each packed window's Slot, reset and limit.
        self._packed: dict[int, tuple[str, dict[int, tuple[Slot, int, int]]]] = {}
        # The windows read from packed fields: (address index, slot), judged from the counts
        # `judge` appends to the values, last first (window k's count at index -1 - k).
        self._unpack: list[tuple[int, Slot]] = []

    def add(self, template: Template) -> Cap:
        limit, grouped = template.limit, template.grouped
        specs = self._specs.get((id(limit), grouped))
        if specs is None:
            specs = self._specs[(id(limit), grouped)] = [
                self._spec(window, grouped) for window in limit.windows
            ]
        head = template.head if grouped else f"{self._user}|{template.head}"
        cap = Cap(limit.role, id(specs))
        addresses, windows, counters = self.addresses, cap.windows, cap.counters
        packed = self._packed_specs(limit) if grouped and limit.packing is not None else None
        field_index = -1
        for position, (window, spec) in enumerate(zip(limit.windows, specs, strict=True)):
            if packed is not None and position in packed[1]:
                # A window of the packed field: its count is unpacked from the field's value.
                if field_index < 0:
                    field_index = len(addresses)
                    addresses.append((self._hash, (head + packed[0]).encode()))
                slot, reset_ms, allowed = packed[1][position]
                virtual = -1 - len(self._unpack)
                self._unpack.append((field_index, slot))
                if counters is not None:
                    counters.append(virtual)
                windows.append((virtual, allowed, reset_ms))
                continue
            if spec is not None:
                suffix, reset_ms, allowed = spec
                if counters is not None:
                    counters.append(len(addresses))
                windows.append((len(addresses), allowed, reset_ms))
                name = (head + suffix).encode()
                addresses.append((self._hash, name) if grouped else name)
                continue
            cap.counters = counters = None
            if grouped:
                hit = field_hit(self._hash, head, window, 0, 0, cap.role, self.now_ms)
            else:
                hit = window_hit(head, window, 0, 0, cap.role, self.now_ms)
            windows.append(len(self._hits))
            self._hits.append(hit)
            addresses += (address(hit.key, hit.field), address(hit.previous, hit.previous_field))
        self._caps.append(cap)
        return cap

    def _packed_specs(self, limit: Limit) -> tuple[str, dict[int, tuple[Slot, int, int]]]:
        """A packed limit's field suffix and, per packed window (by its place in the limit),
        its Slot, reset and limit, the same for every descriptor."""
        known = self._packed.get(id(limit))
        if known is not None:
            return known
        packing = limit.packing
        assert packing is not None
        windows = tuple(limit.windows[index] for index in packing.windows)
        field, _, slots = packed_field("", packing, windows, self.now_ms // 1000)
        now = self.now_ms // 1000
        places = {
            index: (
                slot,
                (now - now % window.seconds + window.seconds) * 1000 - self.now_ms,
                window.requests_per_unit,
            )
            for index, window, slot in zip(packing.windows, windows, slots, strict=True)
        }
        known = self._packed[id(limit)] = ("|" + field.decode(), places)
        return known

    def _spec(self, window: Window, grouped: bool) -> tuple[str, int, int] | None:
        """A plain window's name suffix, reset and limit, the same for every descriptor."""
        if not window.plain:
            return None
        suffix, _, end = plain_suffix(window, self.now_ms // 1000, grouped)
        return suffix, end * 1000 - self.now_ms, window.requests_per_unit

    def judge(self, values: Sequence[State | None]) -> Sequence[State | None]:
        """Judge every cap added from the values read at `addresses`; the values, with the
        counts of packed windows after them (as a `Sum` reads them)."""
        if self._unpack:
            unpack = packing.count
            unpacked = [
                unpack(slot, value if isinstance(value := values[index], int) else 0)
                for index, slot in self._unpack
            ]
            values = [*values, *reversed(unpacked)]
        outcomes: list[Outcome] = []
        if self._hits:
            stored = dict(zip(self.addresses, values[: len(self.addresses)], strict=True))
            outcomes, _ = decide(stored.get, self._hits, self.now_ms, False, read_only=True)
        judge = fixed_window.judge
        # Caps of one rule with the same counts are judged alike: most ads of a check are at 0.
        alike: dict[tuple[object, ...], Cap] = {}
        for cap in self._caps:
            counters = cap.counters
            if counters is not None:
                known = (cap.kind, *[values[index] for index in counters])
                twin = alike.get(known)
                if twin is not None:
                    cap.over, cap.chosen = twin.over, twin.chosen
                    continue
                alike[known] = cap
            states = []
            for slot in cap.windows:
                if isinstance(slot, int):
                    outcome = outcomes[slot]
                    states.append(Judged(outcome.over, outcome.remaining, outcome.reset_ms))
                    continue
                index, allowed, reset_ms = slot
                count = values[index]
                over, left, _ = judge(0, count if isinstance(count, int) else 0, 0, allowed, 0)
                states.append(Judged(over, left, reset_ms))
            cap.over = any(state.over for state in states)
            # The most restrictive of an ad's windows is the most restrictive of its caps'.
            cap.chosen = states[0] if len(states) == 1 else states[most_restrictive(states)]
        return values


class Sum:
    """A cap counted across a person's identifiers (`sidecar.frequency.identities`): each of
    its windows (plain, as the rules require) judged on the sum of its counters under every
    identifier a check names. `parts` are the same cap added to each identifier's Check, by the
    Check's position in the call."""

    __slots__ = ("chosen", "over", "parts", "role")

    def __init__(self, role: Role, parts: Sequence[tuple[int, Cap]]) -> None:
        self.role = role
        self.parts = parts
        self.over = False
        self.chosen = _NO_CAP

    def judge(self, values: Sequence[Sequence[State | None]]) -> None:
        """Judge from each Check's values, in the Checks' order."""
        judge = fixed_window.judge
        states = []
        first = self.parts[0][1]
        for position, window in enumerate(first.windows):
            assert isinstance(window, tuple)  # plain: loading the rules made sure
            _, allowed, reset_ms = window
            total = 0
            for check, cap in self.parts:
                slot = cap.windows[position]
                assert isinstance(slot, tuple)
                count = values[check][slot[0]]
                total += count if isinstance(count, int) else 0
            over, left, _ = judge(0, total, 0, allowed, 0)
            states.append(Judged(over, left, reset_ms))
        self.over = any(state.over for state in states)
        self.chosen = states[most_restrictive(states)]


def verdict(ad_cap: Cap | None, campaign_cap: Cap | None) -> tuple[bool, int, int]:
    """(allowed, remaining, reset seconds) of an ad with these caps, as Envoy would judge a
    request carrying both descriptors; remaining and reset from the most restrictive window
    that can block (4294967295 and 0 when none can)."""
    if campaign_cap is None and ad_cap is not None and ad_cap.role is Role.BLOCKING:
        # The common case, said shortly: one blocking descriptor blocks when it is over.
        best = ad_cap.chosen
        return not ad_cap.over, best.remaining, -(-best.reset_ms // 1000)
    return verdict_of([cap for cap in (ad_cap, campaign_cap) if cap is not None])


def verdict_of(caps: Sequence[Cap | Sum]) -> tuple[bool, int, int]:
    """(allowed, remaining, reset seconds) of an ad with these caps (any number: its own and
    its campaign's under each identifier, and those counted across identifiers), as Envoy
    would judge a request carrying all their descriptors."""
    allowed = not request_is_over([cap.over for cap in caps], [cap.role for cap in caps])
    chosen = [cap.chosen for cap in caps if cap.role is not Role.SHADOW]
    if not chosen:
        return allowed, UNLIMITED_REMAINING, 0
    best = chosen[0] if len(chosen) == 1 else chosen[most_restrictive(chosen)]
    return allowed, best.remaining, -(-best.reset_ms // 1000)
