"""The composition root: one running sidecar, a list of parts (`sidecar.runner.parts`) built from its
`Options` (`sidecar.runner.assembly`), started in order and stopped in reverse.

`App.start` loads the rules (ConfigError on a bad file), opens the backend (InvalidOption for a
URL it cannot use), starts every part and reports SERVING once the backend answered a ping.
`App.stop` is what SIGTERM and SIGINT trigger: unhealthy everywhere first, then no new calls,
calls in flight get a grace period, then the backend is closed. Every new set of rules (a
reload, an xDS push) reaches every part that reads rules through `serve_rules`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import Callable

import structlog

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.limiter import Limiter
from sidecar.decision.stats import Stats
from sidecar.errors import ConfigError
from sidecar.http.health import Health
from sidecar.rls.tls import ServerTls
from sidecar.runner.assembly import (
    HEALTH_INTERVAL,
    SHUTDOWN_GRACE,
    USAGE_METRICS_INTERVAL,
    Assembly,
    RlsServer,
)
from sidecar.runner.options import (
    TRANSPORTS,
    InvalidOption,
    Options,
    Transport,
    check_grpc_address,
    split_address,
)
from sidecar.storage import Backend
from sidecar.telemetry import metrics
from sidecar.telemetry.statsd import StatsdReporter

#: Re-exported: what callers of the composition root import from it.
__all__ = [
    "HEALTH_INTERVAL",
    "SHUTDOWN_GRACE",
    "TRANSPORTS",
    "USAGE_METRICS_INTERVAL",
    "App",
    "InvalidOption",
    "Options",
    "RlsServer",
    "Transport",
    "check_grpc_address",
    "loop_name",
    "split_address",
]

#: The cycle collector's thresholds while serving (`gc.set_threshold`; Python's are 700, 10, 10).
#: A call makes no reference cycle (tests/test_garbage.py), so a collection finds nothing to
#: free: 300,000 calls each on a user of its own (compiled, in one process, Redis) ran 934
#: collections that collected 0 objects. What one costs is its pause, every call in flight
#: waiting. A young collection walks at most about 700 × 10 objects: medians 0.05 and 1 ms,
#: at most 0.7 and 5.6 ms. A full one walks all that is kept and not frozen (`_settle`),
#: mostly the plan cache (`sidecar.rls.service`; when it held 4,096 plans, of two descriptors
#: each, about 90,000 objects: 20 to 65 ms; it holds 1,024 now) and the memory backend's
#: counters. The third threshold makes
#: full ones ten times rarer: over 1,000,000 such calls, 23 (21 over 10 ms, up to 66 ms) at 10,
#: 2 (5 ms each) at 100, none at 1,000; 100 still collects, every few hundred thousand new
#: users, what other libraries may leave in cycles. The first two stay as they are: young
#: collections walk threshold 0 × threshold 1 objects, and measured up to 81 ms at 10,000 × 10
#: and 19 ms at 700 × 100.
GC_THRESHOLDS = (700, 10, 100)

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
        self.gc_pauses = metrics.GcPauses()
        self.registry = metrics.registry(self.stats, self.latency, self.gc_pauses)
        self.registry.register(metrics.LimitsCollector(lambda: self.rules))
        self.clock = clock
        #: The rules served now (replaced by reloads and xDS pushes).
        self.rules = Rules()
        #: The parts, built by `start` (in start order) and stopped in reverse.
        self.assembly = Assembly(options, self, backend)
        self._last_config_error: str | None = None
        self._stopped = False
        #: Whether this app owns the process's collector (`run`): then what it keeps is frozen
        #: after it starts and after each change of rules (`_settle`).
        self._owns_collector = False
        #: The rules' warnings already logged (each is logged once).
        self._warned: set[str] = set()

    # What tests and the CLI look at, from the parts.
    grpc_port = property(lambda self: self.assembly.listeners.ports.get("grpc", 0))
    http_port = property(lambda self: self.assembly.listeners.ports.get("http", 0))
    rlqs_port = property(lambda self: self.assembly.listeners.ports.get("rlqs", 0))
    metrics_port = property(lambda self: self.assembly.listeners.ports.get("metrics", 0))
    debug_port = property(lambda self: self.assembly.listeners.ports.get("debug", 0))
    operator_port = property(lambda self: self.assembly.listeners.ports.get("operator", 0))

    @property
    def _limiter(self) -> Limiter | None:
        return self.assembly.limiter

    @property
    def _grpc(self) -> RlsServer | None:
        return self.assembly.grpc

    @property
    def _tls(self) -> ServerTls | None:
        return self.assembly.tls

    @property
    def _statsd(self) -> StatsdReporter | None:
        return self.assembly.statsd

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

    def load_rules(self) -> Rules:
        """The rules from the files, counted (config_load_success or _error) and their warnings
        logged; raises ConfigError."""
        try:
            rules = self._read_rules()
        except ConfigError:
            self.stats.config_load_error += 1
            raise
        self.stats.config_load_success += 1
        for domain in rules.domains.values():
            log.info("config_loaded", summary=domain.summary())
        self._warn(rules)
        return rules

    def _read_rules(self) -> Rules:
        options = self.options
        return config.load(options.config, options.merge_domain_config, options.calendar_months)

    def _warn(self, rules: Rules) -> None:
        """Log each warning of the rules (see `sidecar.core.rules.ConfigWarning`) once, not at every reload."""
        for warning in rules.warnings():
            text = str(warning)
            if text not in self._warned:
                self._warned.add(text)
                log.warning("config_warning", warning=text)

    def reload(self) -> bool:
        """Load the rules again and serve them from the next call; keep the old ones on error.

        As the reference does: a bad file is counted (config_load_error) and logged once per
        distinct error, and the service goes on with the rules it had. Counters are untouched:
        their keys depend on the descriptors and windows, not on the rules' order.
        Rules from xDS are not reloaded: they change when the control plane pushes.
        """
        if self.options.xds is not None:
            log.info("config_reload_skipped", reason="rules come from xDS")
            return False
        try:
            rules = self._read_rules()
        except ConfigError as exc:
            self.reject_rules(exc)
            return False
        self.serve_rules(rules)
        log.info("config_reloaded", summaries=[d.summary() for d in rules.domains.values()])
        return True

    def serve_rules(self, rules: Rules) -> None:
        """Serve `rules` from the next call on (a reload, or an xDS push): every part that reads
        rules is handed them."""
        self._last_config_error = None
        self.stats.config_load_success += 1
        self._warn(rules)
        self.rules = rules
        for part in self.assembly.parts:
            if part.rules_changed is not None:
                part.rules_changed(rules)
        if self._owns_collector:
            _settle()

    def reject_rules(self, error: ConfigError) -> None:
        """Count and log (once per distinct error) rules that cannot be served; the rules
        served before stay."""
        self.stats.config_load_error += 1
        if str(error) != self._last_config_error:
            self._last_config_error = str(error)
            log.warning("config_load_error", error=str(error), kept="previous rules")

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
            gc.set_threshold(*GC_THRESHOLDS)
            self._owns_collector = True
            _settle()
            await stopping.wait()
            log.info("stopping", grace_seconds=SHUTDOWN_GRACE)
            await self.stop()
        finally:
            for signum in (*signals, signal.SIGHUP):
                loop.remove_signal_handler(signum)
        log.info("stopped", total_requests=self.stats.total_requests)
        return 0


def _settle() -> None:
    """Collect, then freeze what is left: what exists once the sidecar has started (modules,
    rules, servers) or has taken new rules lives until the process ends or the rules change.
    Out of the collector's sight, it is not walked again by every full collection
    (GC_THRESHOLDS), whose pause then grows only with what serving keeps since.

    Frozen objects are still freed by their reference counts, as the old rules are when new ones
    replace them (loading and dropping rules leaves nothing to collect), and as a closed
    connection is (`Connection.release`); only what would end in a cycle after this is never
    collected. The collection costs a full collection's pause once per change of rules (20 to
    40 ms with 4,096 plans cached, compiled; the cache holds at most 1,024 now).
    """
    gc.collect()
    gc.freeze()
