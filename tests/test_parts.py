"""The sidecar as a list of parts (`sidecar.runner.parts`, `sidecar.runner.assembly`): started in order, stopped
in reverse, and every new set of rules handed to every part that reads rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from support.sidecars import running_app

from sidecar.core.rules import Rules
from sidecar.runner.parts import Part

RULES = """\
domain: parts
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: {limit}}}
"""


async def test_parts_stop_in_the_reverse_of_their_start_order(tmp_path: Path) -> None:
    """The backend is built first and closed last; the health report starts last and stops
    first, so the sidecar reports unhealthy before any listener stops."""
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(limit=1))
    stopped: list[tuple[str, bool]] = []
    async with running_app(path) as app:
        parts = app.assembly.parts
        names = [part.name for part in parts]
        assert names[0] == "backend" and names[-1] == "health"
        assert names.index("limiter") < names.index("listeners") < names.index("health")
        assert app.grpc_port and app.http_port  # the listeners part started before health

        def recording(part: Part) -> Part:
            async def stop(grace: float) -> None:
                stopped.append((part.name, app.health.draining))
                await part.stop(grace)

            return dataclasses.replace(part, stop=stop)

        parts[:] = [recording(part) for part in parts]
    assert [name for name, _ in stopped] == names[::-1]
    draining = dict(stopped)
    assert not draining["health"] and draining["listeners"]


async def test_every_new_set_of_rules_reaches_every_part_that_reads_rules(tmp_path: Path) -> None:
    """A reload hands the new rules, the same object the app serves, to the limiter, the
    frequency caps, the HTTP endpoints, the quota service and the health report, once each."""
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(limit=1))
    handed: list[tuple[str, Rules]] = []
    async with running_app(path, rlqs_address="127.0.0.1:0") as app:
        parts = app.assembly.parts

        def recording(part: Part) -> Part:
            changed = part.rules_changed
            if changed is None:
                return part

            def rules_changed(rules: Rules) -> None:
                handed.append((part.name, rules))
                changed(rules)

            return dataclasses.replace(part, rules_changed=rules_changed)

        parts[:] = [recording(part) for part in parts]
        path.write_text(RULES.format(limit=5))
        assert app.reload()
        assert sorted(name for name, _ in handed) == [
            "admin",
            "frequency caps",
            "health",
            "limiter",
            "quota",
        ]
        assert all(rules is app.rules for _, rules in handed)
        assert app.assembly.limiter is not None and app.assembly.limiter.rules is app.rules
