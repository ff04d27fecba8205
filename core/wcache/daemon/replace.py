"""`preload --replace`: the daemons of one checkpoint stopped (each whole TP group, and ranks still loading)
before the new ones start, one replace at a time per run dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from wcache.daemon.stopping import lease_count, stop_daemons, stop_loading
from wcache.errors import (
    UnavailableError,
    option,
)
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    census,
    group_of,
)
from wcache.ipc.run_dir.loading import read_loading


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
