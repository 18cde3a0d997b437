"""Builds the backend keys of counters, safe for Redis Cluster and for hostile descriptor values.

A window counter's key reads::

    rl{<domain>|<key1>|<value1>}|<key2>|<value2>|...|<tag>|<window start>

and a token bucket's ``rl{...}|...|<tag>``. The tag names the kind of window, so two windows of
one descriptor never share a counter: the length in seconds for a plain epoch window (``60``,
the layout of the reference's windows), with a letter for the others (``60b`` borrowing, ``60s``
sliding, ``1t10/20`` a bucket of 10 per second holding 20, ``d@Asia/Shanghai`` a calendar day).

The part in braces is the Redis Cluster hash tag, so every counter whose descriptor starts with
the same first entry lands in one hash slot and one request's counters cost one script call.
Every part is escaped (``%`` ``|`` ``{`` ``}`` become ``%25`` ``%7C`` ``%7B`` ``%7D``), so a value
can neither close the hash tag early nor pose as a separator: two different descriptors never
share a key (the reference's ``_`` separator lets ``(a_b, c)`` and ``(a, b_c)`` collide).
"""

from __future__ import annotations

from collections.abc import Sequence

_ESCAPES = str.maketrans({"%": "%25", "|": "%7C", "{": "%7B", "}": "%7D"})
_SPECIAL = frozenset("%|{}")


def escape(part: str) -> str:
    """Escape one key part so it holds no separator and no brace."""
    if _SPECIAL.isdisjoint(part):
        return part
    return part.translate(_ESCAPES)


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
    return f"{prefix}|{tag}|{start}".encode()


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
