"""One pass over a checkpoint's bytes: each tensor read once, hashed from the buffer it was read into, and the
plan's outputs written to the arena from those same buffers.

So the bytes hashed are the bytes the arena holds, and no second pass re-reads the files to prove it. An output
made of checkpoint bytes unchanged (`byte_spans`) streams through a few reused chunk buffers straight to its place
in the arena, and needs no torch; an output that is one tensor whole shares its digest, and one stacked from
several is hashed back from the arena once written (or, where the caller asks, left for it to hash later). A
tensor that other outputs are computed from (cast, sliced across rows, padded or quantized) stays in memory only
until the last of them is made. The page cache behind the read is dropped, so the pass needs about the arena's
memory and little more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.ipc.arenas.engine_side import torch_dtype
from wcache.key.fingerprint import HashProgress
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard, tensor_hasher
from wcache.load.buffers import HELD_BYTES, typed
from wcache.load.byte_spans import copied_source
from wcache.load.pass_workers import Aborted, Hold, Lane, Workers
from wcache.load.schedule import Schedule, file_order
from wcache.load.shard_sha256 import ShardSha256
from wcache.plan.processing import OutputSpec, ProcessingPlan

if TYPE_CHECKING:
    import torch

# Writes a buffer's bytes at byte `offset` of the arena.
ArenaWrite = Callable[[int, memoryview], None]
# The arena's bytes [offset, offset + nbytes) as written, for hashing an output stacked from several tensors.
ArenaRead = Callable[[int, int], AbstractContextManager[memoryview]]


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass learnt: every tensor's digest, and the digest of every output it wrote."""

    digests: dict[str, str]  # checkpoint tensor name → BLAKE3 of its bytes
    processed: dict[str, str]  # output name → BLAKE3 of the bytes written for it
    sha256: dict[Path, str | None] = field(default_factory=dict)  # shard → SHA-256 of the whole file
    unhashed: tuple[str, ...] = ()  # outputs stacked from several tensors, written but left unhashed (`hash_stacked`)


class _Pass:
    """The reader (the calling thread), and the workers that hash, compute and write behind it."""

    def __init__(self, plan: ProcessingPlan, shards: Sequence[OpenShard], write: ArenaWrite,
                 offsets: Mapping[str, int], progress: HashProgress | None, read_back: ArenaRead | None,
                 file_sha256: bool = True, hash_stacked: bool = True) -> None:
        self.plan = plan
        self.shards = shards
        self.write = write
        self.read_back = read_back
        self.offsets = offsets
        self.progress = progress
        # Outputs stacked from several tensors are hashed back from the arena, so they need a readable one.
        self.schedule = Schedule(plan, spans=read_back is not None)
        self.hash_stacked = hash_stacked
        # stacked output → bytes not yet written, where the pass hashes it back once they are
        self.unwritten = dict(self.schedule.stacked) if hash_stacked else {}
        self.workers = Workers(HELD_BYTES)
        self.cond = self.workers.cond
        self.kept: dict[str, tuple[memoryview, TensorInfo]] = {}  # whole tensors while computed outputs need them
        self.holds: dict[str, Hold] = {}
        self.digests: dict[str, str] = {}
        self.processed: dict[str, str] = {}
        # The arena takes one write at a time anyway (a memfd's writes hold its inode lock), and its writes are
        # the pass's longest chain: they get a thread of their own, and the pool's workers hash and compute.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-write")
        self.writes = Lane(self.workers, self.writer)
        self.shard_sha256 = ShardSha256(self.workers) if file_sha256 else None

    def run(self) -> PassResult:
        try:
            for shard in self.shards:
                shard.advise_sequential()
            current: OpenShard | None = None
            for shard, tensor in file_order(self.shards):
                if shard is not current:
                    if current is not None:
                        self._finish_file(current)
                    if self.shard_sha256 is not None:
                        self.shard_sha256.start(shard)
                current = shard
                self._read(shard, tensor)
            if current is not None:
                self._finish_file(current)
            for name, nbytes in self.unwritten.items():
                if nbytes == 0:  # an empty output: no write will start its hash
                    self.workers.submit(self._hash_back, name)
        except Aborted:
            pass
        finally:
            self.workers.wait_idle()
            self.workers.close()
            self.writer.shutdown()
            if self.shard_sha256 is not None:
                self.shard_sha256.close()
        if self.workers.error is not None:
            raise self.workers.error
        for output in self.plan.outputs:
            source = copied_source(self.plan, output)
            if source is not None:
                self.processed[output.name] = self.digests[source]
        sha256 = self.shard_sha256.digests if self.shard_sha256 is not None else {}
        unhashed = () if self.hash_stacked else tuple(self.schedule.stacked)
        return PassResult(self.digests, self.processed, sha256, unhashed)

    def _finish_file(self, shard: OpenShard) -> None:
        if self.shard_sha256 is not None:
            self.shard_sha256.finish()
        shard.forget_all()

    def _read(self, shard: OpenShard, tensor: TensorInfo) -> None:
        """Read one tensor chunk by chunk; each chunk is hashed (in order) and its bytes written wherever outputs
        hold them, and the whole tensor is kept only for outputs computed from it."""
        spans = self.schedule.spans.get(tensor.name, ())
        computed = self.schedule.computed.get(tensor.name, ())
        hasher = tensor_hasher(tensor.nbytes)
        lane = Lane(self.workers)
        whole: memoryview | None = None
        whole_hold: Hold | None = None
        if computed:
            whole = self.workers.take(tensor.nbytes, wait=True)
            # One reference for the reader and one per computed output; each chunk's tasks add theirs below.
            whole_hold = Hold(1 + len(computed), lambda: self._free_whole(tensor.name, whole, tensor.nbytes))
        for start in range(0, tensor.nbytes, CHUNK_BYTES):
            size = min(CHUNK_BYTES, tensor.nbytes - start)
            end = start + size
            # (arena offset, chunk offset, bytes, span) for every span this chunk has bytes of
            runs = [(self.offsets[s.output] + s.at + lo - s.start, lo - start, hi - lo, s)
                    for s in spans if (lo := max(start, s.start)) < (hi := min(end, s.start + s.nbytes))]
            users = 1 + len(runs) + (self.shard_sha256 is not None)
            if whole is not None and whole_hold is not None:
                chunk, hold = whole[start:end], whole_hold
                with self.cond:
                    hold.refs += users
            else:
                base = self.workers.take(size, wait=True)
                chunk = base[:size]
                hold = Hold(users, functools.partial(self.workers.give, base, size))
            shard.read_into(tensor, start, chunk)
            shard.forget_read(tensor, end)
            if self.progress is not None:
                self.progress.advance(size)
            lane.submit(functools.partial(self._hash_chunk, hasher, chunk, hold))
            if self.shard_sha256 is not None:
                self.shard_sha256.feed(tensor.start + start, chunk, hold)
            for at, lo, n, span in runs:
                self.writes.submit(functools.partial(self._write, at, chunk[lo : lo + n], hold, span.output))
        lane.submit(lambda: self._finish_digest(tensor.name, hasher))
        if whole is not None and whole_hold is not None:
            with self.cond:
                self.kept[tensor.name] = (whole[: tensor.nbytes], tensor)
                self.holds[tensor.name] = whole_hold
            for output in self.schedule.arrived(tensor.name):
                self.workers.submit(self._compute, output)
            self.workers.drop(whole_hold)

    def _hash_chunk(self, hasher: Any, chunk: memoryview, hold: Hold) -> None:
        hasher.update(chunk)
        self.workers.drop(hold)

    def _finish_digest(self, name: str, hasher: Any) -> None:
        digest = hasher.hexdigest()
        with self.cond:
            self.digests[name] = digest

    def _write(self, offset: int, data: memoryview, hold: Hold, output: str | None = None) -> None:
        self.write(offset, data)
        self.workers.drop(hold)
        if output in self.unwritten:
            with self.cond:
                self.unwritten[output] -= len(data)
                done = self.unwritten[output] == 0
            if done:
                self.workers.submit(self._hash_back, output)

    def _hash_back(self, name: str) -> None:
        """An output stacked from several tensors is all written: hash it as the arena holds it."""
        assert self.read_back is not None
        nbytes = self.schedule.stacked[name]
        hasher = tensor_hasher(nbytes)
        if nbytes:
            with self.read_back(self.offsets[name], nbytes) as data:
                hasher.update(data)
        digest = hasher.hexdigest()
        with self.cond:
            self.processed[name] = digest

    def _free_whole(self, name: str, buffer: memoryview, nbytes: int) -> None:
        with self.cond:
            self.kept.pop(name, None)
            self.holds.pop(name, None)
        self.workers.give(buffer, nbytes)

    def _source(self, name: str) -> torch.Tensor:
        buffer, tensor = self.kept[name]
        return typed(buffer, tensor)

    def _compute(self, output: OutputSpec) -> None:
        import torch  # only here: outputs of checkpoint bytes unchanged never wait for it

        nbytes = output.nbytes
        base = self.workers.take(nbytes, wait=False)
        try:
            dtype = torch_dtype(output.dtype)
            out = (torch.frombuffer(base, dtype=torch.uint8, count=nbytes).view(dtype).reshape(output.shape)
                   if nbytes else torch.empty(output.shape, dtype=dtype))
            self.plan.produce(output, self._source, out=out)
        except BaseException:
            self.workers.give(base, nbytes)
            raise
        finally:
            for name in output.sources:
                self.workers.drop(self.holds[name])
        data = base[:nbytes]
        hold = Hold(2, lambda: self.workers.give(base, nbytes))
        self.workers.submit(self._hash_output, output.name, data, hold)
        self.writes.submit(lambda: self._write(self.offsets[output.name], data, hold))

    def _hash_output(self, name: str, data: memoryview, hold: Hold) -> None:
        hasher = tensor_hasher(len(data))
        if len(data):
            hasher.update(data)
        digest = hasher.hexdigest()
        with self.cond:
            self.processed[name] = digest
        self.workers.drop(hold)



def fill_in_one_pass(plan: ProcessingPlan, shards: Sequence[OpenShard], write: ArenaWrite,
                     offsets: Mapping[str, int], progress: HashProgress | None = None,
                     read_back: ArenaRead | None = None, file_sha256: bool = True,
                     hash_stacked: bool = True) -> PassResult:
    """Read every tensor of `shards` once, hash it, and write every output of `plan` at `offsets[output.name]`.

    With `read_back`, outputs made of checkpoint bytes unchanged are written straight from the read buffers and
    need no torch; without (a CUDA arena), only outputs that are one tensor whole are. With `file_sha256`, each
    shard's SHA-256 (what the Hub names an LFS file by) comes from the same buffers, on a thread of its own.
    Without `hash_stacked`, outputs stacked from several tensors are written but not hashed back: the result
    names them (`unhashed`) for the caller to hash once the arena is sealed.
    """
    return _Pass(plan, shards, write, offsets, progress, read_back, file_sha256, hash_stacked).run()
