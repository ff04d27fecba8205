"""Rank 0 run in the calling process, stoppable by the thread that watches the other ranks.

The watcher stops rank 0 with a signal of its own (SIGUSR2, handled only while rank 0 runs) whose handler raises
RankStopped, so a rank 0 sleeping, computing or waiting in a system call returns at once, and its stop is never
mistaken for the user's Ctrl-C. The handler raises only while rank 0 still runs: a signal that arrives after
rank 0 finished (the watcher decided a moment too late) does nothing, so it cannot break the teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from wcache.engine.parallel import TensorParallel
from wcache.tp_launch.failure import Failure, describe, failure_from_report
from wcache.tp_launch.spawned import join_group, leave_group, rank_setting

STOP_SIGNAL = signal.SIGUSR2


class RankStopped(BaseException):
    """Raised in rank 0 when another rank failed or the deadline passed: an echo, never the error reported."""


class Rank0Here:
    """What rank 0, running in the caller's main thread, and the thread watching the other ranks share."""

    def __init__(self) -> None:
        self.running = True  # set False by rank 0 (the main thread) the moment it is done
        self.stopped = False  # the watcher has sent its stop
        self.failure: tuple[Failure, BaseException] | None = None  # rank 0's own error, recorded before it left
        self.joined = threading.Event()  # every other rank is about to join the group
        # Wakes the watcher: a zero byte from rank 0, and the signal numbers Python's wakeup fd writes.
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self._main = threading.main_thread().ident

    def stop(self) -> None:
        """From the watcher: have rank 0 raise RankStopped, once, if it is still running."""
        if self.running and not self.stopped and self._main is not None:
            self.stopped = True
            signal.pthread_kill(self._main, STOP_SIGNAL)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the watcher all the same
            os.write(self.wake_w, b"\0")

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.running:
            raise RankStopped


def run_here(fn: Callable[..., Any], size: int, init_method: str, timeout: float | None,
             args: tuple[Any, ...], state: Rank0Here) -> Any:
    """Rank 0 in this process: wait until the other ranks join, join with them, run `fn`, leave the group
    (so a caller may run ranks again), and put back the threads and signal handler it changed."""
    previous = signal.signal(STOP_SIGNAL, state._on_stop)
    try:
        with contextlib.ExitStack() as stack:
            try:
                try:
                    if size > 1:
                        stack.enter_context(rank_setting(size))
                        # Waited for here, where a signal stops the wait: the group's rendezvous cannot be.
                        while not state.joined.wait(0.2):
                            pass
                        # Left however this ends, even if the stop signal lands the moment the group is joined.
                        stack.callback(leave_group)
                        join_group(0, size, init_method, timeout)
                    return fn(TensorParallel(0, size), *args)
                finally:
                    state.running = False
            except RankStopped:
                raise
            except BaseException as exc:
                # Recorded before leaving the group, as a spawned rank reports before it leaves: the errors
                # leaving causes in the other ranks come later.
                state.failure = (failure_from_report(0, time.time(), describe(exc)), exc)
                raise
    finally:
        signal.signal(STOP_SIGNAL, previous)
        state.wake()
