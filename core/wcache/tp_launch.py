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
  parent unpickles; a rank exits right after sending. The pipe is an anonymous descriptor only the
  parent and that rank hold, so nobody else can put bytes in it. (Spawning on POSIX starts
  multiprocessing's resource-tracker helper once per parent process; it is shared, idle, and exits
  with the parent.)
- **Errors cross as names and text, never as pickled exceptions.** A rank sends the class path of a
  wcache error (and of its wcache bases) with its message; the parent raises the first of those it
  finds among wcache's own error classes, with the same message, so a miss or a bad checkpoint found by
  a rank is the same one sentence and exit code as with `--tp 1`. Anything else (a bug, a dead rank, a timeout) becomes
  one TensorParallelError sentence naming the rank. The rank's traceback rides along as a note (shown
  by `wcache -v`). Unpickling an exception would call its constructor with its args, which breaks for
  errors with extra arguments and would run any class a rank names.
- **The parent waits on the pipes and the process sentinels together**, so a rank that dies without
  reporting (segfault, OOM kill, `os._exit`) is noticed at once, not at the timeout.
- **Any failure stops every rank.** When one rank raises, the others are usually blocked in a collective
  that will never complete; they are terminated, then killed if they ignore SIGTERM, and always reaped,
  so no process is left behind. The failure that came first is the one reported (a rank that died
  silently, else the earliest error, by the ranks' own clocks): later ones are mostly the other ranks
  noticing their peer is gone. A rank reports before it leaves the group, so its report is not beaten
  by the errors its leaving causes. If the parent itself is killed, the kernel SIGTERMs the ranks
  (Linux PR_SET_PDEATHSIG), which matters for servers started with `timeout=None`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wcache.engine.parallel import TensorParallel
from wcache.errors import UnavailableError, WcacheError, marked

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# How long a rank gets to exit after SIGTERM before it is killed; torch can sit in a gloo call for a while.
_TERMINATE_GRACE_S = 5.0
# After a rank exits cleanly, how long its last message may still be in flight through the pipe.
_DRAIN_GRACE_S = 5.0
# After the first failure, how long the other ranks get to report theirs, so the earliest can be named.
_SETTLE_S = 1.0

# "No timeout" for gloo: a finite span, since gloo adds it to the clock in int64 nanoseconds.
_NO_TIMEOUT = timedelta(days=3650)

# linux/prctl.h: deliver a signal to this process when its parent dies.
_PR_SET_PDEATHSIG = 1

_OK = "ok"
_ERROR = "error"


class TensorParallelError(UnavailableError):
    """A rank crashed, died or did not finish in time; every rank was stopped. Its traceback is a note."""


def run_tensor_parallel(
    fn: Callable[[TensorParallel, *Ts], T], tp_size: int, *args: *Ts, timeout: float | None = 300
) -> list[T]:
    """Run `fn(TensorParallel(rank, tp_size), *args)` on `tp_size` CPU processes; results in rank order.

    All ranks are stopped before anything is raised. A rank's WcacheError is raised here as the same class
    with the same message; any other failure, a rank that dies, or ranks that have not all returned within
    `timeout` seconds raise TensorParallelError naming the rank (its traceback is attached as a note).
    `timeout=None` waits for as long as the ranks run (a server); it also lifts the process group's
    per-collective timeout, so ranks may sit idle in a collective (waiting for rank 0's next request).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, not {tp_size}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive (or None for no limit), not {timeout}")
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
                    args=(rank, tp_size, init_method, timeout, sender, os.getpid(), fn, args),
                    name=f"wcache-tp-rank{rank}",
                )
                process.start()
                # The parent's copy of the sending end must go, or a dead rank's pipe never reads as closed.
                sender.close()
                processes.append(process)
                receivers.append(receiver)
            deadline = None if timeout is None else time.monotonic() + timeout
            return _collect(processes, receivers, deadline, timeout)
        finally:
            _stop_all(processes)
            for receiver in receivers:
                receiver.close()


@dataclass(frozen=True, slots=True)
class _Failure:
    rank: int
    at: float  # time.time() when it failed (the rank's own clock reading, or when the parent noticed)
    silent: bool  # died without sending anything: a crash, a kill, os._exit
    text: str  # what happened, to follow "tensor-parallel rank N "
    error_classes: tuple[str, ...] = ()  # a wcache error's class path and its wcache bases', most derived first
    message: str = ""  # that error's own message
    detail: str = ""  # the rank's traceback

    def order(self) -> tuple[bool, float]:
        # A silent death is almost always a cause (a rank whose peer vanished raises, it does not vanish);
        # among raised errors the earliest is the cause, the later ones its echo in the other ranks.
        return (not self.silent, self.at)


def _collect(processes: list[Any], receivers: list[Connection], deadline: float | None,
             timeout: float | None) -> list[Any]:
    """Read one message per rank; raise for the failure that came first, an unexplained exit, or the deadline."""
    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    pending = {receiver: rank for rank, receiver in enumerate(receivers)}
    sentinels = {process.sentinel: rank for rank, process in enumerate(processes)}
    exited_at: dict[int, float] = {}
    settle_until: float | None = None  # after a first failure, how long the others get to report theirs
    while pending:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if deadline is not None and now >= deadline:
            if failures:
                break
            missing = sorted(pending.values())
            names = f"rank {missing[0]}" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing))
            raise TensorParallelError(f"tensor-parallel {names} did not finish within {timeout:g} s.")
        # A rank that exited with status 0 may still have its result in the pipe: read it first, and only
        # call the rank lost when the pipe stays silent for a grace period.
        for rank, when in list(exited_at.items()):
            if rank in pending.values() and now - when > _DRAIN_GRACE_S:
                failures.append(_Failure(rank, time.time(), True, "exited without returning a result"))
                del pending[receivers[rank]]
        watched: list[Any] = list(pending)
        watched += [s for s, rank in sentinels.items() if rank in pending.values() and rank not in exited_at]
        # Wake at least twice a second to re-check the deadline, the grace periods and the settle window.
        limits = [0.5] + [t - now for t in (deadline, settle_until) if t is not None]
        for ready in wait(watched, timeout=max(0.0, min(limits))):
            if ready in pending:
                rank = pending.pop(ready)
                try:
                    data = ready.recv_bytes()
                except (EOFError, OSError):
                    # Closed without a message: the process died; its exit status tells how.
                    processes[rank].join(_TERMINATE_GRACE_S)
                    code = processes[rank].exitcode
                    failures.append(_Failure(rank, time.time(), True, f"died without a result (exit code {code})"))
                    continue
                try:
                    status, payload, failed_at = pickle.loads(data)
                except Exception as exc:  # e.g. a result class the parent cannot import
                    text = f"sent a result that could not be unpickled ({type(exc).__name__}: {exc})"
                    failures.append(_Failure(rank, time.time(), False, text))
                    continue
                if status == _ERROR:
                    failures.append(_failure_from_report(rank, failed_at, payload))
                else:
                    results[rank] = payload
            else:
                rank = sentinels[ready]
                if rank in results or receivers[rank] not in pending:
                    continue  # it already reported; how it exits after that does not matter
                processes[rank].join(_TERMINATE_GRACE_S)  # the sentinel closes a moment before the exit status
                code = processes[rank].exitcode
                if code not in (0, None):
                    # Prefer the rank's own error report if it managed to send one before dying.
                    if receivers[rank].poll(0):
                        continue
                    del pending[receivers[rank]]
                    failures.append(_Failure(rank, time.time(), True, f"died without a result (exit code {code})"))
                else:
                    exited_at[rank] = time.monotonic()
        if failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S
    if failures:
        first = min(failures, key=_Failure.order)
        others = sorted(f.rank for f in failures if f is not first)
        raise _error_for(first, others)
    return [results[rank] for rank in range(len(processes))]


def _error_for(failure: _Failure, others: list[int]) -> WcacheError:
    """The exception the caller sees: the rank's own wcache error class if it had one, else one sentence."""
    also = f" (rank {', '.join(map(str, others))} failed too)" if others else ""
    error: WcacheError | None = None
    for path in failure.error_classes:
        cls = _wcache_error_class(path)
        if cls is not None:
            # Built without calling the class's constructor: some take more than a message (a report, a log).
            error = cls.__new__(cls)
            Exception.__init__(error, failure.message)
            break
    if error is None:
        error = TensorParallelError(f"tensor-parallel rank {failure.rank} {failure.text.rstrip('.')}{also}.")
    if failure.detail:
        error.add_note(f"raised on tensor-parallel rank {failure.rank}{also}:\n{failure.detail.rstrip()}")
    return error


def _wcache_error_class(path: str) -> type[WcacheError] | None:
    """The WcacheError subclass named "module.Class" if it is one of wcache's own; None for anything else."""
    module_name, _, name = path.rpartition(".")
    if module_name != "wcache" and not module_name.startswith("wcache."):
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    cls = getattr(module, name, None)
    if isinstance(cls, type) and issubclass(cls, WcacheError) and cls.__module__ == module_name:
        return cls
    return None


def _failure_from_report(rank: int, at: float, report: Any) -> _Failure:
    """A rank's error report (see _describe) as a failure; a report of another shape is itself the failure."""
    if not isinstance(report, dict):
        return _Failure(rank, at, False, f"sent an error report the launcher cannot read: {report!r}"[:500])
    classes = report.get("error_classes", ())
    text = str(report.get("summary", "failed"))
    return _Failure(rank, at, False, f"failed: {text}", tuple(str(c) for c in classes),
                    str(report.get("message", "")), str(report.get("traceback", "")))


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


def _rank_main(rank: int, size: int, init_method: str, timeout: float | None, sender: Connection,
               parent_pid: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One rank's process: join the group, run `fn`, send back (status, payload), leave the group."""
    _die_with_parent(parent_pid)
    # Single-host by construction, so keep gloo on loopback instead of whatever the hostname resolves to.
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # N ranks each using every core would oversubscribe the CPU; split the cores between them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        message: tuple[str, Any, float | None]
        try:
            # A collective may not outlive the whole run: a rank whose peer died fails instead of hanging.
            group_timeout = _NO_TIMEOUT if timeout is None else timedelta(seconds=timeout)
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                    timeout=group_timeout)
        except BaseException as exc:
            _send(sender, (_ERROR, _describe(exc), time.time()))
            return
        try:
            message = (_OK, fn(TensorParallel(rank, size), *args), None)
        except BaseException as exc:
            message = (_ERROR, _describe(exc), time.time())
        # Report before leaving the group: leaving closes this rank's connections, which makes the other
        # ranks fail too, and their errors should not overtake the one that explains them.
        _send(sender, message)
        with contextlib.suppress(Exception):  # the report is out; a teardown hiccup changes nothing now
            dist.destroy_process_group()
    finally:
        sender.close()


def _describe(exc: BaseException) -> dict[str, Any]:
    """A rank's error as plain strings: the parent rebuilds wcache errors by class name, never by unpickling."""
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__
               if isinstance(c, type) and issubclass(c, WcacheError)]
    message = marked(exc)  # options still marked: the caller words them for its user
    lines = message.strip().splitlines()
    summary = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return {"error_classes": classes, "message": message, "summary": summary,
            "traceback": traceback.format_exc()}


def _send(sender: Connection, message: tuple[str, Any, float | None]) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as exc:
        report = {"summary": f"its result could not be pickled ({type(exc).__name__}: {exc})"}
        data = pickle.dumps((_ERROR, report, time.time()))
    sender.send_bytes(data)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGTERM this rank if the parent dies (even by SIGKILL), so no rank is orphaned.

    The parent's `finally` covers exceptions and Ctrl-C, but not a parent that is killed outright; a
    server launched with `timeout=None` would then run on unowned. Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os.kill(os.getpid(), signal.SIGTERM)
