"""HyperLogLog, as Redis's PFADD and PFCOUNT count: the memory backend's unique counts.

A HyperLogLog estimates how many distinct members were added, in bounded memory: 16,384
six-bit registers (Redis's dense form is 12 KB; its sparse form, for few members, a few hundred
bytes), with a standard error of 1.04/sqrt(16384) = 0.81%. Adding a member hashes it with
MurmurHash64A (seed 0xadc83b19, as Redis does); the low 14 bits pick a register, which keeps the
longest run of zero bits seen above them, plus one. Counting uses the estimator Redis uses
since 5.0 (Otmar Ertl's, "New cardinality estimation algorithms for HyperLogLog sketches",
2017), which needs no bias table and holds from zero members up.

Same hash, same registers, same estimator: for the same members this module and Redis give the
same count, to the unit (tests/test_usage.py holds them to it), so memory and Redis agree.

Here the registers start sparse, an array of ``register << 6 | value`` words, 4 bytes per
register set, sorted; past SPARSE_MAX of them (12 KB) they become a dense bytearray of 16 KB.
"""

from __future__ import annotations

import bisect
import math
from array import array
from typing import TypeAlias

P = 14
REGISTERS = 1 << P
#: Bits of the hash left to count zero runs in (Redis's HLL_Q).
Q = 64 - P
#: Registers kept sparse at most: as many bytes as Redis's dense form (12 KB).
SPARSE_MAX = 3_072
_SEED = 0xADC83B19
_M = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1
_ALPHA_INF = 0.5 / math.log(2)

Registers: TypeAlias = "array[int] | bytearray"


def new() -> Registers:
    """An empty HyperLogLog."""
    return array("I")


def add(registers: Registers, member: bytes) -> tuple[Registers, bool]:
    """Add `member`: the registers after (the same object unless it turned dense), and whether
    a register changed (PFADD's reply)."""
    index, value = _position(member)
    if isinstance(registers, bytearray):
        if registers[index] >= value:
            return registers, False
        registers[index] = value
        return registers, True
    word = index << 6 | value
    at = bisect.bisect_left(registers, index << 6)
    if at < len(registers) and registers[at] >> 6 == index:
        if registers[at] & 63 >= value:
            return registers, False
        registers[at] = word
        return registers, True
    registers.insert(at, word)
    if len(registers) > SPARSE_MAX:
        dense = bytearray(REGISTERS)
        for kept in registers:
            dense[kept >> 6] = kept & 63
        return dense, True
    return registers, True


def count(registers: Registers) -> int:
    """The estimated number of distinct members added (PFCOUNT's reply)."""
    histogram = [0] * (Q + 2)
    if isinstance(registers, bytearray):
        for value in registers:
            histogram[value] += 1
    else:
        histogram[0] = REGISTERS - len(registers)
        for word in registers:
            histogram[word & 63] += 1
    m = REGISTERS
    z = m * _tau((m - histogram[Q + 1]) / m)
    for j in range(Q, 0, -1):
        z += histogram[j]
        z *= 0.5
    z += m * _sigma(histogram[0] / m)
    return round(_ALPHA_INF * m * m / z)


def merge(into: Registers, other: Registers) -> Registers:
    """The registers of the union of two HyperLogLogs (PFMERGE): each register's larger value."""
    dense = bytearray(REGISTERS)
    for registers in (into, other):
        if isinstance(registers, bytearray):
            for index, value in enumerate(registers):
                if value > dense[index]:
                    dense[index] = value
        else:
            for word in registers:
                if word & 63 > dense[word >> 6]:
                    dense[word >> 6] = word & 63
    return dense


def size(registers: Registers) -> int:
    """Bytes the registers take (their buffer, not the Python object around it)."""
    if isinstance(registers, bytearray):
        return len(registers)
    return len(registers) * registers.itemsize


def _position(member: bytes) -> tuple[int, int]:
    """The register `member` falls in and the value it offers it (Redis's hllPatLen)."""
    hashed = murmur64a(member)
    index = hashed & (REGISTERS - 1)
    hashed = (hashed >> P) | (1 << Q)
    run = 1
    while not hashed & 1:
        run += 1
        hashed >>= 1
    return index, run


def murmur64a(data: bytes, seed: int = _SEED) -> int:
    """MurmurHash64A of `data`, as Redis's hyperloglog.c computes it (little-endian words)."""
    length = len(data)
    h = (seed ^ (length * _M)) & _MASK
    whole = length - length % 8
    for start in range(0, whole, 8):
        k = int.from_bytes(data[start : start + 8], "little")
        k = (k * _M) & _MASK
        k ^= k >> 47
        k = (k * _M) & _MASK
        h ^= k
        h = (h * _M) & _MASK
    tail = data[whole:]
    if tail:
        h ^= int.from_bytes(tail, "little")
        h = (h * _M) & _MASK
    h ^= h >> 47
    h = (h * _M) & _MASK
    h ^= h >> 47
    return h


def _sigma(x: float) -> float:
    if x == 1.0:
        return math.inf
    y = 1.0
    z = x
    while True:
        x *= x
        previous = z
        z += x * y
        y += y
        if previous == z:
            return z


def _tau(x: float) -> float:
    if x == 0.0 or x == 1.0:
        return 0.0
    y = 1.0
    z = 1 - x
    while True:
        x = math.sqrt(x)
        previous = z
        y *= 0.5
        z -= (1 - x) ** 2 * y
        if previous == z:
            return z / 3
