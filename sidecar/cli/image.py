"""The image's entrypoint (the Dockerfile's ENTRYPOINT, `ratelimit-sidecar-image`): runs what
`docker run IMAGE [ARGS]`, docker-compose's `command:` and Kubernetes' `args:` ask for, read
as a user of this image or of envoyproxy/ratelimit's means it.

Docker runs ENTRYPOINT followed by CMD, and compose's `command:` (like arguments after the
image's name) replaces CMD only, keeping ENTRYPOINT; the Dockerfile's CMD is empty. So the
arguments arrive here, and the first one says what was meant:

- none (a bare `docker run IMAGE`): serve. As `ratelimit` when any of the reference's
  variables is set (REDIS_URL, RUNTIME_ROOT, ...), as the reference's image does with none;
  otherwise as `ratelimit-sidecar serve`, of the example rules the image carries
  (`RULES`, the repository's envoy/rules) unless RLS_CONFIG or RLS_XDS_SERVER names others,
  on memory:// unless RLS_BACKEND says otherwise, as `make run` does.
- `/bin/ratelimit` or `ratelimit` (the reference's compose file says `command: /bin/ratelimit`):
  `ratelimit`, the rest its flags.
- `ratelimit-sidecar`: that command line; a command of it (`serve`, `check`, ...) or a flag
  (`--help`) with no program name before it, the same, as the image's entrypoint used to be.
- `healthcheck [HOST:PORT]`: the image's HEALTHCHECK (`healthcheck`, below), which needs no curl.
- anything else is a program, run in this process's place (`sh`, `python`).

A Kubernetes `command:` replaces the entrypoint itself: `/bin/ratelimit` is then run directly.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from sidecar.cli import settings
from sidecar.cli.flags import PROG

#: Where the image carries the repository's envoy/rules (the Dockerfile's COPY); the variable
#: lets a test run the entrypoint on the repository's copy, as the image would on its own.
RULES = "/etc/ratelimit-sidecar/rules"
RULES_VARIABLE = "RATELIMIT_SIDECAR_IMAGE_RULES"
#: The names compose and Kubernetes users give the reference's program.
REFERENCE_NAMES = ("/bin/ratelimit", "ratelimit")
#: How long the health check waits for an answer; Docker's own timeout (30 s) is far longer.
HEALTHCHECK_TIMEOUT = 5.0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run what the arguments ask for (see the module's docstring); the exit status."""
    from sidecar import cli

    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    if not args:
        if settings.present(environ):
            return cli.reference_main([])
        rules = [] if environ.get("RLS_CONFIG") or environ.get("RLS_XDS_SERVER") else [
            "--config", environ.get(RULES_VARIABLE, RULES),
        ]  # fmt: skip
        return cli.main(["serve", *rules])
    first, rest = args[0], args[1:]
    if first in REFERENCE_NAMES:
        return cli.reference_main(rest)
    if os.path.basename(first) == PROG:
        return cli.main(rest)
    if first == "healthcheck":
        return healthcheck(rest, environ)
    if first.startswith("-") or first in cli.command_names():
        return cli.main(args)
    os.execvp(first, args)


def healthcheck(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """GET /healthcheck on the sidecar's HTTP address: exit status 0 when it answers 200, else 1
    with why. The address is the argument, else RLS_HTTP_ADDRESS, else the reference's
    HOST and PORT, else 8080; on loopback whatever host the sidecar binds."""
    address = argv[0] if argv else http_address(environ)
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    url = f"http://{host}:{port}/healthcheck"
    try:
        with urllib.request.urlopen(url, timeout=HEALTHCHECK_TIMEOUT) as answer:
            body = answer.read().decode(errors="replace").strip()
            print(f"{url}: {answer.status} {body}")
            return 0 if answer.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read().decode(errors='replace').strip()}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


def http_address(environ: Mapping[str, str]) -> str:
    """The HTTP address `serve` binds from this environment, as far as variables say it."""
    if environ.get("RLS_HTTP_ADDRESS"):
        return environ["RLS_HTTP_ADDRESS"]
    if environ.get("PORT"):
        return f"{environ.get('HOST', '')}:{environ['PORT']}"
    return "127.0.0.1:8080"
