"""Two checkpoints with the same tensors compared in one read of each: what changed, and both Merkle roots.

Worker threads (one per core, at least two) take tensors in the new checkpoint's file order, each the next one
not taken, and go through a tensor in blocks: a block of each checkpoint is read into the worker's own buffers,
the new one hashed (BLAKE3: the keys' digests), the old one too where no receipt gives its digest, and the two
compared eight bytes at a time (`wide_compare`), all while both blocks are in the core's cache: each byte comes
from memory once, in the read's copy. blake3, numpy and the reads release the GIL, so the workers run side by
side; nothing larger than a block per worker is held and no torch is imported. Where the digest store trusts a
receipt for every shard of the old checkpoint (the rule a preload follows), the old digests come from the receipts
and its bytes are only compared. The receipts of what was hashed go to the store, so the next key of that
checkpoint reads nothing. A tensor changed in so many elements that a whole replacement is the smaller entry is
read once more (only it), and its digest checked against the pass's.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
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
from wcache.key.shard_hash import OpenShard, tensor_hasher
from wcache.load.loader import CheckpointReader
from wcache.load.schedule import file_order

# Bytes one changed element costs in a sparse entry beside its value: its int64 index.
INDEX_BYTES = 8
# A worker reads, hashes and compares a tensor in blocks this size: a block of each checkpoint and the word
# comparison's result stay in a core's L2 cache from the read's copy to the last gather (larger blocks measured
# slower; smaller ones spend more on Python per byte).
BLOCK_BYTES = 512 * 1024
# Every thread of a comparison is named so (what a test looks for once a comparison has ended).
THREAD_PREFIX = "wcache-delta"


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


@dataclass(frozen=True, slots=True)
class _Found:
    """One tensor as the pass found it: its new digest, its old one where hashed, and its changed elements
    (indices and new values, block by block)."""

    digest: str
    old_digest: str | None
    indices: list[np.ndarray]
    values: list[np.ndarray]


class _Worker:
    """One worker thread's buffers, reused for every block of every tensor it takes."""

    def __init__(self) -> None:
        self.before = np.empty(BLOCK_BYTES, dtype=np.uint8)
        self.after = np.empty(BLOCK_BYTES, dtype=np.uint8)
        self.scratch = np.empty(BLOCK_BYTES // WORD_BYTES, dtype=np.bool_)

    def tensor(self, pairing: _Pairing, hash_old: bool) -> _Found:
        """Read both checkpoints' bytes of one tensor once, block by block: digests and changed elements."""
        info = pairing.info
        # Single-threaded hashers: the other workers keep the other cores busy with their tensors.
        new_hasher = blake3.blake3()
        old_hasher = blake3.blake3() if hash_old else None
        elements = ChangedElements(ITEMSIZE[info.dtype], self.scratch)
        indices: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for start in range(0, info.nbytes, BLOCK_BYTES):
            size = min(BLOCK_BYTES, info.nbytes - start)
            before, after = self.before[:size], self.after[:size]
            pairing.old_shard.read_into(pairing.old_info, start, before.data)
            pairing.shard.read_into(info, start, after.data)
            new_hasher.update(after.data)
            if old_hasher is not None:
                old_hasher.update(before.data)
            found_at, found = elements.find(before, after, start // elements.itemsize)
            if found_at.size:
                indices.append(found_at)
                values.append(found)
        return _Found(new_hasher.hexdigest(), None if old_hasher is None else old_hasher.hexdigest(), indices,
                      values)


def _read_both(work: list[_Pairing], hash_old: bool) -> list[_Found]:
    """Every tensor of both checkpoints read once by the workers: what each found, in the order of `work`."""
    found: list[_Found | None] = [None] * len(work)
    claimed = itertools.count()  # the next tensor not taken (next() on it is atomic under the GIL)
    stop = threading.Event()  # set when a worker failed or the caller stopped: the others end after their tensor

    def run() -> None:
        worker = _Worker()
        while not stop.is_set() and (index := next(claimed)) < len(work):
            try:
                found[index] = worker.tensor(work[index], hash_old)
            except BaseException:
                stop.set()
                raise

    workers = max(2, os.cpu_count() or 2)
    with ThreadPoolExecutor(workers, thread_name_prefix=THREAD_PREFIX) as pool:
        try:
            for running in [pool.submit(run) for _ in range(workers)]:
                running.result()
        finally:
            stop.set()
    done = [f for f in found if f is not None]
    assert len(done) == len(work)  # every worker returned, none with an error: each tensor was taken once
    return done


def _change(pairing: _Pairing, found: _Found) -> Change | None:
    """The tensor's change (None when no element changed): sparse, or whole where that is the smaller entry."""
    info = pairing.info
    count = sum(int(part.size) for part in found.indices)
    if not count:
        return None
    itemsize, shape = ITEMSIZE[info.dtype], tuple(info.shape)
    if count * (itemsize + INDEX_BYTES) >= math.prod(shape) * itemsize:
        return Change(info.name, info.dtype, shape, _read_again(pairing, found.digest).view(BITS[itemsize]))
    return Change(info.name, info.dtype, shape, _joined(found.values), _joined(found.indices))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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
        found = _read_both(work, hash_old=receipts is None)
        new_digests = {p.info.name: f.digest for p, f in zip(work, found, strict=True)}
        if receipts is None:
            old_digests = {p.info.name: f.old_digest for p, f in zip(work, found, strict=True) if f.old_digest}
        else:
            old_digests = {t.name: d for r in receipts.values() for t, d in zip(r.header.tensors, r.digests,
                                                                                 strict=True)}
        changed = [c for p, f in zip(work, found, strict=True) if (c := _change(p, f)) is not None]
        old_records, _ = a.records(old_digests)
        new_records, _ = b.records(new_digests)
    if store is not None:
        # Receipts the store already trusts are left as they are (they also hold each file's SHA-256).
        store.put_many([*(old_records.values() if receipts is None else ()), *new_records.values()])
    parent = merkle_root(manifest_of(old_layout, old_records))
    total = sum(math.prod(p.info.shape) for p in work)
    return Compared(parent, merkle_root(manifest_of(new_layout, new_records)), changed, total)
