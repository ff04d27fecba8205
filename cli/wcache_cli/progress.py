"""A rich progress bar for hashing (bytes, GB/s, ETA) that stays silent when stderr is not a terminal."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from wcache_cli.output import out

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class HashBar:
    """Implements the library's HashProgress protocol on a rich Progress, or silently without one."""

    def __init__(self, progress: Progress | None, label: str) -> None:
        self._progress = progress
        self._label = label
        self._task: TaskID | None = None

    def start(self, total_bytes: int, num_files: int) -> None:
        if self._progress is None:
            return
        noun = "shard" if num_files == 1 else "shards"
        self._task = self._progress.add_task(f"{self._label}: hashing {num_files} {noun}", total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, nbytes)


@contextmanager
def hash_bar(label: str) -> Iterator[HashBar]:
    if not out.stderr.is_terminal:
        yield HashBar(None, label)  # nothing would be drawn, so rich.progress is not even imported
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=out.stderr,
        transient=True,
    )
    with progress:
        yield HashBar(progress, label)
