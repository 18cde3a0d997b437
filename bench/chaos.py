"""`make chaos`: attacks and faults against a running sidecar, with a legitimate client watching.

    .venv/bin/python -m bench.chaos [--only NAME,...] [--seconds S] [--transport fast,grpcio]
                                    [--build DIR]

For each probe a fresh Redis and sidecar start (`--failure-mode allow`, `--redis-timeout-ms 50`,
over-limit cache off). A legitimate client, a process of its own on a connection of its own
(grpc.aio), sends 200 calls/s with a 1 s deadline for `seconds` before, during and after the
probe. Printed per probe and transport: the legitimate client's p50/p99 and failed calls in each
phase, the sidecar's RSS before, at its peak and once the attack's connections are closed, the
sidecar's CPU seconds during the probe, and whether the flood's limit held (the `overload` probe:
OK answers against the limit). Probes:

  continuation-empty  one connection: a header block continued by 470,000 empty CONTINUATIONs
  continuation-1byte  one connection: a header block in 40,000 one-byte CONTINUATIONs
  bodies              30 connections, each sending 16 MiB of a request body that never ends
  settings            1,023 open streams, then 100,000 SETTINGS moving their windows
  rapid-reset         100,000 streams with a body, each reset at once
  ping                200,000 PINGs
  idle                500 connections that send the preface only, 500 stuck mid-frame
  overload            h2load: 1,000 connections x 8 streams flat out on a limit of 1,000/hour
  redis-pause         Redis SIGSTOP for 2 s, then SIGCONT
  redis-restart       Redis SIGKILL, then started again on the same port
  sentinel-failover   redis+sentinel:// (a master, its replica, 3 Sentinels): the master SIGKILLed
  cluster-failover    a 3-master cluster, the first master with a replica (node timeout 1 s):
                      that master SIGKILLed, its replica promoted by the cluster

The two failover probes run the sidecar with `--failure-mode deny`, so that the calls the failure
mode answers show as failed; their last column says when the new master was available (as the
Sentinels or every master's slot map say, from the kill) and how long after that the legitimate
client's last failed call ended (negative: the sidecar was on the new master before the test saw
it). Their servers come from the tests' own helpers (tests/support/servers.py), not a second copy.

Every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import hpack

from bench.processes import BenchError, Process, free_port, start
from sidecar import build as sidecar_build

#: The failover probes' topologies are the tests' (tests/support/servers.py), not written twice.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import servers

FAILOVERS = ("sentinel-failover", "cluster-failover")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0, 1, 2, 3, 4, 5, 7, 8, 9,
)  # fmt: skip
END_STREAM, END_HEADERS = 0x1, 0x4
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

RULES = """
domain: chaos
descriptors:
  - key: legit
    rate_limit: {unit: hour, requests_per_unit: 100000000}
  - key: flood
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""

#: The legitimate client: this many calls a second, each with this deadline.
LEGIT_RATE, LEGIT_DEADLINE = 200, 1.0

_LEGIT = r"""
import asyncio, json, sys, time
import grpc
from envoy.service.ratelimit.v3 import rls_pb2
port, seconds, rate, deadline = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
async def main():
    message = rls_pb2.RateLimitRequest(domain="chaos")
    message.descriptors.add().entries.add(key="legit", value="me")
    results = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=rls_pb2.RateLimitRequest.SerializeToString,
            response_deserializer=rls_pb2.RateLimitResponse.FromString,
        )
        await call(message, timeout=5)
        print("ready", flush=True)
        async def one(at):
            started = time.time()
            try:
                answer = await call(message, timeout=deadline)
                ok = answer.overall_code == 1
            except grpc.aio.AioRpcError:
                ok = False
            results.append((at, time.time() - started, ok))
        start = time.time()
        tasks = []
        for index in range(int(seconds * rate)):
            at = start + index / rate
            await asyncio.sleep(max(0.0, at - time.time()))
            tasks.append(asyncio.ensure_future(one(time.time())))
        await asyncio.gather(*tasks)
    print(json.dumps(results), flush=True)
asyncio.run(main())
"""


@dataclass
class Phase:
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    failed: int = 0
    calls: int = 0

    def show(self) -> str:
        return f"{self.p50_ms:6.1f} {self.p99_ms:6.1f} {self.failed:4d}"


@dataclass
class Outcome:
    probe: str
    transport: str
    phases: dict[str, Phase] = field(default_factory=dict)
    rss_mb: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu_s: float = 0.0
    exact: str = ""
    note: str = ""


# --- frames -------------------------------------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return struct.pack(">BHBBL", size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


def grpc_body(key: str) -> bytes:
    from envoy.service.ratelimit.v3 import rls_pb2

    message = rls_pb2.RateLimitRequest(domain="chaos")
    message.descriptors.add().entries.add(key=key, value="x")
    payload = message.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def header_block() -> bytes:
    fields = [
        (":method", "POST"), (":scheme", "http"), (":path", METHOD), (":authority", "chaos"),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ]  # fmt: skip
    encoded: bytes = hpack.Encoder().encode([(name, value, True) for name, value in fields])
    return encoded


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PREFACE + frame(SETTINGS, 0, 0))
    return reader, writer


async def drain_reads(reader: asyncio.StreamReader) -> None:
    """Read and drop what the server sends, until it closes."""
    try:
        while await reader.read(65_536):
            pass
    except (ConnectionError, OSError):
        pass


async def send(writer: asyncio.StreamWriter, chunks: list[bytes], stop_at: float) -> None:
    """Write `chunks` in batches, as fast as the socket takes them, until done or `stop_at`."""
    try:
        for at in range(0, len(chunks), 2_000):
            if time.time() > stop_at:
                return
            writer.write(b"".join(chunks[at : at + 2_000]))
            await writer.drain()
    except (ConnectionError, OSError):
        pass


def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.transport.abort()


# --- the attacks (each runs for at most `seconds`, then closes its connections) -----------------


async def attack_continuation(port: int, seconds: float, count: int, piece: bytes) -> None:
    reader, writer = await connect(port)
    block = header_block()
    chunks = [frame(HEADERS, 0, 1, block[:1])] + [frame(CONTINUATION, 0, 1, piece)] * count
    reading = asyncio.ensure_future(drain_reads(reader))
    await send(writer, chunks, time.time() + seconds)
    await asyncio.wait([reading], timeout=max(0.0, seconds))
    close_all([writer])


async def attack_bodies(port: int, seconds: float) -> None:
    writers = []
    block, stop_at = header_block(), time.time() + seconds
    body = b"\x00\x00\x40\x00\x00" + bytes(16_379)  # a prefix promising 4 MiB
    tasks = []
    for _ in range(30):
        reader, writer = await connect(port)
        writers.append(writer)
        tasks.append(asyncio.ensure_future(drain_reads(reader)))
        chunks = [frame(HEADERS, END_HEADERS, 1, block)] + [frame(DATA, 0, 1, body)] * 1_024
        tasks.append(asyncio.ensure_future(send(writer, chunks, stop_at)))
    await asyncio.wait(tasks, timeout=seconds)
    close_all(writers)


async def attack_settings(port: int, seconds: float) -> None:
    reader, writer = await connect(port)
    block = header_block()
    opened = [frame(HEADERS, END_HEADERS, stream_id, block) for stream_id in range(1, 2_047, 2)]
    flips = [
        frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 70_000 + index % 2)) for index in range(100_000)
    ]
    reading = asyncio.ensure_future(drain_reads(reader))
    await send(writer, opened + flips, time.time() + seconds)
    await asyncio.wait([reading], timeout=seconds)
    close_all([writer])


async def attack_rapid_reset(port: int, seconds: float) -> None:
    reader, writer = await connect(port)
    block, body = header_block(), grpc_body("flood")
    chunks = []
    for index in range(100_000):
        stream_id = 2 * index + 1
        chunks.append(
            frame(HEADERS, END_HEADERS, stream_id, block)
            + frame(DATA, END_STREAM, stream_id, body)
            + frame(RST_STREAM, 0, stream_id, struct.pack(">I", 8))
        )
    reading = asyncio.ensure_future(drain_reads(reader))
    await send(writer, chunks, time.time() + seconds)
    await asyncio.wait([reading], timeout=seconds)
    close_all([writer])


async def attack_ping(port: int, seconds: float) -> None:
    reader, writer = await connect(port)
    reading = asyncio.ensure_future(drain_reads(reader))
    await send(writer, [frame(PING, 0, 0, bytes(8))] * 200_000, time.time() + seconds)
    await asyncio.wait([reading], timeout=seconds)
    close_all([writer])


async def attack_idle(port: int, seconds: float) -> None:
    writers = []
    for index in range(1_000):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            break
        writer.write(PREFACE if index % 2 else PREFACE + frame(SETTINGS, 0, 0) + b"\x00\x00")
        writers.append(writer)
    await asyncio.sleep(seconds)
    close_all(writers)


# --- running a probe ----------------------------------------------------------------------------


class Watch:
    """Samples a process's RSS every 50 ms in a thread; `peak` since the last `reset`."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, self.rss_mb())
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop = True


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(http_port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def phases_of(results: list[tuple[float, float, bool]], bounds: list[float]) -> dict[str, Phase]:
    named = {}
    for name, start_at, end_at in zip(
        ("before", "during", "after"), bounds, bounds[1:], strict=False
    ):
        rows = [row for row in results if start_at <= row[0] < end_at]
        times = sorted(seconds * 1000 for _, seconds, ok in rows if ok)
        phase = Phase(calls=len(rows), failed=sum(1 for row in rows if not row[2]))
        if times:
            phase.p50_ms = statistics.median(times)
            phase.p99_ms = times[min(len(times) - 1, int(len(times) * 0.99))]
        named[name] = phase
    return named


class Failover:
    """A replicated topology for the failover probes: `kill` its master, then `promoted` says
    when the new one is available."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.sentinels: servers.SentinelGroup | None = None
        self.cluster: servers.RedisCluster | None = None
        if name == "sentinel-failover":
            self.sentinels = servers.start_sentinels(workdir / "sentinel", 3)
            self.url = self.sentinels.url
            self.old, self.new = self.sentinels.master(), self.sentinels.replica()
        else:
            self.cluster = servers.start_cluster(workdir / "cluster", node_timeout_ms=1000)
            # The master killed is the one holding the legitimate client's counter.
            self._slot, self.old = _owner(self.cluster)
            self.new = servers.add_replica(self.cluster, self.old, workdir / "cluster")
            self.url = self.cluster.url

    def fail_over(self) -> str:
        """Kill the master and wait until the new one is available; says after how long."""
        killed = time.time()
        self.old.kill()
        servers.wait_for(self.promoted, "the new master", timeout=60)
        self.available_at = time.time()
        return f"new master after {self.available_at - killed:.1f} s"

    def promoted(self) -> bool:
        if servers.role(self.new) != "master":
            return False
        if self.sentinels is not None:
            return self.sentinels.master_address() == (servers.HOST, self.new.port)
        with self.new.client() as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
            state = client.execute_command("CLUSTER", "INFO")
        owners = [int(m[1]) for a, b, m, *_ in ranges if a <= self._slot <= b]
        return b"cluster_state:ok" in state and owners == [self.new.port]

    def stop(self) -> None:
        for group in (self.sentinels, self.cluster):
            if group is not None:
                group.stop()


def _owner(cluster: servers.RedisCluster) -> tuple[int, servers.RedisServer]:
    """The slot of the legitimate client's counters (their hash tag, `sidecar.core.keys`)
    and the master serving it."""
    from redis.crc import key_slot

    slot = key_slot(b"{chaos|legit|me}")
    with cluster.nodes[0].client() as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    port = next(int(m[1]) for a, b, m, *_ in ranges if a <= slot <= b)
    return slot, next(node for node in cluster.nodes if node.port == port)


def run_probe(name: str, transport: str, seconds: float, workdir: Path) -> Outcome:
    outcome = Outcome(name, transport)
    redis_port, grpc_port, http_port = free_port(), free_port(), free_port()
    redis_argv = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no"]  # fmt: skip
    backend, failure_mode = f"redis://127.0.0.1:{redis_port}", "allow"
    failover = None
    if name in FAILOVERS:
        try:
            failover = Failover(name, workdir / f"{name}-{transport}")
        except servers.ServerError as exc:
            raise BenchError(str(exc)) from exc
        backend, failure_mode = failover.url, "deny"
        redis_argv = ["sleep", "3600"]  # no standalone Redis: a placeholder process
    redis = start(f"{name}-{transport}-redis", redis_argv, {}, workdir)
    rules = workdir / "rules.yaml"
    rules.write_text(RULES)
    sidecar_argv = [
        sys.executable, "-m", "sidecar", "serve", "--config", str(rules),
        "--backend", backend, "--redis-timeout-ms", "50",
        "--failure-mode", failure_mode, "--over-limit-cache", "0", "--transport", transport,
        "--grpc-address", f"127.0.0.1:{grpc_port}", "--http-address", f"127.0.0.1:{http_port}",
        "--log-level", "warning",
    ]  # fmt: skip
    time.sleep(0.3)
    sidecar = start(f"{name}-{transport}-sidecar", sidecar_argv, {}, workdir)
    legit: subprocess.Popen[str] | None = None
    watch: Watch | None = None
    try:
        _wait_ready(sidecar, http_port)
        legit = subprocess.Popen(
            [sys.executable, "-c", _LEGIT, str(grpc_port), str(3 * seconds),
             str(LEGIT_RATE), str(LEGIT_DEADLINE)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert legit.stdout is not None
        if legit.stdout.readline().strip() != "ready":
            raise BenchError(f"{name}: the legitimate client did not start")
        watch = Watch(sidecar.pid)
        started = time.time()
        rss_before = watch.rss_mb()
        time.sleep(seconds)
        during_at = time.time()
        watch.peak = watch.rss_mb()
        cpu_before = cpu_seconds(sidecar.pid)
        if failover is not None:
            outcome.note = failover.fail_over()
        else:
            outcome.note = _attack(name, grpc_port, seconds, redis, redis_argv, workdir)
        outcome.cpu_s = cpu_seconds(sidecar.pid) - cpu_before
        after_at = max(time.time(), during_at + seconds)
        time.sleep(max(0.0, after_at - time.time()))
        peak = watch.peak
        time.sleep(1.0)
        outcome.rss_mb = (rss_before, peak, watch.rss_mb())
        output, _ = legit.communicate(timeout=6 * seconds + 30)
        results = json.loads(output.strip().splitlines()[-1])
        outcome.phases = phases_of(results, [started, during_at, after_at, after_at + seconds + 5])
        if name == "overload":
            admitted = metric(
                http_port, 'ratelimit_service_rate_limit_within_limit{domain="chaos",key1="flood"}'
            )
            outcome.exact = f"{admitted:.0f}/1000 {'yes' if admitted <= 1000 else 'NO'}"
        if failover is not None:
            failed_ends = [at + took for at, took, ok in results if not ok]
            last = max(failed_ends) - failover.available_at if failed_ends else None
            limiting = "no call failed" if last is None else f"last failed call {last:+.2f} s"
            outcome.exact = f"{outcome.note}; {limiting}"
    finally:
        if watch is not None:
            watch.stop()
        if legit is not None and legit.poll() is None:
            legit.kill()
            legit.wait()
        sidecar.stop()
        redis.stop()
        if failover is not None:
            failover.stop()
    return outcome


def _wait_ready(sidecar: Process, http_port: int) -> None:
    import urllib.request

    for _ in range(100):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=1):
                return
        except OSError:
            if sidecar.exit_code() is not None:
                raise BenchError(f"the sidecar exited\n{sidecar.log_tail()}") from None
            time.sleep(0.1)
    raise BenchError(f"the sidecar did not start\n{sidecar.log_tail()}")


def _attack(
    name: str, port: int, seconds: float, redis: Process, redis_argv: list[str], workdir: Path
) -> str:
    attacks: dict[str, Callable[[], Awaitable[None]]] = {
        "continuation-empty": lambda: attack_continuation(port, seconds, 470_000, b""),
        "continuation-1byte": lambda: attack_continuation(port, seconds, 40_000, b"\x00"),
        "bodies": lambda: attack_bodies(port, seconds),
        "settings": lambda: attack_settings(port, seconds),
        "rapid-reset": lambda: attack_rapid_reset(port, seconds),
        "ping": lambda: attack_ping(port, seconds),
        "idle": lambda: attack_idle(port, seconds),
    }
    if name in attacks:
        asyncio.run(attacks[name]())
        return ""
    if name == "overload":
        body = workdir / "flood.bin"
        body.write_bytes(grpc_body("flood"))
        h2load = subprocess.Popen(
            ["h2load", "-n", "100000000", "-c", "1000", "-m", "8", "-D", f"{seconds:g}",
             "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
             f"http://127.0.0.1:{port}{METHOD}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        output, _ = h2load.communicate(timeout=seconds + 60)
        done = [line for line in output.splitlines() if line.startswith("requests:")]
        return done[0] if done else output[-200:]
    if name == "redis-pause":
        os.kill(redis.pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(redis.pid, signal.SIGCONT)
        time.sleep(max(0.0, seconds - 2.0))
        return ""
    if name == "redis-restart":
        os.kill(redis.pid, signal.SIGKILL)
        redis.popen.wait()
        time.sleep(0.5)
        restarted = start(redis.name + "-again", redis_argv, {}, workdir)
        redis.popen = restarted.popen  # stopped with the probe, by its PID
        time.sleep(max(0.0, seconds - 0.5))
        return ""
    raise BenchError(f"unknown probe {name!r}")


PROBES = (
    "continuation-empty", "continuation-1byte", "bodies", "settings", "rapid-reset", "ping",
    "idle", "overload", "redis-pause", "redis-restart", *FAILOVERS,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PROBES))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--transport", default="fast,grpcio")
    parser.add_argument("--build", default=None, help="the compiled build's directory")
    args = parser.parse_args(argv)
    if args.build is not None:
        os.environ.update(sidecar_build.environ(args.build, also=[str(Path.cwd())]))
    probes = [name for name in args.only.split(",") if name]
    unknown = [name for name in probes if name not in PROBES]
    if unknown:
        parser.error(f"unknown probes {unknown}; known: {', '.join(PROBES)}")
    print(
        f"legitimate client: {LEGIT_RATE} calls/s, deadline {LEGIT_DEADLINE:g} s; "
        f"{args.seconds:g} s per phase; build: {args.build or 'sources'}"
    )
    print(
        "| probe | transport | before p50/p99 ms, failed | during | after "
        "| RSS MB before/peak/after | CPU s | limit held |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="chaos-") as directory:
        for name in probes:
            for transport in args.transport.split(","):
                try:
                    outcome = run_probe(name, transport, args.seconds, Path(directory))
                except BenchError as exc:
                    print(f"| {name} | {transport} | error: {exc} |")
                    continue
                phases = [outcome.phases.get(key, Phase()) for key in ("before", "during", "after")]
                cells = [
                    f"{phase.p50_ms:.1f}/{phase.p99_ms:.1f}, {phase.failed}" for phase in phases
                ]
                before, peak, after = outcome.rss_mb
                print(
                    f"| {name} | {transport} | {' | '.join(cells)} "
                    f"| {before:.0f}/{peak:.0f}/{after:.0f} | {outcome.cpu_s:.1f} "
                    f"| {outcome.exact or '-'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
