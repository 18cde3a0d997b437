"""The values that travel through the pipeline, from Envoy's descriptors to a decision.

Everything here is pure and immutable: no protobuf, no Redis, no clock. Values made on every
call (Outcome, DescriptorStatus, Decision) are NamedTuples, which cost a third of a frozen
dataclass to build. Values made for every new request body (Entry, Descriptor, Request, Hit;
most of a gateway's bodies are new) are dataclasses that are immutable by convention, not
declared frozen: the compiled build makes a frozen dataclass as the interpreter does, with one
Python-level `object.__setattr__` a field (about 0.2 µs an Entry, 1.3 µs a Hit), and these as
native classes, several times faster. Nothing assigns to them once made (a request's plan,
kept and shared by later calls, holds them), and they hash by their fields as frozen ones do
(`unsafe_hash`). Each writes its own `__init__` (`init=False`): the compiled build turns it
into a native constructor, where the one `dataclass` writes is Python code run for every
instance (about 1,300 instructions an Entry, 4,000 a Hit, measured by callgrind). The others
are frozen dataclasses.
Names follow Envoy's vocabulary (`domain`, `descriptor`, `entry`, `hits_addend`, `unit`).

One module past the usual size because it is every value the pipeline hands along, each a few
lines, kept together so the core reads one vocabulary; much of its length is the notes on how
each is built for the compiled build.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

#: `limit_remaining` reported for an `unlimited` rule (the reference's MaxUint32).
UNLIMITED_REMAINING: Final = 4_294_967_295


class Unit(enum.IntEnum):
    """A rate limit unit, numbered as in `envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit`."""

    SECOND = 1
    MINUTE = 2
    HOUR = 3
    DAY = 4
    MONTH = 5
    YEAR = 6
    WEEK = 7

    @property
    def seconds(self) -> int:
        """Length of one epoch-aligned window: months are 30 days and years 365, as in the reference."""
        return _UNIT_SECONDS[self]


_UNIT_SECONDS: Final = {
    Unit.SECOND: 1,
    Unit.MINUTE: 60,
    Unit.HOUR: 3_600,
    Unit.DAY: 86_400,
    Unit.WEEK: 604_800,
    Unit.MONTH: 2_592_000,
    Unit.YEAR: 31_536_000,
}


class Code(enum.IntEnum):
    """A response code, numbered as in `RateLimitResponse.Code`."""

    UNKNOWN = 0
    OK = 1
    OVER_LIMIT = 2


class Role(enum.IntEnum):
    """How one counter's over-limit result weighs on the request's `overall_code`.

    BLOCKING: over limit makes the request OVER_LIMIT.
    SHADOW: never does (`shadow_mode` rule).
    QUOTA: only when every quota counter of the request is over limit (`quota_mode`).
    """

    BLOCKING = 0
    SHADOW = 1
    QUOTA = 2
    #: Not a limit: a usage count (`sidecar.core.usage`), never judged. The backend adds its `hits`
    #: to the field `field` of the hash at `key` when the request is admitted, to
    #: `previous_field` when it is refused, and makes the hash expire at `end_ms`.
    USAGE = 3
    #: Not a limit: a unique count. The backend adds `field` (the member) to the HyperLogLog at
    #: `key`, which expires at `end_ms`.
    UNIQUE = 4


@dataclass(init=False, eq=True, unsafe_hash=True)
class Entry:
    """One `(key, value)` pair of a descriptor."""

    key: str
    value: str

    def __init__(self, key: str, value: str) -> None:
        self.key = key
        self.value = value


@dataclass(frozen=True, slots=True)
class Override:
    """A per-descriptor `limit` sent by Envoy (RateLimitOverride)."""

    requests_per_unit: int
    unit: Unit


@dataclass(init=False, eq=True, unsafe_hash=True)
class Descriptor:
    """A request descriptor: its entries and, when Envoy set them, its own `hits_addend` and `limit`.

    `is_negative_hits` (Envoy 1.38+) makes the descriptor a refund: its hits are given back to
    its counters instead of added (see `sidecar.algorithms.refunds`).
    """

    entries: tuple[Entry, ...]
    hits_addend: int | None = None
    override: Override | None = None
    is_negative_hits: bool = False

    def __init__(
        self,
        entries: tuple[Entry, ...],
        hits_addend: int | None = None,
        override: Override | None = None,
        is_negative_hits: bool = False,
    ) -> None:
        self.entries = entries
        self.hits_addend = hits_addend
        self.override = override
        self.is_negative_hits = is_negative_hits


@dataclass(init=False, eq=True, unsafe_hash=True)
class Request:
    """A ShouldRateLimit call. `hits_addend` is the request-level value as sent (0 means 1)."""

    domain: str
    descriptors: tuple[Descriptor, ...]
    hits_addend: int = 0

    def __init__(
        self, domain: str, descriptors: tuple[Descriptor, ...], hits_addend: int = 0
    ) -> None:
        self.domain = domain
        self.descriptors = descriptors
        self.hits_addend = hits_addend


class Algorithm(enum.Enum):
    """How a window counts: see the module docstrings in `sidecar.algorithms`."""

    FIXED_WINDOW = "fixed_window"
    TOKEN_BUCKET = "token_bucket"
    SLIDING_WINDOW = "sliding_window"
    #: Windows anchored on events, not on the clock (`sidecar.algorithms.anchored`).
    FIRST_EVENT = "first_event"
    COOLDOWN = "cooldown"
    LIFETIME = "lifetime"
    #: Requests in flight, each forgotten a lease after it started (`sidecar.algorithms.concurrency`).
    CONCURRENCY = "concurrency"
    #: Not a window a rule names: a rule's `penalty` (`sidecar.algorithms.penalty`), asked as
    #: one more hit of its descriptor.
    PENALTY = "penalty"


@dataclass(frozen=True, slots=True)
class Penalty:
    """A rule's `penalty`: a descriptor that goes over its limit is blocked `block_ms`, then
    each time it trips again `escalate` times longer, at most `max_ms`, until it stays clear of
    blocks for `forget_after_ms` (see `sidecar.algorithms.penalty`)."""

    block_ms: int
    escalate: float
    max_ms: int
    forget_after_ms: int


@dataclass(frozen=True, slots=True)
class Window:
    """One window of a rule: `requests_per_unit` per `unit` × `unit_multiplier`, counted by `algorithm`.

    `burst` is a token bucket's capacity (default `requests_per_unit`); `borrow` lets a fixed
    window or a token bucket run a debt; `calendar` windows follow the wall clock of `timezone`,
    weeks starting on `week_start` (0 Monday … 6 Sunday). `approximate` (a plain fixed window's,
    from its rule's `approximate: true`) lets a sidecar syncing its counters periodically decide
    it on its local view (`sidecar.algorithms.approximate`); without `--sync-interval-ms` it is
    decided as any other. `leased` (a plain fixed window's, from its rule's `leased: true`) lets
    a sidecar decide it from a lease of its budget (`sidecar.algorithms.lease`) under
    `--lease-ms`; without it, it is decided as any other. `ends` (Unix seconds) is a lifetime
    window's end, its flight's; a lifetime window without an interval (a TTL) has
    `unit_multiplier` 0, so `seconds` 0. A `concurrency` window counts requests in flight, at
    most `requests_per_unit`; its lease, in seconds, is `unit_multiplier` (of `Unit.SECOND`), so
    `seconds` too.
    """

    requests_per_unit: int
    unit: Unit
    algorithm: Algorithm = Algorithm.FIXED_WINDOW
    unit_multiplier: int = 1
    burst: int | None = None
    borrow: int = 0
    calendar: bool = False
    timezone: str = "UTC"
    week_start: int = 0
    name: str = ""
    approximate: bool = False
    leased: bool = False
    ends: int = 0
    #: A penalty's window (algorithm PENALTY) carries its penalty; no other window has one.
    penalty: Penalty | None = None
    #: A concurrency window's `request_id`: the key of the descriptor entry that names the
    #: request, so that its refund closes its own start ("": none; `sidecar.algorithms.concurrency`).
    request_id: str = ""
    #: The reference's algorithm: a fixed window that does not borrow (it counts rejected hits).
    #: Worked out once (see `_derived`), as `Limit.role` is.
    plain: bool = field(init=False, repr=False, compare=False)
    #: Length of an epoch-aligned window (calendar windows vary and are computed from the
    #: date). Worked out once, as `plain` is: naming every new counter reads it.
    seconds: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _derived(self, "plain", self.algorithm is Algorithm.FIXED_WINDOW and self.borrow == 0)
        _derived(self, "seconds", self.unit.seconds * self.unit_multiplier)

    @property
    def capacity(self) -> int:
        return self.requests_per_unit if self.burst is None else self.burst


@dataclass(frozen=True, slots=True)
class Packing:
    """How several windows of a limit share one grouped field (`group_counters: packed`, see
    `sidecar.algorithms.packing`): which windows of a limit share a field (indexes into `Limit.windows`, shortest first),
    and the field's arithmetic: `unit` seconds per offset step, `spread` offsets, counts
    saturating at `cap`."""

    windows: tuple[int, ...]
    unit: int
    spread: int
    cap: int


@dataclass(frozen=True, slots=True)
class Slot:
    """One window's place in a packed field at one instant: its `position` among the field's
    counts, every window's start as an offset (`starts`, in the field's order), and the offset
    a write now leaves (`now`)."""

    position: int
    spread: int
    cap: int
    now: int
    starts: tuple[int, ...]

    def argument(self) -> str:
        """The slot as `decide.lua` reads it: ``spread cap now start_1 ... start_n``."""
        return " ".join(str(n) for n in (self.spread, self.cap, self.now, *self.starts))


@dataclass(frozen=True, slots=True)
class Limit:
    """A rule's limit (`rate_limit`, or every window of `rate_limits`), with the descriptor flags that
    shape its outcome.

    `rule_key` is the rule's place in the tree (`domain.key_value.subkey`), shown by `/rlconfig`.
    The rule's `approximate` flag is kept on its windows (a Hit carries its window, not its
    limit): `approximate` says whether they have it. `pace` (its rule's `pace: true`) paces its
    budget over each window for Envoys on RLQS, instead of leasing it (`sidecar.quota.allocator`);
    ShouldRateLimit does not read it. `metadata` is the descriptor's `metadata`
    map from the rules, returned as dynamic metadata (`--response-dynamic-metadata`); it takes
    no part in comparing limits.
    """

    windows: tuple[Window, ...]
    name: str = ""
    unlimited: bool = False
    replaces: tuple[str, ...] = ()
    shadow_mode: bool = False
    quota_mode: bool = False
    rule_key: str = ""
    pace: bool = False
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    #: Which of its windows share a field, in a `group_counters: packed` tree (None: a field
    #: or a key each).
    packing: Packing | None = None
    #: The rule's `penalty` (None: none): its descriptor asks its windows and, last, the
    #: penalty's window (`penalty_window`, worked out once), in one backend call.
    penalty: Penalty | None = None
    #: How the limit's over-limit result weighs on the request (see `Role`), worked out once.
    role: Role = field(init=False, repr=False, compare=False)

    #: The window of `penalty` (None without one), the last of the descriptor's hits.
    penalty_window: Window | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        penalty = self.penalty
        _derived(
            self,
            "penalty_window",
            None if penalty is None else Window(0, Unit.SECOND, Algorithm.PENALTY, penalty=penalty),
        )
        role = Role.SHADOW if self.shadow_mode else Role.QUOTA if self.quota_mode else Role.BLOCKING
        _derived(self, "role", role)

    @property
    def requests_per_unit(self) -> int:
        return self.windows[0].requests_per_unit

    @property
    def unit(self) -> Unit:
        return self.windows[0].unit

    @property
    def approximate(self) -> bool:
        return any(w.approximate for w in self.windows)

    @property
    def leased(self) -> bool:
        return any(w.leased for w in self.windows)

    @property
    def names(self) -> tuple[str, ...]:
        """The names `replaces` can target: the limit's and its windows'."""
        return tuple(n for n in (self.name, *(w.name for w in self.windows)) if n)


def _derived(instance: object, name: str, value: object) -> None:
    """Set a frozen dataclass's field derived from its others, once, when it is made.

    The decision path reads `Window.plain` and `Limit.role` on every call. As properties they
    cost a Python call each and, on Python 3.11, an enum member read through its class is a
    Python-level descriptor call too (about 120 ns, a dozen times a plain attribute): kept as
    fields they cost an attribute read. Excluded from `==`, hashing and repr, so two windows
    or limits compare by what they were made of, as before.
    """
    object.__setattr__(instance, name, value)


def single(requests_per_unit: int, unit: Unit, **flags: object) -> Limit:
    """A plain one-window limit (the reference's only kind), for overrides and tests."""
    name = str(flags.get("name", ""))
    return Limit((Window(requests_per_unit, unit, name=name),), **flags)  # type: ignore[arg-type]


@dataclass(eq=True, unsafe_hash=True)
class Hit:
    """What one window of one descriptor asks of a backend: add `hits` to the counter at `key`.

    `hits == 0` is a check: it asks whether one more hit would be admitted and consumes nothing.
    `hits < 0` is a refund: `-hits` are given back (`sidecar.algorithms.refunds`); never over.
    `previous` is the previous window's counter (borrowing and sliding windows read it; `key`
    when unused). `ttl` is how long a new counter must live, in seconds; `start_ms` and `end_ms`
    bound the window in Unix milliseconds (fixed and sliding windows; 0 for a token bucket). A
    Hit names a counter and its window, not an instant: the same Hit serves every call of its
    window (of its second, when `ttl` counts down to the window's end), and whoever holds `now`
    works out the time to the reset and since the start.
    The windows of one descriptor share a `group`: the descriptor is admitted only when all are.

    `field` is empty for a counter stored under its own key (the reference's layout). Otherwise
    the counter is one field of the hash at `key` (`group_counters`, see `core.keys`), and
    `previous_field` names the previous window's field in that hash; `ttl` is then how long the
    hash must live at least for this field. `packed` is set when the field holds several
    windows of the descriptor (`sidecar.algorithms.packing`): the window's place in it, at this second.
    A concurrency window's `previous_field` is the id of the request it starts or closes, when
    it names one (`counters.in_flight_hit`).

    `counter` is what the over-limit cache knows the counter by: its key, its field and the
    window's limit (worked out once, as `Window.plain` is: it is read on every call).
    `adds_only` (worked out once too) says the hit adds to a plain window's counter stored under
    its own key: unless the request is all or nothing, adding is then all a backend has to do,
    and the answer follows from what the counter comes to (Redis runs `lua/count.lua`).
    `script_parts` is the Redis backends' encoding of the hit for the script's call
    (`storage.scripts.packed_command`), made on the hit's first call and kept on it, so that it
    lives exactly as long as the hit: a cached plan's hits keep theirs, and a new body's are
    freed with its plan, by their reference counts, as its call ends. Nothing else reads it.

    Immutable by convention (see the module docstring): a plan's hits are shared by every call
    of their window.
    """

    key: bytes
    hits: int
    window: Window
    group: int = 0
    role: Role = Role.BLOCKING
    previous: bytes = b""
    ttl: int = 1
    start_ms: int = 0
    end_ms: int = 0
    field: bytes = b""
    previous_field: bytes = b""
    packed: Slot | None = None
    # (`field` here is the attribute above: the function is reached through its module.)
    counter: tuple[bytes, bytes, int] = dataclasses.field(init=False, repr=False, compare=False)
    adds_only: bool = dataclasses.field(init=False, repr=False, compare=False)
    script_parts: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __init__(
        self,
        key: bytes,
        hits: int,
        window: Window,
        group: int = 0,
        role: Role = Role.BLOCKING,
        previous: bytes = b"",
        ttl: int = 1,
        start_ms: int = 0,
        end_ms: int = 0,
        field: bytes = b"",
        previous_field: bytes = b"",
        packed: Slot | None = None,
    ) -> None:
        self.key = key
        self.hits = hits
        self.window = window
        self.group = group
        self.role = role
        self.previous = previous
        self.ttl = ttl
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.field = field
        self.previous_field = previous_field
        self.packed = packed
        # A packed field holds several windows: each is a counter of its own to the cache.
        counter_field = field if packed is None else b"%s#%d" % (field, packed.position)
        self.counter = (key, counter_field, window.requests_per_unit)
        self.adds_only = window.plain and not field and hits > 0
        self.script_parts = None

    @property
    def limit(self) -> int:
        return self.window.requests_per_unit


@dataclass(frozen=True, slots=True)
class Dedupe:
    """What a record call needs to count each impression once: the ids already seen are kept in
    two hashes per user, one per horizon bucket (see `sidecar.frequency`).

    `ids[g]` is the id of the impression whose hits carry group `g`. `current` is the bucket the
    new ids go to, kept `ttl_ms` from now; `previous` is the bucket before it, only read.
    """

    current: bytes
    previous: bytes
    ids: tuple[str, ...]
    ttl_ms: int


class Outcome(NamedTuple):
    """A backend's answer for one Hit.

    over: the window would not admit the hit (a check: one more hit).
    remaining: what the window admits after this request (its `limit_remaining`).
    reset_ms: time until the window resets (see each algorithm for what reset means); for a hit
    the window refuses, until it would admit it.
    applied: whether the hit was added to the counter.
    left_before: what the window admitted before this request (for the statistics' near-limit
    accounting, which needs the count before the hits).
    """

    over: bool
    remaining: int
    reset_ms: int
    applied: bool
    left_before: int = 0


class DescriptorStatus(NamedTuple):
    """The answer for one descriptor, in Envoy's terms. `limit` is None when no rule applies.

    `window` is the limit's window the status reports (its `current_limit`): the most restrictive
    one when the limit has several.
    """

    code: Code
    limit: Limit | None = None
    limit_remaining: int = 0
    duration_until_reset: int | None = None
    window: Window | None = None


class Decision(NamedTuple):
    """The answer for a whole request: `overall_code` and one status per descriptor, in request order."""

    overall_code: Code
    statuses: tuple[DescriptorStatus, ...] = ()


#: Builds one of the NamedTuples above from all its fields, in order, as
#: `new(Outcome, (over, remaining, reset_ms, applied, left_before))`. A NamedTuple's own
#: `__new__` is a Python function (it fills in the defaults) that costs twice as much: the hot
#: path, which builds a few per call, uses this instead.
new: Final = tuple.__new__
