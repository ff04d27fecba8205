"""Starting and stopping daemons from Python: what `wcache preload` and `wcache stop` do, for any caller.

    from wcache import start_daemons
    group = start_daemons("Qwen/Qwen3-0.6B", tp=2)   # returns once every rank is ready
    ...
    group.stop()
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from wcache.client import DaemonError, request_once
from wcache.daemon.status_pipe import parse_line
from wcache.errors import EXIT_UNAVAILABLE, UnavailableError, WcacheError
from wcache.rundir import DaemonDescriptor, DaemonExistsError, default_run_dir, ensure_run_dir, read_descriptors

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
    ready: dict[str, Any]
    run_dir: Path

    @property
    def names(self) -> list[str]:
        return [str(r["name"]) for r in sorted(self.ready.get("ranks", []), key=lambda r: r["rank"])]

    def descriptors(self) -> list[DaemonDescriptor]:
        by_name = {d.name: d for d in read_descriptors(self.run_dir)}
        return [by_name[name] for name in self.names if name in by_name]

    def detach(self) -> None:
        """Leave the daemons running on their own (the supervisor no longer reports to us)."""
        if self.supervisor.stdout is not None:
            self.supervisor.stdout.close()

    def stop(self, *, force: bool = False) -> None:
        """Stop every rank (refused while zero-copy engines hold leases, unless `force`) and the supervisor."""
        refused = [f"{d.name} ({n} lease(s))" for d in self.descriptors() if (n := stop_daemon(d, force=force))]
        if refused:
            raise UnavailableError(f"daemons still hold leases: {', '.join(refused)}; stop them with force.")
        self.supervisor.wait(timeout=STOP_TIMEOUT_S * 2)
        self.detach()


def _supervisor_command(
    model: Path, device: str, tp: int, dtype: str, quantization: str, layout: str, run_dir: Path,
    health_host: str, health_port: int,
) -> list[str]:
    return [
        sys.executable, "-m", "wcache.daemon.supervisor", "--model", str(model.absolute()), "--device", device,
        "--tp", str(tp), "--dtype", dtype, "--quantization", quantization, "--plan", layout,
        "--run-dir", str(run_dir), "--health-host", health_host, "--health-port", str(health_port),
    ]


def _follow(stream: IO[str], on_progress: ProgressCallback | None) -> dict[str, Any] | None:
    """Read the supervisor's status lines until it says ready or failed; None if it exits saying neither."""
    for line in stream:
        message = parse_line(line)
        if message is None:
            continue
        if message["event"] == "progress" and on_progress is not None:
            on_progress(int(message.get("done", 0)), int(message.get("total") or 0))
        elif message["event"] in ("ready", "failed", "exists"):
            return message
    return None


def start_daemons(
    model: str | os.PathLike[str], *, device: str = "cpu", tp: int = 1, dtype: str = "auto",
    quantization: str = "none", layout: str = "fused", run_dir: Path | None = None,
    health_host: str = "127.0.0.1", health_port: int = 0, on_progress: ProgressCallback | None = None,
) -> DaemonGroup:
    """Start a supervisor with one daemon per TP rank and return once every rank is ready.

    Raises DaemonExistsError (exit code 0) when a daemon already holds (or is loading) a rank's key, having
    started nothing that stays; PreloadFailedError with the failing rank's reason (and its exit code)
    otherwise. Ctrl-C (or any exception while waiting) stops the ranks before it propagates.
    """
    from wcache.model_path import resolve_model_path

    path = resolve_model_path(model)
    where = ensure_run_dir(run_dir or default_run_dir())
    logs = where / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    log_path = logs / f"supervisor-{os.getpid()}.log"
    command = _supervisor_command(path, device, tp, dtype, quantization, layout, where, health_host, health_port)
    with log_path.open("a") as log_file:
        # A session of its own: Ctrl-C here reaches the supervisor only through us, so it can stop cleanly.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                   text=True, bufsize=1, start_new_session=True)
    assert process.stdout is not None
    try:
        outcome = _follow(process.stdout, on_progress)
    except BaseException:  # Ctrl-C or a stop signal while loading: the ranks must not outlive the caller
        process.send_signal(signal.SIGTERM)
        process.wait()
        raise
    if outcome is not None and outcome["event"] == "exists":
        process.wait()
        raise DaemonExistsError(str(outcome.get("reason", "a daemon already holds this key.")))
    if outcome is None or outcome["event"] == "failed":
        code = process.wait()
        reason = outcome.get("reason") if outcome else f"the supervisor exited with code {code}; see {log_path}"
        error = PreloadFailedError(str(reason).rstrip(".") + ".")
        error.exit_code = int(outcome.get("exit_code", 1)) if outcome else EXIT_UNAVAILABLE
        raise error
    return DaemonGroup(path, process, outcome, where)


def stop_daemon(descriptor: DaemonDescriptor, *, force: bool = False) -> int:
    """Ask a daemon to stop and wait until it has; returns the lease count when it refused (else 0)."""
    try:
        reply = request_once(descriptor.socket, "shutdown", force=force).fields
    except DaemonError as exc:
        raise UnavailableError(f"daemon {descriptor.name} did not answer ({exc})") from None
    if not reply.get("stopping"):
        return int(reply.get("leases") or 1)
    _wait_gone(descriptor)
    return 0


def _wait_gone(descriptor: DaemonDescriptor) -> None:
    try:
        process = psutil.Process(descriptor.pid)
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
    raise UnavailableError(f"daemon {descriptor.name} (pid {descriptor.pid}) did not exit within {STOP_TIMEOUT_S} s.")
