"""How the supervisor and the rank daemons log: one line per event, as text or JSON, to stderr and a log file.

`wcache preload --log-level/--log-format` choose; the vocabulary lives here and the CLI imports it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
DEFAULT_LOG_LEVEL = "info"
DEFAULT_LOG_FORMAT = "text"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (journald's JSON mode, Loki, Fluent Bit)."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6), "level": record.levelname.lower(), "component": self.component,
            "pid": record.process, "logger": record.name, "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(component: str, level: str = DEFAULT_LOG_LEVEL, fmt: str = DEFAULT_LOG_FORMAT,
              log_file: Path | None = None) -> None:
    """Root logging for a wcache process: stderr, plus `log_file` when stderr is not already that file."""
    formatter: logging.Formatter = (
        JsonFormatter(component) if fmt == "json"
        else logging.Formatter(f"%(asctime)s {component} %(levelname)s %(message)s")
    )
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None and not _same_file(log_file):
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level.upper() if level in LOG_LEVELS else DEFAULT_LOG_LEVEL.upper())


def _same_file(path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(sys.stderr.fileno()), os.stat(path))
    except (OSError, ValueError):
        return False
