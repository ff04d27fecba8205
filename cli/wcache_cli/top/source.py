"""Where `wcache top` gets its snapshots: a polling source the TUI, `--once` and `--json` all share.

No Textual here: the scripting modes import this module alone. The dashboard takes any object with this
shape, so tests hand it a fake that returns fixed snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from wcache.monitor.collector import Collector
from wcache.monitor.snapshot import Snapshot


class Source(Protocol):
    """One `Snapshot` per `poll()`; called from a worker thread, so it may block (about a second at worst)."""

    def poll(self) -> Snapshot: ...

    def close(self) -> None: ...


def open_source(run_dir: Path, scrape: list[str], interval_s: float) -> Source:
    """The real source: daemons and events from the run dir, engines from their /metrics."""
    return Collector(run_dir, scrape=scrape, interval_s=interval_s)


def two_samples(source: Source, interval_s: float, sleep: Callable[[float], None] = time.sleep) -> Snapshot:
    """Poll, wait one interval, poll again: the second snapshot's rates are over a real interval."""
    source.poll()
    sleep(interval_s)
    return source.poll()


def every_interval(source: Source, interval_s: float, count: int | None,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> Iterator[Snapshot]:
    """A priming sample, then one snapshot per interval (`count` of them, or forever), on a fixed beat."""
    source.poll()
    start = clock()
    produced = 0
    while count is None or produced < count:
        produced += 1
        sleep(max(0.0, start + produced * interval_s - clock()))
        yield source.poll()
