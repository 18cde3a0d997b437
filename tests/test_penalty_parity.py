"""The Python and the Lua rendering of penalties (`sidecar.algorithms.penalty`,
`lua/decide.lua`) agree, hit for hit: the same request sequences, on the memory backend, a real
Redis and a real Redis Cluster, get the same Outcomes, the penalty's included.

The sequences are drawn from a seeded generator: descriptors of rules with a penalty on every
kind of window (plain, borrowing, sliding, token bucket, two windows grouped in a hash), in
shadow and quota modes, one or two per request, with checks, refunds and costs above 1, all or
nothing or not, and time steps from none to longer than a block, so that blocks start, refuse,
end, escalate and are forgotten. Every sequence uses keys of its own (its seed is in the domain).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from support.callbacks import apply

from sidecar.core import config
from sidecar.core.matching import match
from sidecar.decision.plan import descriptor_hits
from sidecar.model import Entry, Hit
from sidecar.storage import Backend
from sidecar.storage.backends import open_backend
from sidecar.storage.memory import MemoryBackend

RULES = """\
domain: parity{seed}
descriptors:
  - key: plain
    rate_limit: {{unit: minute, requests_per_unit: 3}}
    penalty: {{block: 2m, escalate: 1.5, max: 10m, forget_after: 15m}}
  - key: borrowing
    rate_limit: {{unit: minute, requests_per_unit: 3, borrow: 2}}
    penalty: {{block: 90s, escalate: 2, max: 6m, forget_after: 10m}}
  - key: sliding
    rate_limit: {{algorithm: sliding_window, unit: minute, requests_per_unit: 4}}
    penalty: {{block: 1m, escalate: 3, max: 20m, forget_after: 30m}}
  - key: bucket
    rate_limit: {{algorithm: token_bucket, unit: minute, requests_per_unit: 2, burst: 4}}
    penalty: {{block: 2m}}
  - key: quiet
    shadow_mode: true
    rate_limit: {{unit: minute, requests_per_unit: 2}}
    penalty: {{block: 3m, escalate: 2, max: 12m}}
  - key: quota
    quota_mode: true
    rate_limit: {{unit: minute, requests_per_unit: 2}}
    penalty: {{block: 2m}}
  - key: tenant
    group_counters: true
    descriptors:
      - key: user
        rate_limits:
          - {{unit: minute, requests_per_unit: 3}}
          - {{algorithm: token_bucket, unit: hour, requests_per_unit: 30, burst: 5}}
        penalty: {{block: 2m, escalate: 2, max: 8m, forget_after: 20m}}
"""
KEYS = ("plain", "borrowing", "sliding", "bucket", "quiet", "quota", "tenant")
STEPS_MS = (0, 0, 0, 0, 0, 1_000, 7_000, 20_000, 61_000, 3 * 60_000, 11 * 60_000, 25 * 60_000)
COSTS = (1, 1, 1, 1, 2, 0, -1)
START_MS = 1_800_000_005_000
REQUESTS = 300


def sequence(seed: int) -> list[tuple[int, list[Hit], bool]]:
    """(time, hits, all or nothing) of each request of sequence `seed`."""
    domain = config.parse(RULES.format(seed=seed), "rules.yaml")
    draw = random.Random(seed)
    now_ms = START_MS
    requests = []
    for _ in range(REQUESTS):
        now_ms += draw.choice(STEPS_MS)
        hits: list[Hit] = []
        for group, key in enumerate(draw.sample(KEYS, draw.choice((1, 1, 2)))):
            user = draw.choice(("u0", "u0", "u0", "u1"))
            pairs = [(key, user)] if key != "tenant" else [("tenant", "t"), ("user", user)]
            found = match(domain, tuple(Entry(k, v) for k, v in pairs))
            assert found is not None
            hits += descriptor_hits(domain.name, found, draw.choice(COSTS), group, now_ms)
        requests.append((now_ms, hits, draw.random() < 0.3))
    return requests


async def outcomes_on(backend: Backend, seed: int) -> list[list[tuple[object, ...]]]:
    return [
        [tuple(outcome) for outcome in await apply(backend, hits, all_or_nothing, now_ms)]
        for now_ms, hits, all_or_nothing in sequence(seed)
    ]


@pytest.fixture
async def shared(backend_url: str) -> AsyncIterator[Backend]:
    backend = open_backend(backend_url, timeout_ms=2_000)
    yield backend
    await backend.close()


SEEDS = range(12)


def penalty_outcomes(
    seed: int, answers: list[list[tuple[object, ...]]]
) -> list[tuple[object, ...]]:
    """The outcomes of sequence `seed`'s penalty hits."""
    return [
        outcome
        for (_, hits, _), outcomes in zip(sequence(seed), answers, strict=True)
        for hit, outcome in zip(hits, outcomes, strict=True)
        if hit.window.penalty is not None
    ]


async def test_the_sequences_start_escalate_and_enforce_blocks() -> None:
    """The sequences exercise what they claim to: each starts blocks, and together they refuse
    requests by a block and reach a third strike."""
    found = [penalty_outcomes(seed, await outcomes_on(MemoryBackend(), seed)) for seed in SEEDS]
    assert all(any(outcome[3] for outcome in outcomes) for outcomes in found)
    assert sum(bool(outcome[0]) for outcomes in found for outcome in outcomes) >= 10
    assert max(int(outcome[1]) for outcomes in found for outcome in outcomes) >= 3  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "backend_url",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
    indirect=True,
)
@pytest.mark.parametrize("seed", SEEDS)
async def test_redis_answers_penalties_as_the_memory_backend(shared: Backend, seed: int) -> None:
    """Every request of a sequence gets the same Outcomes from the script as from the Python
    decision."""
    assert await outcomes_on(shared, seed) == await outcomes_on(MemoryBackend(), seed)
