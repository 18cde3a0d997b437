"""The page (`/ui`) in headless Chromium: against a sidecar with traffic, it draws each usage
dimension's calls per day and its top keys today, the limits refusing now and the rules
loaded; the numbers it shows are `/v1/usage`'s, and the screenshot shows the charts."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import require_binary
from support.browser import chromium, count_color, open_page, png_pixels
from support.envoys import HOST, Sidecar, free_port

from sidecar import cli

RULES = """\
domain: open
usage:
  - by: [app]
  - by: [app, interface]
  - by: [app]
    unique: user
descriptors:
  - key: app
    rate_limit: {unit: day, requests_per_unit: 1000}
    descriptors:
      - key: interface
        rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: app
    value: tiny
    rate_limit: {unit: day, requests_per_unit: 40, name: tiny-daily}
"""
#: Calls per (app, interface), and each app's distinct users.
TRAFFIC = {
    ("shop", "orders"): 120,
    ("shop", "search"): 70,
    ("maps", "tiles"): 90,
    ("tiny", "pay"): 60,
}
USERS = {"shop": 45, "maps": 20, "tiny": 7}
#: The page's colours for admitted and refused calls (its --ok and --over).
ADMITTED_RGB, REFUSED_RGB = (0x2F, 0x7D, 0x4F), (0xC0, 0x39, 0x2B)


def post(port: int, path: str, body: dict[str, Any]) -> int:
    connection = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def get_json(port: int, path: str) -> Any:
    connection = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        return json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    """A sidecar on memory with a day's traffic: a few apps, interfaces and users, one app
    past its daily limit."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    process = Sidecar(["--config", str(rules)], free_port(), free_port(), tmp_path / "sidecar.log")
    process.start()
    try:
        for (app, interface), calls in TRAFFIC.items():
            for n in range(calls):
                user = f"{app}-user-{n % USERS[app]}"
                descriptors = [
                    {"entries": [{"key": "app", "value": app}]},
                    {
                        "entries": [
                            {"key": "app", "value": app},
                            {"key": "interface", "value": interface},
                        ]
                    },
                    {"entries": [{"key": "app", "value": app}, {"key": "user", "value": user}]},
                ]
                status = post(
                    process.http_port, "/json", {"domain": "open", "descriptors": descriptors}
                )
                assert status in (200, 429)
        yield process
    finally:
        process.stop()


SHOWN = """
(() => {
  const number = cell => Number(cell.textContent);
  return [...document.querySelectorAll("section.dimension")].map(section => ({
    by: section.dataset.by,
    bars: [...section.querySelectorAll("svg.chart g.bar")].map(g => ({
      day: g.dataset.day, admitted: Number(g.dataset.admitted), refused: Number(g.dataset.refused),
      heights: [...g.querySelectorAll("rect")].map(r => Number(r.getAttribute("height")))})),
    top: [...section.querySelectorAll("table.top tr.key")].map(tr => ({
      key: tr.querySelector(".name").textContent,
      admitted: number(tr.querySelector(".admitted")),
      refused: number(tr.querySelector(".refused")),
      unique: Object.fromEntries([...tr.querySelectorAll(".unique")].map(td => [td.dataset.unique, number(td)]))})),
  }));
})()
"""


async def test_the_page_shows_usage_as_v1_usage_counts_it(sidecar: Sidecar, tmp_path: Path) -> None:
    """Each dimension's chart has a bar per retained day holding `/v1/usage`'s admitted and
    refused totals of that day; its table lists today's top keys with `/v1/usage`'s counts
    (unique users where declared); the refusing limit is listed with its refused calls; the
    rules are shown; and the screenshot has the admitted and refused bars drawn in their
    colours."""
    require_binary("chromium")
    port = sidecar.http_port
    with chromium() as devtools:
        async with aiohttp.ClientSession() as session:
            page, socket = await open_page(session, devtools, f"http://{HOST}:{port}/ui")
            try:
                await page.wait_for("document.body?.dataset.ready === '1'")
                shown = await page.evaluate(SHOWN)
                refusing = await page.evaluate(
                    "[...document.querySelectorAll('table.refusing tr')].slice(1)"
                    ".map(tr => [...tr.cells].map(td => td.textContent))"
                )
                rules_text = await page.evaluate("document.querySelector('#rules').textContent")
                png = await page.screenshot()
            finally:
                await socket.close()
    (tmp_path / "ui.png").write_bytes(png)

    described = get_json(port, "/v1/usage/dimensions")["domains"][0]["usage"]
    days = described["days"]
    assert [section["by"] for section in shown] == ["app", "app,interface"]
    for section in shown:
        report = get_json(
            port, f"/v1/usage?domain=open&by={section['by']}&from={days[0]}&to={days[-1]}&top=10"
        )
        assert [(b["day"], b["admitted"], b["refused"]) for b in section["bars"]] == [
            (d["day"], d["admitted"], d["refused"]) for d in report["days"]
        ]
        today = report["days"][-1]
        assert section["top"] == [
            {
                "key": ", ".join(f"{k}={v}" for k, v in row["key"].items()),
                "admitted": row["admitted"],
                "refused": row["refused"],
                "unique": row.get("unique", {}),
            }
            for row in today["top"]
        ]
        assert sum(b["admitted"] + b["refused"] for b in section["bars"]) == sum(TRAFFIC.values())
    by_app = {row["key"]: row for row in shown[0]["top"]}
    assert by_app["app=tiny"]["refused"] == 20 and by_app["app=tiny"]["admitted"] == 40
    assert {key: row["unique"]["user"] for key, row in by_app.items()} == {
        f"app={app}": users for app, users in USERS.items()
    }
    assert [row[0] for row in refusing] == ["open.app_tiny"]
    assert refusing[0][2] == "20"
    assert "open.app.interface: unit=MINUTE requests_per_unit=1000" in rules_text

    width, height, rows = png_pixels(png)
    assert width >= 1000 and height >= 600
    # Today's bars: 340 calls at the chart's full height in each of the two charts.
    assert count_color(rows, ADMITTED_RGB) > 4_000
    assert count_color(rows, REFUSED_RGB) > 300


def test_the_usage_command_prints_v1_usage_as_a_table(
    sidecar: Sidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ratelimit-sidecar usage` prints today's keys of a dimension with their admitted,
    refused and unique counts, most calls first; a dimension the domain does not declare is
    exit status 2 with the sidecar's reason."""
    address = f"{HOST}:{sidecar.http_port}"
    assert cli.main(["usage", "--http-address", address, "--domain", "open", "--by", "app"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("(UTC): 3 keys, 320 admitted, 20 refused")
    assert [line.split() for line in lines[1:]] == [
        ["app", "admitted", "refused", "unique", "user"],
        ["shop", "190", "0", "45"],
        ["maps", "90", "0", "20"],
        ["tiny", "40", "20", "7"],
    ]
    assert cli.main(["usage", "--http-address", address, "--domain", "open", "--by", "user"]) == 2
    assert capsys.readouterr().err == (
        "ratelimit-sidecar usage: by must be one of the domain's usage dimensions: "
        "app, app,interface\n"
    )
