"""Starting daemons from Python: what `wcache preload` does, for any caller (stopping them: `stopping`).

    from wcache import start_daemons
    group = start_daemons("Qwen/Qwen3-0.6B", tp=2)   # returns once every rank is ready
    ...
    group.stop()
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from wcache.daemon.argv import LoadArgs
from wcache.daemon.groups import parent_group
from wcache.daemon.stopping import STOP_TIMEOUT_S, stop_daemons
from wcache.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIFFERENCE,
    EXIT_UNAVAILABLE,
    UnavailableError,
)
from wcache.ipc.interpreter import python_module_argv
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    DaemonExistsError,
    default_run_dir,
    ensure_daemon_run_dir,
    lock_held,
    lock_path,
    lock_taken_if_free,
    read_descriptors,
    remove_daemon_files,
)
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.wire.framing import ProtocolError
from wcache.ipc.wire.status_pipe import FROM_SUPERVISOR, Exists, Failed, GroupReady, Progress, parse_line

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
