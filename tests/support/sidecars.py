"""Sidecars for the transport tests: the app in-process, or `python -m sidecar serve` as a process.

Both listen on loopback port 0 and report the ports they bound; a subprocess reports them in
its `started` log event, which is read from its stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ratelimit.v3.rls_pb2 import RateLimitRequest, RateLimitResponse

from sidecar.rls.server import METHOD
from sidecar.runner.app import App, Options
from sidecar.storage import Backend
from sidecar.storage.memory import MemoryBackend

#: 30 seconds into a minute, so a minute window resets in 30 s.
NOW = 1_699_999_980.0 + 30

RULES = """\
domain: test
descriptors:
  - key: user
    rate_limit:
      name: per-user
      unit: minute
      requests_per_unit: 3
  - key: app
    descriptors:
      - key: path
        rate_limit:
          unit: hour
          requests_per_unit: 10
  - key: quiet
    shadow_mode: true
    rate_limit:
      unit: second
      requests_per_unit: 1
  - key: health
    rate_limit:
      unlimited: true
"""

START_TIMEOUT = 20.0


def write_rules(directory: Path, text: str = RULES, name: str = "rules.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


class Clock:
    """A clock the test sets; the app and the memory backend read it."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request(
    domain: str, *descriptors: Iterable[tuple[str, str]], hits_addend: int = 0
) -> RateLimitRequest:
    message = RateLimitRequest(domain=domain, hits_addend=hits_addend)
    for entries in descriptors:
        descriptor = message.descriptors.add()
        for key, value in entries:
            descriptor.entries.add(key=key, value=value)
    return message


@asynccontextmanager
async def running_app(
    rules: Path,
    *,
    backend: Backend | None = None,
    clock: Clock | None = None,
    **options: Any,
) -> AsyncIterator[App]:
    """The app in this process on free loopback ports, with a memory backend, on `clock`."""
    clock = clock or Clock()
    app = App(
        Options(config=[rules], grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", **options),
        backend=MemoryBackend() if backend is None else backend,
        clock=clock,
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace=1.0)


class Client:
    """ShouldRateLimit and gRPC health over one real channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.call = channel.unary_unary(
            METHOD,
            request_serializer=RateLimitRequest.SerializeToString,
            response_deserializer=RateLimitResponse.FromString,
        )
        self.raw = channel.unary_unary(METHOD)

    async def should_rate_limit(self, message: RateLimitRequest) -> RateLimitResponse:
        return await self.call(message, timeout=10)


@asynccontextmanager
async def client(
    port: int, credentials: grpc.ChannelCredentials | None = None
) -> AsyncIterator[Client]:
    """A client of 127.0.0.1:`port`, over TLS with `credentials`, else in cleartext."""
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.aio.insecure_channel(target)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials)
    )
    async with channel:
        yield Client(channel)


@dataclass
class ServeProcess:
    """A `python -m sidecar serve` process and everything it wrote to stderr so far."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    grpc_port: int = 0
    http_port: int = 0

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.lines:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return found

    def output(self) -> str:
        return "\n".join(self.lines)


async def _read_lines(
    stream: asyncio.StreamReader, into: ServeProcess, ready: asyncio.Event
) -> None:
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip("\n")
        into.lines.append(text)
        if '"started"' in text:
            event = json.loads(text)
            into.grpc_port, into.http_port = event["grpc_port"], event["http_port"]
            ready.set()
    ready.set()


@asynccontextmanager
async def serve_process(
    args: Sequence[str], env: Mapping[str, str] | None = None, wait: bool = True
) -> AsyncIterator[ServeProcess]:
    """Start `python -m sidecar serve ARGS`; with `wait`, until its `started` event (or its exit).

    The process is killed by its PID on the way out if it is still running.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    served = ServeProcess(process)
    ready = asyncio.Event()
    assert process.stderr is not None
    reader = asyncio.create_task(_read_lines(process.stderr, served, ready))
    try:
        if wait:
            await asyncio.wait_for(ready.wait(), START_TIMEOUT)
            if not served.grpc_port:
                raise AssertionError(f"sidecar did not start:\n{served.output()}")
        yield served
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await reader
