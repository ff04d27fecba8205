"""The threads behind a pass's reader: tasks on pools, lanes that run their calls in order, buffers shared by
several tasks, and a bound on the memory their buffers hold. The first error stops them all."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wcache.load.buffers import BufferPool


class Aborted(Exception):
    """A worker failed; the reader stops and the worker's error is raised instead."""


class Hold:
    """A buffer shared by several tasks; `release` runs when the last of them lets go (`Workers.drop`)."""

    __slots__ = ("refs", "release")

    def __init__(self, refs: int, release: Callable[[], None]) -> None:
        self.refs = refs
        self.release = release


class Workers:
    """A pool that hashes, computes and writes behind the reader, and the buffers in use, at most `held_bytes`
    while the reader waits for them (`take`)."""

    def __init__(self, held_bytes: int) -> None:
        self.held_bytes = held_bytes
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.outstanding = 0  # tasks submitted and not finished
        self.held = 0  # bytes of buffers in use
        self.buffers = BufferPool(held_bytes)
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="wcache-fill")

    # -- tasks ---------------------------------------------------------------------------------------------

    def submit(self, call: Callable[..., None], *args: Any, pool: ThreadPoolExecutor | None = None) -> None:
        with self.cond:
            self.outstanding += 1
        (pool or self.pool).submit(self._run, call, args)

    def _run(self, call: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            if self.error is None:
                call(*args)
        except BaseException as exc:  # handed to the reader, which raises it
            with self.cond:
                self.error = self.error or exc
        finally:
            with self.cond:
                self.outstanding -= 1
                self.cond.notify_all()

    def drop(self, hold: Hold) -> None:
        with self.cond:
            hold.refs -= 1
            last = hold.refs == 0
        if last:
            hold.release()

    def wait_idle(self) -> None:
        """Return once every task submitted has finished (or been skipped after an error)."""
        with self.cond:
            while self.outstanding:
                self.cond.wait()

    def close(self) -> None:
        """After `wait_idle`: stop the pool and return the free buffers to the system."""
        self.pool.shutdown()
        self.buffers.clear()

    # -- memory ----------------------------------------------------------------------------------------------

    def take(self, nbytes: int, wait: bool) -> memoryview:
        """A buffer of at least `nbytes`. Only the reader waits (`wait`), and only while workers still run:
        buffers waiting for tensors not read yet free nothing."""
        with self.cond:
            while wait and self.error is None and self.outstanding and self.held + nbytes > self.held_bytes:
                self.cond.wait()
            if self.error is not None and wait:
                raise Aborted
            self.held += nbytes
        return self.buffers.take(nbytes)

    def give(self, buffer: memoryview, nbytes: int) -> None:
        self.buffers.give(buffer)
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


class Lane:
    """Calls run one at a time, in the order given, on `pool` (the workers' own by default): one tensor's hash
    is fed in order."""

    def __init__(self, workers: Workers, pool: ThreadPoolExecutor | None = None) -> None:
        self._workers = workers
        self._pool = pool
        self._queue: deque[Callable[[], None]] = deque()
        self._busy = False

    def submit(self, call: Callable[[], None]) -> None:
        with self._workers.cond:
            self._queue.append(call)
            if self._busy:
                return
            self._busy = True
        self._workers.submit(self._drain, pool=self._pool)

    def _drain(self) -> None:
        while True:
            with self._workers.cond:
                if not self._queue or self._workers.error is not None:
                    self._busy = False
                    return
                call = self._queue.popleft()
            call()
