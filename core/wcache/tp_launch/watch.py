"""The caller's view of the spawned ranks: each one's result or failure, the deadline, and stopping rank 0.

It waits on the pipes and the process sentinels together, so a rank that dies without reporting (segfault, OOM
kill, `os._exit`) is noticed at once, not at the timeout. After the first failure the others get a moment to
report theirs, so the one that came first can be named (a rank that died silently, else the earliest error, by
the ranks' own clocks): later ones are mostly the other ranks noticing their peer is gone. When rank 0 runs in
the caller, this runs on a thread beside it, stops it when another rank fails or the deadline passes, and stops
the other ranks when the caller is interrupted (Ctrl-C) and rank 0 has not returned after a grace period (it is
waiting in a collective for them, which no signal interrupts).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from wcache.tp_launch.failure import Failure, TensorParallelError, failure_from_report
from wcache.tp_launch.here import Rank0Here
from wcache.tp_launch.spawned import ERROR, JOINING

# How long a rank gets to exit after SIGTERM before it is killed; torch can sit in a gloo call for a while.
TERMINATE_GRACE_S = 5.0
# After a rank exits cleanly, how long its last message may still be in flight through the pipe.
_DRAIN_GRACE_S = 5.0
# After the first failure, how long the other ranks get to report theirs, so the earliest can be named.
_SETTLE_S = 1.0
# After Ctrl-C, how long rank 0 gets to return by itself (a server stops its followers) before they are stopped.
_INTERRUPT_GRACE_S = 5.0


class Watch:
    """Reads one message per spawned rank (after its JOINING); `run` returns when every rank is accounted for."""

    def __init__(self, processes: dict[int, Any], receivers: dict[int, Connection], deadline: float | None,
                 timeout: float | None, here: Rank0Here | None) -> None:
        self.processes, self.receivers, self.here = processes, receivers, here
        self.deadline, self.timeout = deadline, timeout
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.timed_out: TensorParallelError | None = None
        self.interrupted = False  # the caller was interrupted and the other ranks were stopped
        self.crashed: BaseException | None = None  # this watcher's own bug, raised in the caller
        self.closing = False

    def close(self) -> None:
        """From the caller: stop watching (it is about to stop every rank itself)."""
        self.closing = True
        if self.here is not None:
            self.here.wake()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # on a thread nothing else would see it
            self.crashed = exc
        finally:
            if self.here is not None and (self.failures or self.timed_out is not None or self.crashed is not None):
                self.here.stop()

    def _run(self) -> None:
        here, processes, receivers = self.here, self.processes, self.receivers
        pending = {receiver: rank for rank, receiver in receivers.items()}
        sentinels = {process.sentinel: rank for rank, process in processes.items()}
        joined: set[int] = set()
        exited_at: dict[int, float] = {}
        settle_until: float | None = None  # after a first failure, how long the others get to report theirs
        interrupted_at: float | None = None
        rank0_counted = False
        if here is not None and not processes:
            here.joined.set()
        while (pending or (here is not None and here.running)) and not self.closing:
            now = time.monotonic()
            if here is not None and not here.running and not rank0_counted:
                rank0_counted = True
                if here.failure is not None:
                    self.failures.append(here.failure[0])
            if settle_until is not None and now >= settle_until:
                break
            if self.deadline is not None and now >= self.deadline:
                if self.failures:
                    break
                missing = sorted([*([0] if here is not None and here.running else []), *pending.values()])
                names = f"rank {missing[0]}" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing))
                self.timed_out = TensorParallelError(
                    f"tensor-parallel {names} did not finish within {self.timeout:g} s.")
                return
            if interrupted_at is not None and here is not None and here.running \
                    and now - interrupted_at >= _INTERRUPT_GRACE_S:
                for process in processes.values():
                    if process.is_alive():
                        process.terminate()
                self.interrupted = True
                return
            # A rank that exited with status 0 may still have its result in the pipe: read it first, and only
            # call the rank lost when the pipe stays silent for a grace period.
            for rank, when in list(exited_at.items()):
                if rank in pending.values() and now - when > _DRAIN_GRACE_S:
                    self.failures.append(Failure(rank, time.time(), True, "exited without returning a result"))
                    del pending[receivers[rank]]
            watched: list[Any] = list(pending)
            watched += [s for s, rank in sentinels.items() if rank in pending.values() and rank not in exited_at]
            if here is not None:
                watched.append(here.wake_r)
            # Wake at least twice a second to re-check the deadline, the grace periods and the settle window.
            limits = [0.5] + [t - now for t in (self.deadline, settle_until) if t is not None]
            for ready in wait(watched, timeout=max(0.0, min(limits))):
                if here is not None and ready == here.wake_r:
                    if signal.SIGINT in _drain(here.wake_r) and interrupted_at is None:
                        interrupted_at = time.monotonic()
                elif ready in pending:
                    self._read(ready, pending, joined)
                else:
                    rank = sentinels[ready]
                    if rank in self.results or receivers[rank] not in pending:
                        continue  # it already reported; how it exits after that does not matter
                    processes[rank].join(TERMINATE_GRACE_S)  # the sentinel closes a moment before the exit status
                    code = processes[rank].exitcode
                    if code not in (0, None):
                        # Prefer the rank's own error report if it managed to send one before dying.
                        if receivers[rank].poll(0):
                            continue
                        del pending[receivers[rank]]
                        self.failures.append(Failure(rank, time.time(), True,
                                                     f"died without a result (exit code {code})"))
                    else:
                        exited_at[rank] = time.monotonic()
            if here is not None and len(joined) == len(processes):
                here.joined.set()
            if self.failures and settle_until is None:
                settle_until = time.monotonic() + _SETTLE_S
                if here is not None:
                    here.stop()

    def _read(self, ready: Connection, pending: dict[Connection, int], joined: set[int]) -> None:
        """One message from a rank's pipe: it is joining, its result, or its failure."""
        rank = pending[ready]
        try:
            data = ready.recv_bytes()
        except (EOFError, OSError):
            # Closed without a message: the process died; its exit status tells how.
            del pending[ready]
            self.processes[rank].join(TERMINATE_GRACE_S)
            code = self.processes[rank].exitcode
            self.failures.append(Failure(rank, time.time(), True, f"died without a result (exit code {code})"))
            return
        try:
            status, payload, failed_at = pickle.loads(data)
        except Exception as exc:  # e.g. a result class the caller cannot import
            del pending[ready]
            text = f"sent a result that could not be unpickled ({type(exc).__name__}: {exc})"
            self.failures.append(Failure(rank, time.time(), False, text))
            return
        if status == JOINING:
            joined.add(rank)
            return
        del pending[ready]
        if status == ERROR:
            self.failures.append(failure_from_report(rank, failed_at, payload))
        else:
            self.results[rank] = payload


def _drain(fd: int) -> bytes:
    """Everything waiting in the wake pipe: zero bytes from rank 0, signal numbers from Python's wakeup fd."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 512)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk
