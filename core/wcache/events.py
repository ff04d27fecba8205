"""Structured events: one JSON object per line, appended atomically to `<run dir>/events.jsonl`."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("wcache")

EVENTS_NAME = "events.jsonl"
KINDS = frozenset({
    "preload", "ready", "preload_failed", "attach_hit", "attach_miss", "fallback", "release", "stop",
    "daemon_exited", "daemon_lost", "engine_counters",
})


def events_path(run_dir: Path) -> Path:
    return run_dir / EVENTS_NAME


def _open_log(path: Path, flags: int) -> int:
    """Open the log without blocking on a FIFO planted in its place, and refuse anything but a regular file."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event; a failure to log is a warning, never a reason to fail the work it describes."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    event = {"ts": round(time.time(), 6), "kind": kind, "pid": os.getpid(), **fields}
    line = (json.dumps(event, ensure_ascii=False, default=str) + "\n").encode()
    try:
        # One write() on an O_APPEND descriptor: concurrent writers never interleave within a line.
        fd = _open_log(events_path(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("Could not write a %s event to %s (%s).", kind, events_path(run_dir), exc.strerror)
    return event


def read_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every well-formed event in order; a torn or foreign line is skipped."""
    try:
        fd = _open_log(events_path(run_dir), os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("Cannot read events from %s (%s).", events_path(run_dir), exc.strerror)
        return
    try:
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(event, dict) and "kind" in event:
                    yield event
    except FileNotFoundError:
        return
