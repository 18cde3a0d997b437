"""The decision path's callback forms awaited, for tests: through `sidecar.loop.callbacks.awaited`,
the one adapter the sidecar's own coroutine callers use."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sidecar.decision.limiter import Limiter
from sidecar.decision.plan import Plan
from sidecar.loop.callbacks import awaited
from sidecar.model import Decision, Hit, Outcome, Request
from sidecar.rls.service import RateLimitService


async def apply(
    backend: Any, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int
) -> list[Outcome]:
    """What `backend.apply` answers (raised when it is an exception)."""
    outcomes: list[Outcome] = await awaited(
        functools.partial(backend.apply, hits, all_or_nothing, now_ms)
    )
    return outcomes


def _same(decision: Decision) -> Decision:
    return decision


async def decide(limiter: Limiter, plan: Plan) -> Decision:
    """The decision `limiter.decide` answers for a prepared request."""
    return await awaited(functools.partial(limiter.decide, plan, _same))


async def should_rate_limit(limiter: Limiter, request: Request) -> Decision:
    """`request` prepared and decided; raises InvalidRequest for one that breaks the protocol."""
    return await decide(limiter, limiter.prepare(request))


async def service_call(service: RateLimitService, body: bytes) -> bytes:
    """The serialized response `service.should_rate_limit` answers for `body`."""
    return await awaited(functools.partial(service.should_rate_limit, body))
