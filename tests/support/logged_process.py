"""A program started in a process of its own as a deployment starts it, its JSON log on stderr
kept: the `started` event gives the ports it bound. `ratelimit` as the reference's Deployments
start it (`support.reference_process`) and the image's ENTRYPOINT as Docker runs it
(`tests/test_image.py`) are both started here.

The process gets nothing else from the tests' environment but what runs Python at all (PATH,
and PYTHONPATH/PYTHONSAFEPATH, which carry the compiled build under SIDECAR_BUILD).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

#: What a process needs of the tests' environment to run Python at all; nothing else leaks in.
PYTHON_RUNTIME = ("PATH", "PYTHONPATH", "PYTHONSAFEPATH", "HOME", "LANG")


def python_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env`, with the tests' own `PYTHON_RUNTIME` variables beneath it."""
    runtime = {name: os.environ[name] for name in PYTHON_RUNTIME if name in os.environ}
    return {**runtime, **env}


@dataclass
class Logged:
    """A started process: the environment it got, each line of its log, and its `started`
    event (empty until it serves)."""

    process: asyncio.subprocess.Process
    env: dict[str, str]
    lines: list[str] = field(default_factory=list)
    started: dict[str, Any] = field(default_factory=dict)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The log's JSON events (named `name`), in order; lines that are not JSON left out."""
        found = []
        for line in self.lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if name is None or event.get("event") == name:
                found.append(event)
        return found

    def output(self) -> str:
        return "\n".join(self.lines)


@asynccontextmanager
async def logged_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    start_timeout: float,
    wait: bool = True,
    stop_grace: float | None = None,
) -> AsyncIterator[Logged]:
    """Start `argv` with `python_env(env)`; with `wait`, until its `started` event (an
    AssertionError with its log when it ends without one). On the way out it is stopped by its
    PID: killed, or with `stop_grace`, sent SIGTERM (as `docker stop`) and killed if it lingers
    that many seconds."""
    environment = python_env(env)
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
    )
    logged = Logged(process, environment)
    ready = asyncio.Event()

    async def read() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            text = line.decode(errors="replace").rstrip("\n")
            logged.lines.append(text)
            if '"started"' in text:
                logged.started = json.loads(text)
                ready.set()
        ready.set()

    reader = asyncio.create_task(read())
    try:
        if wait:
            await asyncio.wait_for(ready.wait(), start_timeout)
            if not logged.started:
                raise AssertionError(f"{list(argv)} did not start:\n{logged.output()}")
        yield logged
    finally:
        if process.returncode is None:
            if stop_grace is None:
                process.kill()
            else:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), stop_grace)
                except TimeoutError:
                    process.kill()
        await process.wait()
        await reader
