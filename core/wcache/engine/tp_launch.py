"""Run one function on N tensor-parallel CPU ranks, each in its own process, joined by a gloo group.

`run_tensor_parallel(fn, tp_size, *args)` is what `wcache verify` and `wcache attach --serve` use for
`--tp > 1` on a single host, and what the TP tests use: every rank runs `fn(TensorParallel(rank, size),
*args)` and the caller gets the ranks' return values in rank order.

Design choices, and why:

- **spawn, never fork.** A forked child inherits the parent's torch thread pools, locks held by other
  threads, and any process group; spawn starts clean interpreters, which is also what CUDA would need.
  So `fn`, `args` and the results must be picklable (a module-level function, not a lambda).
- **A file:// rendezvous in a fresh temporary directory** rather than a TCP port picked in advance: a
  port found free now can be taken by someone else before rank 0 binds it; a new file cannot collide.
- **One pipe per rank, results pickled to bytes by the plain pickler.** torch.multiprocessing's own
  pickler would pass tensors by shared-memory handle, which needs the sending process alive while the
  parent unpickles; a rank exits right after sending. (Spawning on POSIX starts multiprocessing's
  resource-tracker helper once per parent process; it is shared, idle, and exits with the parent.)
- **The parent waits on the pipes and the process sentinels together**, so a rank that dies without
  reporting (segfault, OOM kill, `os._exit`) is noticed at once, not at the timeout.
- **Any failure stops every rank.** When one rank raises, the others are usually blocked in a collective
  that will never complete; they are terminated, then killed if they ignore SIGTERM, and always reaped,
  so no process is left behind. The first failure is the one reported: later ones are mostly the other
  ranks noticing their peer is gone.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wcache.engine.parallel import TensorParallel

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# How long a rank gets to exit after SIGTERM before it is killed; torch can sit in a gloo call for a while.
_TERMINATE_GRACE_S = 5.0
# After a rank exits cleanly, how long its last message may still be in flight through the pipe.
_DRAIN_GRACE_S = 5.0

_OK = "ok"
_ERROR = "error"


def run_tensor_parallel(
    fn: Callable[[TensorParallel, *Ts], T], tp_size: int, *args: *Ts, timeout: float = 300
) -> list[T]:
    """Run `fn(TensorParallel(rank, tp_size), *args)` on `tp_size` CPU processes; results in rank order.

    Raises RuntimeError naming the rank and its error (with the rank's traceback) when any rank raises,
    dies, or when not every rank has returned within `timeout` seconds; all ranks are stopped first.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, not {tp_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="wcache-tp-") as rendezvous_dir:
        init_method = Path(rendezvous_dir, "rendezvous").as_uri()
        processes: list[Any] = []
        receivers: list[Connection] = []
        try:
            for rank in range(tp_size):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=_rank_main,
                    args=(rank, tp_size, init_method, timeout, sender, fn, args),
                    name=f"wcache-tp-rank{rank}",
                )
                process.start()
                # The parent's copy of the sending end must go, or a dead rank's pipe never reads as closed.
                sender.close()
                processes.append(process)
                receivers.append(receiver)
            return _collect(processes, receivers, time.monotonic() + timeout, timeout)
        finally:
            _stop_all(processes)
            for receiver in receivers:
                receiver.close()


def _collect(processes: list[Any], receivers: list[Connection], deadline: float, timeout: float) -> list[Any]:
    """Read one message per rank; raise on the first error, unexplained exit, or the deadline."""
    results: dict[int, Any] = {}
    pending = {receiver: rank for rank, receiver in enumerate(receivers)}
    sentinels = {process.sentinel: rank for rank, process in enumerate(processes)}
    exited_at: dict[int, float] = {}
    while pending:
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(pending.values())
            names = f"rank {missing[0]}" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing))
            raise RuntimeError(f"tensor-parallel {names} did not finish within {timeout:g} s")
        # A rank that exited with status 0 may still have its result in the pipe: read it first, and only
        # call the rank lost when the pipe stays silent for a grace period.
        for rank, when in exited_at.items():
            if rank in pending.values() and now - when > _DRAIN_GRACE_S:
                raise RuntimeError(f"tensor-parallel rank {rank} exited without returning a result")
        watched: list[Any] = list(pending)
        watched += [s for s, rank in sentinels.items() if rank in pending.values() and rank not in exited_at]
        for ready in wait(watched, timeout=min(deadline - now, 0.5)):
            if ready in pending:
                rank = pending[ready]
                try:
                    status, payload = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    # Closed without a message: the process died; its sentinel tells how.
                    del pending[ready]
                    processes[rank].join(_TERMINATE_GRACE_S)
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} died without a result (exit code {processes[rank].exitcode})"
                    ) from None
                del pending[ready]
                if status == _ERROR:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed: {payload}")
                results[rank] = payload
            else:
                rank = sentinels[ready]
                processes[rank].join(_TERMINATE_GRACE_S)  # the sentinel closes a moment before the exit status
                code = processes[rank].exitcode
                if code not in (0, None):
                    # Prefer the rank's own error report if it managed to send one before dying.
                    receiver = receivers[rank]
                    if receiver in pending and receiver.poll(0):
                        continue
                    raise RuntimeError(f"tensor-parallel rank {rank} died without a result (exit code {code})")
                exited_at[rank] = time.monotonic()
    return [results[rank] for rank in range(len(processes))]


def _stop_all(processes: list[Any]) -> None:
    """Terminate, then kill, then reap every rank still running; a no-op for ranks that already exited."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
        process.close()


def _rank_main(rank: int, size: int, init_method: str, timeout: float, sender: Connection,
               fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One rank's process: join the group, run `fn`, send back (status, payload), leave the group."""
    # Single-host by construction, so keep gloo on loopback instead of whatever the hostname resolves to.
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # N ranks each using every core would oversubscribe the CPU; split the cores between them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                    timeout=timedelta(seconds=timeout))
            try:
                message = (_OK, fn(TensorParallel(rank, size), *args))
            finally:
                dist.destroy_process_group()
        except BaseException as exc:
            message = (_ERROR, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            data = pickle.dumps(message)
        except Exception as exc:
            data = pickle.dumps((_ERROR, f"its result could not be pickled ({type(exc).__name__}: {exc})"))
        sender.send_bytes(data)
    finally:
        sender.close()
