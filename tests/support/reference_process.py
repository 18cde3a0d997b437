"""The sidecar started as a Deployment written for envoyproxy/ratelimit starts it: the `ratelimit`
console script (the image's /bin/ratelimit) with no arguments and only the reference's
environment variables, in a process of its own.

The process gets nothing else from the tests' environment but what runs Python at all (PATH, and
PYTHONPATH/PYTHONSAFEPATH, which carry the compiled build under SIDECAR_BUILD). Its JSON log on
stderr is kept; the `started` event gives the ports it bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

START_TIMEOUT = 20.0
#: Runs the `ratelimit` console script's entry point, as its generated script does.
ENTRY = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "sys.exit(entry_points(group='console_scripts')['ratelimit'].load()())\n"
)
_PYTHON_RUNTIME = ("PATH", "PYTHONPATH", "PYTHONSAFEPATH", "HOME", "LANG")


@dataclass
class Reference:
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    started: dict[str, Any] = field(default_factory=dict)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
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
async def reference_process(env: Mapping[str, str], wait: bool = True) -> AsyncIterator[Reference]:
    """Start `ratelimit` with `env` (and Python's own variables); killed by PID on the way out."""
    runtime = {name: os.environ[name] for name in _PYTHON_RUNTIME if name in os.environ}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        ENTRY,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**runtime, **env},
    )
    served = Reference(process)
    ready = asyncio.Event()

    async def read() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            text = line.decode(errors="replace").rstrip("\n")
            served.lines.append(text)
            if '"started"' in text:
                served.started = json.loads(text)
                ready.set()
        ready.set()

    reader = asyncio.create_task(read())
    try:
        if wait:
            await asyncio.wait_for(ready.wait(), START_TIMEOUT)
            if not served.started:
                raise AssertionError(f"ratelimit did not start:\n{served.output()}")
        yield served
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await reader
