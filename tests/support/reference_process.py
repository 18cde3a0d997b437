"""The sidecar started as a Deployment written for envoyproxy/ratelimit starts it: the `ratelimit`
console script (the image's /bin/ratelimit) with no arguments and only the reference's
environment variables, in a process of its own (`support.logged_process`: its JSON log on
stderr is kept; the `started` event gives the ports it bound).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from support.logged_process import Logged, logged_process

START_TIMEOUT = 20.0
#: Runs the `ratelimit` console script's entry point, as its generated script does.
ENTRY = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "sys.exit(entry_points(group='console_scripts')['ratelimit'].load()())\n"
)


@asynccontextmanager
async def reference_process(env: Mapping[str, str], wait: bool = True) -> AsyncIterator[Logged]:
    """Start `ratelimit` with `env` (and Python's own variables); killed by PID on the way out."""
    argv = [sys.executable, "-c", ENTRY]
    async with logged_process(argv, env, start_timeout=START_TIMEOUT, wait=wait) as started:
        yield started
