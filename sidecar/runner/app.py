"""The composition root: one running sidecar, a list of parts (`sidecar.runner.parts`) built from its
`Options` (`sidecar.runner.assembly`), started in order and stopped in reverse.

`App.start` loads the rules (ConfigError on a bad file), opens the backend (InvalidOption for a
URL it cannot use), starts every part and reports SERVING once the backend answered a ping.
`App.stop` is what SIGTERM and SIGINT trigger: unhealthy everywhere first, then no new calls,
calls in flight get a grace period, then the backend is closed. Every new set of rules (a
reload, an xDS push) reaches every part that reads rules through one `ServedRules`
(`sidecar.runner.served_rules`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

import structlog

from sidecar.core.rules import Rules
from sidecar.decision.stats import Stats
from sidecar.errors import ConfigError
from sidecar.http.health import Health
from sidecar.runner.assembly import (
    HEALTH_INTERVAL,
    SHUTDOWN_GRACE,
    Assembly,
)
from sidecar.runner.options import (
    TRANSPORTS,
    InvalidOption,
    Options,
    check_grpc_address,
    split_address,
)
from sidecar.runner.served_rules import ServedRules
from sidecar.storage import Backend
from sidecar.telemetry import garbage, metrics

#: Re-exported: what callers of the composition root import from it.
__all__ = [
    "HEALTH_INTERVAL",
    "SHUTDOWN_GRACE",
    "TRANSPORTS",
    "App",
    "InvalidOption",
    "Options",
    "check_grpc_address",
    "split_address",
]

log = structlog.get_logger("sidecar.app")


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """Which event loop runs the sidecar, "uvloop" or "asyncio" (logged when it starts)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


class App:
    """One running sidecar. `backend` and `clock` may be given (tests); by default from Options."""

    def __init__(
        self,
        options: Options,
        *,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.options = options
        self.stats = Stats()
        self.latency = metrics.Latency()
        #: The cycle collector's pauses, timed from the end of `start` to `stop`.
        self.gc_pauses = garbage.GcPauses()
        self.registry = metrics.registry(self.stats, self.latency)
        self.registry.register(garbage.GcCollector(self.gc_pauses))
        self.registry.register(metrics.LimitsCollector(lambda: self.rules))
        self.clock = clock
        #: The parts, built by `start` (in start order) and stopped in reverse.
        self.assembly = Assembly(options, self, backend)
        self.served = ServedRules(options, self.stats, self.assembly.parts, self._settle)
        self._stopped = False
        #: Whether this app owns the process's collector (`run`): then what it keeps is frozen
        #: after it starts and after each change of rules (`garbage.settle`).
        self._owns_collector = False

    # What tests and the CLI look at, from the parts.
    grpc_port = property(lambda self: self.assembly.listeners.ports.get("grpc", 0))
    http_port = property(lambda self: self.assembly.listeners.ports.get("http", 0))
    rlqs_port = property(lambda self: self.assembly.listeners.ports.get("rlqs", 0))
    metrics_port = property(lambda self: self.assembly.listeners.ports.get("metrics", 0))
    debug_port = property(lambda self: self.assembly.listeners.ports.get("debug", 0))
    operator_port = property(lambda self: self.assembly.listeners.ports.get("operator", 0))

    @property
    def health(self) -> Health:
        """The serving state (after `start`)."""
        assert self.assembly.health is not None, "App.start() first"
        return self.assembly.health

    async def start(self) -> None:
        """Build and start every part, in order; raises ConfigError, InvalidOption or OSError
        after stopping what was built."""
        check_grpc_address(self.options.grpc_address)
        try:
            self.assembly.build()
            for part in self.assembly.parts:
                await part.start()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "started",
            **self.assembly.summary(),
            loop=loop_name(asyncio.get_running_loop()),
            healthy=self.health.healthy,
            pid=os.getpid(),
        )
        self.gc_pauses.watch()

    async def stop(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Stop every part built, in reverse; safe to call twice and after a failed start."""
        if self._stopped:
            return
        self._stopped = True
        for part in reversed(self.assembly.parts):
            await part.stop(grace)
        self.gc_pauses.unwatch()

    # The rules, as the parts reach them (`sidecar.runner.assembly.Host`), kept by `served`.
    @property
    def rules(self) -> Rules:
        """The rules served now (replaced by reloads and xDS pushes)."""
        return self.served.current

    @rules.setter
    def rules(self, rules: Rules) -> None:
        self.served.current = rules

    def load_rules(self) -> Rules:
        return self.served.load()

    def reload(self) -> bool:
        """Load the rules again and serve them; keep the old ones on error (`ServedRules`)."""
        return self.served.reload()

    def serve_rules(self, rules: Rules) -> None:
        self.served.serve(rules)

    def reject_rules(self, error: ConfigError) -> None:
        self.served.reject(error)

    def _settle(self) -> None:
        if self._owns_collector:
            garbage.settle()

    def reload_all(self) -> None:
        """SIGHUP: the rules, and the TLS files when they changed."""
        self.reload()
        if self.assembly.tls is not None:
            self.assembly.tls.reload()

    async def _start_unless(self, stopping: asyncio.Event) -> bool:
        """`start`, unless `stopping` is set first (a sidecar waiting for its first rules over
        xDS must still stop on SIGTERM); returns whether it started."""
        starting = asyncio.ensure_future(self.start())
        signalled = asyncio.ensure_future(stopping.wait())
        await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if starting.done():
            starting.result()  # raises what start raised
            return True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await self.stop()
        return False

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit status (0)."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        # Before starting: a SIGTERM that comes as soon as "started" is logged (a supervisor
        # stopping its workers) must stop the sidecar in order, not kill it.
        for signum in signals:
            loop.add_signal_handler(signum, stopping.set)
        try:
            if not await self._start_unless(stopping):
                log.info("stopped", before="the first rules arrived")
                return 0
            loop.add_signal_handler(signal.SIGHUP, self.reload_all)
            self._owns_collector = True
            garbage.take_over()
            await stopping.wait()
            log.info("stopping", grace_seconds=SHUTDOWN_GRACE)
            await self.stop()
        finally:
            for signum in (*signals, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        log.info("stopped", total_requests=self.stats.total_requests)
        return 0
