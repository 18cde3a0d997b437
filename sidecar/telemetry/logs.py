"""Logging: structlog events, one JSON object per line on stderr by default.

The sidecar logs what an operator needs to see once (start-up with the bound ports, config
loaded, backend failure and recovery, shutdown), never one line per request at INFO.
Records from libraries that use the standard `logging` module (grpc, aiohttp) are rendered the
same way, so the output stays one format.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import Processor

LogFormat = Literal["json", "console"]
LEVELS = ("debug", "info", "warning", "error", "critical")


def configure(level: str = "info", fmt: LogFormat = "json", stream: TextIO | None = None) -> None:
    """Send every log event to `stream` (stderr) at `level` and above, as JSON or for a console."""
    number = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(number)

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
