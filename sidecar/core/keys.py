"""Builds the backend keys of counters, safe for Redis Cluster and for hostile descriptor values.

A window counter's key reads::

    rl{<domain>|<key1>|<value1>}|<key2>|<value2>|...|<tag>|<window start>

and a token bucket's ``rl{...}|...|<tag>`` (a concurrency limit's starts in flight too, tag
``n``, with its refused starts beside them at ``...|nr``). The tag names the kind of window, so
two windows of one descriptor never share a counter: the length in seconds for a plain epoch
window (``60``, the layout of the reference's windows), with a letter for the others (``60b``
borrowing, ``60s`` sliding, ``1t10/20`` a bucket of 10 per second holding 20,
``d@Asia/Shanghai`` a calendar day).

The part in braces is the Redis Cluster hash tag, so every counter whose descriptor starts with
the same first entry lands in one hash slot and one request's counters cost one script call.
Every part is escaped (``%`` ``|`` ``{`` ``}`` become ``%25`` ``%7C`` ``%7B`` ``%7D``), so a value
can neither close the hash tag early nor pose as a separator: two different descriptors never
share a key (the reference's ``_`` separator lets ``(a_b, c)`` and ``(a, b_c)`` collide).

Grouped counters (`group_counters: true` on a first-level descriptor) live instead in one hash
per first entry, at the hash tag alone, one field per counter::

    rl{<domain>|<key1>|<value1>}   field  <key2>|<value2>|...|<code><keep until>

The code is the window kind, shortened (``d`` a day, ``M`` a 30-day month, ``cdk7q`` a
calendar day in some zone; see `sidecar.core.counters.code`), and "keep until" names the window
by the time after which nobody reads its counter, so a script can drop the fields of ended
windows without knowing the rules: five base-36 digits counting minutes from 2020 (rounded up;
enough until 2134), or for windows shorter than a minute ``.`` and the Unix second in base 36.
Every byte counts here (a user's 40 counters should fit a 768-byte listpack): ``ad|a0042|d25ktc``.
A token bucket's field ends in ``_`` and keeps that time in its value, and so does a window
anchored on events (`sidecar.algorithms.anchored`), whose field ends in ``^``. The ids behind
exactly-once impression counts sit beside the hash, in the same slot:
``rl{...}|%ids|<horizon bucket>`` (``%i`` never comes out of `escape`, so no counter key can
take that name). A descriptor's penalty (`sidecar.algorithms.penalty`) is ``rl{...}|...|%penalty``,
whatever the layout of its counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

_ESCAPES: Final = str.maketrans({"%": "%25", "|": "%7C", "{": "%7B", "}": "%7D"})


def escape(part: str) -> str:
    """Escape one key part so it holds no separator and no brace."""
    # Four substring tests (memchr each) cost less than walking the text through a set, and
    # every new descriptor value comes here.
    if "%" in part or "|" in part or "{" in part or "}" in part:
        return part.translate(_ESCAPES)
    return part


def descriptor_prefix(domain: str, parts: Sequence[tuple[str, str]]) -> str:
    """The window-independent head of a counter key: hash tag on the domain and first entry."""
    first_key, first_value = parts[0]
    head = f"rl{{{escape(domain)}|{escape(first_key)}|{escape(first_value)}}}"
    if len(parts) == 1:
        return head
    rest = "|".join(f"{escape(k)}|{escape(v)}" for k, v in parts[1:])
    return f"{head}|{rest}"


def window_key(prefix: str, tag: str, start: int) -> bytes:
    """The counter of the window starting at `start` (Unix seconds) of the window kind `tag`."""
    return named(prefix, window_suffix(tag, start))


def window_suffix(tag: str, start: int) -> str:
    """What follows the descriptor in a window counter's key."""
    return f"|{tag}|{start}"


def named(head: str, suffix: str) -> bytes:
    """A counter's key (`head` a descriptor prefix) or grouped field (`head` a field head, empty
    for the first entry's own counters) from the window's suffix."""
    return (head + suffix if head else suffix[1:]).encode()


def bucket_key(prefix: str, tag: str) -> bytes:
    """The state of a token bucket (one per descriptor and bucket kind; it has no windows)."""
    return f"{prefix}|{tag}".encode()


def fixed_window_key(prefix: str, window_seconds: int, window_start: int) -> bytes:
    """The key of one plain epoch window: its tag is its length in seconds."""
    return window_key(prefix, str(window_seconds), window_start)


def hash_tag(key: bytes) -> bytes:
    """The part of `key` Redis Cluster hashes: between the first '{' and the next '}'."""
    start = key.find(b"{")
    if start != -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def group_key(domain: str, parts: Sequence[tuple[str, str]]) -> bytes:
    """The hash holding every grouped counter under the descriptor's first entry."""
    return descriptor_prefix(domain, parts[:1]).encode()


def field_head(parts: Sequence[tuple[str, str]]) -> str:
    """The descriptor's part of its field names: the entries after the first one."""
    return "|".join(f"{escape(k)}|{escape(v)}" for k, v in parts[1:])


def counter_field(head: str, code: str, keep_until: str) -> bytes:
    """One counter's field in a grouped hash: descriptor head, window code and its keep-until
    (as `keep_until_id` writes it)."""
    return named(head, field_suffix(code, keep_until))


def field_suffix(code: str, keep_until: str) -> str:
    """What follows the descriptor head in a grouped counter's field."""
    return f"|{code}{keep_until}"


#: Where keep-until minutes count from (2020-01-01T00:00:00Z); `lua/decide.lua` knows it too.
FIELD_EPOCH: Final = 1_577_836_800
KEEP_UNTIL_DIGITS: Final = 5


def keep_until_id(keep_until: int, precise: bool) -> str:
    """A window's keep-until (Unix seconds) as its field ends: minutes since FIELD_EPOCH, rounded
    up, in five base-36 digits; `precise` (windows shorter than a minute, which need seconds to
    tell two apart) ``.`` and the Unix second in base 36."""
    if precise:
        return "." + base36(keep_until)
    minutes = max(0, -(-(keep_until - FIELD_EPOCH) // 60))
    return base36(minutes).rjust(KEEP_UNTIL_DIGITS, "0")


#: The end of a token bucket's field: a bucket has no windows, and its keep-until changes with
#: every hit, so its value carries it.
BUCKET_FIELD_END: Final = "_"
#: The end of an anchored window's field: its end moves with the event that opens (or, for a
#: cooldown, restarts) it, so its value carries it ("<count> <end ms>").
ANCHORED_FIELD_END: Final = "^"


def penalty_key(prefix: str) -> bytes:
    """A descriptor's penalty state (`sidecar.algorithms.penalty`), beside its counters in
    their hash slot, whatever their layout: ``rl{...}|...|%penalty`` (as for ``%ids``, no
    escaped part can end so)."""
    return f"{prefix}|%penalty".encode()


def dedupe_key(domain: str, first: tuple[str, str], bucket: int) -> bytes:
    """The ids of the impressions recorded under `first` during horizon bucket `bucket`."""
    return f"{descriptor_prefix(domain, [first])}|%ids|{base36(bucket)}".encode()


_DIGITS: Final = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(number: int) -> str:
    """`number` in base 36, lower case (Lua's ``tonumber(text, 36)`` reads it back)."""
    if number < 0:
        return "-" + base36(-number)
    if number < 36:
        return _DIGITS[number]
    digits = []
    while number:
        number, digit = divmod(number, 36)
        digits.append(_DIGITS[digit])
    return "".join(reversed(digits))
