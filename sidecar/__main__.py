"""`python -m sidecar` runs the same CLI as the `ratelimit-sidecar` console script."""

from sidecar.cli import main

raise SystemExit(main())
