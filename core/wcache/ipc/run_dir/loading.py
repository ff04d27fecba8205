"""Daemons that are still loading: one small JSON file per rank process, so `status` and `top` can list them.

A rank writes `<run dir>/loading/<pid>.json` when it starts, rewrites it (atomically, at most every
`UPDATE_INTERVAL_S`) as bytes are read, hashed and processed, and removes it once it publishes its descriptor
or exits. Beside it the rank holds a lock on `<pid>.lock` for as long as it runs; a record whose lock nobody
holds is stale and removed by the next reader. The lock, not the pid, says whether the rank lives: a reader
in another pid namespace (a container sharing the run dir) does not see the pid, or sees another process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec

from wcache.canonical import INT64_BITS
from wcache.ipc.run_dir.directory import Pid, lock_taken_if_free, read_run_file, run_subdir, still_at
from wcache.ipc.run_dir.paths import RunPaths
from wcache.schema import Schema

log = logging.getLogger("wcache")

UPDATE_INTERVAL_S = 0.5
MAX_RECORD_BYTES = 64 * 1024
# msgspec bounds an integer within int64; a count past it is no count a rank wrote.
MAX_COUNT = (1 << (INT64_BITS - 1)) - 1


# Bounded as well as typed: the numbers go into arithmetic, psutil and the tables, where an unbounded one (a
# 400-digit pid_created, a null start) would fail far from here.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_COUNT)]  # a time.time() value


class LoadingRecord(Schema, frozen=True):
    """What a rank that is not ready yet says about itself; `from_wire` refuses what no rank would have written."""

    pid: Pid
    pid_created: Seconds
    source: str
    device: str
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    tp_rank: Count
    supervisor_pid: Pid | None
    started: Seconds  # time.time() when the rank began
    phase: str  # starting, loading (reading, hashing and processing), publishing
    done_bytes: Count = 0
    total_bytes: Count = 0
    name: str | None = None  # known once the key is

    @property
    def fraction(self) -> float | None:
        return self.done_bytes / self.total_bytes if self.total_bytes else None


def _record_path(run_dir: Path, pid: int) -> Path:
    return RunPaths(run_dir).loading_record(pid)


def record_lock_path(run_dir: Path, pid: int) -> Path:
    return RunPaths(run_dir).loading_lock(pid)


def hold_record_lock(path: Path) -> int:
    """Lock `path` for this process's life; a reader that found it stale may unlink it meanwhile: lock anew."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a reader checks it, microseconds
        if still_at(fd, path):
            return fd
        os.close(fd)


class LoadingBoard:
    """One rank's record, kept current; also a HashProgress, so the loader's byte counts move it."""

    def __init__(self, run_dir: Path, record: LoadingRecord) -> None:
        self._path = _record_path(run_dir, record.pid)
        with contextlib.suppress(OSError):  # what is there instead is refused just below
            self._path.parent.mkdir(mode=0o700, exist_ok=True)
        # A symlink planted as loading/ is never written through (run_subdir warned once); the load goes on.
        self._visible = run_subdir(run_dir, RunPaths.LOADING) is not None
        self._lock_path = record_lock_path(run_dir, record.pid)
        # Before the record: readers trust a record whose lock is held.
        self._lock_fd: int | None = hold_record_lock(self._lock_path) if self._visible else None
        self._record = record
        self._lock = threading.Lock()
        self._written = 0.0
        self._write(force=True)

    def start(self, total_bytes: int, num_files: int) -> None:
        self.update(phase="loading", total_bytes=total_bytes)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._record = msgspec.structs.replace(self._record, done_bytes=self._record.done_bytes + nbytes)
        self._write()

    def update(self, **changes: Any) -> None:
        with self._lock:
            self._record = msgspec.structs.replace(self._record, **changes)
        self._write(force=True)

    def remove(self) -> None:
        if not self._visible:
            return
        for path in (self._path, self._lock_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _write(self, *, force: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not self._visible or (not force and now - self._written < UPDATE_INTERVAL_S):
                return
            self._written = now
            temporary = self._path.with_suffix(".tmp")
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(self._record.to_wire(), f)
                temporary.replace(self._path)
            except OSError as exc:
                # Visibility is a courtesy: a full or read-only run dir must not fail the load itself.
                log.debug("cannot write the loading record %s (%s)", self._path, exc)


def read_loading(run_dir: Path) -> list[LoadingRecord]:
    """The records of ranks still loading, by pid; stale and unreadable records are removed or skipped."""
    where = run_subdir(run_dir, RunPaths.LOADING)
    if where is None:
        return []
    found = []
    for path in sorted(where.glob("*.json")):
        try:
            record = _read_record(path)
        except FileNotFoundError:
            continue  # the rank became ready while we listed
        except (OSError, ValueError) as exc:
            log.warning("Ignoring unreadable loading record %s (%s).", path, getattr(exc, "strerror", None) or exc)
            continue
        lock = record_lock_path(run_dir, record.pid)
        with lock_taken_if_free(lock) as free:
            if free:  # removed while we hold the lock, so a rank reusing the pid locks a file of its own
                for stale in (path, lock):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
                continue
        found.append(record)
    return found


def forget_dead_rank(run_dir: Path, pid: int) -> str | None:
    """Remove the record of rank `pid` if it died loading (its lock is free); the daemon name it had taken."""
    if run_subdir(run_dir, RunPaths.LOADING) is None:
        return None
    path = _record_path(run_dir, pid)
    with lock_taken_if_free(record_lock_path(run_dir, pid)) as free:
        if not free:
            return None
        name = None
        with contextlib.suppress(OSError, ValueError):
            name = _read_record(path).name
        for stale in (path, record_lock_path(run_dir, pid)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        return name


def _read_record(path: Path) -> LoadingRecord:
    return LoadingRecord.from_wire(read_run_file(path, MAX_RECORD_BYTES))
