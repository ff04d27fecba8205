"""`run_tensor_parallel`: the one entry for running a function on N tensor-parallel CPU ranks (package docstring)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import torch.multiprocessing as mp

from wcache.engine.parallel import TensorParallel
from wcache.errors import WcacheError
from wcache.tp_launch.failure import TensorParallelError, also_failed, error_for, first_failure
from wcache.tp_launch.here import Rank0Here, RankStopped, run_here
from wcache.tp_launch.spawned import rank_main
from wcache.tp_launch.watch import TERMINATE_GRACE_S, Watch

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def run_tensor_parallel(fn: Callable[[TensorParallel, *Ts], T], tp_size: int, *args: *Ts,
                        timeout: float | None = None, isolate_rank0: bool = False) -> list[T]:
    """Run `fn(TensorParallel(rank, tp_size), *args)` on `tp_size` CPU ranks; the results in rank order.

    Rank 0 runs in this process (its main thread), the others are spawned; TP 1 spawns nothing. With
    `isolate_rank0`, rank 0 is spawned too: for a caller that must not run it itself (it calls from another
    thread, or the rank must be a process of its own). All ranks are stopped before anything is raised. A rank's
    WcacheError is raised here as the same class with the same message; any other failure, a rank that dies, or
    ranks that have not all returned within `timeout` seconds raise TensorParallelError naming the rank (its
    traceback is attached as a note). `timeout=None` waits for as long as the ranks run (a server); it also
    lifts the process group's per-collective timeout, so ranks may sit idle in a collective (waiting for rank
    0's next request).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, not {tp_size}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive (or None for no limit), not {timeout}")
    if not isolate_rank0:
        if tp_size == 1 and timeout is None:
            return [fn(TensorParallel(), *args)]  # nothing to spawn, group or watch
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("rank 0 can run in the caller only on its main thread, where a signal can stop it; "
                             "pass isolate_rank0=True to spawn it too")
    here = None if isolate_rank0 else Rank0Here()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="wcache-tp-") as rendezvous_dir:
        init_method = Path(rendezvous_dir, "rendezvous").as_uri()
        processes: dict[int, Any] = {}
        receivers: dict[int, Connection] = {}
        watcher: threading.Thread | None = None
        watch: Watch | None = None
        try:
            for rank in range(0 if here is None else 1, tp_size):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=rank_main,
                    args=(rank, tp_size, init_method, timeout, sender, os.getpid(), fn, args),
                    name=f"wcache-tp-rank{rank}",
                )
                process.start()
                # The caller's copy of the sending end must go, or a dead rank's pipe never reads as closed.
                sender.close()
                processes[rank] = process
                receivers[rank] = receiver
            deadline = None if timeout is None else time.monotonic() + timeout
            watch = Watch(processes, receivers, deadline, timeout, here)
            if here is None:
                watch.run()
                return _outcome(watch, None, [watch.results.get(rank) for rank in range(tp_size)])
            watcher = threading.Thread(target=watch.run, name="wcache-tp-watch", daemon=True)
            watcher.start()
            value = _rank0(fn, tp_size, init_method, timeout, args, here, watcher)
            return _outcome(watch, here, [value, *(watch.results.get(rank) for rank in range(1, tp_size))])
        finally:
            if watch is not None:
                watch.close()
            if watcher is not None:
                watcher.join()
            _stop_all(list(processes.values()))
            for receiver in receivers.values():
                receiver.close()
            if here is not None:
                here.close()


def _rank0(fn: Callable[..., Any], tp_size: int, init_method: str, timeout: float | None, args: tuple[Any, ...],
           here: Rank0Here, watcher: threading.Thread) -> Any:
    """Rank 0's result (None when it failed or was stopped: the watch knows why), once the others are done."""
    # Ctrl-C's signal number reaches the watcher even while rank 0 waits in a collective.
    previous_fd = signal.set_wakeup_fd(here.wake_w, warn_on_full_buffer=False)
    try:
        try:
            value = run_here(fn, tp_size, init_method, timeout, args, here)
        except (RankStopped, Exception):
            value = None
        watcher.join()
        return value
    finally:
        signal.set_wakeup_fd(previous_fd)


def _outcome(watch: Watch, here: Rank0Here | None, results: list[Any]) -> list[Any]:
    """The ranks' results in rank order, or the error the caller sees."""
    if watch.crashed is not None:
        raise watch.crashed
    if watch.interrupted:
        raise KeyboardInterrupt
    if watch.timed_out is not None:
        raise watch.timed_out
    if watch.failures:
        first, others = first_failure(watch.failures)
        if here is not None and here.failure is not None and first is here.failure[0]:
            exc = here.failure[1]
            if isinstance(exc, WcacheError):
                if others:
                    exc.add_note(f"raised on tensor-parallel rank 0{also_failed(others)}")
                raise exc
            raise error_for(first, others) from exc
        raise error_for(first, others)
    if here is not None and here.stopped:
        raise TensorParallelError("tensor-parallel rank 0 was stopped without a cause.")
    return results


def _stop_all(processes: list[Any]) -> None:
    """Terminate, then kill, then reap every rank still running; a no-op for ranks that already exited."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
        process.close()
