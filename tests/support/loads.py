"""Load generators for the interop tests: wrk through Envoy and h2load straight at the sidecar.

Each runs as a subprocess while the test breaks something, and reports counts only (responses
by status, socket errors, requests that failed), never latencies: the tests assert that every
call was answered, not how fast. A run still going when its test ends is killed by the PID it
was started with.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from envoy.service.ratelimit.v3.rls_pb2 import RateLimitRequest

#: Extra seconds a run may take past its duration before the test gives up on it.
OVERRUN = 30.0

# wrk runs one Lua state per thread: `done` collects what each thread's `response` counted,
# and prints it as plain lines. The app id comes as the script's argument.
_WRK_SCRIPT = """\
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  wrk.headers["x-app-id"] = args[1]
  statuses = {}
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses")) do
      io.write(string.format("status %d %d\\n", status, count))
    end
  end
  local e = summary.errors
  io.write(string.format("errors %d %d %d %d %d\\n",
                         e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass(frozen=True)
class WrkReport:
    """What one wrk run saw: responses by HTTP status, and socket errors by kind (connect,
    read, write, and timeout: no response within wrk's `--timeout`)."""

    statuses: Counter[int]
    socket_errors: dict[str, int]
    output: str

    @property
    def responses(self) -> int:
        return sum(self.statuses.values())


class Wrk:
    """`wrk` sending GETs with `x-app-id: APP` for `seconds` on `connections` connections.

    `timeout` is how long wrk waits for one response before counting a timeout error.
    """

    def __init__(
        self,
        url: str,
        app: str,
        workdir: Path,
        *,
        seconds: float,
        connections: int = 4,
        timeout: float = 5.0,
    ) -> None:
        script = workdir / "wrk-statuses.lua"
        script.write_text(_WRK_SCRIPT)
        self.seconds = seconds
        self._popen = subprocess.Popen(
            ["wrk", "--threads", "1", "--connections", str(connections),
             "--duration", f"{seconds:g}s", "--timeout", f"{timeout:g}s",
             "--script", str(script), url, "--", app],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def report(self) -> WrkReport:
        """Wait for the run to end and parse its summary."""
        return self._parse(self._popen.communicate(timeout=self.seconds + OVERRUN)[0])

    def finish(self) -> WrkReport:
        """End the run now, once what it had to load has happened, and parse its summary: on
        SIGINT wrk stops its threads and reports as at the end of its duration (requests still
        unanswered left unread, as then), instead of loading on for the rest of `seconds`."""
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGINT)
        return self.report()

    def _parse(self, output: str) -> WrkReport:
        if self._popen.returncode != 0:
            raise AssertionError(f"wrk exited with {self._popen.returncode}:\n{output}")
        statuses: Counter[int] = Counter()
        errors: dict[str, int] | None = None
        for line in output.splitlines():
            words = line.split()
            if words[:1] == ["status"]:
                statuses[int(words[1])] += int(words[2])
            elif words[:1] == ["errors"]:
                kinds = ("connect", "read", "write", "status", "timeout")
                errors = dict(zip(kinds, map(int, words[1:]), strict=True))
        if errors is None:
            raise AssertionError(f"wrk printed no summary:\n{output}")
        # wrk's "status" errors are the responses of 400 and above, counted in `statuses`.
        del errors["status"]
        return WrkReport(statuses, errors, output)

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()
        self._popen.communicate()


@dataclass(frozen=True)
class H2loadReport:
    """The `requests:` line of h2load's summary and the HTTP statuses it counted."""

    total: int
    started: int
    done: int
    succeeded: int
    failed: int
    errored: int
    timeout: int
    status_2xx: int
    output: str


_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
_STATUSES = re.compile(r"status codes: (\d+) 2xx")


def grpc_body(message: RateLimitRequest) -> bytes:
    """A unary gRPC request body: uncompressed flag, 4-byte length, the message."""
    payload = message.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class H2load:
    """`h2load` sending `message` to ShouldRateLimit at `target` (`HOST:PORT`): `requests` in
    all, from `clients` connections of `streams` streams each, each at `rate` requests a
    second (None: as fast as they are answered).

    Count-based, so it waits for every request it sent. A client whose connection gets a GOAWAY
    does not reconnect: nghttp2 starts no stream after a GOAWAY, so the requests that client
    still had to send, or had just queued, count as failed and errored without ever leaving
    h2load (a client such as Envoy or grpc sends them on a new connection).
    """

    def __init__(
        self,
        target: str,
        message: RateLimitRequest,
        workdir: Path,
        *,
        requests: int,
        clients: int = 4,
        rate: int | None = 100,
        streams: int = 4,
    ) -> None:
        body = workdir / "h2load-body.bin"
        body.write_bytes(grpc_body(message))
        # Unthrottled (`rate` None), as fast as the server answers: a few thousand a second
        # at the least, on a loaded machine.
        self.seconds = requests / (clients * rate if rate else 2_000)
        url = f"http://{target}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
        pace = ["--rps", str(rate)] if rate else []
        self._popen = subprocess.Popen(
            ["h2load", "--requests", str(requests), "--clients", str(clients),
             "--max-concurrent-streams", str(streams), *pace, "--data", str(body),
             "--header", "content-type: application/grpc", "--header", "te: trailers", url],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def report(self) -> H2loadReport:
        output, _ = self._popen.communicate(timeout=self.seconds + OVERRUN)
        requests = _REQUESTS.search(output)
        statuses = _STATUSES.search(output)
        if self._popen.returncode != 0 or requests is None or statuses is None:
            raise AssertionError(f"h2load exited with {self._popen.returncode}:\n{output}")
        numbers = [int(n) for n in requests.groups()]
        return H2loadReport(*numbers, status_2xx=int(statuses.group(1)), output=output)

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()
        self._popen.communicate()
