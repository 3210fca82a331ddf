"""One log format for every long-running process (api, worker, beat).

Text by default; ``TOKENFLEET_LOG_FORMAT=json`` (``tokenfleet up --log-format
json``) writes one JSON object per line for a log shipper, with the access
log's fields (``extra={"fields": {...}}``) as top-level keys.

Celery's per-task INFO lines ("received", "succeeded", beat's "sending due
task") are raised to WARNING unless the level is DEBUG: the API's access log
has one line per request, and a control loop ticking every second would
otherwise write thousands of identical lines an hour.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

LOG_FORMAT_ENV = "TOKENFLEET_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Celery loggers that write a line per task
PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, plus the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_format(fmt: str | None = None) -> str:
    """``fmt``, else ``$TOKENFLEET_LOG_FORMAT``, else text (ValueError if unknown)."""
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format '{fmt}' is not one of {', '.join(LOG_FORMATS)}")
    return fmt


def setup_logging(level: str, fmt: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if root.level > logging.DEBUG:
        for name in PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
