"""Resident weights re-checked: a daemon re-hashes its arena in the background and compares every tensor with the
digest taken when it was filled.

A pass hashes one tensor after another on one thread, a chunk at a time, and sleeps after each chunk long enough
that hashing takes at most SHARE of one core while a pass runs; passes start `interval_s` apart, the first one an
interval after the daemon is ready (`--scrub-interval`, 0 turns them off). The arena is sealed, so nothing in user
space can change it: a difference is a memory error (or a kernel bug), and the daemon reports it as one (an event,
a metric, a `top` banner, a failed readiness probe) naming the tensor and where it lies, refuses new attaches, and
tells every engine holding a lease at once (`server.DaemonServer`: a `CorruptNotice` on each lease; stats and hello
replies carry it too; the event lists the pids holding leases). The bytes
hashed are the arena's own, through `arena_digest`, the function the daemon's other checks of its arena use.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.errors import BadInputError, WcacheError, option
from wcache.ipc.arenas.daemon_side import ArenaClosedError, ArenaEntry, CpuArena

if TYPE_CHECKING:
    from wcache.checkpoint.manifest import TensorDigest
    from wcache.plan.processing import ProcessingPlan

log = logging.getLogger("wcache.daemon")

DEFAULT_INTERVAL_S = 600.0
# A year: an interval past it is a re-check that never comes (and past 2**63 ns threading's waits overflow).
MAX_INTERVAL_S = 365 * 24 * 3600.0
# The most of one core a pass may take while it runs.
SHARE = 0.05
# Corruption is located to a block this size once a clean pass has recorded each block's CRC.
BLOCK_BYTES = 64 * 1024


def checked_interval(seconds: float) -> float:
    """`seconds` as the interval between passes; BadInputError for a value that is not one (negative, NaN,
    infinite, or past MAX_INTERVAL_S), so that no daemon starts with re-checks that silently never run."""
    if not 0 <= seconds <= MAX_INTERVAL_S:  # NaN fails both comparisons
        raise BadInputError(f"{option('scrub_interval', seconds)} is not an interval: give seconds from 0 (no "
                            f"re-checks) to {MAX_INTERVAL_S:.0f} (a year).")
    return seconds


@dataclass(frozen=True, slots=True)
class Corruption:
    """A tensor whose bytes no longer hash to the digest taken when the arena was filled."""

    tensor: str
    arena_offset: int
    nbytes: int
    block: tuple[int, int] | None  # the changed bytes [start, end) within the tensor, when a clean pass came first
    found_at: float
    byte: int | None = None  # the first changed byte within the tensor, where the checkpoint could tell

    def sentence(self) -> str:
        if self.byte is not None:
            where = f"at its byte {self.byte}"
        elif self.block is not None:
            where = f"in its bytes {self.block[0]}–{self.block[1]}"
        else:
            where = "(changed before the first clean pass, and its checkpoint cannot tell where)"
        return (f"tensor {self.tensor!r} (arena offset {self.arena_offset}, {self.nbytes} bytes) changed in memory "
                f"{where}")


@dataclass
class ScrubStats:
    passes: int = 0
    bytes_hashed: int = 0
    busy_s: float = 0.0
    last_pass_s: float = 0.0


class Scrubber:
    """The background pass of one daemon; `on_corrupt` runs once per corrupted tensor."""

    def __init__(self, arena: CpuArena, entries: tuple[ArenaEntry, ...], digests: Callable[[], Mapping[str, str]],
                 interval_s: float, on_corrupt: Callable[[Corruption], None], share: float = SHARE,
                 locate: Callable[[ArenaEntry], int | None] | None = None) -> None:
        self.arena = arena
        self.entries = entries
        self.digests = digests
        self.interval_s = interval_s
        self.on_corrupt = on_corrupt
        self.share = share
        self.locate = locate
        self.stats = ScrubStats()
        self.found: dict[str, Corruption] = {}
        self._blocks: dict[str, list[int]] = {}  # tensor → CRC32 of each block, from a pass that found it clean
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wcache-scrub", daemon=True)

    def start(self) -> None:
        if self.interval_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # The first pass waits an interval too: the arena was just filled from bytes hashed as they were written,
        # and engines starting against it should not share the cores with a re-check.
        began = time.monotonic()
        while not self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began))):
            began = time.monotonic()
            if not self.scrub_once():
                return  # the weights are gone (released or stopping): nothing left to check

    def scrub_once(self) -> bool:
        """One pass over every tensor not yet found corrupt; False when the arena went away during it."""
        began = time.monotonic()
        try:
            digests = self.digests()  # as built: some may still be being hashed (`OutputDigests`)
        except ArenaClosedError:
            return False
        for entry in self.entries:
            if entry.name in self.found:
                continue
            if self._stop.is_set():
                return False
            try:
                digest, blocks = self._hash(entry)
            except _Gone:
                return False
            if digest == digests[entry.name]:
                self._blocks.setdefault(entry.name, blocks)
                continue
            block = self._locate(entry.name, blocks)
            byte = self.locate(entry) if self.locate is not None else None
            corruption = Corruption(entry.name, entry.offset, entry.nbytes, block, time.time(), byte)
            self.found[entry.name] = corruption
            self.on_corrupt(corruption)
        self.stats.passes += 1
        self.stats.last_pass_s = time.monotonic() - began
        return True

    def _hash(self, entry: ArenaEntry) -> tuple[str, list[int]]:
        """The tensor's digest and its blocks' CRCs, paced to SHARE of one core."""
        blocks: list[int] = []
        last = [time.perf_counter()]

        def each_chunk(data: memoryview) -> None:
            for at in range(0, len(data), BLOCK_BYTES):
                blocks.append(zlib.crc32(data[at : at + BLOCK_BYTES]))
            busy = time.perf_counter() - last[0]
            self.stats.bytes_hashed += len(data)
            self.stats.busy_s += busy
            if self._stop.wait(busy * (1 - self.share) / self.share):
                raise _Gone
            last[0] = time.perf_counter()

        from wcache.load.loader import arena_digest  # here: the CLI reads this module's defaults without it

        try:
            return arena_digest(self.arena, entry.offset, entry.nbytes, each_chunk=each_chunk), blocks
        except ArenaClosedError:
            raise _Gone from None

    def _locate(self, name: str, blocks: list[int]) -> tuple[int, int] | None:
        clean = self._blocks.get(name)
        if clean is None:
            return None
        for i, (was, now) in enumerate(zip(clean, blocks, strict=True)):
            if was != now:
                return i * BLOCK_BYTES, (i + 1) * BLOCK_BYTES
        return None


class _Gone(Exception):
    """The arena was released or the daemon is stopping."""


def first_difference_from_checkpoint(plan: ProcessingPlan, manifest: Sequence[TensorDigest], source: Path,
                                     arena: CpuArena, entry: ArenaEntry) -> int | None:
    """The first byte of engine tensor `entry` that differs from the checkpoint it was made from, when the plan
    made it of checkpoint bytes unchanged and the checkpoint still holds exactly the tensors it was made from
    (each source re-hashed against the manifest first); else None. Reads those tensors: only after a
    difference was found."""
    import numpy as np
    import torch

    from wcache.delta.make import read_tensor, tensor_locations
    from wcache.load.byte_spans import byte_spans
    from wcache.load.loader import processed_digest

    output = next((o for o in plan.outputs if o.name == entry.name), None)
    spans = byte_spans(plan, output) if output is not None else None
    digests = {e.name: e.digest for e in manifest}
    try:
        if spans is None:
            return None
        where = tensor_locations(source)
        for name, span in spans:
            tensor = read_tensor(*where[name])
            if processed_digest(tensor) != digests.get(name):
                return None  # the checkpoint changed since: it cannot say what the arena held
            expected = tensor.reshape(-1).view(torch.uint8).numpy()[span.start : span.start + span.nbytes]
            with arena.bytes_at(entry.offset + span.at, span.nbytes) as data:
                held = np.frombuffer(data, dtype=np.uint8)
                differ = np.flatnonzero(held != expected)
                del held
            if differ.size:
                return span.at + int(differ[0])
    except (WcacheError, KeyError, OSError):
        return None
    return None
