"""How long the launcher waits before starting a server that died again: 1, 2, 4 … 30 s, reset by a healthy run.

A server that crashes at start-up (a bad argument vLLM accepts, a port in use) would otherwise be restarted as
fast as it can import vLLM, forever; one that served a while before it died starts the series over at 1 s.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_S = 1.0
LONGEST_S = 30.0
# Serving this long since it became ready counts as healthy: the next death starts the series over.
HEALTHY_S = 60.0


@dataclass
class Backoff:
    """The delays before successive restarts; `reset` after a healthy run."""

    first_s: float = FIRST_S
    longest_s: float = LONGEST_S
    healthy_s: float = HEALTHY_S
    failures: int = 0

    def next_delay(self, served_s: float | None) -> float:
        """The wait before the next start, given how long the dead server served (None: it never became ready)."""
        if served_s is not None and served_s >= self.healthy_s:
            self.failures = 0
        delay = min(self.longest_s, self.first_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return delay

    def reset(self) -> None:
        """A restart that was asked for, not a death: the next death starts the series over."""
        self.failures = 0
