"""Who calls: keys drawn from a large key space, and the `ShouldRateLimit` bodies they make.

Real gateway traffic names client IPs and user ids, so most request bodies are new to the
service; this module draws them the way such traffic spreads, and pre-serializes each request
(a `RateLimitRequest`, framed with gRPC's 5-byte prefix) so the load generator only writes bytes.

Two spreads over `size` keys (ranks 1 to `size`):

- uniform: every key equally likely (`random.randrange`);
- Zipf with exponent `s` (1.0 by default): key k drawn with weight k**-s, so a few keys are hot
  and a long tail is seen once or never, as user ids are. Without numpy (the venv has none, and
  it is not worth a dependency) the draw inverts the cumulative weights: exactly, by bisection,
  over the first HEAD_RANKS keys, where nearly all the draws fall; past them the sum of k**-s is
  the integral over [k - 1/2, k + 1/2] (the midpoint rule: off by about s(s+1)/24 k**(-s-2) per
  key, under 1e-10 of one key's weight there), which inverts in closed form. Memory: one float
  per head rank (at most HEAD_RANKS, 512 KiB), whatever the key space.

The bodies (`Shape`): one descriptor (`user`), or two (`user` alone, and `app` with
`remote_address`, as bench/gateway-rules has them), both from the same drawn key, as one client
sends its user id and its address. Draws are seeded, so a row is the same calls every run.
"""

from __future__ import annotations

import bisect
import enum
import math
import random
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

#: The domain the bodies name; bench/distinct-rules declares it.
DOMAIN = "distinct"
APP = "bench"
#: Ranks inverted exactly by table; the rest by the closed form (see the module docstring).
HEAD_RANKS = 1 << 16
ZIPF_S = 1.0


class Spread(enum.Enum):
    UNIFORM = "uniform"
    ZIPF = "zipf"


class Shape(enum.Enum):
    """Descriptors per request."""

    ONE = 1  # user=<key>
    TWO = 2  # user=<key>; app=bench, remote_address=<the key as an IPv4 address>


@dataclass(frozen=True)
class Keys:
    """A key space: `size` keys spread as `spread`."""

    size: int
    spread: Spread
    s: float = ZIPF_S

    def draw(self, count: int, seed: int) -> list[int]:
        """`count` key indices in [0, size), seeded."""
        rng = random.Random(seed)
        if self.spread is Spread.UNIFORM:
            return [rng.randrange(self.size) for _ in range(count)]
        zipf = Zipf(self.size, self.s)
        return [zipf.rank(rng.random()) - 1 for _ in range(count)]


class Zipf:
    """Ranks 1..size with weight k**-s, drawn by inverting the cumulative weight."""

    def __init__(self, size: int, s: float) -> None:
        if size < 1 or s <= 0:
            raise ValueError(f"Zipf over {size} keys with s={s}: need size >= 1 and s > 0")
        self.size, self.s = size, s
        self._head = array("d")
        total = 0.0
        for k in range(1, min(size, HEAD_RANKS) + 1):
            total += k**-s
            self._head.append(total)
        self._head_total = total
        self._tail_from = self._integral(len(self._head) + 0.5)
        self.total = total + (self._integral(size + 0.5) - self._tail_from)

    def rank(self, u: float) -> int:
        """The rank whose cumulative share first reaches `u` in [0, 1)."""
        target = u * self.total
        if target < self._head_total:
            return bisect.bisect_right(self._head, target) + 1
        x = self._inverse(self._tail_from + target - self._head_total)
        return min(self.size, max(len(self._head) + 1, math.ceil(x - 0.5)))

    def _integral(self, x: float) -> float:
        """An antiderivative of x**-s."""
        return math.log(x) if self.s == 1 else x ** (1 - self.s) / (1 - self.s)

    def _inverse(self, y: float) -> float:
        return math.exp(y) if self.s == 1 else (y * (1 - self.s)) ** (1 / (1 - self.s))


def address(index: int) -> str:
    """Key `index` as an IPv4 address in 10.0.0.0/8 (16,777,216 of them)."""
    return f"10.{index >> 16 & 0xFF}.{index >> 8 & 0xFF}.{index & 0xFF}"


def message(index: int, shape: Shape) -> bytes:
    """The serialized `RateLimitRequest` of key `index`."""
    user = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="user", value=f"u{index}")]
    )
    descriptors = [user]
    if shape is Shape.TWO:
        entries = [
            ratelimit_pb2.RateLimitDescriptor.Entry(key="app", value=APP),
            ratelimit_pb2.RateLimitDescriptor.Entry(key="remote_address", value=address(index)),
        ]
        descriptors.append(ratelimit_pb2.RateLimitDescriptor(entries=entries))
    serialized: bytes = rls_pb2.RateLimitRequest(
        domain=DOMAIN, descriptors=descriptors
    ).SerializeToString()
    return serialized


def framed(message: bytes) -> bytes:
    """A unary gRPC request body: uncompressed flag, big-endian length, the message."""
    return struct.pack(">BI", 0, len(message)) + message


def bodies(indices: list[int], shape: Shape) -> Iterator[bytes]:
    """The framed body of each drawn key, in order."""
    for index in indices:
        yield framed(message(index, shape))
