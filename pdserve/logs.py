"""The console's log lines in `pdserve up`: which pdserve loggers reach it, at what level, and in
which format.

`configure_console(observability)` runs once, as `up` starts, before Ray or the router: one
handler on the root logger writing to stderr, either text lines (time, level, logger, message) or
one JSON object a line (`log_format: json`, for log shippers: time, level, logger, message, and
the exception's traceback when there is one), and the level of every `pdserve.*` logger from
`--log-level`, else `observability.log_level`, else `PDSERVE_LOG_LEVEL`, else info: the router's
console line (router/console.py), planner decisions, role flips, workers dropped and returning,
and the deployment's own lines. Other libraries stay at warning. A PDSERVE_LOG_LEVEL that names no
level is reported in one line and info is used.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601 with milliseconds), level, logger, message, and
    exc (the traceback) when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def console_level(observability, environ=os.environ) -> tuple[str, str | None]:
    """(the level's name, a warning line or None): the key (a flag sets it), else
    PDSERVE_LOG_LEVEL, else info."""
    if observability.log_level is not None:
        return observability.log_level, None
    wanted = environ.get("PDSERVE_LOG_LEVEL", "").strip().lower()
    if not wanted:
        return "info", None
    if wanted not in LEVELS:
        return "info", (
            f"PDSERVE_LOG_LEVEL={wanted!r} is not one of {', '.join(LEVELS)}: logging at info"
        )
    return wanted, None


def configure_console(observability, stream=None, environ=os.environ) -> str:
    """The console handler and the pdserve loggers' level (module docstring); returns the
    level's name."""
    level, warning = console_level(observability, environ)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if observability.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler._pdserve_console = True  # a second call (tests run `up` in one process) replaces it
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pdserve_console", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    logging.getLogger("pdserve").setLevel(level.upper())
    if warning is not None:
        logging.getLogger("pdserve.deploy").warning("%s", warning)
    return level
