"""bench/distinct.py's parts: the key draws (bench/keyspace.py) and the load generator
(bench/h2client.py) against a real sidecar. Speed is the bench's business; these check that what
it sends is what it says, and that what it counts is what the server answered."""

from __future__ import annotations

import math
import re
from pathlib import Path

import aiohttp
import pytest
from support.sidecars import serve_process

from bench import h2client, keyspace
from bench.keyspace import Keys, Shape, Spread, Zipf

#: bench/distinct-rules' descriptors, with hour windows so no counter ends during the test.
RULES = """\
domain: distinct
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
  - key: app
    descriptors:
      - key: remote_address
        rate_limit: {unit: hour, requests_per_unit: 1000000000}
"""


@pytest.mark.parametrize("size", [100_000, 10_000_000])
@pytest.mark.parametrize("spread", list(Spread))
def test_draws_stay_in_their_key_space_and_spread_over_it(size: int, spread: Spread) -> None:
    """Every drawn index lies in [0, size) and the draws reach its far end; a uniform draw
    names as many distinct keys as n draws from `size` should (size * (1 - e**(-n/size))),
    a Zipf draw fewer, its head repeating with rank 1 about twice as often as rank 2."""
    draws = 50_000
    indices = Keys(size, spread).draw(draws, seed=1)
    assert min(indices) >= 0
    assert max(indices) < size
    assert max(indices) > size * 0.99
    distinct = len(set(indices))
    expected = size * -math.expm1(-draws / size)
    if spread is Spread.UNIFORM:
        assert distinct == pytest.approx(expected, rel=0.02)
    else:
        assert distinct < expected * 0.6
        assert 1.8 < indices.count(0) / indices.count(1) < 2.3


@pytest.mark.parametrize("size", [100_000, 10_000_000])
def test_zipf_ranks_run_from_one_to_the_key_space_size(size: int) -> None:
    """The inverse of the cumulative weight maps [0, 1) onto ranks 1..size, in order."""
    zipf = Zipf(size, 1.0)
    assert zipf.rank(0.0) == 1
    assert zipf.rank(math.nextafter(1.0, 0.0)) == size
    ranks = [zipf.rank(u / 1000) for u in range(1000)]
    assert ranks == sorted(ranks)


def test_zipf_weights_past_the_table_agree_with_the_exact_sum() -> None:
    """Past the exact head, the closed form's total weight is the sum of k**-s to within 1e-9
    of it, and rank 1 comes up with its share 1 / H(n)."""
    size = 300_000
    for s in (1.0, 1.2):
        exact = math.fsum(k**-s for k in range(1, size + 1))
        assert Zipf(size, s).total == pytest.approx(exact, rel=1e-9)
    draws = Keys(size, Spread.ZIPF).draw(100_000, seed=2)
    expected = 100_000 / Zipf(size, 1.0).total
    assert abs(draws.count(0) - expected) < 5 * math.sqrt(expected)


def test_two_descriptor_bodies_name_the_user_and_the_address_of_one_key() -> None:
    """A body of Shape.TWO carries `user` and `app` + `remote_address` of the same key, framed
    with gRPC's prefix."""
    from envoy.service.ratelimit.v3 import rls_pb2

    (body,) = keyspace.bodies([70_000], Shape.TWO)
    assert body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5
    request = rls_pb2.RateLimitRequest.FromString(body[5:])
    entries = [[(e.key, e.value) for e in d.entries] for d in request.descriptors]
    assert request.domain == keyspace.DOMAIN
    assert entries == [[("user", "u70000")], [("app", "bench"), ("remote_address", "10.1.17.112")]]


@pytest.mark.parametrize("rate", [400.0, None], ids=["fixed-rate", "flat-out"])
async def test_the_generator_sends_distinct_bodies_and_counts_every_answer(
    tmp_path: Path, rate: float | None
) -> None:
    """Against a real sidecar on the memory backend, a short run answers every call OK, and the
    sidecar holds one counter per distinct user and per distinct address the draw named."""
    rules = tmp_path / "distinct.yaml"
    rules.write_text(RULES)
    indices = Keys(100_000, Spread.UNIFORM).draw(300, seed=3)
    bodies = list(keyspace.bodies(indices, Shape.TWO))
    args = ["--config", str(rules), "--backend", "memory://", "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]  # fmt: skip
    async with serve_process(args) as served:
        pace = h2client.Pace(connections=2, streams=4, rate=rate)
        tally = await h2client.run("127.0.0.1", served.grpc_port, bodies, pace)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{served.http_port}/metrics") as response,
        ):
            metrics = await response.text()
    assert tally.outcomes == {"OK": 300}
    assert len(tally.latencies_us) == 300
    assert len(tally.lags_us) == (300 if rate else 0)
    counters = re.search(r"^ratelimit_sidecar_memory_counters (\S+)$", metrics, re.MULTILINE)
    assert counters is not None
    assert float(counters.group(1)) == 2 * len(set(indices))
    assert len(set(indices)) > 290


async def test_the_generator_counts_a_refused_call_by_its_grpc_status(tmp_path: Path) -> None:
    """A call the sidecar refuses (a body that is not a RateLimitRequest: INVALID_ARGUMENT,
    answered trailers-only) is counted under its gRPC status, beside the calls answered OK."""
    rules = tmp_path / "distinct.yaml"
    rules.write_text(RULES)
    bodies = [keyspace.framed(b"\xff\xff\xff"), *keyspace.bodies([1, 2], Shape.ONE)]
    args = ["--config", str(rules), "--backend", "memory://", "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]  # fmt: skip
    async with serve_process(args) as served:
        tally = await h2client.run("127.0.0.1", served.grpc_port, bodies, h2client.Pace(1, 1))
    assert tally.outcomes == {"OK": 2, "INVALID_ARGUMENT": 1}
