"""Structured events: one JSON object per line, appended atomically to `<run dir>/events.jsonl`.

Each line is one of `event_types`' kinds, written by `append_event` and read back by `parse_event` in one
decode (a line of a kind this version does not know, or of the wrong shape, is skipped like a torn one).

The log is bounded: once it passes `max_events_bytes()` the writer that crossed the line renames it to
`events.jsonl.1` (replacing the previous generation) and the next event starts a fresh file; readers take
both generations in order.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from wcache.ipc.run_dir.paths import RunPaths
from wcache.monitor.event_types import AnyEvent, Event

log = logging.getLogger("wcache")

DEFAULT_MAX_EVENTS_BYTES = 16 * 1024 * 1024
# An event is a few hundred bytes; a longer line (a file planted in the log's place) is skipped, never held whole.
MAX_LINE_BYTES = 1 << 20
_ENCODER = msgspec.json.Encoder()
_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(AnyEvent)
E = TypeVar("E", bound=Event)


def events_path(run_dir: Path) -> Path:
    return RunPaths(run_dir).events


def rotated_path(path: Path) -> Path:
    return RunPaths.rotated(path)


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


def append_event(run_dir: Path, event: Event) -> Event:
    """Append one event; a failure to log is a warning, never a reason to fail the work it describes."""
    kind = event.KIND
    line = _ENCODER.encode(event) + b"\n"
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
    """Every well-formed event still kept (the rotated generation, then the current one), in order, as the
    fields it has a value for."""
    for event in read_typed_events(run_dir):
        yield _fields(event)


def read_typed_events(run_dir: Path) -> Iterator[Event]:
    """Every well-formed event still kept (the rotated generation, then the current one), in order."""
    path = events_path(run_dir)
    yield from _read_log(rotated_path(path))
    yield from _read_log(path)


def engine_events(run_dir: Path, kind: type[E], engine: str, since: float = 0.0) -> list[E]:
    """The events of `kind` an engine integration (`engine`) wrote at or after `since`, in order."""
    return [e for e in read_typed_events(run_dir)
            if isinstance(e, kind) and getattr(e, "engine", None) == engine and e.ts >= since]


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """One line of the log as an event's fields, those it has a value for, or None for a torn or foreign line
    (see `read_event`)."""
    event = read_event(line)
    return None if event is None else _fields(event)


def _fields(event: Event) -> dict[str, Any]:
    return {k: v for k, v in event.to_wire().items() if v is not None}


def read_event(line: bytes | str) -> Event | None:
    """One line of the log as its event, or None for a torn or foreign line: not JSON, a kind this version does
    not know, a field of the wrong type, or no time to sort and show it by (NaN, 1e400, a string)."""
    try:
        event: Event = _DECODER.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return event


def _read_log(path: Path) -> Iterator[Event]:
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
            while raw := f.readline(MAX_LINE_BYTES + 1):
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while (more := f.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                        pass  # the rest of a line too long to be an event
                    continue
                if (event := read_event(raw)) is not None:
                    yield event
    except FileNotFoundError:
        return
