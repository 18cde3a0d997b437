"""The image as Docker runs it, without a Docker engine: the Dockerfile's ENTRYPOINT, CMD and
HEALTHCHECK, read from the Dockerfile itself, are run here with the arguments `docker run
IMAGE`, docker-compose's `command: /bin/ratelimit` and a `ratelimit-sidecar` command line give
them (compose replaces CMD and keeps ENTRYPOINT), each of which must serve and pass the health
check; its build tools are pinned; and what it copies is in the build context.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import shutil
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from support.logged_process import Logged, logged_process, python_env
from support.servers import free_port

from sidecar.cli import image

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
START_TIMEOUT = 30.0
#: Seconds a container has to stop after SIGTERM before it is killed.
STOP_GRACE = 10.0


def final_stage() -> list[str]:
    """The Dockerfile's instructions after its last FROM, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    last_from = max(i for i, line in enumerate(instructions) if line.startswith("FROM "))
    return instructions[last_from + 1 :]


def instruction(name: str) -> str:
    """The arguments of the final stage's last `name` instruction (Docker uses the last)."""
    found = [line for line in final_stage() if line.split(" ", 1)[0] == name]
    assert found, f"the Dockerfile's final stage has no {name}"
    return found[-1].split(" ", 1)[1] if " " in found[-1] else ""


def exec_form(name: str) -> list[str]:
    """ENTRYPOINT's or CMD's exec form (a JSON array): what Docker runs, without a shell."""
    value = json.loads(instruction(name))
    assert isinstance(value, list)
    return [str(part) for part in value]


def healthcheck_command() -> list[str]:
    """HEALTHCHECK's `CMD [...]`, after its options."""
    _, _, command = instruction("HEALTHCHECK").partition("CMD ")
    assert command, "HEALTHCHECK without CMD"
    value = json.loads(command)
    return [str(part) for part in value]


def program(name: str) -> str:
    """A program of the image's PATH (its virtualenv's bin), here the tests' virtualenv's."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found is not None, f"{name} is not installed (pip install -e .)"
    return found


@asynccontextmanager
async def docker_run(command: list[str], env: Mapping[str, str]) -> AsyncIterator[Logged]:
    """ENTRYPOINT followed by `command` (CMD, or what replaces it), with `env` (`-e`), until its
    `started` event; stopped by its PID (SIGTERM, as `docker stop`; killed if it lingers)."""
    entrypoint = exec_form("ENTRYPOINT")
    argv = [program(entrypoint[0]), *entrypoint[1:], *command]
    async with logged_process(
        argv, env, start_timeout=START_TIMEOUT, stop_grace=STOP_GRACE
    ) as container:
        yield container


async def health(container: Logged) -> tuple[int, str]:
    """/healthcheck on the port the container bound."""
    url = f"http://127.0.0.1:{container.started['http_port']}/healthcheck"
    async with aiohttp.ClientSession() as http, http.get(url) as answer:
        return answer.status, await answer.text()


async def docker_healthcheck(env: Mapping[str, str]) -> tuple[int, str]:
    """The Dockerfile's HEALTHCHECK command, run as Docker runs it: in the container's
    environment; its exit status and what it printed."""
    command = healthcheck_command()
    process = await asyncio.create_subprocess_exec(
        program(command[0]),
        *command[1:],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=python_env(env),
    )
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")


def reference_env(tmp_path: Path, redis_url: str, http_port: int) -> dict[str, str]:
    """The environment of envoyproxy/ratelimit's own docker-compose.yml (its rules mounted at
    /data/ratelimit/config, here under `tmp_path`), on loopback."""
    config = tmp_path / "ratelimit" / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.yaml").write_text(
        "domain: compose\ndescriptors:\n  - key: user\n    rate_limit:\n"
        "      unit: second\n      requests_per_unit: 5\n"
    )
    return {
        "USE_STATSD": "false",
        "LOG_LEVEL": "debug",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": redis_url.removeprefix("redis://"),
        "RUNTIME_ROOT": str(tmp_path),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "HOST": "127.0.0.1",
        "PORT": str(http_port),
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": "0",
    }


def own_env(http_port: int) -> dict[str, str]:
    """`-e` settings of this image's own, on loopback; the example rules the image carries at
    `image.RULES` are the repository's envoy/rules (`test_the_image_carries_the_example_rules`)."""
    return {
        "RLS_HTTP_ADDRESS": f"127.0.0.1:{http_port}",
        "RLS_GRPC_ADDRESS": "127.0.0.1:0",
        image.RULES_VARIABLE: str(ROOT / "envoy" / "rules"),
    }


async def serves_and_is_healthy(container: Logged, backend: str) -> None:
    assert container.started["backend"] == backend
    assert await health(container) == (200, "OK")
    status, printed = await docker_healthcheck(container.env)
    assert status == 0, printed


async def test_a_bare_docker_run_serves_the_example_rules() -> None:
    """`docker run IMAGE`: ENTRYPOINT and CMD as the Dockerfile has them serve the example
    rules on memory:// (not --help), and the HEALTHCHECK passes."""
    async with docker_run(exec_form("CMD"), own_env(free_port())) as container:
        await serves_and_is_healthy(container, "memory")
        assert container.started["rules"] == "files"


async def test_compose_command_bin_ratelimit_serves_as_the_reference(
    tmp_path: Path, redis_url: str
) -> None:
    """envoyproxy/ratelimit's docker-compose.yml with only the image changed: `command:
    /bin/ratelimit` replaces CMD, keeps ENTRYPOINT, and serves from the reference's variables,
    counting in the Redis at REDIS_URL; so does `ratelimit`, and a bare `docker run -e ...`."""
    for command in (["/bin/ratelimit"], ["ratelimit"], exec_form("CMD")):
        env = reference_env(tmp_path, redis_url, free_port())
        async with docker_run(command, env) as container:
            await serves_and_is_healthy(container, "redis")


@pytest.mark.parametrize(
    "command",
    [["ratelimit-sidecar", "serve"], ["serve"]],
    ids=["program-name", "command-only"],
)
async def test_a_ratelimit_sidecar_command_line_serves(command: list[str]) -> None:
    """`docker run IMAGE ratelimit-sidecar serve ...`, and `serve ...` as the image's old
    entrypoint took it, run that command."""
    env = own_env(free_port())
    argv = [*command, "--config", env.pop(image.RULES_VARIABLE)]
    async with docker_run(argv, env) as container:
        await serves_and_is_healthy(container, "memory")


async def test_the_healthcheck_fails_when_nothing_answers() -> None:
    """The HEALTHCHECK exits 1, saying why, when no sidecar listens at the address."""
    status, printed = await docker_healthcheck({"RLS_HTTP_ADDRESS": f"127.0.0.1:{free_port()}"})
    assert status == 1
    assert "/healthcheck" in printed


def test_the_image_carries_the_example_rules() -> None:
    """The final stage copies envoy/rules to where the entrypoint looks for them."""
    copies = [line.split()[1:] for line in final_stage() if line.startswith("COPY ")]
    assert ["envoy/rules", image.RULES] in copies


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` out of the build context: the last pattern that
    matches it or one of its parent directories decides, `!` putting it back."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").removeprefix("**/")
        if any(fnmatch.fnmatch(prefix, glob) for prefix in prefixes) or (
            pattern.lstrip("!").startswith("**/") and any(fnmatch.fnmatch(p, glob) for p in parts)
        ):
            ignored = not negated
    return ignored


def test_what_the_dockerfile_copies_is_in_the_build_context() -> None:
    """Every file COPY takes from the context (the rules, the sources, the pinned build tools)
    survives .dockerignore, and the tests do not go in."""
    sources = [
        line.split()[1:-1]
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
    ]
    for source in (s for group in sources for s in group):
        files = [source] if (ROOT / source).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / source).rglob("*") if p.is_file()
            and "__pycache__" not in p.parts
        ]  # fmt: skip
        assert files, source
        for path in files:
            assert not dockerignored(path), path
    assert dockerignored("tests/test_image.py")


def test_the_build_tools_are_pinned() -> None:
    """The build stage installs its tools (mypy, its stubs, setuptools) from
    build-requirements.txt, every one pinned to a version, and uninstalls the same list."""
    requirements = [
        line.strip()
        for line in (ROOT / "build-requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    names = {re.split(r"[=<>!~ ;\[]", line)[0].lower() for line in requirements}
    assert {"mypy", "setuptools", "types-pyyaml"} <= names
    for line in requirements:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.]+", line), line
    build = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    installs = [cmd for cmd in re.split(r"&&|RUN ", build) if "pip install" in cmd]
    assert any("-r build-requirements.txt" in cmd for cmd in installs)
    for cmd in installs:
        assert not re.search(r"\b(mypy|types-PyYAML|setuptools)\b(?!-)", cmd.replace('"', " ")), cmd
    assert re.search(r"pip uninstall --yes -r build-requirements\.txt", build)
