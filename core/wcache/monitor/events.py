"""Structured events: one JSON object per line, appended atomically to `<run dir>/events.jsonl`.

The log is bounded: once it passes `max_events_bytes()` the writer that crossed the line renames it to
`events.jsonl.1` (replacing the previous generation) and the next event starts a fresh file; readers take
both generations in order.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
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
ROTATED_SUFFIX = ".1"
DEFAULT_MAX_EVENTS_BYTES = 16 * 1024 * 1024
KINDS = frozenset({
    "preload", "ready", "preload_failed", "attach_hit", "attach_miss", "fallback", "release", "stop",
    "daemon_exited", "daemon_lost", "engine_counters", "group_stopped", "placement",
})


def events_path(run_dir: Path) -> Path:
    return run_dir / EVENTS_NAME


def rotated_path(path: Path) -> Path:
    return path.with_name(path.name + ROTATED_SUFFIX)


def max_events_bytes() -> int:
    """The size at which the log rotates: `WCACHE_EVENTS_MAX_BYTES`, else 16 MiB."""
    try:
        return max(4096, int(os.environ.get("WCACHE_EVENTS_MAX_BYTES", DEFAULT_MAX_EVENTS_BYTES)))
    except ValueError:
        return DEFAULT_MAX_EVENTS_BYTES


def _rotate_if_full(path: Path, fd: int) -> None:
    """Move a full log aside; the lock on the old file makes exactly one of several writers do it."""
    if os.fstat(fd).st_size < max_events_bytes():
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with contextlib.suppress(FileNotFoundError):
            # Another writer may have rotated it while we waited: then the path names a fresh file.
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.replace(rotated_path(path))
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


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
            _rotate_if_full(events_path(run_dir), fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("Could not write the %s event to %s (%s).", kind, events_path(run_dir), exc.strerror)
    return event


def read_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every well-formed event still kept (the rotated generation, then the current one), in order."""
    path = events_path(run_dir)
    yield from _read_log(rotated_path(path))
    yield from _read_log(path)


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """One line of the log as an event, or None for a torn or foreign line (not JSON, or without a kind)."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return event if isinstance(event, dict) and isinstance(event.get("kind"), str) else None


def _read_log(path: Path) -> Iterator[dict[str, Any]]:
    """One file's well-formed events; a torn or foreign line is skipped."""
    try:
        fd = _open_log(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("Cannot read events from %s (%s).", path, exc.strerror)
        return
    try:
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                if (event := parse_event(raw)) is not None:
                    yield event
    except FileNotFoundError:
        return
