"""The order a pass reads a checkpoint in, and which outputs each tensor it reads feeds: copied as bytes or
computed, and when an output computed from several tensors has them all."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.key.shard_hash import OpenShard
from wcache.load.byte_spans import Span, byte_spans, copied_source
from wcache.plan.processing import OutputSpec, ProcessingPlan


class Schedule:
    """Which outputs each checkpoint tensor feeds, and when an output computed from several can be made.

    An output that is one tensor whole is written as a span of it; with `spans`, so is every output made of
    checkpoint bytes unchanged (it is hashed back from the arena, so it needs one that can be read), and without
    such an output is computed.
    """

    def __init__(self, plan: ProcessingPlan, spans: bool = False) -> None:
        self.copies: dict[str, list[OutputSpec]] = {}  # tensor → outputs that are its bytes unchanged, whole
        self.spans: dict[str, list[Span]] = {}  # tensor → runs of its bytes in outputs
        self.stacked: dict[str, int] = {}  # output → bytes of it to write before it is hashed back
        self.computed: dict[str, list[OutputSpec]] = {}  # tensor → outputs computed from it (and others)
        self._missing: dict[str, int] = {}
        self._lock = threading.Lock()
        for output in plan.outputs:
            source = copied_source(plan, output)
            if source is not None:
                self.copies.setdefault(source, []).append(output)
            runs = byte_spans(plan, output) if spans or source is not None else None
            if runs is not None:
                for name, span in runs:
                    self.spans.setdefault(name, []).append(span)
                if source is None:
                    self.stacked[output.name] = output.nbytes
                continue
            self._missing[output.name] = len(output.sources)
            for name in output.sources:
                self.computed.setdefault(name, []).append(output)

    def arrived(self, name: str) -> list[OutputSpec]:
        """Tensor `name` is in memory: the computed outputs that now have all their sources."""
        ready = []
        with self._lock:
            for output in self.computed.get(name, ()):
                self._missing[output.name] -= 1
                if self._missing[output.name] == 0:
                    ready.append(output)
        return ready


def file_order(shards: Sequence[OpenShard]) -> Iterator[tuple[OpenShard, TensorInfo]]:
    """Every tensor, shard by shard and by offset within each: the order the disk serves fastest."""
    for shard in shards:
        for tensor in sorted(shard.header.tensors, key=lambda t: t.start):
            yield shard, tensor

