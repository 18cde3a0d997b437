"""The programs the tests run come from one list, tests/binaries.txt, which `make test`'s
install step reads: a binary a test asks for but the list does not name would be missing on a
fresh machine, so it is caught here, without running the test that needs it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import listed_binaries, require_binary

TESTS = Path(__file__).parent
ASKED = re.compile(r'require_binary\(\s*"([^"]+)"\s*\)')


def test_every_binary_a_test_requires_is_listed() -> None:
    """Every `require_binary("...")` in tests/ names a binary of tests/binaries.txt, and
    each one the list names is asked for by some test (the list holds nothing stale)."""
    asked = {
        name
        for path in TESTS.rglob("*.py")
        if path.name != Path(__file__).name  # this file asks for unlisted names on purpose
        for name in ASKED.findall(path.read_text())
    }
    assert asked, "the pattern found no require_binary call"
    assert asked == set(listed_binaries())


def test_an_unlisted_binary_fails_even_when_installed() -> None:
    """require_binary refuses a program the list does not name, present on PATH or not, so a
    new dependency shows in review rather than only on a fresh machine."""
    with pytest.raises(pytest.fail.Exception, match=r"not in binaries\.txt"):
        require_binary("sh")


def test_the_install_step_installs_the_listed_packages(tmp_path: Path) -> None:
    """`make test-deps`, with no listed binary on PATH, asks apt-get for exactly the listed
    packages (dry run: `make -n` prints the recipe, which a shell then runs with apt-get
    replaced by echo)."""
    recipe = subprocess.run(
        ["make", "-s", "-n", "test-deps", "SUDO="],
        cwd=TESTS.parent, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    apt = tmp_path / "apt-get"
    apt.write_text('#!/bin/sh\necho "apt-get $*"\n')
    apt.chmod(0o755)
    # A PATH with only the fake apt-get and the shell's tools: none of the binaries is found.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("awk", "sort", "tr", "cat"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    done = subprocess.run(
        ["/bin/sh", "-c", recipe.replace(">/dev/null", "")],
        cwd=TESTS.parent, capture_output=True, text=True,
        env={"PATH": f"{tmp_path}:{tools}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if line.startswith("apt-get install")]
    assert len(installs) == 1
    assert sorted(installs[0].split()[4:]) == sorted(set(listed_binaries().values()))
