"""structlog set-up: JSON lines for services, console on a TTY; always on stderr so that
stdout stays the program's answer (``pdserve generate`` prints only the text)."""

from __future__ import annotations

import logging
import sys

import structlog


class _StderrLogger:
    """Writes to whatever ``sys.stderr`` is at the time of the call, not at configuration
    (a captured or replaced stderr, e.g. under pytest, may be closed later)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_logger(*args: object) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
