"""One pass over a checkpoint's bytes: each tensor read once, hashed from the buffer it was read into, and the
plan's outputs written to the arena from those same buffers.

So the bytes hashed are the bytes the arena holds, and no second pass re-reads the files to prove it. An output
made of checkpoint bytes unchanged (a tensor, a run of its rows, or such runs stacked: all of a TP 1 fused plan
that casts nothing) streams through a few reused chunk buffers straight to its place in the arena, and needs no
torch; an output that is one tensor whole shares its digest, and one stacked from several is hashed back from the
arena once written. A tensor that other outputs are computed from (cast, sliced across rows, padded or
quantized) stays in memory only until the last of them is made. The page cache behind the read is dropped, so
the pass needs about the arena's memory and little more.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.checkpoint.dtypes import TORCH_ITEMSIZE, TORCH_NAMES
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.ipc.arenas.engine_side import torch_dtype
from wcache.key.file_digest import FileSha256
from wcache.key.fingerprint import HashProgress
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard, tensor_hasher
from wcache.plan.processing import OutputSpec, ProcessingPlan

if TYPE_CHECKING:
    import torch

# Buffers (chunks, whole tensors, computed outputs) in use before the reader waits for the workers to catch up;
# also about what the pool keeps for reuse.
HELD_BYTES = 64 * 1024 * 1024

# Writes a buffer's bytes at byte `offset` of the arena.
ArenaWrite = Callable[[int, memoryview], None]
# The arena's bytes [offset, offset + nbytes) as written, for hashing an output stacked from several tensors.
ArenaRead = Callable[[int, int], AbstractContextManager[memoryview]]


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [start, start + nbytes) of one checkpoint tensor are bytes [at, at + nbytes) of `output`."""

    output: str
    start: int
    nbytes: int
    at: int


def byte_spans(plan: ProcessingPlan, output: OutputSpec) -> list[tuple[str, Span]] | None:
    """`output` as runs of its sources' bytes, (source, span) in output order, when it is their bytes unchanged:
    no cast, whole tensors or runs of rows stacked along dim 0, no padding. None when it must be computed."""
    recipe = plan.recipes[output.name]
    if recipe.kind != "tensor" or not recipe.pieces:
        return None
    itemsize = TORCH_ITEMSIZE[output.dtype]
    spans: list[tuple[str, Span]] = []
    rows = at = 0
    for piece in recipe.pieces:
        if piece.source_dtype != output.dtype:
            return None
        if piece.dim is None:
            if len(recipe.pieces) != 1 or tuple(recipe.shape) != tuple(piece.source_shape):
                return None
            return [(piece.source, Span(output.name, 0, output.nbytes, 0))]
        if piece.start == 0 and piece.length == piece.source_shape[piece.dim]:
            first, count = 0, piece.source_shape[0]  # all of the source, whichever dim it is cut along
        elif piece.dim == 0:
            first, count = piece.start, piece.length
        else:
            return None  # a slice across rows is not one run of bytes
        if tuple(piece.source_shape[1:]) != tuple(recipe.shape[1:]):
            return None
        row_bytes = math.prod(piece.source_shape[1:]) * itemsize
        spans.append((piece.source, Span(output.name, first * row_bytes, count * row_bytes, at)))
        at += count * row_bytes
        rows += count
    return spans if rows == recipe.shape[0] else None


def copied_source(plan: ProcessingPlan, output: OutputSpec) -> str | None:
    """The checkpoint tensor whose bytes `output` is, unchanged (no cast, slice, fusion or padding), or None."""
    spans = byte_spans(plan, output)
    if spans is None or len(spans) != 1:
        return None
    source, span = spans[0]
    piece = plan.recipes[output.name].pieces[0]
    whole = span.start == 0 and span.nbytes == math.prod(piece.source_shape) * TORCH_ITEMSIZE[output.dtype]
    return source if whole else None


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


def typed(buffer: memoryview, tensor: TensorInfo) -> torch.Tensor:
    """The checkpoint tensor's bytes in `buffer` seen as a torch tensor of its own dtype and shape."""
    import torch

    dtype = torch_dtype(TORCH_NAMES[tensor.dtype])
    if tensor.nbytes == 0:
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=tensor.nbytes).view(dtype).reshape(tensor.shape)


def fresh_buffer(nbytes: int) -> memoryview:
    """`nbytes` of anonymous memory, in huge pages where the kernel offers them (the first touch of a 4 KiB page
    costs microseconds on a VM), given back to the system as soon as it is dropped."""
    if nbytes == 0:
        return memoryview(bytearray())
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous memory, not a file
    with contextlib.suppress(AttributeError, OSError):
        region.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(region)


class BufferPool:
    """Reused uint8 buffers: a buffer given back serves the next request it fits, since fresh memory costs a
    page fault per page. Keeps at most `cap` bytes; a buffer given back past that returns to the system."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._owned = 0  # bytes of the buffers handed out or free
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes` (slice it); give it back whole."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
            while self._free and self._owned + nbytes > self._cap:
                self._owned -= len(self._free.pop(0))
            self._owned += nbytes
        return fresh_buffer(nbytes)

    def give(self, buffer: memoryview) -> None:
        with self._lock:
            if self._owned > self._cap:
                self._owned -= len(buffer)
            else:
                self._free.append(buffer)

    def clear(self) -> None:
        """Return every free buffer to the system now, not whenever the garbage collector gets to them."""
        with self._lock:
            for buffer in self._free:
                self._owned -= len(buffer)
            self._free.clear()


def as_buffer(data: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU uint8 tensor's bytes, for preadv and BLAKE3."""
    return data.numpy().data


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass learnt: every tensor's digest, and the digest of every output it wrote."""

    digests: dict[str, str]  # checkpoint tensor name → BLAKE3 of its bytes
    processed: dict[str, str]  # output name → BLAKE3 of the bytes written for it
    sha256: dict[Path, str | None] = field(default_factory=dict)  # shard → SHA-256 of the whole file


class _Aborted(Exception):
    """A worker failed; the reader stops and the worker's error is raised instead."""


class _Hold:
    """A buffer shared by several tasks; `release` runs when the last of them lets go."""

    __slots__ = ("refs", "release")

    def __init__(self, refs: int, release: Callable[[], None]) -> None:
        self.refs = refs
        self.release = release


class _Lane:
    """Calls run one at a time, in the order given, on the pass's pool: one tensor's hash is fed in order."""

    def __init__(self, owner: _Pass, pool: ThreadPoolExecutor | None = None) -> None:
        self._owner = owner
        self._pool = pool
        self._queue: deque[Callable[[], None]] = deque()
        self._busy = False

    def submit(self, call: Callable[[], None]) -> None:
        with self._owner.cond:
            self._queue.append(call)
            if self._busy:
                return
            self._busy = True
        self._owner.submit(self._drain, pool=self._pool)

    def _drain(self) -> None:
        while True:
            with self._owner.cond:
                if not self._queue or self._owner.error is not None:
                    self._busy = False
                    return
                call = self._queue.popleft()
            call()


class _Pass:
    """The reader (the calling thread) and a pool that hashes, computes and writes behind it."""

    def __init__(self, plan: ProcessingPlan, shards: Sequence[OpenShard], write: ArenaWrite,
                 offsets: Mapping[str, int], progress: HashProgress | None, read_back: ArenaRead | None,
                 file_sha256: bool = True) -> None:
        self.plan = plan
        self.file_sha256 = file_sha256
        self.sha256: dict[Path, str | None] = {}
        self.shards = shards
        self.write = write
        self.read_back = read_back
        self.offsets = offsets
        self.progress = progress
        # Outputs stacked from several tensors are hashed back from the arena, so they need a readable one.
        self.schedule = Schedule(plan, spans=read_back is not None)
        self.unwritten = dict(self.schedule.stacked)  # stacked output → bytes not yet written
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.outstanding = 0  # tasks submitted and not finished
        self.held = 0  # bytes of buffers in use
        self.buffers_pool = BufferPool(HELD_BYTES)
        self.kept: dict[str, tuple[memoryview, TensorInfo]] = {}  # whole tensors while computed outputs need them
        self.holds: dict[str, _Hold] = {}
        self.digests: dict[str, str] = {}
        self.processed: dict[str, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="wcache-fill")
        # The arena takes one write at a time anyway (a memfd's writes hold its inode lock), and its writes are
        # the pass's longest chain: they get a thread of their own, and the pool's workers hash and compute.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-write")
        self.writes = _Lane(self, self.writer)
        # Each file's SHA-256 is one stream in file order, as long as the checkpoint: a thread of its own.
        self.sha_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-sha256")

    # -- tasks ---------------------------------------------------------------------------------------------

    def submit(self, call: Callable[..., None], *args: Any, pool: ThreadPoolExecutor | None = None) -> None:
        with self.cond:
            self.outstanding += 1
        (pool or self.pool).submit(self._run, call, args)

    def _run(self, call: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            if self.error is None:
                call(*args)
        except BaseException as exc:  # handed to the reader, which raises it
            with self.cond:
                self.error = self.error or exc
        finally:
            with self.cond:
                self.outstanding -= 1
                self.cond.notify_all()

    def drop(self, hold: _Hold) -> None:
        with self.cond:
            hold.refs -= 1
            last = hold.refs == 0
        if last:
            hold.release()

    # -- memory ----------------------------------------------------------------------------------------------

    def _take(self, nbytes: int, wait: bool) -> memoryview:
        """A buffer of at least `nbytes`. Only the reader waits (`wait`), and only while workers still run:
        buffers waiting for tensors not read yet free nothing."""
        with self.cond:
            while wait and self.error is None and self.outstanding and self.held + nbytes > HELD_BYTES:
                self.cond.wait()
            if self.error is not None and wait:
                raise _Aborted
            self.held += nbytes
        return self.buffers_pool.take(nbytes)

    def _give(self, buffer: memoryview, nbytes: int) -> None:
        self.buffers_pool.give(buffer)
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()

    # -- the pass ------------------------------------------------------------------------------------------

    def run(self) -> PassResult:
        try:
            for shard in self.shards:
                shard.advise_sequential()
            current: OpenShard | None = None
            file_sha: tuple[_Lane, FileSha256] | None = None
            for shard, tensor in file_order(self.shards):
                if shard is not current:
                    if current is not None:
                        self._finish_file(current, file_sha)
                        current.forget_all()
                    # The reader goes through each file in order: its SHA-256 is a lane fed every chunk in turn.
                    file_sha = (_Lane(self, self.sha_thread), shard.start_sha256()) if self.file_sha256 else None
                current = shard
                self._read(shard, tensor, file_sha)
            if current is not None:
                self._finish_file(current, file_sha)
                current.forget_all()
            for name, nbytes in self.schedule.stacked.items():
                if nbytes == 0:  # an empty output: no write will start its hash
                    self.submit(self._hash_back, name)
        except _Aborted:
            pass
        finally:
            with self.cond:
                while self.outstanding:
                    self.cond.wait()
            self.pool.shutdown()
            self.writer.shutdown()
            self.sha_thread.shutdown()
            self.buffers_pool.clear()
        if self.error is not None:
            raise self.error
        for output in self.plan.outputs:
            source = copied_source(self.plan, output)
            if source is not None:
                self.processed[output.name] = self.digests[source]
        return PassResult(self.digests, self.processed, self.sha256)

    def _finish_file(self, shard: OpenShard, file_sha: tuple[_Lane, FileSha256] | None) -> None:
        if file_sha is not None:
            lane, digest = file_sha
            lane.submit(lambda: self._finish_sha(shard.path, digest))

    def _finish_sha(self, path: Path, digest: FileSha256) -> None:
        with self.cond:
            self.sha256[path] = digest.hexdigest()

    def _sha_chunk(self, digest: FileSha256, offset: int, chunk: memoryview, hold: _Hold) -> None:
        digest.feed(offset, chunk)
        self.drop(hold)

    def _read(self, shard: OpenShard, tensor: TensorInfo, file_sha: tuple[_Lane, FileSha256] | None = None) -> None:
        """Read one tensor chunk by chunk; each chunk is hashed (in order) and its bytes written wherever outputs
        hold them, and the whole tensor is kept only for outputs computed from it."""
        spans = self.schedule.spans.get(tensor.name, ())
        computed = self.schedule.computed.get(tensor.name, ())
        hasher = tensor_hasher(tensor.nbytes)
        lane = _Lane(self)
        whole: memoryview | None = None
        whole_hold: _Hold | None = None
        if computed:
            whole = self._take(tensor.nbytes, wait=True)
            # One reference for the reader and one per computed output; each chunk's tasks add theirs below.
            whole_hold = _Hold(1 + len(computed), lambda: self._free_whole(tensor.name, whole, tensor.nbytes))
        for start in range(0, tensor.nbytes, CHUNK_BYTES):
            size = min(CHUNK_BYTES, tensor.nbytes - start)
            end = start + size
            # (arena offset, chunk offset, bytes, span) for every span this chunk has bytes of
            runs = [(self.offsets[s.output] + s.at + lo - s.start, lo - start, hi - lo, s)
                    for s in spans if (lo := max(start, s.start)) < (hi := min(end, s.start + s.nbytes))]
            users = 1 + len(runs) + (file_sha is not None)
            if whole is not None and whole_hold is not None:
                chunk, hold = whole[start:end], whole_hold
                with self.cond:
                    hold.refs += users
            else:
                base = self._take(size, wait=True)
                chunk = base[:size]
                hold = _Hold(users, functools.partial(self._give, base, size))
            shard.read_into(tensor, start, chunk)
            shard.forget_read(tensor, end)
            if self.progress is not None:
                self.progress.advance(size)
            lane.submit(functools.partial(self._hash_chunk, hasher, chunk, hold))
            if file_sha is not None:
                file_sha[0].submit(functools.partial(self._sha_chunk, file_sha[1],
                                                     shard.header.data_start + tensor.start + start, chunk, hold))
            for at, lo, n, span in runs:
                self.writes.submit(functools.partial(self._write, at, chunk[lo : lo + n], hold, span.output))
        lane.submit(lambda: self._finish_digest(tensor.name, hasher))
        if whole is not None and whole_hold is not None:
            with self.cond:
                self.kept[tensor.name] = (whole[: tensor.nbytes], tensor)
                self.holds[tensor.name] = whole_hold
            for output in self.schedule.arrived(tensor.name):
                self.submit(self._compute, output)
            self.drop(whole_hold)

    def _hash_chunk(self, hasher: Any, chunk: memoryview, hold: _Hold) -> None:
        hasher.update(chunk)
        self.drop(hold)

    def _finish_digest(self, name: str, hasher: Any) -> None:
        digest = hasher.hexdigest()
        with self.cond:
            self.digests[name] = digest

    def _write(self, offset: int, data: memoryview, hold: _Hold, output: str | None = None) -> None:
        self.write(offset, data)
        self.drop(hold)
        if output in self.unwritten:
            with self.cond:
                self.unwritten[output] -= len(data)
                done = self.unwritten[output] == 0
            if done:
                self.submit(self._hash_back, output)

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
        self._give(buffer, nbytes)

    def _source(self, name: str) -> torch.Tensor:
        buffer, tensor = self.kept[name]
        return typed(buffer, tensor)

    def _compute(self, output: OutputSpec) -> None:
        import torch  # only here: outputs of checkpoint bytes unchanged never wait for it

        nbytes = output.nbytes
        base = self._take(nbytes, wait=False)
        try:
            dtype = torch_dtype(output.dtype)
            out = (torch.frombuffer(base, dtype=torch.uint8, count=nbytes).view(dtype).reshape(output.shape)
                   if nbytes else torch.empty(output.shape, dtype=dtype))
            self.plan.produce(output, self._source, out=out)
        except BaseException:
            self._give(base, nbytes)
            raise
        finally:
            for name in output.sources:
                self.drop(self.holds[name])
        data = base[:nbytes]
        hold = _Hold(2, lambda: self._give(base, nbytes))
        self.submit(self._hash_output, output.name, data, hold)
        self.writes.submit(lambda: self._write(self.offsets[output.name], data, hold))

    def _hash_output(self, name: str, data: memoryview, hold: _Hold) -> None:
        hasher = tensor_hasher(len(data))
        if len(data):
            hasher.update(data)
        digest = hasher.hexdigest()
        with self.cond:
            self.processed[name] = digest
        self.drop(hold)


def fill_in_one_pass(plan: ProcessingPlan, shards: Sequence[OpenShard], write: ArenaWrite,
                     offsets: Mapping[str, int], progress: HashProgress | None = None,
                     read_back: ArenaRead | None = None, file_sha256: bool = True) -> PassResult:
    """Read every tensor of `shards` once, hash it, and write every output of `plan` at `offsets[output.name]`.

    With `read_back`, outputs made of checkpoint bytes unchanged are written straight from the read buffers and
    need no torch; without (a CUDA arena), only outputs that are one tensor whole are. With `file_sha256`, each
    shard's SHA-256 (what the Hub names an LFS file by) comes from the same buffers, on a thread of its own.
    """
    return _Pass(plan, shards, write, offsets, progress, read_back, file_sha256).run()


def read_outputs(plan: ProcessingPlan, shards: Sequence[OpenShard]) -> dict[str, torch.Tensor]:
    """Every output of `plan` from one read of each tensor it needs, in tensors the caller owns (a disk load)."""
    import torch

    schedule = Schedule(plan)
    outputs: dict[str, torch.Tensor] = {}
    held: dict[str, tuple[memoryview, torch.Tensor]] = {}  # tensor → (pooled buffer, typed view of it)
    users_left = {name: len(users) for name, users in schedule.computed.items()}
    pool = BufferPool(HELD_BYTES)
    workers = os.cpu_count() or 2
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wcache-read") as readers:
        for shard, tensor in file_order(shards):
            copies = schedule.copies.get(tensor.name, [])
            if tensor.name in schedule.computed:
                # A reused buffer: it lives only until the outputs computed from it are made.
                base = pool.take(tensor.nbytes)
                shard.read_into(tensor, 0, base[: tensor.nbytes])
                view = typed(base[: tensor.nbytes], tensor)
                held[tensor.name] = (base, view)
                for output in copies:
                    outputs[output.name] = view.clone()
                for output in schedule.arrived(tensor.name):
                    outputs[output.name] = plan.produce(output, lambda name: held[name][1])
                    for name in output.sources:
                        users_left[name] -= 1
                        if users_left[name] == 0:
                            pool.give(held.pop(name)[0])
            elif copies:
                # The engine owns these: the first copy is read straight into its own tensor, any other is a
                # clone (an engine may change one in place).
                data = torch.empty(tensor.nbytes, dtype=torch.uint8)
                _read_in_parts(shard, tensor, data, readers, workers)
                view = data.view(torch_dtype(TORCH_NAMES[tensor.dtype])).reshape(tensor.shape)
                for i, output in enumerate(copies):
                    outputs[output.name] = view if i == 0 else view.clone()
            # A tensor no output needs is not read: a disk load does not hash.
    pool.clear()
    return {o.name: outputs[o.name] for o in plan.outputs}


def _read_in_parts(shard: OpenShard, tensor: TensorInfo, data: torch.Tensor, readers: ThreadPoolExecutor,
                   workers: int) -> None:
    """Read a tensor into fresh memory a part per thread: the first touch of each page (a fault) is then paid
    by several cores at once, as a parallel copy would."""
    parts = max(1, min(workers, tensor.nbytes // CHUNK_BYTES))
    bounds = [tensor.nbytes * i // parts for i in range(parts + 1)]
    futures = [readers.submit(shard.read_into, tensor, lo, as_buffer(data[lo:hi]))
               for lo, hi in itertools.pairwise(bounds)]
    for future in futures:
        future.result()
