"""Stopping daemons and ranks still loading: through their socket and their lock, never a pid that may name
another process (`wcache stop`, `DaemonGroup.stop`, a replace).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from wcache.errors import (
    BadInputError,
    UnavailableError,
    option,
)
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    lock_held,
    lock_path,
    process_created,
    process_exited,
    read_descriptors,
)
from wcache.ipc.run_dir.loading import LoadingRecord, record_lock_path
from wcache.ipc.wire.client import DaemonError, request_once
from wcache.ipc.wire.messages import Shutdown, Stats

STOP_TIMEOUT_S = 15.0

log = logging.getLogger("wcache.daemon")


def stop_daemon(descriptor: DaemonDescriptor, *, force: bool = False) -> int:
    """Ask a daemon to stop and wait until it has; returns the lease count when it refused (else 0).

    Through its socket and its lock, never its pid: the daemon may run in another pid namespace."""
    try:
        reply = request_once(descriptor.socket, Shutdown(force=force))
    except DaemonError as exc:
        # Already stopping (its socket goes first), asked by someone else or by its supervisor, or hung: one that
        # runs in this pid namespace is also sent SIGTERM (which a stopping daemon takes as the same request);
        # one in another is waited out.
        if _same_process(descriptor.pid, descriptor.pid_created):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(descriptor.pid, signal.SIGTERM)
        try:
            wait_exit(daemon_lock(descriptor), descriptor.name)
        except UnavailableError:
            raise UnavailableError(f"daemon {descriptor.name} did not answer ({exc})") from None
        _wait_process_gone(descriptor)
        return 0
    if not reply.stopping:
        return reply.leases or 1
    wait_exit(daemon_lock(descriptor), descriptor.name)
    _wait_process_gone(descriptor)
    return 0


def stop_daemons(
    targets: Sequence[DaemonDescriptor], *, force: bool = False, on_stopped: Callable[[str], None] | None = None
) -> None:
    """Stop `targets`, each waited for; `on_stopped(name)` after each.

    Leases are checked on every target first, so a refusal (BadInputError, unless `force`) never leaves part
    of a group stopped.
    """
    held = {} if force else {d.name: n for d in targets if (n := lease_count(d))}
    if held:
        busy = ", ".join(f"{name} ({n} lease(s))" for name, n in held.items())
        raise BadInputError(f"engines still hold leases on {busy}; detach them first or use {option('force', True)}.")
    refused = []
    for descriptor in targets:
        try:
            leases = stop_daemon(descriptor, force=force)
        except UnavailableError:
            if descriptor.tp_size == 1:
                raise
            # Its supervisor is already stopping it with the rest of its group: that is what we asked for.
            wait_exit(daemon_lock(descriptor), descriptor.name)
            leases = 0
        if leases:
            refused.append(f"{descriptor.name} ({leases} lease(s))")
        elif on_stopped is not None:
            on_stopped(descriptor.name)
    if refused:
        raise BadInputError(f"engines still hold leases on {', '.join(refused)}; detach them first or use "
                            f"{option('force', True)}.")


def daemon_lock(descriptor: DaemonDescriptor) -> Path:
    """The lock the daemon holds while it runs, beside the socket it published (both in its run dir)."""
    return lock_path(Path(descriptor.socket).parent, descriptor.name)


def stop_loading(run_dir: Path, record: LoadingRecord) -> None:
    """Stop a rank that is still loading and wait until it has; it removes its own files on the way out.

    No socket yet, so the pid (checked against the start time it recorded) is the only handle: a rank whose
    lock is held but whose pid is not that process here runs in another pid namespace, and UnavailableError
    says so without signalling anyone."""
    name = record.name or f"pid {record.pid}"
    if not _same_process(record.pid, record.pid_created):
        if not lock_held(record_lock_path(run_dir, record.pid)):
            return  # it finished or died meanwhile
        what = f"daemon {record.name}" if record.name else "a rank"
        raise UnavailableError(f"{what} is loading in another pid namespace (pid {record.pid} there), so it cannot "
                               "be signalled from here; stop it where it runs, or here once it is ready.")
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    wait_exit(record_lock_path(run_dir, record.pid), name)


def _same_process(pid: int, pid_created: float) -> bool:
    """Whether `pid` here is the process that recorded `pid_created`: only then may it be signalled (in another
    pid namespace the number names no process, or another one)."""
    created = process_created(pid)
    return created is not None and abs(created - pid_created) < 0.01


def wait_exit(lock: Path, name: str) -> None:
    """Wait until the process holding `lock` (daemon or rank `name`) has exited; UnavailableError when it does
    not in time. The lock is released by the kernel when the process is gone, in whatever pid namespace."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while lock_held(lock):
        if time.monotonic() >= deadline:
            raise UnavailableError(f"daemon {name} did not exit within {STOP_TIMEOUT_S:g} s of being asked to stop.")
        time.sleep(0.05)


def _wait_process_gone(descriptor: DaemonDescriptor) -> None:
    """Once a daemon's lock is released, wait for its process too where that was the last version it served
    and it runs in this pid namespace: `stopped` then means gone, not only no longer serving (the process still
    unmaps and tears down after its lock)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _same_process(descriptor.pid, descriptor.pid_created) and not process_exited(descriptor.pid):
        if _serves_another(descriptor):
            return  # a version built in its process serves on: the process stays, and rightly so
        if time.monotonic() >= deadline:
            # Stopped all the same (its weights are released): a large version pool may take this long to close.
            log.warning("daemon %s stopped serving; its process (pid %d) is still exiting after %g s.",
                        descriptor.name, descriptor.pid, STOP_TIMEOUT_S)
            return
        time.sleep(0.05)


def _serves_another(descriptor: DaemonDescriptor) -> bool:
    run_dir = Path(descriptor.socket).parent
    return any(d.name != descriptor.name and d.pid == descriptor.pid and d.pid_created == descriptor.pid_created
               for d in read_descriptors(run_dir))


def lease_count(descriptor: DaemonDescriptor) -> int:
    """Zero-copy engines holding a daemon's weights now; 0 when it cannot be asked (stopping it will say why)."""
    try:
        return request_once(descriptor.socket, Stats()).leases
    except DaemonError:
        return 0


def terminate_started(pid: int, marker: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM a process this program started (checked by `marker` in its command line, so a reused pid is
    left alone), and SIGKILL it if it has not exited within `timeout_s`."""
    try:
        process = psutil.Process(pid)
        if marker not in " ".join(process.cmdline()):
            return
        process.send_signal(signal.SIGTERM)
        process.wait(timeout_s)
    except psutil.TimeoutExpired:
        process.kill()
    except psutil.Error:
        pass
