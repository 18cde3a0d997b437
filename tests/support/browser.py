"""Headless Chromium driven over its DevTools protocol, for the tests of the page (`/ui`).

Debian's `chromium` (tests/binaries.txt) is started with a fresh profile and
`--remote-debugging-port=0`; the port it picks is read from the profile's DevToolsActivePort
file, and a page is driven over a WebSocket (aiohttp's client): navigate, evaluate, take a
screenshot. Nothing is downloaded; the process is stopped by its PID. `png_pixels` decodes the
screenshot (8-bit RGB or RGBA, the five PNG filters) so a test can check what it shows.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

#: The flags that work on this machine (no sandbox as root, nothing fetched from outside).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
START_TIMEOUT = 30.0


@contextmanager
def chromium(width: int = 1280, height: int = 1000) -> Iterator[int]:
    """A headless Chromium; yields the port of its DevTools endpoint."""
    binary = shutil.which("chromium")
    assert binary is not None
    profile = Path(tempfile.mkdtemp(prefix="chromium-profile-"))
    log = (profile / "chromium.log").open("wb")
    process = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT
        while not active.exists() or not active.read_text().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"chromium did not start: {(profile / 'chromium.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
        yield int(active.read_text().split()[0])
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """One tab, driven by DevTools commands over its WebSocket."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its result (events in between are passed over)."""
        number = next(self._ids)
        await self._socket.send_str(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(await self._socket.receive_str())
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll `expression` until it is truthy; its value. An evaluation that fails (the page
        still navigating: its context destroyed) counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression} still false after {timeout:g}s")
            await _pause()

    async def screenshot(self) -> bytes:
        """The whole page as PNG bytes."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        result = await self.send(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        return base64.b64decode(result["data"])


async def _pause() -> None:
    await asyncio.sleep(0.1)


async def open_page(session: aiohttp.ClientSession, port: int, url: str) -> tuple[Page, Any]:
    """A new tab at `url`; returns the page and its WebSocket (close it when done)."""
    async with session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
        target = await response.json()
    socket = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
    page = Page(socket)
    await page.send("Page.enable")
    await page.send("Page.navigate", url=url)
    return page, socket


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    position, chunks, header = 8, [], b""
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), f"PNG of depth {depth}, color type {color}"
    channels = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            left = line[x - channels] if x >= channels else 0
            up = previous[x]
            corner = previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                nearest = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[x] = (line[x] + nearest) & 0xFF
        previous = line
        if channels == 4:
            rows.append(bytes(b for i, b in enumerate(line) if i % 4 != 3))
        else:
            rows.append(bytes(line))
    return width, height, rows


def count_color(rows: list[bytes], rgb: tuple[int, int, int], tolerance: int = 8) -> int:
    """Pixels within `tolerance` of `rgb` on each channel."""
    r, g, b = rgb
    found = 0
    for row in rows:
        for x in range(0, len(row), 3):
            if (
                abs(row[x] - r) <= tolerance
                and abs(row[x + 1] - g) <= tolerance
                and abs(row[x + 2] - b) <= tolerance
            ):
                found += 1
    return found
