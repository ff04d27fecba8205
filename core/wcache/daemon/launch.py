"""Starting and stopping daemons from Python: what `wcache preload` and `wcache stop` do, for any caller.

    from wcache import start_daemons
    group = start_daemons("Qwen/Qwen3-0.6B", tp=2)   # returns once every rank is ready
    ...
    group.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from wcache.daemon.argv import LoadArgs
from wcache.errors import EXIT_UNAVAILABLE, BadInputError, UnavailableError, WcacheError
from wcache.ipc.client import DaemonError, request_once
from wcache.ipc.loading import LoadingRecord, read_loading
from wcache.ipc.messages import Shutdown, Stats
from wcache.ipc.protocol import ProtocolError
from wcache.ipc.rundir import (
    DaemonDescriptor,
    DaemonExistsError,
    census,
    default_run_dir,
    ensure_run_dir,
    matches,
    process_created,
    read_descriptors,
)
from wcache.ipc.status_pipe import FROM_SUPERVISOR, Exists, Failed, GroupReady, Progress, parse_line

STOP_TIMEOUT_S = 15.0

# done, total bytes read and hashed so far, as the ranks report them.
ProgressCallback = Callable[[int, int], None]


class PreloadFailedError(WcacheError):
    """A rank failed to load; the others were stopped."""


@dataclass
class DaemonGroup:
    """The ranks one preload started: their supervisor, the READY message, and where they publish."""

    model: Path  # the checkpoint as resolved (a Hugging Face id becomes its cached snapshot)
    supervisor: subprocess.Popen[str]
    ready: GroupReady
    run_dir: Path

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.ready.by_rank()]

    def descriptors(self) -> list[DaemonDescriptor]:
        by_name = {d.name: d for d in read_descriptors(self.run_dir)}
        return [by_name[name] for name in self.names if name in by_name]

    def detach(self) -> None:
        """Leave the daemons running on their own (the supervisor no longer reports to us)."""
        if self.supervisor.stdout is not None:
            self.supervisor.stdout.close()

    def stop(self, *, force: bool = False) -> None:
        """Stop every rank (BadInputError, nothing stopped, while zero-copy engines hold leases, unless `force`)
        and the supervisor; a TP group's supervisor stops its other ranks once the first one stops."""
        stop_daemons(self.descriptors(), force=force)
        self.supervisor.wait(timeout=STOP_TIMEOUT_S * 2)
        self.detach()

    def terminate(self) -> None:
        """Stop the group through its supervisor (what a stop signal does): it stops every rank, each
        removing its files, and exits; returns once it has. Leases are not asked about."""
        self.supervisor.send_signal(signal.SIGTERM)
        self.supervisor.wait()

    def wait(self) -> int:
        """Block until the supervisor exits (every rank has); its exit code, non-zero when a rank died."""
        return self.supervisor.wait()


def _supervisor_command(load: LoadArgs, health_host: str, health_port: int, share_stderr: bool) -> list[str]:
    return [
        sys.executable, "-m", "wcache.daemon.supervisor", *load.to_argv(), "--health-host", health_host,
        "--health-port", str(health_port), *(["--foreground"] if share_stderr else []),
    ]


def _follow(stream: IO[str], on_progress: ProgressCallback | None) -> GroupReady | Exists | Failed | None:
    """Read the supervisor's status lines until it says ready or failed; None if it exits saying neither."""
    for line in stream:
        try:
            message = parse_line(line, FROM_SUPERVISOR)
        except ProtocolError as exc:
            raise PreloadFailedError(f"the supervisor's status line is malformed ({exc}).") from None
        if isinstance(message, Progress):
            if on_progress is not None:
                on_progress(message.done, message.total)
        elif isinstance(message, GroupReady | Exists | Failed):
            return message
    return None


def start_daemons(
    model: str | os.PathLike[str], *, device: str = LoadArgs.device, tp: int = LoadArgs.tp,
    dtype: str = LoadArgs.dtype, quantization: str = LoadArgs.quantization, layout: str = LoadArgs.plan,
    run_dir: Path | None = None, health_host: str = "127.0.0.1", health_port: int = 0,
    on_progress: ProgressCallback | None = None, log_level: str = LoadArgs.log_level,
    log_format: str = LoadArgs.log_format, share_stderr: bool = False, env: Mapping[str, str] | None = None,
    scrub_interval: float = LoadArgs.scrub_interval,
) -> DaemonGroup:
    """Start a supervisor with one daemon per TP rank and return once every rank is ready.

    The supervisor and the ranks log to files under `<run dir>/logs`; with `share_stderr` also to this
    process's stderr (a foreground service whose stderr is a journal or a container log). `env` is their
    environment (default: this process's), e.g. a `WCACHE_CACHE_DIR` of their own.

    Raises DaemonExistsError (exit code 0) when a daemon already holds (or is loading) a rank's key, having
    started nothing that stays; PreloadFailedError with the failing rank's reason (and its exit code)
    otherwise. Ctrl-C (or any exception while waiting) stops the ranks before it propagates.
    """
    from wcache.checkpoint.model_path import resolve_model_path

    path = resolve_model_path(model)
    where = ensure_run_dir(run_dir or default_run_dir())
    load = LoadArgs(model=path.absolute(), run_dir=where, device=device, tp=tp, dtype=dtype,
                    quantization=quantization, plan=layout, log_level=log_level, log_format=log_format,
                    scrub_interval=scrub_interval)
    return _supervise(path, load, health_host, health_port, on_progress, share_stderr, env)


def start_next_version(
    parent: str, delta: Path, *, run_dir: Path | None = None, health_host: str = "127.0.0.1", health_port: int = 0,
    log_level: str = LoadArgs.log_level, log_format: str = LoadArgs.log_format, share_stderr: bool = False,
    env: Mapping[str, str] | None = None, scrub_interval: float = LoadArgs.scrub_interval,
) -> DaemonGroup:
    """Start a new daemon group holding the group of daemon `parent` (a name or key id prefix) with the delta
    file `delta` applied: same devices, TP size and plan, built from the parent's arena, reading nothing of the
    checkpoint but the delta. The parent keeps serving. Raises as `start_daemons` does; a delta made from
    another checkpoint is a BadInputError before anything starts.
    """
    from wcache.delta.format import read_digests

    where = ensure_run_dir(run_dir or default_run_dir())
    group = parent_group(where, parent)
    head = group[0]
    read_digests(delta).check_parent(head.key.checkpoint, f"daemon {head.name}")
    devices = [d.device for d in group]
    device = "cpu" if set(devices) == {"cpu"} else "cuda:" + ",".join(d.removeprefix("cuda:") for d in devices)
    load = LoadArgs(model=delta.absolute(), run_dir=where, device=device, tp=head.tp_size, dtype=head.plan.dtype,
                    quantization=head.plan.quantization, plan=head.plan.layout, log_level=log_level,
                    log_format=log_format, parents=",".join(d.name for d in group), scrub_interval=scrub_interval)
    return _supervise(delta, load, health_host, health_port, None, share_stderr, env)


def parent_group(run_dir: Path, ident: str) -> list[DaemonDescriptor]:
    """The whole TP group of the one running daemon `ident` names, by rank, each holding its weights."""
    live = census(run_dir).live if run_dir.exists() else ()
    found = [d for d in live if matches(d, ident)]
    if not found:
        raise UnavailableError(f"no running daemon is named {ident!r}; `wcache status` lists them.")
    groups = {tuple(d.name for d in group_of(d, live)) for d in found}
    if len(groups) > 1:
        raise BadInputError(f"{ident!r} names {len(found)} daemons ({', '.join(d.name for d in found)}); give more "
                            "of the id.")
    group = group_of(found[0], live)
    if len(group) != group[0].tp_size:
        raise UnavailableError(f"daemon {found[0].name}'s tensor-parallel group has {len(group)} of its "
                               f"{group[0].tp_size} ranks running; it cannot be the parent of a new version.")
    return group


def _supervise(path: Path, load: LoadArgs, health_host: str, health_port: int,
               on_progress: ProgressCallback | None, share_stderr: bool, env: Mapping[str, str] | None) -> DaemonGroup:
    """Run the supervisor of `load` until every rank is ready (or one failed)."""
    where = load.run_dir
    logs = where / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    log_path = logs / f"supervisor-{os.getpid()}.log"
    load = dataclasses.replace(load, log_file=log_path)
    command = _supervisor_command(load, health_host, health_port, share_stderr)
    with log_path.open("a") as log_file:
        # A session of its own: Ctrl-C here reaches the supervisor only through us, so it can stop cleanly.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None if share_stderr else log_file,
                                   stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
                                   env=None if env is None else dict(env))
    assert process.stdout is not None
    try:
        outcome = _follow(process.stdout, on_progress)
    except BaseException:  # Ctrl-C or a stop signal while loading: the ranks must not outlive the caller
        process.send_signal(signal.SIGTERM)
        process.wait()
        raise
    if isinstance(outcome, Exists):
        process.wait()
        raise DaemonExistsError(outcome.reason)
    if not isinstance(outcome, GroupReady):
        code = process.wait()
        reason = outcome.reason if outcome else f"the supervisor exited with code {code}; see {log_path}"
        error = PreloadFailedError(reason.rstrip(".") + ".")
        error.exit_code = outcome.exit_code if outcome else EXIT_UNAVAILABLE
        raise error
    return DaemonGroup(path, process, outcome, where)


def stop_daemon(descriptor: DaemonDescriptor, *, force: bool = False) -> int:
    """Ask a daemon to stop and wait until it has; returns the lease count when it refused (else 0)."""
    try:
        reply = request_once(descriptor.socket, Shutdown(force=force))
    except DaemonError as exc:
        raise UnavailableError(f"daemon {descriptor.name} did not answer ({exc})") from None
    if not reply.stopping:
        return reply.leases or 1
    wait_exit(descriptor.pid, descriptor.name)
    return 0


def stop_loading(record: LoadingRecord) -> None:
    """Stop a rank that is still loading and wait until it has; it removes its own files on the way out."""
    # No socket yet: the pid, checked against the start time it recorded, is the handle.
    created = process_created(record.pid)
    if created is not None and abs(created - record.pid_created) < 0.01:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
        wait_exit(record.pid, record.name or f"pid {record.pid}")


def wait_exit(pid: int, name: str) -> None:
    """Wait until process `pid` (daemon `name`) has exited; UnavailableError when it does not in time."""
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise UnavailableError(f"daemon {name} (pid {pid}) did not exit within {STOP_TIMEOUT_S} s.")


def lease_count(descriptor: DaemonDescriptor) -> int:
    """Zero-copy engines holding a daemon's weights now; 0 when it cannot be asked (stopping it will say why)."""
    try:
        return request_once(descriptor.socket, Stats()).leases
    except DaemonError:
        return 0


def replace_daemons(source: Path, devices: list[str], run_dir: Path, *, force: bool = False) -> list[str]:
    """Stop every daemon of checkpoint `source` on `devices`, ready or still loading; returns their names.

    Refuses (nothing stopped) while engines hold zero-copy leases on any of them, unless `force`.
    """
    wanted = str(source.absolute())
    ready = [d for d in census(run_dir).live if d.source == wanted and d.device in devices]
    loading = [r for r in read_loading(run_dir) if r.source == wanted and r.device in devices]
    if not force:
        held = [f"{d.name} ({n} lease(s))" for d in ready if (n := lease_count(d))]
        if held:
            raise UnavailableError(f"engines hold leases on {', '.join(held)}; detach them first, or replace "
                                   "with --force.")
    for descriptor in ready:
        stop_daemon(descriptor, force=True)
    for record in loading:
        stop_loading(record)
    return [d.name for d in ready] + [r.name or f"pid {r.pid}" for r in loading]


def group_of(descriptor: DaemonDescriptor, live: Sequence[DaemonDescriptor]) -> list[DaemonDescriptor]:
    """The ranks one preload started together; a TP group only serves whole."""
    if descriptor.tp_size == 1 or descriptor.supervisor_pid is None:
        return [descriptor]
    return sorted((d for d in live if d.supervisor_pid == descriptor.supervisor_pid), key=lambda d: d.tp_rank)


def stop_targets(run_dir: Path, ident: str | None, *, group: bool = False) -> list[DaemonDescriptor]:
    """The running daemons `ident` (a name or key id prefix; None: every one) names, with their whole TP groups.

    One rank of a group is never stopped alone (the rest could not serve): unless `group`, naming part of a
    group is a BadInputError. An empty list when nothing matches.
    """
    live = census(run_dir).live if run_dir.exists() else ()
    if ident is None:
        return list(live)
    targets = [d for d in live if matches(d, ident)]
    chosen = {d.name for d in targets}
    for descriptor in list(targets):
        members = group_of(descriptor, live)
        missing = [d.name for d in members if d.name not in chosen]
        if missing and not group:
            raise BadInputError(
                f"daemon {descriptor.name} is rank {descriptor.tp_rank} of a tensor-parallel group of "
                f"{descriptor.tp_size} ({', '.join(d.name for d in members)}); stop the whole group with "
                "--group."
            )
        targets += [d for d in members if d.name not in chosen]
        chosen.update(d.name for d in members)
    return targets


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
        raise BadInputError(f"engines still hold leases on {busy}; detach them first or use --force.")
    refused = []
    for descriptor in targets:
        try:
            leases = stop_daemon(descriptor, force=force)
        except UnavailableError:
            if descriptor.tp_size == 1:
                raise
            # Its supervisor is already stopping it with the rest of its group: that is what we asked for.
            wait_exit(descriptor.pid, descriptor.name)
            leases = 0
        if leases:
            refused.append(f"{descriptor.name} ({leases} lease(s))")
        elif on_stopped is not None:
            on_stopped(descriptor.name)
    if refused:
        raise BadInputError(f"engines still hold leases on {', '.join(refused)}; detach them first or use --force.")


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
