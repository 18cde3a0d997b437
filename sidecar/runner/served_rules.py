"""The rules a sidecar serves, and how they change: loaded from the files, loaded again on a
reload (SIGHUP, a change on disk) or pushed over xDS, and handed to every part that reads rules.

As the reference does, every set loaded counts as `config_load_success` and every set refused
as `config_load_error`; a refused set keeps the rules served before, and is logged once per
distinct error. Each warning of the rules (`sidecar.core.rules.ConfigWarning`) is logged once, not
at every reload. Counters are untouched by a change: their keys depend on the descriptors and
windows, not on the rules' order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from sidecar.core import config
from sidecar.core.rules import Rules
from sidecar.decision.stats import Stats
from sidecar.errors import ConfigError
from sidecar.runner.options import Options
from sidecar.runner.parts import Part

log = structlog.get_logger("sidecar.app")


class ServedRules:
    """The rules served now (`current`), and every change of them: counted in `stats`, logged,
    handed to each of `parts` that reads rules (the list the composition root runs, read at
    each change, so parts added after this was made are handed them too), then `changed()`."""

    def __init__(
        self,
        options: Options,
        stats: Stats,
        parts: Sequence[Part],
        changed: Callable[[], object] = lambda: None,
    ) -> None:
        self.options = options
        self.stats = stats
        self.parts = parts
        self.changed = changed
        #: Replaced by reloads and xDS pushes; empty until the first set is loaded.
        self.current = Rules()
        #: The rules' warnings already logged, never logged again (a few per distinct set of
        #: rules an operator writes: as many as were logged).
        self._warned: set[str] = set()
        self._last_error: str | None = None

    def load(self) -> Rules:
        """The rules from the files, counted and their warnings logged; raises ConfigError."""
        try:
            rules = self._read()
        except ConfigError:
            self.stats.config_load_error += 1
            raise
        self.stats.config_load_success += 1
        for domain in rules.domains.values():
            log.info("config_loaded", summary=domain.summary())
        self._warn(rules)
        return rules

    def reload(self) -> bool:
        """Load the rules again and serve them from the next call; keep the old ones on error.
        Rules from xDS are not reloaded: they change when the control plane pushes."""
        if self.options.xds is not None:
            log.info("config_reload_skipped", reason="rules come from xDS")
            return False
        try:
            rules = self._read()
        except ConfigError as exc:
            self.reject(exc)
            return False
        self.serve(rules)
        log.info("config_reloaded", summaries=[d.summary() for d in rules.domains.values()])
        return True

    def serve(self, rules: Rules) -> None:
        """Serve `rules` from the next call on (a reload, or an xDS push): every part that reads
        rules is handed them."""
        self._last_error = None
        self.stats.config_load_success += 1
        self._warn(rules)
        self.current = rules
        for part in self.parts:
            if part.rules_changed is not None:
                part.rules_changed(rules)
        self.changed()

    def reject(self, error: ConfigError) -> None:
        """Count and log (once per distinct error) rules that cannot be served; the rules
        served before stay."""
        self.stats.config_load_error += 1
        if str(error) != self._last_error:
            self._last_error = str(error)
            log.warning("config_load_error", error=str(error), kept="previous rules")

    def _read(self) -> Rules:
        options = self.options
        return config.load(options.config, options.merge_domain_config, options.calendar_months)

    def _warn(self, rules: Rules) -> None:
        for warning in rules.warnings():
            text = str(warning)
            if text not in self._warned:
                self._warned.add(text)
                log.warning("config_warning", warning=text)
