"""Deltas between checkpoints on disk: write one from two checkpoints, and materialize a delta's checkpoint.

What a trainer (or a test) uses; a daemon applies deltas to its arena instead (`wcache.delta.arena`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.files import locate
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.delta.format import Change, Delta, DeltaError, read_delta, write_delta
from wcache.errors import BadInputError
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache.key.shard_hash import OpenShard

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True, slots=True)
class DeltaSummary:
    """What `make_delta` wrote: the file, its size, and how much of the checkpoint changed."""

    path: Path
    file_bytes: int
    parent: str
    checkpoint: str
    tensors_changed: int
    tensors_whole: int
    elements_changed: int
    elements_total: int


def tensor_locations(path: Path) -> dict[str, tuple[Path, TensorInfo]]:
    """Every tensor of a checkpoint: the shard holding it and its header entry."""
    found: dict[str, tuple[Path, TensorInfo]] = {}
    for shard_path in locate(path).shards:
        with OpenShard(shard_path) as shard:
            for info in shard.header.tensors:
                found[info.name] = (shard_path, info)
    return found


def read_tensor(shard_path: Path, info: TensorInfo) -> torch.Tensor:
    import torch

    data = torch.empty(info.nbytes, dtype=torch.uint8)
    with OpenShard(shard_path) as shard:
        if info.nbytes:
            shard.read_into(info, 0, data.numpy().data)
    return data.view(getattr(torch, TORCH_NAMES[info.dtype]))


def make_delta(old: Path, new: Path, out: Path, store: DigestStore | None = None) -> DeltaSummary:
    """Write the delta that turns checkpoint `old` into checkpoint `new` (same tensors, same shapes and dtypes).

    Each checkpoint is read once, tensor by tensor: both tensors' bytes are hashed (their keys' Merkle roots come
    from these digests, and the receipts go to `store`) while torch compares them as bit patterns on every core.
    """
    from wcache.delta.compare import compare_checkpoints

    compared = compare_checkpoints(old, new, store)
    counts = {"whole": 0, "elements": 0}

    def changes() -> Iterator[Change]:
        for found in compared.changed:
            counts["elements"] += found.count
            if found.indices is None:
                counts["whole"] += 1
            yield found

    size = write_delta(out, compared.parent, compared.checkpoint, changes())
    return DeltaSummary(out, size, compared.parent, compared.checkpoint, len(compared.changed), counts["whole"],
                        counts["elements"], compared.elements_total)


def _check_output_dir(out: Path, old: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInputError(f"{out} already exists and is not an empty directory; choose a new -o DIR.")
    if out.resolve() == locate(old).root.resolve():
        raise BadInputError(f"{out} is the parent checkpoint's own directory; choose a new -o DIR.")


def apply_to_disk(old: Path, delta_path: Path, out: Path, store: DigestStore | None = None) -> KeyFile:
    """Materialize the checkpoint `delta_path` makes from `old` in directory `out` (config, tokenizer and other
    files copied); its key, checked against the checkpoint digest the delta names. Nothing is left in `out`
    when that check fails."""
    import torch

    _check_output_dir(out, old)
    parent = compute_key(old, store=store)
    delta: Delta = read_delta(delta_path, {e.name: e for e in parent.manifest})
    delta.check_parent(parent.key.checkpoint, str(old))
    layout = locate(old)
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        sources = layout.shards if old.is_file() else tuple(p for p in sorted(layout.root.iterdir()) if p.is_file())
        if old.is_file():
            sources += tuple(p for p in sorted(layout.root.iterdir())
                             if p.is_file() and not p.name.endswith(".safetensors"))
        for source in sources:
            shutil.copyfile(source, out / source.name)
        where = tensor_locations(out if old.is_dir() else out / old.name)
        for name, change in delta.changes.items():
            shard_path, info = where[name]
            tensor = read_tensor(shard_path, info)
            change.apply_to(tensor.reshape(-1))
            with OpenShard(shard_path) as shard:
                start = shard.header.data_start + info.start
            fd = os.open(shard_path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, tensor.view(torch.uint8).numpy().data, start)
            finally:
                os.close(fd)
        result = compute_key(out if old.is_dir() else out / old.name, store=store)
        if result.key.checkpoint != delta.claimed:
            raise DeltaError(
                f"applying {delta_path} to {old} gives checkpoint {result.key.checkpoint[:12]}, not the "
                f"{delta.claimed[:12]} the delta names; the delta is damaged."
            )
        return result
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for child in out.iterdir():
                child.unlink()
        raise
