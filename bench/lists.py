"""Benchmark allow and deny lists (`sidecar.core.lists`): what a 100,000-entry CIDR list costs a
request, and what it keeps.

1. Load: reading and parsing the list file with the rules (`config.load`), and the memory the
   list keeps (tracemalloc over the load, the rules' own few objects included).
2. Lookup: one address asked of the list (`in`), an IPv4 and an IPv6 address, on the list and
   not, against the same lookup in a list of one network of each of its prefix lengths (10
   entries): a cost that does not grow with the list is O(prefix length), not O(list).
3. Per request: `ShouldRateLimit` decided in this process on the memory backend (plan and
   decision, every body new: a client address per call, so every call matches anew, as most of
   a gateway's calls do), with the list in the rules and without, CPU per call
   (`time.process_time`, so the other processes of a busy machine weigh less).

    .venv/bin/python -m bench.lists [--entries N] [--calls N]

Numbers taken on a busy machine vary by a few tens of percent: compare rows taken side by side.
Exit status: 0 when measured, 1 when something failed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import socket
import sys
import tempfile
import time
import timeit
import tracemalloc
from pathlib import Path

if not __package__:  # run as `python bench/lists.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.core import config
from sidecar.core.lists import Networks
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.loop.callbacks import awaited
from sidecar.model import Code, Decision, Descriptor, Entry, Request
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: edge
{lists}
descriptors:
  - key: remote_address
    rate_limit: {{unit: minute, requests_per_unit: 1000000000}}
"""
LISTS = """\
lists:
  - key: remote_address
    match: cidr
    deny: denied.txt
"""


def networks(count: int, seed: int = 1) -> list[str]:
    """`count` distinct networks, three quarters IPv4 (/16 to /32) and a quarter IPv6 (/32 to
    /64), of 10 prefix lengths, none of them in 10.0.0.0/8 or 2001:db8::/32 (the addresses the calls come from)."""
    draw = random.Random(seed)
    found: set[str] = set()
    while len(found) < count:
        if draw.random() < 0.75:
            length = draw.choice((16, 20, 24, 24, 24, 28, 32, 32))
            number = draw.getrandbits(32) >> (32 - length) << (32 - length)
            if number >> 24 == 10:
                continue
            text = socket.inet_ntop(socket.AF_INET, number.to_bytes(4, "big"))
        else:
            length = draw.choice((32, 40, 48, 48, 56, 64))
            number = draw.getrandbits(128) >> (128 - length) << (128 - length)
            if number >> 96 == 0x20010DB8:
                continue
            text = socket.inet_ntop(socket.AF_INET6, number.to_bytes(16, "big"))
        found.add(f"{text}/{length}")
    return sorted(found)


def load(directory: Path, entries: list[str]) -> tuple[Rules, float, int]:
    """The rules naming a deny list of `entries`: load seconds (the best of three) and bytes
    kept (a fourth load, under tracemalloc, which slows it)."""
    (directory / "denied.txt").write_text("\n".join(entries) + "\n")
    rules_file = directory / "rules.yaml"
    rules_file.write_text(RULES.format(lists=LISTS))
    seconds = min(timeit.repeat(lambda: config.load([rules_file]), number=1, repeat=3))
    tracemalloc.start()
    rules = config.load([rules_file])
    kept, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return rules, seconds, kept


def lookup_ns(held: Networks, value: str) -> float:
    """CPU nanoseconds of one `value in held` (the lambda's call included), the best of five
    runs."""
    runs = timeit.repeat(lambda: value in held, number=100_000, repeat=5, timer=time.process_time)
    return min(runs) / 100_000 * 1e9


async def per_call_us(rules: Rules, calls: int) -> float:
    """CPU µs per ShouldRateLimit call on the memory backend, every call from an address of
    its own (on no list: the list is looked up and the rule counts the call)."""
    limiter = Limiter(rules, MemoryBackend())
    requests = [
        Request(
            "edge",
            (
                Descriptor(
                    (Entry("remote_address", f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"),)
                ),
            ),
        )
        for n in range(calls)
    ]

    def same(decision: Decision) -> Decision:
        return decision

    started = time.process_time()
    for made in requests:
        decision = await awaited(functools.partial(limiter.decide, limiter.prepare(made), same))
        assert decision.overall_code is Code.OK
    return (time.process_time() - started) / calls * 1e6


def _networks(rules: Rules) -> Networks:
    held = rules.domains["edge"].lists
    assert held is not None
    found = held.held("remote_address", "deny")
    assert isinstance(found, Networks)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=50_000)
    args = parser.parse_args()
    entries = networks(args.entries)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        rules, seconds, kept = load(directory, entries)
        small_dir = directory / "small"
        small_dir.mkdir()
        # One network of each prefix length of the big list: as many sets to ask, few entries.
        lengths = {(":" in entry, entry.split("/")[1]): entry for entry in entries}
        small, _, _ = load(small_dir, sorted(lengths.values()))
    big_networks = _networks(rules)
    small_networks = _networks(small)
    ipv4 = sum(":" not in entry for entry in entries)
    print(f"a deny list of {len(big_networks):,} CIDR entries ({ipv4:,} IPv4, the rest IPv6)")
    print(
        f"  load with the rules: {seconds:.2f} s; kept: {kept / 1e6:.1f} MB "
        f"({kept / len(entries):.0f} B an entry)"
    )
    print(f"  sets a lookup asks at most (IPv4, IPv6): {big_networks.probes}")
    on_list = entries[0].split("/")[0]
    print(
        f"lookup, CPU ns (best of 5 × 100,000)    {len(big_networks):,} entries "
        f"  {len(small_networks)} entries"
    )
    for label, value in (
        ("IPv4 on no list", "10.1.2.3"),
        ("IPv6 on no list", "2001:db8::1"),
        (f"on the list ({on_list})", on_list),
        ("not an address", "alice"),
    ):
        print(
            f"  {label:<38} {lookup_ns(big_networks, value):>12.0f} {lookup_ns(small_networks, value):>12.0f}"
        )
    plain = config.parse(RULES.format(lists=""), "plain.yaml")
    without = asyncio.run(per_call_us(Rules({"edge": plain}), args.calls))
    listed = asyncio.run(per_call_us(rules, args.calls))
    print(
        f"per ShouldRateLimit call, every body new, memory backend, CPU µs ({args.calls:,} calls)"
    )
    print(
        f"  without lists {without:.2f}; with the 100,000-entry list {listed:.2f}; difference {listed - without:+.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
