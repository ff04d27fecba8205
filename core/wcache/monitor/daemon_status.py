"""Asking daemons how they are: one `stats` request each, all at once, one timeout for every caller.

`wcache status`, `wcache top` and the supervisor's /health, /readyz, /livez, /metrics and /stats all read
daemons through `collect`, so a slow daemon is "unreachable" to each of them after the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wcache.ipc.wire.client import DaemonError, request_once
from wcache.ipc.wire.messages import Stats, StatsReply

if TYPE_CHECKING:
    from concurrent.futures import Executor

# Long enough for a daemon busy attaching a burst of engines, short enough that a hung one does not stall
# a probe or a `top` refresh: a stats reply takes well under a millisecond.
STATS_TIMEOUT_S = 2.0
MAX_PARALLEL = 16


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """One daemon's answer to `stats`, or the sentence saying why there was none."""

    socket: str
    stats: StatsReply | None
    error: str | None = None

    @property
    def state(self) -> str:
        return self.stats.state if self.stats is not None else "unreachable"

    @property
    def serving(self) -> bool:
        """Ready and holding weights: what a readiness probe answers 200 to."""
        return self.stats is not None and self.stats.state == "ready" and self.stats.holds_weights


def ask(socket: str) -> DaemonStatus:
    try:
        return DaemonStatus(socket, request_once(socket, Stats(), timeout=STATS_TIMEOUT_S))
    except DaemonError as exc:
        return DaemonStatus(socket, None, str(exc))


def collect(sockets: Sequence[str], pool: Executor | None = None) -> list[DaemonStatus]:
    """`ask` every socket concurrently (on `pool`, else threads of our own): a hung daemon costs one timeout."""
    if len(sockets) <= 1:
        return [ask(s) for s in sockets]
    if pool is not None:
        return [f.result() for f in [pool.submit(ask, s) for s in sockets]]
    # Imported here: `wcache status` of one daemon, the common case, needs no thread pool.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(sockets)), thread_name_prefix="wcache-stats") as own:
        return list(own.map(ask, sockets))
