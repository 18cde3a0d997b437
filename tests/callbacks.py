"""A backend's callback form seen as its coroutine form, for tests of `apply_then`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sidecar.model import Hit, Outcome


class Callbacks:
    """A backend's callback form, `apply_then` (the fast transport's path), seen as `apply`, so
    that the same tests hold it to the same outcomes and failures."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.name = backend.name

    async def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int) -> list[Outcome]:
        future: asyncio.Future[list[Outcome] | Exception] = (
            asyncio.get_running_loop().create_future()
        )
        self.backend.apply_then(hits, all_or_nothing, now_ms, future.set_result)
        result = await future
        if isinstance(result, Exception):
            raise result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)
