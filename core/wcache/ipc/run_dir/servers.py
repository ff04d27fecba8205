"""What a `wcache serve` launcher records in `<run dir>/servers/<launcher pid>.json`, for `status` and `top`.

The launcher rewrites it at each change of its server's state and removes it when it stops; a launcher killed
outright leaves it behind, so a reader judges it by the launcher's process (`launcher_alive`), as engine
announcements are judged. A restart asked with `wcache restart` is a request file beside it and a SIGHUP.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from wcache.ipc.run_dir.directory import Pid, process_created, read_run_file, run_subdir
from wcache.ipc.run_dir.paths import RunPaths
from wcache.schema import Schema

MAX_RECORD_BYTES = 64 * 1024
# Server states, in the order a start goes through them.
STARTING = "starting"  # started, /health not yet 200
SERVING = "serving"
BACKING_OFF = "backing off"  # died; waiting before the next start
STOPPING = "stopping"
STATES = (STARTING, SERVING, BACKING_OFF, STOPPING)
START_SLACK_S = 1.0


class ServerRecord(Schema, frozen=True):
    """One launcher and the vLLM server it supervises."""

    launcher_pid: Pid
    started: float  # when the launcher started (its clock), to tell a reused pid
    model: str
    url: str
    state: str
    pid: Pid | None  # the server's front process; None between a death and the next start
    restarts: int  # starts after the first
    last_ready_s: float | None  # how long the last start took until /health answered 200
    last_exit: str | None  # the one line saying why the last server died
    log: str
    daemons: tuple[str, ...] = ()  # the daemon group it attaches to, by name
    argv: tuple[str, ...] = ()  # the vLLM arguments it runs with now


class RestartRequest(Schema, frozen=True):
    """A restart asked of a launcher; `argv`: new vLLM arguments (checked by the asker), None: the same ones."""

    argv: tuple[str, ...] | None = None


def launcher_alive(record: ServerRecord) -> bool:
    """Whether the launcher that wrote `record` still runs here (not gone, not a new process reusing its pid)."""
    created = process_created(record.launcher_pid)
    return created is not None and created <= record.started + START_SLACK_S


def _write_atomically(path: Path, data: object) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)


def write_server_record(run_dir: Path, record: ServerRecord) -> Path:
    paths = RunPaths(run_dir)
    paths.servers.mkdir(mode=0o700, exist_ok=True)
    path = paths.server(record.launcher_pid)
    _write_atomically(path, record.to_wire())
    return path


def read_server_record(path: Path) -> ServerRecord:
    """One record; OSError or ValueError (SchemaError) when it cannot be read or is not one."""
    return ServerRecord.from_wire(read_run_file(path, MAX_RECORD_BYTES))


def live_server_records(run_dir: Path) -> list[ServerRecord]:
    """The records of launchers still running, by launcher pid; unreadable and stale ones are skipped."""
    directory = run_subdir(run_dir, RunPaths.SERVERS)  # a symlink there is refused: its pids could be anyone's
    if directory is None:
        return []
    records = []
    for path in RunPaths.server_files(directory):
        try:
            record = read_server_record(path)
        except (OSError, ValueError):
            continue
        if launcher_alive(record):
            records.append(record)
    return records


def remove_server_files(run_dir: Path, launcher_pid: int) -> None:
    paths = RunPaths(run_dir)
    for path in (paths.server(launcher_pid), paths.server_restart(launcher_pid)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_restart_request(run_dir: Path, launcher_pid: int, request: RestartRequest) -> None:
    _write_atomically(RunPaths(run_dir).server_restart(launcher_pid), request.to_wire())


def take_restart_request(run_dir: Path, launcher_pid: int) -> RestartRequest:
    """The restart asked (and remove its file); a plain restart when none was written (a SIGHUP alone)."""
    path = RunPaths(run_dir).server_restart(launcher_pid)
    try:
        request = RestartRequest.from_wire(read_run_file(path, MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return RestartRequest()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return request
