"""How many threads a forward step runs on: torch's setting, or fewer when the step is too small to share.

A thread only pays for itself when its share of each matmul outweighs OpenMP's fork and join, and on a busy
machine a join can wait a whole scheduler slice (milliseconds) for a descheduled thread: the tiny preset
decoded 3× slower on 2 threads than on 1. So each thread must get about a millisecond of work per layer.
On a 2-core VM a second thread made qwen3-0.6b-sized decode steps (16M multiply-adds per layer, memory bound)
at most 10% faster when the machine was idle and 2-3× slower when another process ran; prefill steps of a
few hundred tokens gained 1.7× when idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Multiply-adds of one layer's matmuls (tokens × weights) each thread must get before another one is added.
MACS_PER_THREAD = 1 << 24


def step_threads(ceiling: int, tokens: int, layer_macs: int) -> int:
    """Threads for a step of `tokens` positions through layers of `layer_macs` multiply-adds per token."""
    return max(1, min(ceiling, tokens * layer_macs // MACS_PER_THREAD))


def use_threads(count: int) -> None:
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@contextmanager
def restored_threads() -> Iterator[int]:
    """torch's thread count on entry (the ceiling for the steps inside), set back on exit."""
    before = torch.get_num_threads()
    try:
        yield before
    finally:
        use_threads(before)
