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

from wcache.canonical import INT64_BITS, loads_finite

log = logging.getLogger("wcache")

EVENTS_NAME = "events.jsonl"
ROTATED_SUFFIX = ".1"
DEFAULT_MAX_EVENTS_BYTES = 16 * 1024 * 1024
# Seconds since the epoch no event can be from (the year 5138): a larger ts is a forged line, not a time to show.
MAX_TS = 1e11
KINDS = frozenset({
    "preload", "ready", "preload_failed", "attach_hit", "attach_miss", "fallback", "release", "stop",
    "daemon_exited", "daemon_lost", "engine_counters", "group_stopped", "provenance", "engine_switch",
    "switch_refused", "scrub_failed", "placement",
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
    """Move a full log aside; the lock on the old file makes exactly one of several writers do it.

    Where the rename fails (something that is not a file holds the rotated name, a read-only directory) the log
    is emptied instead: it loses its older events, but it never grows past the bound.
    """
    if os.fstat(fd).st_size < max_events_bytes():
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        # Another writer may have rotated it while we waited: then the path names a fresh file.
        if os.lstat(path).st_ino != os.fstat(fd).st_ino:
            return
        try:
            path.replace(rotated_path(path))
        except OSError as exc:
            os.ftruncate(fd, 0)
            log.warning("Could not rotate %s to %s (%s); emptied it instead, so it stays under %d bytes.", path,
                        rotated_path(path).name, exc.strerror, max_events_bytes())
    except FileNotFoundError:
        pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _open_log(path: Path, flags: int) -> int:
    """Open the log without following a link, blocking on a FIFO planted in its place, or taking anything but a
    regular file: a symlink named events.jsonl would have every writer append to whatever it points at."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW, 0o600)
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
    path = events_path(run_dir)
    try:
        # One write() on an O_APPEND descriptor: concurrent writers never interleave within a line.
        fd = _open_log(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as exc:
        log.warning("Could not write the %s event to %s (%s).", kind, path, _reason(exc))
        return event
    try:
        try:
            os.write(fd, line)
        except OSError as exc:
            log.warning("Could not write the %s event to %s (%s).", kind, path, _reason(exc))
            return event
        with contextlib.suppress(OSError):  # the event is written; a failed rotation warned on its own
            _rotate_if_full(path, fd)
    finally:
        os.close(fd)
    return event


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symlink"
    return exc.strerror or str(exc)


def read_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every well-formed event still kept (the rotated generation, then the current one), in order."""
    path = events_path(run_dir)
    yield from _read_log(rotated_path(path))
    yield from _read_log(path)


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """One line of the log as an event, or None for a torn or foreign line: not JSON, a number without a finite
    value (NaN, 1e400), or no kind and time to sort and show it by."""
    try:
        event = loads_finite(line, int_bits=INT64_BITS)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return None
    ts = event.get("ts")
    return event if isinstance(ts, int | float) and not isinstance(ts, bool) and 0 <= ts < MAX_TS else None


def _read_log(path: Path) -> Iterator[dict[str, Any]]:
    """One file's well-formed events; a torn or foreign line is skipped."""
    try:
        fd = _open_log(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("Cannot read events from %s (%s).", path, _reason(exc))
        return
    try:
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                if (event := parse_event(raw)) is not None:
                    yield event
    except FileNotFoundError:
        return
