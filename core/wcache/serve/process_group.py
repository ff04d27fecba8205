"""A served vLLM's process group: its members, and the shared memory they leave behind once they are gone.

vLLM's CPU workers at TP > 1 make `/dev/shm/vllm_dist_*-cpushm_*` segments that are not removed when the server is
stopped (vLLM's own shutdown kills its engine core outright) or dies, and a process killed before it removed its
Python SharedMemory (`/dev/shm/psm_*`; vLLM's message queues are such) leaves that. Left alone they hold memory
until the machine reboots. The launcher notes the segments its server's processes map (once it serves, and again as
it stops) and removes those still there once the whole group is gone. Only the names vLLM and Python's
multiprocessing give their segments are taken, so an arena a user placed in /dev/shm is never touched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")
# vLLM's own segments, Python's SharedMemory (vLLM's message queues) and multiprocessing's named semaphores.
_LEFT_BEHIND_PREFIXES = ("vllm_", "psm_", "sem.mp-")


def group_members(group: int) -> list[int]:
    """The pids of process group `group` that have not exited (zombies awaiting their parent are gone)."""
    import psutil

    found = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
    return found


def mapped_segments(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm segments named as vLLM names its own that processes `pids` map now (one that exited maps none)."""
    found: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].endswith(" (deleted)"):
                continue  # anonymous memory, or a segment already removed
            path = Path(fields[5])
            if path.parent == SHARED_MEMORY and path.name.startswith(_LEFT_BEHIND_PREFIXES):
                found.add(path)
    return found


def remove_segments(paths: Iterable[Path]) -> list[Path]:
    """Remove those of `paths` that are still there; the ones removed."""
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
