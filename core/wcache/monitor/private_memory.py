"""How much memory a process holds privately: what an attach adds to it, as opposed to pages it shares."""

from __future__ import annotations

from pathlib import Path

_ROLLUP = Path("/proc/self/smaps_rollup")
_PRIVATE_FIELDS = ("Private_Clean:", "Private_Dirty:")


def private_bytes(rollup: Path = _ROLLUP) -> int | None:
    """This process's private bytes (USS: Private_Clean + Private_Dirty); None where the kernel has no rollup.

    smaps_rollup is one read of a few hundred bytes, cheap enough to take inside a model load; a daemon's
    arena mapped by the engine is shared memory and never counts, a page the engine writes does.
    """
    try:
        text = rollup.read_text()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        if line.startswith(_PRIVATE_FIELDS):
            total += int(line.split()[1]) * 1024  # the kernel reports kB
    return total
