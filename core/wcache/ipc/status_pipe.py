"""JSON lines a child process writes to its parent about its progress (rank → supervisor → CLI)."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO


class StatusWriter:
    """Writes one JSON object per line and flushes; goes quiet once the reader has gone away."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._closed = False

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._stream.write(json.dumps({"event": event, **fields}) + "\n")
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                # A detached preload closes its end after READY; the daemon carries on without it.
                self._closed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True


class ProgressReporter:
    """HashProgress that forwards byte counts at most every `interval` seconds."""

    def __init__(self, writer: StatusWriter, interval: float = 0.2, **labels: Any) -> None:
        self._writer = writer
        self._interval = interval
        self._labels = labels
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._last = 0.0

    def start(self, total_bytes: int, num_files: int) -> None:
        self._total = total_bytes
        self._writer.emit("progress", done=0, total=total_bytes, files=num_files, **self._labels)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            now = time.monotonic()
            if now - self._last < self._interval and self._done < self._total:
                return
            self._last = now
            done = self._done
        self._writer.emit("progress", done=done, total=self._total, **self._labels)


def parse_line(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("event"), str) else None
