"""`make run`, a newcomer's first command: it installs only what serving needs, on its own
stamp, serves on loopback where envoy/gateway.yaml looks for it, takes its ports from the make
line or RLS_* variables, and the READMEs say the addresses it binds. Read from make's dry run
(`make -n -B`, every recipe printed and none run), as test_binaries.py reads test-deps.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_recipe(*make_args: str, env: dict[str, str] | None = None) -> list[str]:
    """The commands `make run` would run from nothing (-B: as if no stamp existed)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    printed = subprocess.run(
        ["make", "-s", "-n", "-B", "run", *make_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**environ, **(env or {})},
    ).stdout
    return printed.replace("\\\n", " ").splitlines()


def serve_line(commands: list[str]) -> str:
    [line] = [command for command in commands if "ratelimit-sidecar serve" in command]
    return line


def test_make_run_installs_the_package_without_the_test_and_dev_extras() -> None:
    """Its install is `pip install -e .` alone (no Envoy, mypy, ruff, grpcio-tools), and it
    touches its own stamp, not the one `make test` installs everything for."""
    commands = run_recipe()
    installs = [command for command in commands if "pip install" in command]
    assert installs, commands
    for command in installs:
        assert "[" not in command and "test" not in command and "dev" not in command, command
    assert any(re.search(r"touch \S*\.installed-run$", command) for command in commands)
    assert not any(re.search(r"touch \S*\.installed( |$)", command) for command in commands)


def test_make_run_serves_on_loopback_and_takes_its_ports_from_the_make_line_or_rls() -> None:
    """By default gRPC 127.0.0.1:8081 and HTTP 127.0.0.1:8080; `make run GRPC_ADDRESS=...
    HTTP_ADDRESS=...` or RLS_GRPC_ADDRESS and RLS_HTTP_ADDRESS in the environment move them."""
    assert "--grpc-address 127.0.0.1:8081 --http-address 127.0.0.1:8080" in serve_line(run_recipe())
    moved = run_recipe("GRPC_ADDRESS=127.0.0.1:9081", "HTTP_ADDRESS=127.0.0.1:9080")
    assert "--grpc-address 127.0.0.1:9081 --http-address 127.0.0.1:9080" in serve_line(moved)
    from_env = run_recipe(
        env={"RLS_GRPC_ADDRESS": "127.0.0.1:7081", "RLS_HTTP_ADDRESS": "127.0.0.1:7080"}
    )
    assert "--grpc-address 127.0.0.1:7081 --http-address 127.0.0.1:7080" in serve_line(from_env)


def test_the_readmes_say_where_make_run_listens_and_how_to_move_it() -> None:
    """README's first steps and envoy/README.md name the addresses `make run` binds, and
    README says how to pick others; envoy/gateway.yaml's ratelimit cluster points at its
    gRPC address."""
    line = serve_line(run_recipe())
    grpc = re.search(r"--grpc-address (\S+)", line)
    http = re.search(r"--http-address (\S+)", line)
    assert grpc is not None and http is not None
    readme = (ROOT / "README.md").read_text()
    first_steps = readme[readme.index("## Two commands") : readme.index("## Rules")]
    envoy_readme = (ROOT / "envoy" / "README.md").read_text()
    for text in (first_steps, envoy_readme):
        assert f"gRPC {grpc[1]}, HTTP {http[1]}" in text
    for how in ("GRPC_ADDRESS=", "RLS_GRPC_ADDRESS", "RLS_HTTP_ADDRESS"):
        assert how in first_steps
    host, port = grpc[1].rsplit(":", 1)
    gateway = (ROOT / "envoy" / "gateway.yaml").read_text()
    assert re.search(rf"address: {re.escape(host)}\s+port_value: {port}\b", gateway)
