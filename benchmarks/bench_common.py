"""Helpers every benchmark script shares: a work directory, raw reads, and how numbers are printed."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

READ_CHUNK_BYTES = 16 * 1024 * 1024


@contextlib.contextmanager
def workspace(workdir: Path | None) -> Iterator[Path]:
    """The given directory (kept), or a temporary one removed afterwards."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir.absolute()
        return
    tmp = Path(tempfile.mkdtemp(prefix="wcache-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_all(paths: list[Path]) -> int:
    """Read every file start to end with large reads into one reused buffer; the bytes read."""
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def fmt_seconds(seconds: float) -> str:
    """A duration in µs, ms or s, whichever reads best."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:,.0f} µs"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def fmt_rate(rate: float) -> str:
    """Bytes per second as GB/s (10^9)."""
    return f"{rate / 1e9:,.2f} GB/s"


def speed_ratio(base: float, seconds: float) -> str:
    """How much faster (or slower) `seconds` is than `base`."""
    speed = base / seconds
    return f"{speed:,.1f}× faster" if speed >= 1 else f"{1 / speed:,.1f}× slower"
