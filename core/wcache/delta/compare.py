"""Two checkpoints with the same tensors compared in one read of each: what changed, and both Merkle roots.

A reader thread reads both checkpoints chunk by chunk (the new checkpoint's file order) into a few reused buffer
pairs, hashing the new checkpoint's bytes as they arrive (BLAKE3: the keys' digests); the calling thread compares
both eight bytes at a time (`wide_compare`) and hashes the old checkpoint's, block by block while a block is in
its core's cache. Reading, hashing and comparing overlap on two cores, nothing larger than a chunk is held, and no
torch is imported. Where the digest store trusts a receipt for every shard of the old checkpoint (the rule a
preload follows), the old digests come from the receipts and its bytes are only compared. The receipts of what was
hashed go to the store, so the next key of that checkpoint reads nothing. A tensor changed in so many elements that
a whole replacement is the smaller entry is read once more (only it), and its digest checked against the pass's.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

from wcache.checkpoint.dtypes import ITEMSIZE
from wcache.checkpoint.files import locate
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.delta.format import BITS, Change
from wcache.delta.wide_compare import WORD_BYTES, ChangedElements
from wcache.errors import BadInputError, CheckpointError
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import manifest_of
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard, tensor_hasher
from wcache.load.loader import CheckpointReader
from wcache.load.schedule import file_order

# Bytes one changed element costs in a sparse entry beside its value: its int64 index.
INDEX_BYTES = 8
# Buffer pairs between the reader and the comparer: enough that neither waits on the other's jitter.
PAIRS = 4
# The comparer hashes and compares a chunk in blocks this size, which stay in a core's L2 cache between the two.
BLOCK_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Compared:
    """Both checkpoints' digests (Merkle roots) and the changes, in the new checkpoint's file order."""

    parent: str
    checkpoint: str
    changed: list[Change]
    elements_total: int


def check_same_tensors(old: Path, a: tuple[TensorDigest, ...], new: Path, b: tuple[TensorDigest, ...]) -> None:
    """Both checkpoints hold the same tensors with the same dtypes and shapes (from their headers)."""
    by_a, by_b = {e.name: e for e in a}, {e.name: e for e in b}
    added, removed = sorted(set(by_b) - set(by_a)), sorted(set(by_a) - set(by_b))
    if added or removed:
        name = (added or removed)[0]
        how = "adds" if added else "removes"
        raise BadInputError(f"{new} {how} tensor {name!r}; a delta only changes the values of existing tensors.")
    for name, entry in by_a.items():
        if (entry.dtype, entry.shape) != (by_b[name].dtype, by_b[name].shape):
            raise BadInputError(
                f"tensor {name!r} is {entry.dtype} {list(entry.shape)} in {old} but {by_b[name].dtype} "
                f"{list(by_b[name].shape)} in {new}; a delta never reshapes or recasts a tensor."
            )


@dataclass(frozen=True, slots=True)
class _Pairing:
    """One tensor as the two checkpoints hold it."""

    old_shard: OpenShard
    old_info: TensorInfo
    shard: OpenShard
    info: TensorInfo


class _Pair:
    """One chunk's bytes of both checkpoints, reused chunk after chunk."""

    def __init__(self) -> None:
        self.before = np.empty(CHUNK_BYTES, dtype=np.uint8)
        self.after = np.empty(CHUNK_BYTES, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class _Piece:
    """A chunk of tensor `index` read into `pair` (None for a tensor of no bytes), from its byte `start` on; the
    last one carries the new tensor's digest."""

    index: int
    start: int
    nbytes: int
    pair: _Pair | None
    last: bool
    new_digest: str = ""


def _read_pieces(work: list[_Pairing], free: queue.Queue[_Pair | None],
                 ready: queue.Queue[_Piece | BaseException | None]) -> None:
    """The reader thread: every chunk of every tensor of both checkpoints, in order, then None (or the error).

    It also hashes the new checkpoint, a block at a time right after reading it (while the block is in its
    core's cache): the comparer has the comparison and, where no receipt gives them, the old digests, so the two
    threads' work is about even."""
    old_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-delta-read-old")
    try:
        for index, pairing in enumerate(work):
            nbytes = pairing.info.nbytes
            new_hasher = blake3.blake3()  # single-threaded: the other core is comparing
            if nbytes == 0:
                ready.put(_Piece(index, 0, 0, None, True, new_hasher.hexdigest()))
            for start in range(0, nbytes, CHUNK_BYTES):
                pair = free.get()
                if pair is None:  # the comparer stopped
                    return
                size = min(CHUNK_BYTES, nbytes - start)
                # Both files at once: storage then serves two streams side by side, not one and then a seek.
                old_read = old_reader.submit(pairing.old_shard.read_into, pairing.old_info, start,
                                             pair.before[:size].data)
                for at in range(0, size, BLOCK_BYTES):
                    block = pair.after[at : min(at + BLOCK_BYTES, size)].data
                    pairing.shard.read_into(pairing.info, start + at, block)
                    new_hasher.update(block)
                old_read.result()
                last = start + size == nbytes
                ready.put(_Piece(index, start, size, pair, last, new_hasher.hexdigest() if last else ""))
        ready.put(None)
    except BaseException as exc:  # handed to the comparer, which raises it
        ready.put(exc)
    finally:
        old_reader.shutdown()


def _pieces(work: list[_Pairing]) -> Iterator[_Piece]:
    """Every chunk of both checkpoints as the reader thread delivers it; a pair is reused once the next is asked
    for, and the reader stops (within PAIRS chunks) when this generator is closed."""
    free: queue.Queue[_Pair | None] = queue.Queue()
    for _ in range(PAIRS):
        free.put(_Pair())
    ready: queue.Queue[_Piece | BaseException | None] = queue.Queue()
    reader = threading.Thread(target=_read_pieces, args=(work, free, ready), name="wcache-delta-read",
                              daemon=True)
    reader.start()
    try:
        while (piece := ready.get()) is not None:
            if isinstance(piece, BaseException):
                raise piece
            yield piece
            if piece.pair is not None:
                free.put(piece.pair)
    finally:
        free.put(None)
        reader.join()


class _TensorComparison:
    """One tensor's digests and changed elements, chunk by chunk."""

    def __init__(self, pairing: _Pairing, hash_old: bool, scratch: np.ndarray) -> None:
        self.pairing = pairing
        self.old_hasher = blake3.blake3() if hash_old else None  # single-threaded: the other core is reading
        self.elements = ChangedElements(ITEMSIZE[pairing.info.dtype], scratch)
        self.indices: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.count = 0

    def add(self, piece: _Piece) -> None:
        if piece.pair is None:
            return
        itemsize = self.elements.itemsize
        for at in range(0, piece.nbytes, BLOCK_BYTES):
            end = min(at + BLOCK_BYTES, piece.nbytes)
            before, after = piece.pair.before[at:end], piece.pair.after[at:end]
            if self.old_hasher is not None:
                self.old_hasher.update(before.data)
            indices, values = self.elements.find(before, after, (piece.start + at) // itemsize)
            if indices.size:
                self.indices.append(indices)
                self.values.append(values)
                self.count += int(indices.size)

    def change(self, digest: str) -> Change | None:
        """The change (None when no element changed): sparse, or whole where that is the smaller entry."""
        info = self.pairing.info
        if not self.count:
            return None
        itemsize, shape = ITEMSIZE[info.dtype], tuple(info.shape)
        if self.count * (itemsize + INDEX_BYTES) >= math.prod(shape) * itemsize:
            return Change(info.name, info.dtype, shape, _read_again(self.pairing, digest).view(BITS[itemsize]))
        return Change(info.name, info.dtype, shape, np.concatenate(self.values), np.concatenate(self.indices))


def _read_again(pairing: _Pairing, digest: str) -> np.ndarray:
    """A tensor's bytes read once more for a whole replacement, refused unless they are the bytes compared."""
    info = pairing.info
    data = np.empty(info.nbytes, dtype=np.uint8)
    pairing.shard.read_into(info, 0, data.data)
    hasher = tensor_hasher(info.nbytes)
    hasher.update(data.data)
    if hasher.hexdigest() != digest:
        raise CheckpointError(f"{pairing.shard.path} changed while it was being read; write the delta again once "
                              "it is fully written.")
    return data


def compare_checkpoints(old: Path, new: Path, store: DigestStore | None = None) -> Compared:
    """Read `old` and `new` once each: every changed tensor, and both checkpoints' digests."""
    old_layout, new_layout = locate(old), locate(new)
    with CheckpointReader(old_layout) as a, CheckpointReader(new_layout) as b:
        check_same_tensors(old, a.header_manifest(), new, b.header_manifest())
        old_at = {t.name: (shard, t) for shard in a.shards for t in shard.header.tensors}
        work = [_Pairing(*old_at[info.name], shard, info) for shard, info in file_order(b.shards)]
        for shard in (*a.shards, *b.shards):
            shard.advise_sequential()
        receipts = a.trusted_receipts(store)
        old_digests: dict[str, str] = {}
        if receipts is not None:
            old_digests = {t.name: d for r in receipts.values() for t, d in zip(r.header.tensors, r.digests,
                                                                                  strict=True)}
        new_digests: dict[str, str] = {}
        changed: list[Change] = []
        scratch = np.empty(BLOCK_BYTES // WORD_BYTES, dtype=np.bool_)
        comparison: _TensorComparison | None = None
        for piece in _pieces(work):
            if comparison is None:
                comparison = _TensorComparison(work[piece.index], receipts is None, scratch)
            comparison.add(piece)
            if piece.last:
                name = comparison.pairing.info.name
                new_digests[name] = piece.new_digest
                if comparison.old_hasher is not None:
                    old_digests[name] = comparison.old_hasher.hexdigest()
                found = comparison.change(new_digests[name])
                if found is not None:
                    changed.append(found)
                comparison = None
        old_records, _ = a.records(old_digests)
        new_records, _ = b.records(new_digests)
    if store is not None:
        # Receipts the store already trusts are left as they are (they also hold each file's SHA-256).
        store.put_many([*(old_records.values() if receipts is None else ()), *new_records.values()])
    parent = merkle_root(manifest_of(old_layout, old_records))
    total = sum(math.prod(p.info.shape) for p in work)
    return Compared(parent, merkle_root(manifest_of(new_layout, new_records)), changed, total)
