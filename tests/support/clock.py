"""A settable clock for tests that drive the limiter on every backend."""

from __future__ import annotations

import math
import time


class Clock:
    """Time the test sets, 5 s into the current real minute by default.

    Redis expires keys by real time, so simulated times stay near now unless a test needs a
    particular date (keys carry their window's start, so a far date only matters for expiry).
    """

    def __init__(self, now: float | None = None) -> None:
        self.now = math.floor(time.time() / 60) * 60 + 5.0 if now is None else now

    def __call__(self) -> float:
        return self.now
