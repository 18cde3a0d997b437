"""Counters known to be over their limit, so a request can be refused without a backend call.

A plain fixed window that is over its limit stays over until the window ends: its counter only
grows. Remembering it until then lets the sidecar answer OVER_LIMIT at once, which is what keeps
Redis calm under a flood of rejected traffic (the reference's local cache). Only plain windows
qualify: a token bucket refills, a sliding window slides and a borrowing window never counts
rejections, so their "over" can end at any moment.

The answers are the same as without the cache. The counter in the store is not incremented for
the hits answered here, which only shows in a count already past its limit (the reference's
local cache behaves the same). It is not used with `--rejected-hits skip`, where a refused
request must still be judged as a whole.
"""

from __future__ import annotations

#: A counter as the cache knows it: its key, its field (empty for a counter under its own key)
#: and its window's limit (`Hit.counter`), so a rule that changes the limit starts afresh.
Counter = tuple[bytes, bytes, int]


class OverLimitCache:
    """Counters mapped to the Unix ms when their over-limit window ends."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        #: counter -> when its window ends; empty when nothing is known to be over
        self.ends: dict[Counter, int] = {}

    def __len__(self) -> int:
        return len(self.ends)

    def get(self, counter: Counter, now_ms: int) -> int | None:
        """When the over-limit window of `counter` ends, or None if it is not known to be over."""
        end = self.ends.get(counter)
        if end is None:
            return None
        if end <= now_ms:
            del self.ends[counter]
            return None
        return end

    def put(self, counter: Counter, end_ms: int, now_ms: int) -> None:
        ends = self.ends
        if len(ends) >= self.max_entries:
            for stale in [e for e, end in ends.items() if end <= now_ms]:
                del ends[stale]
            if len(ends) >= self.max_entries:
                # Still full of live windows: start again rather than grow without bound.
                ends.clear()
        ends[counter] = end_ms
