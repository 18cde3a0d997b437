"""Which build the suite tests: the sources, or the compiled build that SIDECAR_BUILD names.

`make test` runs the suite twice: on the sources, then with SIDECAR_BUILD=build/compiled (the
wheel `make compiled` builds, unpacked). Imported by conftest.py before anything imports
`sidecar`, this puts that directory first on the path of the tests' process, and of every
process a test starts (`sidecar.build.environ`). Then every module of the hot path must come
from it compiled: a run that would quietly test the sources instead stops before the first test.
"""

from __future__ import annotations

import importlib
import os
import sys

BUILD = os.environ.get("SIDECAR_BUILD", "")

if BUILD:
    sys.path.insert(0, os.path.abspath(BUILD))
    from sidecar import build

    if not build.__file__ or not build.__file__.startswith(os.path.abspath(BUILD)):
        raise SystemExit(f"SIDECAR_BUILD={BUILD}: sidecar was imported from {build.__file__}")
    _inherited = os.environ.get("PYTHONPATH")
    try:
        os.environ.update(build.environ(BUILD, _inherited.split(os.pathsep) if _inherited else ()))
    except ValueError as exc:
        raise SystemExit(f"SIDECAR_BUILD={exc}") from None
    for _name in build.HOT_PATH:
        importlib.import_module(_name)
    if build.name() != "compiled":
        _missing = sorted(set(build.HOT_PATH) - set(build.compiled()))
        raise SystemExit(f"SIDECAR_BUILD={BUILD}: not compiled in this process: {_missing}")
