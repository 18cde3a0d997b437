"""Which build of the sidecar is running: the modules the compiled build compiles, and which of
them are compiled in this process.

The compiled build (`RATELIMIT_SIDECAR_COMPILE=1`, see setup.py and README) compiles the modules
every ShouldRateLimit call runs through with mypyc, from the same source: the fast transport's
HTTP/2 state machine, the service, the limiter and the Redis backend with its script contract and its pipelined client, and
what a frequency-cap check (CheckAds) runs through.
The rest (configuration, the admin endpoints, the injector, grpcio) stays interpreted: it is off
the hot path, and it talks to libraries whose stubs mypyc's runtime checks would hold it to.

Stdlib only: setup.py reads HOT_PATH from this file before anything is installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: The modules of the hot path, compiled together (one extension, so calls between them are
#: native calls).
HOT_PATH = (
    "sidecar.rls.h2.frames",
    "sidecar.rls.h2.fields",
    "sidecar.rls.h2.unary",
    "sidecar.rls.h2.streams",
    "sidecar.rls.h2.connection",
    "sidecar.rls.h2.server",
    "sidecar.rls.convert",
    "sidecar.rls.extras",
    "sidecar.rls.service",
    "sidecar.decision.plan",
    "sidecar.model",
    "sidecar.core.rules",
    "sidecar.core.matching",
    "sidecar.core.counters",
    "sidecar.core.keys",
    "sidecar.algorithms.windows",
    "sidecar.algorithms.fixed_window",
    "sidecar.algorithms.packing",
    "sidecar.decision.limiter",
    "sidecar.decision.stats",
    "sidecar.decision.over_limit_cache",
    "sidecar.telemetry.metrics",
    "sidecar.storage.redis_client",
    "sidecar.storage.failures",
    "sidecar.storage.scripts",
    "sidecar.storage.redis",
    # A frequency-cap check (CheckAds): about two hundred caps named and judged a call.
    "sidecar.frequency.identities",
    "sidecar.frequency.checks",
    "sidecar.frequency.caps",
)


def compiled() -> list[str]:
    """The modules of HOT_PATH imported in this process from a compiled extension."""
    found = []
    for name in HOT_PATH:
        module = sys.modules.get(name)
        if module is not None and str(getattr(module, "__file__", "")).endswith(
            tuple(EXTENSION_SUFFIXES)
        ):
            found.append(name)
    return found


def name() -> str:
    """What runs: `compiled` when every module of HOT_PATH imported so far is compiled,
    `source` when none is, `partial` otherwise (a broken build)."""
    loaded = [module for module in HOT_PATH if module in sys.modules]
    count = len(compiled())
    if count and count == len(loaded):
        return "compiled"
    return "partial" if count else "source"


def environ(directory: str | Path, also: Sequence[str | Path] = ()) -> dict[str, str]:
    """The environment under which Python imports the compiled build unpacked in `directory`
    (`make compiled`) ahead of any checkout's sources, then what is in `also`: PYTHONPATH, and
    PYTHONSAFEPATH so that `python -m` and `python SCRIPT` do not put their own directory first.

    Raises ValueError when `directory` holds no compiled build of every HOT_PATH module.
    """
    root = Path(directory).resolve()
    missing = [
        module
        for module in HOT_PATH
        if not any(
            (root / (module.replace(".", "/") + suffix)).is_file() for suffix in EXTENSION_SUFFIXES
        )
    ]
    if missing:
        raise ValueError(
            f"{directory}: no compiled build of {', '.join(missing)} (run `make compiled`)"
        )
    path = os.pathsep.join(str(Path(entry).resolve()) for entry in (root, *also))
    return {"PYTHONPATH": path, "PYTHONSAFEPATH": "1"}
