"""JSON lines a child process writes to its parent about its progress (rank → supervisor → CLI).

Each line is one of the events below: `{"event": EVENT, ...its fields}`. A rank says progress, then ready,
exists or failed; the supervisor sums its ranks' progress and says ready (with every rank's ready) once all
are, or exists or failed for the first that was.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, ClassVar, TextIO

from wcache.ipc.wire.framing import ProtocolError
from wcache.schema import Schema, SchemaError


class StatusEvent(Schema, frozen=True):
    EVENT: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"event": self.EVENT, **self.to_wire()}


class Progress(StatusEvent, frozen=True):
    """Bytes read and hashed so far; a rank's carry its rank (and the file count when it starts)."""

    EVENT: ClassVar[str] = "progress"
    done: int
    total: int
    files: int | None = None
    rank: int | None = None


class RankReady(StatusEvent, frozen=True):
    """One rank serves: its daemon's name, key and socket."""

    EVENT: ClassVar[str] = "ready"
    rank: int
    name: str
    key_id: str
    socket: str
    weights_bytes: int
    load_s: float


class GroupReady(StatusEvent, frozen=True):
    """Every rank of a preload serves; what `wcache preload --json` prints."""

    EVENT: ClassVar[str] = "ready"
    seconds: float
    health_url: str
    ranks: tuple[RankReady, ...]

    def by_rank(self) -> list[RankReady]:
        return sorted(self.ranks, key=lambda r: r.rank)


class Exists(StatusEvent, frozen=True):
    """A daemon already serves (or is loading) this key; nothing more was started. Not a failure."""

    EVENT: ClassVar[str] = "exists"
    reason: str
    rank: int | None = None


class Failed(StatusEvent, frozen=True):
    """Loading failed: the one-sentence reason and the exit code the failure maps to."""

    EVENT: ClassVar[str] = "failed"
    reason: str
    exit_code: int
    rank: int | None = None


# What each reader expects from the process it started.
FROM_RANK: tuple[type[StatusEvent], ...] = (Progress, RankReady, Exists, Failed)
FROM_SUPERVISOR: tuple[type[StatusEvent], ...] = (Progress, GroupReady, Exists, Failed)


class StatusWriter:
    """Writes one JSON object per line and flushes; goes quiet once the reader has gone away."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._closed = False

    def emit(self, event: StatusEvent) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._stream.write(json.dumps(event.to_json()) + "\n")
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                # A detached preload closes its end after READY; the daemon carries on without it.
                self._closed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True


class ProgressReporter:
    """HashProgress that forwards byte counts at most every `interval` seconds."""

    def __init__(self, writer: StatusWriter, interval: float = 0.2, rank: int | None = None) -> None:
        self._writer = writer
        self._interval = interval
        self._rank = rank
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._last = 0.0

    def start(self, total_bytes: int, num_files: int) -> None:
        self._total = total_bytes
        self._writer.emit(Progress(done=0, total=total_bytes, files=num_files, rank=self._rank))

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            now = time.monotonic()
            if now - self._last < self._interval and self._done < self._total:
                return
            self._last = now
            done = self._done
        self._writer.emit(Progress(done=done, total=self._total, rank=self._rank))


def parse_line(line: str, kinds: tuple[type[StatusEvent], ...]) -> StatusEvent | None:
    """The event on `line`, one of `kinds`; None for a line that is no event at all (stray output).

    A line that is an event but not one of `kinds`, or has missing, extra or mistyped fields, raises
    ProtocolError.
    """
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("event"), str):
        return None
    event = value.pop("event")
    for kind in kinds:
        if event == kind.EVENT:
            try:
                return kind.from_wire(value)
            except SchemaError as exc:
                raise ProtocolError(str(exc)) from None
    raise ProtocolError(f"status event {event!r} is not one of {', '.join(k.EVENT for k in kinds)}")
