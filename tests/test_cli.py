"""The command line: `check`, RLS_* variables, `serve` start-up failures, `query`, and help."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.sidecars import RULES, serve_process, write_rules

from sidecar import cli
from sidecar.core import config
from sidecar.errors import ConfigError

BAD_RULES = """\
domain: test
descriptors:
  - key: user
    ratelimit:
      unit: second
      requests_per_unit: 1
"""


def test_check_prints_one_summary_line_per_domain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid rules: one line per domain, exit 0."""
    write_rules(tmp_path, RULES, "a.yaml")
    write_rules(tmp_path, "domain: other\ndescriptors: []\n", "b.yaml")

    status = cli.main(["check", str(tmp_path)])

    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out == [domain.summary() for domain in config.load([tmp_path]).domains.values()]
    assert len(out) == 2


def test_check_reports_the_first_error_with_file_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad file: exit 1 and `FILE: PATH-IN-FILE: message` on stderr."""
    bad = write_rules(tmp_path, BAD_RULES)
    with pytest.raises(ConfigError) as expected:
        config.load([bad])

    status = cli.main(["check", str(bad)])

    err = capsys.readouterr().err
    assert status == 1
    assert err == f"{expected.value}\n"
    assert err.startswith(f"{bad}: descriptors[0]")
    assert "ratelimit" in err


def test_check_shows_warnings_and_strict_makes_them_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file the reference loads but that is likely a mistake: `check` prints the warning on
    stderr and exits 0; `check --strict` exits 1."""
    rules = write_rules(
        tmp_path, "domain: d\ndescriptors:\n  - key: k\n    unit: minute\n", "a.yaml"
    )
    assert cli.main(["check", str(rules)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"warning: {rules}: descriptors[0]: key 'unit' is ignored in a descriptor, as "
        "envoyproxy/ratelimit ignores it (it belongs in rate_limit: move it there, or remove it)\n"
    )
    assert captured.out == f"{rules}: domain 'd': 0 rate limits\n"
    assert cli.main(["check", "--strict", str(rules)]) == 1
    assert capsys.readouterr().err.endswith("check --strict: 1 warning(s)\n")


def test_check_refuses_a_directory_without_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing to check is an error: the path is probably wrong."""
    assert cli.main(["check", str(tmp_path)]) == 1
    assert "no rules files" in capsys.readouterr().err


#: Runs the `ratelimit_config_check` console script's entry point from the installed package's
#: metadata, as its generated script does (so the registration in pyproject.toml is tested too).
CONFIG_CHECK = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "sys.exit(entry_points(group='console_scripts')['ratelimit_config_check'].load()())\n"
)


#: A domain with one rule on `key`.
ONE_RULE = "domain: test\ndescriptors:\n  - key: {key}\n    rate_limit: {{unit: minute, requests_per_unit: 3}}\n"


def config_check(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`ratelimit_config_check ARGV` in a process of its own, with only `env` beside PATH."""
    return subprocess.run(
        [sys.executable, "-c", CONFIG_CHECK, *argv],
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_ratelimit_config_check_takes_the_references_flags(tmp_path: Path) -> None:
    """`ratelimit_config_check -config_dir DIR` (or `--config_dir=DIR`, Go's flag syntax) exits
    0 on a directory whose rules load, printing `check`'s summary, and 1 on one whose rules do
    not, with the error naming file, path and fix; an unknown flag is status 2."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    write_rules(good, ONE_RULE.format(key="user"), "a.yaml")
    bad_file = write_rules(bad, BAD_RULES, "a.yaml")

    for argv in (["-config_dir", str(good)], [f"--config_dir={good}"]):
        ran = config_check(*argv)
        assert (ran.returncode, ran.stderr) == (0, "")
        assert ran.stdout == f"{good / 'a.yaml'}: domain 'test': 1 rate limits\n"

    ran = config_check("-config_dir", str(bad))
    assert ran.returncode == 1
    assert ran.stderr == (
        f"{bad_file}: descriptors[0]: config error, unknown key 'ratelimit' (did you mean 'rate_limit'?)\n"
    )
    assert config_check("-config_dir", str(tmp_path / "missing")).returncode == 1
    assert config_check("-config", str(good)).returncode == 2


def test_ratelimit_config_check_defaults_to_the_references_rules_directory(
    tmp_path: Path,
) -> None:
    """Without -config_dir it checks RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY, the
    directory `ratelimit` loads; a domain in two files passes with -merge_domain_configs or
    MERGE_DOMAIN_CONFIG=true, as the flag's default, and fails without."""
    rules = tmp_path / "ratelimit" / "config"
    rules.mkdir(parents=True)
    write_rules(rules, ONE_RULE.format(key="user"), "a.yaml")
    write_rules(rules, ONE_RULE.format(key="ip"), "b.yaml")
    env = {"RUNTIME_ROOT": str(tmp_path), "RUNTIME_SUBDIRECTORY": "ratelimit"}

    ran = config_check(env=env)
    assert ran.returncode == 1
    assert "duplicate domain 'test'" in ran.stderr
    assert config_check("-merge_domain_configs", env=env).returncode == 0
    assert config_check("-merge_domain_configs=true", env=env).returncode == 0
    assert config_check(env={**env, "MERGE_DOMAIN_CONFIG": "true"}).returncode == 0
    merged = {**env, "MERGE_DOMAIN_CONFIG": "true"}
    assert config_check("-merge_domain_configs=false", env=merged).returncode == 1
    refused = config_check(env={**env, "MERGE_DOMAIN_CONFIG": "maybe"})
    assert refused.returncode == 2
    assert "MERGE_DOMAIN_CONFIG='maybe': expected true or false" in refused.stderr


def test_serve_flags_come_from_rls_variables() -> None:
    """Each flag has an RLS_<FLAG> variable; RLS_CONFIG holds several paths split on ':' or ','."""
    env = {
        "RLS_CONFIG": "a.yaml:b.yaml,rules/",
        "RLS_BACKEND": "redis://redis:6379",
        "RLS_GRPC_ADDRESS": "127.0.0.1:9081",
        "RLS_HTTP_ADDRESS": "127.0.0.1:9080",
        "RLS_REDIS_TIMEOUT_MS": "20",
        "RLS_FAILURE_MODE": "deny",
        "RLS_REJECTED_HITS": "skip",
        "RLS_SHADOW_MODE": "true",
        "RLS_LOG_FORMAT": "console",
        "RLS_LOG_LEVEL": "warning",
        "RLS_RLQS_ADDRESS": "127.0.0.1:18081",
        "RLS_RLQS_ASSIGNMENT_TTL": "2.5",
    }

    args = cli.parse_args(["serve"], env)

    assert args.config == ["a.yaml", "b.yaml", "rules/"]
    assert args.backend == "redis://redis:6379"
    assert (args.grpc_address, args.http_address) == ("127.0.0.1:9081", "127.0.0.1:9080")
    assert args.redis_timeout_ms == 20
    assert (args.failure_mode, args.rejected_hits, args.shadow_mode) == ("deny", "skip", True)
    assert (args.log_format, args.log_level) == ("console", "warning")
    assert (args.rlqs_address, args.rlqs_assignment_ttl) == ("127.0.0.1:18081", 2.5)


def test_flags_win_over_variables_and_defaults_fill_the_rest() -> None:
    """A flag on the command line replaces its variable (lists too); unset flags get defaults."""
    env = {"RLS_CONFIG": "from-env.yaml", "RLS_BACKEND": "redis://redis:6379"}

    args = cli.parse_args(
        ["serve", "--config", "a.yaml", "--config", "b.yaml", "--backend", "memory://"], env
    )

    assert args.config == ["a.yaml", "b.yaml"]
    assert args.backend == "memory://"
    assert (args.grpc_address, args.http_address) == ("0.0.0.0:8081", "0.0.0.0:8080")
    assert (args.redis_timeout_ms, args.failure_mode, args.rejected_hits) == (50, "allow", "count")
    assert args.shadow_mode is False
    assert (args.log_format, args.log_level) == ("json", "info")
    assert (args.rlqs_address, args.rlqs_assignment_ttl) == (None, 6.0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"RLS_CONFIG": "a.yaml", "RLS_FAILURE_MODE": "maybe"},
            "RLS_FAILURE_MODE='maybe': invalid choice",
        ),
        ({"RLS_CONFIG": "a.yaml", "RLS_SHADOW_MODE": "perhaps"}, "RLS_SHADOW_MODE='perhaps'"),
        ({"RLS_CONFIG": "a.yaml", "RLS_GRPC_ADDRESS": "nowhere"}, "RLS_GRPC_ADDRESS='nowhere'"),
        ({}, "--config (or RLS_CONFIG)"),
        (
            {"RLS_CONFIG": "a.yaml", "RLS_RLQS_ASSIGNMENT_TTL": "0.5"},
            "RLS_RLQS_ASSIGNMENT_TTL='0.5': must be at least 1 second",
        ),
    ],
    ids=["bad-choice", "bad-boolean", "bad-address", "missing-config", "short-ttl"],
)
def test_bad_or_missing_settings_are_usage_errors(
    env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A variable that does not parse, or a required flag set nowhere, exits 2 naming it, in
    one line under the command's name (no usage: it says nothing about a variable)."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["serve"], env)

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("ratelimit-sidecar serve: ") and err.count("\n") == 1


def test_an_unknown_rls_variable_is_found_with_the_one_meant() -> None:
    """An RLS_* variable no flag of any command reads is listed for the start-up warning, with
    the closest real one when there is one; variables of other commands are known."""
    env = {"RLS_CONFG": "rules/", "RLS_NOTHING_LIKE_IT": "1", "RLS_ADDRESS": "x:1", "HOME": "/"}
    args = cli.parse_args(["serve", "--config", "r"], env)
    assert args.unknown_variables == [("RLS_CONFG", "RLS_CONFIG"), ("RLS_NOTHING_LIKE_IT", None)]


def test_help_documents_every_command_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` and `serve --help` list the commands, every flag, its default and its variable."""
    with pytest.raises(SystemExit) as top:
        cli.main(["--help"])
    top_help = capsys.readouterr().out
    with pytest.raises(SystemExit) as serve:
        cli.main(["serve", "--help"])
    serve_help = capsys.readouterr().out

    assert top.value.code == serve.value.code == 0
    for command in ("serve", "check", "query", "RLS_"):
        assert command in top_help
    for flag in (
        "--config", "--backend", "--grpc-address", "--http-address", "--redis-timeout-ms",
        "--failure-mode", "--rejected-hits", "--shadow-mode", "--log-format", "--log-level",
    ):  # fmt: skip
        assert flag in serve_help
        assert "RLS_" + flag[2:].upper().replace("-", "_") in serve_help
    assert "default: memory://" in serve_help


async def test_serve_exits_1_on_a_config_error(tmp_path: Path) -> None:
    """A bad rules file stops the start: `FILE: PATH: message` on stderr, exit 1."""
    bad = write_rules(tmp_path, BAD_RULES)
    args = ["--config", str(bad), "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]
    async with serve_process(args, wait=False) as served:
        status = await asyncio.wait_for(served.process.wait(), 20)

    assert status == 1
    assert f"{bad}: descriptors[0]: " in served.output()


async def test_serve_exits_2_on_a_backend_url_it_cannot_use(tmp_path: Path) -> None:
    """An unknown backend scheme is named with the schemes that work, exit 2."""
    rules = write_rules(tmp_path)
    args = ["--config", str(rules), "--backend", "postgres://db", "--grpc-address", "127.0.0.1:0"]
    async with serve_process(args, wait=False) as served:
        status = await asyncio.wait_for(served.process.wait(), 20)

    assert status == 2
    assert "unsupported backend URL 'postgres://db'" in served.output()


async def test_serve_runs_on_uvloop_when_installed_and_on_asyncio_when_told(
    tmp_path: Path,
) -> None:
    """`--loop auto` (the default) picks uvloop, installed with the package here; `--loop
    asyncio` and RLS_LOOP=asyncio keep the standard library's loop. The `started` event names
    the loop."""
    rules = write_rules(tmp_path)
    base = ["--config", str(rules), "--grpc-address", "127.0.0.1:0",
            "--http-address", "127.0.0.1:0"]  # fmt: skip
    started: list[str] = []
    for args, env in (([], {}), (["--loop", "asyncio"], {}), ([], {"RLS_LOOP": "asyncio"})):
        async with serve_process([*base, *args], env=env) as served:
            started += [e["loop"] for e in served.events() if e["event"] == "started"]
    assert started == ["uvloop", "asyncio", "asyncio"]


def test_loop_uvloop_without_uvloop_is_a_usage_error(tmp_path: Path) -> None:
    """Where uvloop is not installed, `--loop auto` falls back to asyncio's loop, and `--loop
    uvloop` stops the start with exit 2 and the fix. (A process of its own, with uvloop
    blocked from importing, since `serve` configures logging for the whole process.)"""
    rules = write_rules(tmp_path)
    program = (
        "import sys; sys.modules['uvloop'] = None\n"  # `import uvloop` raises ImportError
        "from sidecar import cli\n"
        "assert cli.serve.event_loop_factory('auto') is None\n"
        f"sys.exit(cli.main(['serve', '--config', {str(rules)!r}, '--loop', 'uvloop'], {{}}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "--loop uvloop: uvloop is not installed (pip install uvloop)" in done.stderr


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_query_prints_the_answer_and_exits_by_overall_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`query` against `serve` (configured from RLS_* variables): exit 0 while OK, 1 once
    OVER_LIMIT, 2 when nothing answers."""
    rules = write_rules(tmp_path)
    env = {
        "RLS_CONFIG": str(rules),
        "RLS_GRPC_ADDRESS": "127.0.0.1:0",
        "RLS_HTTP_ADDRESS": "127.0.0.1:0",
    }
    async with serve_process([], env=env) as served:
        query_env = {"RLS_ADDRESS": f"127.0.0.1:{served.grpc_port}", "RLS_DOMAIN": "test"}
        argv = ["query", "--descriptor", "user=alice"]
        first = await asyncio.to_thread(cli.main, argv, query_env)
        first_out = capsys.readouterr().out
        await asyncio.to_thread(cli.main, [*argv, "--hits", "2"], query_env)
        capsys.readouterr()
        over = await asyncio.to_thread(cli.main, [*argv, "--format", "json"], query_env)
        over_out = capsys.readouterr().out

    nowhere = ["query", "--address", f"127.0.0.1:{_closed_port()}", "--domain", "test",
               "--descriptor", "user=alice", "--timeout", "2"]  # fmt: skip
    unreachable = await asyncio.to_thread(cli.main, nowhere, {})
    unreachable_err = capsys.readouterr().err

    assert first == 0
    assert "overall_code: OK" in first_out
    assert "requests_per_unit: 3" in first_out
    assert over == 1
    assert json.loads(over_out)["overallCode"] == "OVER_LIMIT"
    assert unreachable == 2
    assert "UNAVAILABLE" in unreachable_err


def test_query_refuses_a_malformed_descriptor(capsys: pytest.CaptureFixture[str]) -> None:
    """A descriptor that is not key=value[,key=value] is an error before any call (exit 2)."""
    status = cli.main(["query", "--domain", "test", "--descriptor", "user"], {})

    assert status == 2
    assert "expected key=value" in capsys.readouterr().err
