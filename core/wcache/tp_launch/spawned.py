"""A spawned rank's process: say it is joining, join the gloo group, run the function, report, leave.

What a rank sends its one pipe, each message pickled to bytes by the plain pickler as (status, payload, time):
JOINING right before it joins the group (a rank 0 that runs in the caller waits for every rank's, so that it
never sits in the group's rendezvous, which no signal interrupts, for a rank that died before joining), then
OK with its result or ERROR with `failure.describe`'s report. torch.multiprocessing's own pickler would pass
tensors by shared-memory handle, which needs the sending process alive while the caller unpickles; a rank exits
right after sending.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from wcache.engine.parallel import TensorParallel
from wcache.tp_launch.failure import describe

JOINING, OK, ERROR = "joining", "ok", "error"

# "No timeout" for gloo: a finite span, since gloo adds it to the clock in int64 nanoseconds.
_NO_TIMEOUT = timedelta(days=3650)

# linux/prctl.h: deliver a signal to this process when its parent dies.
_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def rank_setting(size: int) -> Iterator[None]:
    """This process set up as one of `size` ranks on one host, and put back as it was after."""
    # Single-host by construction, so keep gloo on loopback instead of whatever the hostname resolves to.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname is None and sys.platform.startswith("linux"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # N ranks each using every core would oversubscribe the CPU; split the cores between them.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if ifname is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def join_group(rank: int, size: int, init_method: str, timeout: float | None) -> None:
    # A collective may not outlive the whole run: a rank whose peer died fails instead of hanging.
    group_timeout = _NO_TIMEOUT if timeout is None else timedelta(seconds=timeout)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=group_timeout)
    except BaseException:
        # A failed join leaves torch's count of groups raised (it is put back only when a group is destroyed),
        # and the next group this process made would be named unlike its peers': they would never meet.
        if dist.is_initialized():
            leave_group()
        else:
            distributed_c10d._world.group_count = 0
        raise


def leave_group() -> None:
    with contextlib.suppress(Exception):  # the report is out; a teardown hiccup changes nothing now
        dist.destroy_process_group()


def rank_main(rank: int, size: int, init_method: str, timeout: float | None, sender: Connection,
              parent_pid: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One spawned rank: join the group, run `fn`, send back (status, payload, failed at), leave the group."""
    _die_with_parent(parent_pid)
    # The caller owns interruption: Ctrl-C reaches it, and it stops this rank (or rank 0 tells it to stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with rank_setting(size):
            message: tuple[str, Any, float | None]
            try:
                _send(sender, (JOINING, None, None))
                join_group(rank, size, init_method, timeout)
            except BaseException as exc:
                _send(sender, (ERROR, describe(exc), time.time()))
                return
            try:
                message = (OK, fn(TensorParallel(rank, size), *args), None)
            except BaseException as exc:
                message = (ERROR, describe(exc), time.time())
            # Report before leaving the group: leaving closes this rank's connections, which makes the other
            # ranks fail too, and their errors should not overtake the one that explains them.
            _send(sender, message)
            leave_group()
    finally:
        sender.close()


def _send(sender: Connection, message: tuple[str, Any, float | None]) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as exc:
        report = {"summary": f"its result could not be pickled ({type(exc).__name__}: {exc})"}
        data = pickle.dumps((ERROR, report, time.time()))
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
