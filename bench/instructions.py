"""Instructions per call of the fast path, counted by callgrind: a figure that does not move with
the load of a shared machine, where CPU per call moves by a quarter between runs.

One process holds the whole sidecar path: recorded HTTP/2 bytes (h2's client, 8 calls per read)
go into the fast transport's protocol, through the service, the limiter and the backend, and
the answers come out into a transport that only keeps them. It runs under
`valgrind --tool=callgrind` twice, replaying the calls once and three times; the difference over
the extra calls is the cost of a call, start-up excluded. Each backend has two rows: one body
sent again and again (its plan cached after the first call), and every body new (a user of its
own per call, planned anew, as most of a gateway's real traffic is). Backends: memory, Redis and a
3-master Redis Cluster (redis-servers this script starts and stops by their PIDs; their own
CPU is not counted).

    python -m bench.instructions            # memory, redis and cluster, about eight minutes
    python -m bench.instructions --only memory
    python -m bench.instructions --build build/compiled   # the sources, then the compiled build

With `--build`, each backend is counted on the sources and on the compiled build unpacked in
that directory (`make compiled`), side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sidecar import build as sidecar_build

PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
CALLS = 1_000
PER_READ = 8
RULES = Path(__file__).parent / "rules"


def _body(user: str = "u1") -> bytes:
    from envoy.service.ratelimit.v3.rls_pb2 import (  # type: ignore[import-untyped]
        RateLimitRequest,
    )

    request = RateLimitRequest(domain="bench")
    entry = request.descriptors.add().entries.add()
    entry.key, entry.value = "user", user
    message: bytes = request.SerializeToString()
    return b"\x00" + len(message).to_bytes(4, "big") + message


async def replay(
    url: str, rounds: int, distinct: bool = False, ready: Callable[[], None] | None = None
) -> None:
    """Record CALLS calls once with a live h2 client, then replay their bytes `rounds` times,
    each on a new connection, waiting for every answer of a read before the next read.

    `distinct`: every call of every pass names a user of its own, so no body is seen twice and
    each call is planned anew (matching, counter names, a new counter), as most calls of a
    gateway's real traffic are. The bytes of MAX_ROUNDS + 1 passes are written before any is
    sent, whatever `rounds` is, so that writing them cancels out of the difference.

    `ready` is called once all is made and recorded, before the calls replayed: what it starts
    (`bench.collector`'s watch of the cycle collector) sees the calls alone."""
    import h2.config
    import h2.connection
    import h2.events

    from sidecar.core import config
    from sidecar.decision.limiter import Limiter
    from sidecar.rls.fast import FastServer
    from sidecar.rls.h2.server import _Protocol
    from sidecar.rls.service import RateLimitService
    from sidecar.runner.app import Options
    from sidecar.storage.backends import open_backend

    class Transport(asyncio.Transport):
        """Keeps what the server writes, and tells when no call is left in flight."""

        def __init__(self, client: Any = None) -> None:
            super().__init__()
            self.client = client
            self.protocol: Any = None
            self.idle: asyncio.Event | None = None

        def write(self, data: Any) -> None:
            if self.client is not None:
                for event in self.client.receive_data(bytes(data)):
                    if isinstance(event, h2.events.DataReceived):
                        self.client.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
            if self.idle is not None and not self.protocol.conn.calls:
                self.idle.set()

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

    backend = open_backend(url, 1_000)
    # The limiter as `serve` builds it by default: the over-limit cache on.
    cache = Options(config=[]).over_limit_cache
    service = RateLimitService(Limiter(config.load([str(RULES)]), backend, over_limit_cache=cache))
    fast = FastServer(service, "127.0.0.1:0")
    await fast.set_serving(True)
    server: Any = fast._server

    async def feed(transport: Transport, protocol: Any, data: bytes) -> None:
        transport.idle = asyncio.Event()
        protocol.data_received(data)
        if protocol.conn.calls:
            await transport.idle.wait()
        transport.idle = None

    def connect(client: Any = None) -> tuple[Transport, Any]:
        transport = Transport(client)
        protocol = _Protocol(server)
        transport.protocol = protocol
        protocol.connection_made(transport)
        return transport, protocol

    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", "sidecar"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if distinct:
        passes = [
            _distinct_pass(headers, first * CALLS) for first in range(max(rounds, MAX_ROUNDS) + 1)
        ]
        if ready is not None:
            ready()
        for preface, reads in passes[: rounds + 1]:
            transport, protocol = connect()
            await feed(transport, protocol, preface)
            for data in reads:
                await feed(transport, protocol, data)
        await backend.close()
        return
    body = _body()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    transport, protocol = connect(client)
    preface = client.data_to_send()
    await feed(transport, protocol, preface)
    reads = []
    for _ in range(CALLS // PER_READ):
        for _ in range(PER_READ):
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, headers)
            client.send_data(stream_id, body, end_stream=True)
        reads.append(client.data_to_send())
        await feed(transport, protocol, reads[-1])
        reads[-1] += client.data_to_send()  # WINDOW_UPDATEs for the answers, as a peer sends
    if ready is not None:
        ready()
    for _ in range(rounds):
        transport, protocol = connect()
        await feed(transport, protocol, preface)
        for data in reads:
            await feed(transport, protocol, data)
    await backend.close()


def _distinct_pass(headers: list[tuple[str, str]], first_user: int) -> tuple[bytes, list[bytes]]:
    """One connection's bytes: its preface, then CALLS calls in reads of PER_READ, the users
    numbered from `first_user`. The answers (a few bytes each) fit the connection's first flow
    control window, so no WINDOW_UPDATE is needed."""
    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    preface = client.data_to_send()
    reads = []
    user = first_user
    for _ in range(CALLS // PER_READ):
        for _ in range(PER_READ):
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, headers)
            client.send_data(stream_id, _body(f"user-{user:08d}"), end_stream=True)
            user += 1
        reads.append(client.data_to_send())
    return preface, reads


ROOT = Path(__file__).parent.parent
#: The most rounds a replay is asked for (`per_call`: 1, then 3).
MAX_ROUNDS = 3


def _instructions(url: str, rounds: int, build: dict[str, str] | None, distinct: bool) -> int:
    """The replay's instructions, on the sources or under `build`'s environment (`environ`)."""
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "bench.instructions",
            "--replay",
            url,
            "--rounds",
            str(rounds),
            *(["--distinct"] if distinct else []),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, **(build or {})},
    )
    ran = out.stdout.split()[-1:]
    if ran != ["compiled" if build else "source"]:
        raise RuntimeError(f"the replay ran the {ran} build, not the one asked for")
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind total in:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_call(url: str, build: dict[str, str] | None = None, distinct: bool = False) -> int:
    """Instructions per call: (3 rounds - 1 round) / (2 × CALLS), on the sources or under
    `build`'s environment; `distinct`, of calls whose bodies are all new."""
    return (
        _instructions(url, MAX_ROUNDS, build, distinct) - _instructions(url, 1, build, distinct)
    ) // (2 * CALLS)


def _counts(url: str, build: dict[str, str] | None, distinct: bool = False) -> str:
    """The count on the sources, and beside it on `build` when there is one."""
    counts = f"{per_call(url, None, distinct):>9,}"
    if build is not None:
        counts += f"  {per_call(url, build, distinct):>9,}"
    return counts


def _print_rows(name: str, url: str, build: dict[str, str] | None) -> None:
    """The backend's two rows: one body sent again and again, then every body new."""
    print(f"  fast transport, {name + ':':<8}           {_counts(url, build)}", flush=True)
    print(f"  fast transport, {name + ',':<8} new bodies {_counts(url, build, True)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("memory", "redis", "cluster"), action="append")
    parser.add_argument(
        "--build",
        type=Path,
        help="also count the compiled build unpacked in this directory (make compiled)",
    )
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--distinct", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        asyncio.run(replay(args.replay, args.rounds, args.distinct))
        print(sidecar_build.name())  # which build ran, for `_instructions` to check
        return 0
    if shutil.which("valgrind") is None:
        print("bench.instructions: valgrind is not installed (apt-get install valgrind)")
        return 1
    build = None
    if args.build is not None:
        try:
            build = sidecar_build.environ(args.build, also=[ROOT])
        except ValueError as exc:
            print(f"bench.instructions: {exc}")
            return 1
    print(f"instructions per call (callgrind; {CALLS:,} calls, {PER_READ} per read, in-process)")
    if build is not None:
        print(f"{'':36}{'sources':>9}  {'compiled':>9}")
    for name in args.only or ("memory", "redis", "cluster"):
        with backend(name) as url:
            _print_rows(name, url, build)
    return 0


@contextlib.contextmanager
def backend(name: str) -> Iterator[str]:
    """The URL of a backend to replay on: `memory`, or a `redis` server or a 3-master `cluster`
    started for the block and stopped by their PIDs after it."""
    if name == "memory":
        yield "memory://"
        return
    from bench.services import start_redis, start_redis_cluster

    with tempfile.TemporaryDirectory() as logs:
        if name == "redis":
            service = start_redis(Path(logs))
            url = service.placeholders["redis_url"]
        else:
            service = start_redis_cluster(Path(logs))
            url = service.placeholders["redis_cluster_url"]
        try:
            yield url
        finally:
            service.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
