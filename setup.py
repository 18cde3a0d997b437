"""The compiled build: with RATELIMIT_SIDECAR_COMPILE=1, a wheel build compiles the hot path
(`sidecar/build.py` names its modules) with mypyc; without it, the package is pure Python.

Everything else about the package is in pyproject.toml. The compiled build needs mypy, a C
compiler and the project's dependencies in the build environment, because mypyc type-checks
the modules against them and their stubs (mypy and types-PyYAML, as in the dev extra): build
it with `make compiled`, or as the Dockerfile does, in an environment where the package and
those are installed already,

    RATELIMIT_SIDECAR_COMPILE=1 pip install --no-build-isolation --no-deps --force-reinstall .

Never in an editable install: the extensions would sit beside the sources and shadow every
later edit of them.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _ext_modules() -> list:
    if os.environ.get("RATELIMIT_SIDECAR_COMPILE", "") != "1":
        return []
    if any(command.startswith("editable") for command in sys.argv[1:]):
        raise SystemExit(
            "RATELIMIT_SIDECAR_COMPILE=1 builds a wheel, not an editable install (its compiled "
            "modules would shadow the sources): `make compiled`, or `pip install .`"
        )
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(
            "RATELIMIT_SIDECAR_COMPILE=1 needs mypy (mypyc) in the build environment: "
            "pip install mypy, then build with --no-build-isolation"
        ) from None
    hot_path = runpy.run_path(str(ROOT / "sidecar" / "build.py"))["HOT_PATH"]
    paths = [name.replace(".", "/") + ".py" for name in hot_path]
    return mypycify(paths, opt_level="3", debug_level="1")


setup(ext_modules=_ext_modules())
