"""Starting and stopping daemons from Python: what `wcache preload` and `wcache stop` do, for any caller.

    from wcache import start_daemons
    group = start_daemons("Qwen/Qwen3-0.6B", tp=2)   # returns once every rank is ready
    ...
    group.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from wcache.daemon.argv import LoadArgs
from wcache.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIFFERENCE,
    EXIT_UNAVAILABLE,
    BadInputError,
    UnavailableError,
    option,
)
from wcache.ipc.interpreter import python_module_argv
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    DaemonExistsError,
    census,
    default_run_dir,
    ensure_daemon_run_dir,
    lock_held,
    lock_path,
    lock_taken_if_free,
    matches,
    process_created,
    read_descriptors,
    remove_daemon_files,
)
from wcache.ipc.run_dir.loading import LoadingRecord, read_loading, record_lock_path
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.wire.client import DaemonError, request_once
from wcache.ipc.wire.framing import ProtocolError
from wcache.ipc.wire.messages import Shutdown, Stats
from wcache.ipc.wire.status_pipe import FROM_SUPERVISOR, Exists, Failed, GroupReady, Progress, parse_line

STOP_TIMEOUT_S = 15.0

# done, total bytes read and hashed so far, as the ranks report them.
ProgressCallback = Callable[[int, int], None]


class PreloadFailedError(UnavailableError):
    """A rank failed to load, crashed or was killed; the others were stopped. Its class says the exit code: this
    one, a daemon that is unavailable; its subclasses, the verdict a rank reached on the user's checkpoint."""

    @staticmethod
    def of(reason: str, exit_code: int) -> PreloadFailedError:
        """The error for a rank's `reason` and the exit code it gave (a crash's or an unknown one: unavailable)."""
        kind = next((c for c in (PreloadBadInputError, PreloadRefusedError) if c.exit_code == exit_code),
                    PreloadFailedError)
        return kind(reason)


class PreloadBadInputError(PreloadFailedError):
    """A rank could not use the user's checkpoint or options."""

    exit_code = EXIT_BAD_INPUT


class PreloadRefusedError(PreloadFailedError):
    """A rank refused the checkpoint: its files differ from what was published (`require_provenance`)."""

    exit_code = EXIT_DIFFERENCE


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
    return python_module_argv(
        "wcache.daemon.supervisor", *load.to_argv(), "--health-host", health_host, "--health-port",
        str(health_port), *(["--foreground"] if share_stderr else []),
    )


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
    require_provenance: str = LoadArgs.require_provenance, expected: Path | None = None,
    scrub_interval: float = LoadArgs.scrub_interval, version_pool: int = LoadArgs.version_pool,
) -> DaemonGroup:
    """Start a supervisor with one daemon per TP rank and return once every rank is ready.

    The supervisor and the ranks log to files under `<run dir>/logs`; with `share_stderr` also to this
    process's stderr (a foreground service whose stderr is a journal or a container log). `env` is their
    environment (default: this process's), e.g. a `WCACHE_CACHE_DIR` of their own.

    Raises DaemonExistsError (exit code 0) when a daemon already serves a rank's key, having started nothing
    that stays (a rank whose key another process is still loading waits for that load's outcome);
    PreloadFailedError with the failing rank's reason (and its exit code) otherwise. Ctrl-C (or any exception
    while waiting) stops the ranks before it propagates.

    `require_provenance` ("warn", "differs", "unknown": key.provenance) is what each rank refuses to serve
    when a file's SHA-256 is not what the Hugging Face cache (or the `expected` digests) say.
    """
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.checkpoint.provenance import read_expected

    path = resolve_model_path(model)
    if expected is not None:
        read_expected(expected)  # one sentence now, before each rank reads the whole checkpoint only to refuse it
    where = ensure_daemon_run_dir(run_dir or default_run_dir())
    load = LoadArgs(model=path.absolute(), run_dir=where, device=device, tp=tp, dtype=dtype,
                    quantization=quantization, plan=layout, log_level=log_level, log_format=log_format,
                    scrub_interval=scrub_interval, version_pool=version_pool, require_provenance=require_provenance,
                    expected=expected.absolute() if expected is not None else None)
    return _supervise(path, load, health_host, health_port, on_progress, share_stderr, env)


def start_next_version(
    parent: str, delta: Path, *, run_dir: Path | None = None, health_host: str = "127.0.0.1", health_port: int = 0,
    log_level: str = LoadArgs.log_level, log_format: str = LoadArgs.log_format, share_stderr: bool = False,
    env: Mapping[str, str] | None = None, scrub_interval: float = LoadArgs.scrub_interval,
    version_pool: int = LoadArgs.version_pool,
) -> DaemonGroup:
    """Start a new daemon group holding the group of daemon `parent` (a name or key id prefix) with the delta
    file `delta` applied: same devices, TP size and plan, built from the parent's arena, reading nothing of the
    checkpoint but the delta. The parent keeps serving. Raises as `start_daemons` does; a delta made from
    another checkpoint is a BadInputError before anything starts.
    """
    from wcache.delta.format import read_digests

    where = ensure_daemon_run_dir(run_dir or default_run_dir())
    group = parent_group(where, parent)
    head = group[0]
    read_digests(delta).check_parent(head.key.checkpoint, f"daemon {head.name}")
    devices = [d.device for d in group]
    device = "cpu" if set(devices) == {"cpu"} else "cuda:" + ",".join(d.removeprefix("cuda:") for d in devices)
    load = LoadArgs(model=delta.absolute(), run_dir=where, device=device, tp=head.tp_size, dtype=head.plan.dtype,
                    quantization=head.plan.quantization, plan=head.plan.layout, log_level=log_level,
                    log_format=log_format, parents=",".join(d.name for d in group), scrub_interval=scrub_interval,
                    version_pool=version_pool)
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
    paths = RunPaths(where)
    paths.logs.mkdir(mode=0o700, exist_ok=True)
    log_path = paths.supervisor_log(os.getpid())
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
        raise PreloadFailedError.of(reason.rstrip(".") + ".", outcome.exit_code if outcome else EXIT_UNAVAILABLE)
    _refuse_a_lost_rank(DaemonGroup(path, process, outcome, where))
    return DaemonGroup(path, process, outcome, where)


def _refuse_a_lost_rank(group: DaemonGroup) -> None:
    """A rank killed between saying ready and now: stop the rest and say which, never "ready"."""
    from wcache.daemon.supervisor import rank_log_path

    lost = [r for r in group.ready.by_rank() if not lock_held(lock_path(group.run_dir, r.name))]
    if not lost:
        return
    group.terminate()
    for r in lost:
        with lock_taken_if_free(lock_path(group.run_dir, r.name)) as free:
            if free:
                remove_daemon_files(group.run_dir, r.name)
    first = lost[0]
    log = rank_log_path(group.run_dir, group.supervisor.pid, first.rank)
    raise PreloadFailedError(f"rank {first.rank} (daemon {first.name}) exited right after it became ready, so "
                             f"nothing was left running; its log is {log}.")


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
        return 0
    if not reply.stopping:
        return reply.leases or 1
    wait_exit(daemon_lock(descriptor), descriptor.name)
    return 0


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


def lease_count(descriptor: DaemonDescriptor) -> int:
    """Zero-copy engines holding a daemon's weights now; 0 when it cannot be asked (stopping it will say why)."""
    try:
        return request_once(descriptor.socket, Stats()).leases
    except DaemonError:
        return 0


def checkpoint_identity(source: str | os.PathLike[str]) -> str:
    """What --replace takes as one checkpoint: the real path (symlinks and `..` resolved), with every revision
    of a repo in a Hugging Face cache (`models--Org--Name/snapshots/<revision>`) taken as the same one."""
    path = Path(os.path.abspath(source))  # noqa: PTH100  (what a daemon records as its source)
    # A file's directory is resolved, not the file: in a Hugging Face snapshot it is a link into blobs/.
    real = Path(os.path.realpath(path.parent)) / path.name if path.is_file() else Path(os.path.realpath(path))
    parts = real.parts
    for i in range(1, len(parts) - 1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return str(Path(*parts[:i]))
    return str(real)


# Held by a `preload --replace` from before it stops the old daemons until the new ones are ready (or failed):
# two replaces at once then run one after the other, so each stops a whole group and starts one.
REPLACE_LOCK = "replace.lock"


@contextlib.contextmanager
def replacing(run_dir: Path) -> Iterator[None]:
    """Serialize replaces in `run_dir`: blocks while another `preload --replace` there stops and starts."""
    fd = os.open(run_dir / REPLACE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def replace_daemons(source: Path, devices: list[str], run_dir: Path, *, force: bool = False) -> list[str]:
    """Stop every daemon of checkpoint `source` (as `checkpoint_identity` tells) on `devices`, ready or still
    loading, each with its whole TP group; returns their names.

    Refuses (nothing stopped) while engines hold zero-copy leases on any of them, unless `force`.
    """
    wanted = checkpoint_identity(source)
    live = census(run_dir).live
    matched = [d for d in live if checkpoint_identity(d.source) == wanted and d.device in devices]
    ready: list[DaemonDescriptor] = []
    for descriptor in matched:
        ready += [d for d in group_of(descriptor, live) if d not in ready]
    loading = [r for r in read_loading(run_dir) if checkpoint_identity(r.source) == wanted and r.device in devices]
    if not force:
        held = [f"{d.name} ({n} lease(s))" for d in ready if (n := lease_count(d))]
        if held:
            raise UnavailableError(f"engines hold leases on {', '.join(held)}; detach them first, or replace "
                                   f"with {option('force', True)}.")
    stop_daemons(ready, force=True)
    for record in loading:
        stop_loading(run_dir, record)
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
                f"{option('group', True)}."
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
