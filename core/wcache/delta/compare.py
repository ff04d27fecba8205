"""Two checkpoints with the same tensors compared in one read of each: what changed, and both Merkle roots.

Each tensor of the new checkpoint is read whole next to the old one's (two reused buffers), both are BLAKE3-hashed
on a pool, and where the digests differ torch compares them as bit patterns (`!=` and `nonzero` on every core),
so a changed element is found without a Python loop and neither checkpoint is read twice. The digests are the
keys' (their Merkle roots are the delta's parent and checkpoint); the receipts go to the digest store, so the next
key of either checkpoint reads nothing.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.checkpoint.dtypes import ITEMSIZE
from wcache.checkpoint.files import locate
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.delta.format import BITS, Change
from wcache.errors import BadInputError
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import manifest_of
from wcache.key.shard_hash import tensor_hasher
from wcache.load.loader import CheckpointReader
from wcache.load.single_pass import as_buffer, file_order

if TYPE_CHECKING:
    import torch

# Bytes one changed element costs in a sparse entry beside its value: its int64 index.
INDEX_BYTES = 8


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


def change_between(info: TensorInfo, before: torch.Tensor, after: torch.Tensor) -> Change | None:
    """The change from `before` to `after` (uint8 tensors of one tensor's bytes) on bit patterns, so -0.0
    against 0.0 or a rewritten NaN counts: sparse, or whole where that is smaller; None when equal."""
    import torch

    if torch.equal(before, after):
        return None
    itemsize = ITEMSIZE[info.dtype]
    bits = getattr(torch, BITS[itemsize])
    old_bits, new_bits = before.view(bits), after.view(bits)
    indices = torch.ne(old_bits, new_bits).nonzero().reshape(-1)
    shape = tuple(info.shape)
    if indices.numel() * (itemsize + INDEX_BYTES) >= new_bits.numel() * itemsize:
        return Change(info.name, info.dtype, shape, new_bits.clone().numpy())
    return Change(info.name, info.dtype, shape, new_bits[indices].numpy(), indices.numpy())


def _digest(data: torch.Tensor) -> str:
    hasher = tensor_hasher(data.numel())
    if data.numel():
        hasher.update(as_buffer(data))
    return hasher.hexdigest()


def compare_checkpoints(old: Path, new: Path, store: DigestStore | None = None) -> Compared:
    """Read `old` and `new` once each: every changed tensor, and both checkpoints' digests."""
    import torch

    old_layout, new_layout = locate(old), locate(new)
    with CheckpointReader(old_layout) as a, CheckpointReader(new_layout) as b:
        check_same_tensors(old, a.header_manifest(), new, b.header_manifest())
        old_at = {t.name: (shard, t) for shard in a.shards for t in shard.header.tensors}
        largest = max((t.nbytes for s in b.shards for t in s.header.tensors), default=0)
        old_buffer = torch.empty(largest, dtype=torch.uint8)
        new_buffer = torch.empty(largest, dtype=torch.uint8)
        old_digests: dict[str, str] = {}
        new_digests: dict[str, str] = {}
        changed: list[Change] = []
        total = 0
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="wcache-delta-hash") as hashers:
            for shard, info in file_order(b.shards):
                old_shard, old_info = old_at[info.name]
                before, after = old_buffer[: info.nbytes], new_buffer[: info.nbytes]
                if info.nbytes:
                    old_shard.read_into(old_info, 0, as_buffer(before))
                    shard.read_into(info, 0, as_buffer(after))
                hashing = (hashers.submit(_digest, before), hashers.submit(_digest, after))
                old_digests[info.name], new_digests[info.name] = (f.result() for f in hashing)
                # Equal digests are equal bytes: torch compares only what changed, and never beside the hashing.
                same = old_digests[info.name] == new_digests[info.name]
                found = None if same else change_between(info, before, after)
                if found is not None:
                    changed.append(found)
                total += math.prod(info.shape)
        old_records, _ = a.records(old_digests)
        new_records, _ = b.records(new_digests)
    if store is not None:
        store.put_many([*old_records.values(), *new_records.values()])
    parent = merkle_root(manifest_of(old_layout, old_records))
    return Compared(parent, merkle_root(manifest_of(new_layout, new_records)), changed, total)
