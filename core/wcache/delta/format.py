"""The sparse delta format: what changed between two checkpoints with the same tensors, in one safetensors file.

A delta names its parent, so it is only ever applied to the checkpoint it was made from:

- `__metadata__` holds `format` = "wcache.delta/1", `parent` = the parent's checkpoint digest (the `checkpoint`
  field of its key: the Merkle root over every tensor's bytes) and `checkpoint` = the digest of the checkpoint
  the delta makes, which every application checks its result against. Only a delta `publish` hands the daemon
  that builds it in its own process leaves `checkpoint` out: that daemon names the result from the bytes it
  built (every reader of a delta file from a user requires it).
- For each changed tensor (its Hugging Face checkpoint name N), either
  `N:indices` (int64, 1-D: flat element indices into N, sorted, unique, each in [0, numel)) and `N:values`
  (1-D, N's own dtype, one new value per index), or `N:tensor` (N's dtype and shape: a whole replacement).
  A tensor without entries is unchanged. A delta never adds, removes, reshapes or recasts a tensor.

Reading is strict: the header goes through wcache's safetensors parser, and every violation of the rules above
(an unknown entry, a tensor the parent lacks, unsorted, repeated or out-of-range indices, a dtype or shape that
does not match) is one BadInputError sentence naming the file and the tensor.
"""

from __future__ import annotations

import fcntl
import functools
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from wcache.checkpoint.dtypes import ITEMSIZE, TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.checkpoint.safetensors_write import Entry, write_safetensors, write_safetensors_to
from wcache.errors import BadInputError, CheckpointError
from wcache.key.shard_hash import OpenShard

if TYPE_CHECKING:
    import torch

FORMAT = "wcache.delta/1"
INDICES, VALUES, WHOLE = "indices", "values", "tensor"
_PARTS = (INDICES, VALUES, WHOLE)
_DIGEST = re.compile(r"[0-9a-f]{64}")
# What makes a memfd's bytes fixed for good: a sealed delta is read through a map, never copied.
SEALED = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # its page tables filled at once, not fault by fault


class DeltaError(BadInputError):
    """A delta file breaks the format, or does not fit the checkpoint it is applied to."""


def entry_name(tensor: str, part: str) -> str:
    """The delta entry holding `part` ("indices", "values" or "tensor") of checkpoint tensor `tensor`."""
    return f"{tensor}:{part}"


# Same-size integer containers for element bit patterns: a delta moves bits, never values, so numpy (which has
# no bfloat16 or float8) carries every dtype, and applying a change needs no torch.
BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass(frozen=True, slots=True)
class Change:
    """One changed tensor: new elements at sorted flat indices, or all of them (`indices` None).

    `values` holds the new elements' bit patterns (BITS of the dtype's size), 1-D.
    """

    name: str
    dtype: str  # safetensors dtype, the tensor's own
    shape: tuple[int, ...]
    values: np.ndarray
    indices: np.ndarray | None = None

    @property
    def count(self) -> int:
        """Elements changed (all of them for a whole replacement)."""
        return int(self.values.size)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def torch_values(self) -> torch.Tensor:
        """The new elements as a 1-D tensor of the tensor's dtype (a view of `values`)."""
        import torch

        return torch.from_numpy(self.values).view(getattr(torch, TORCH_NAMES[self.dtype]))

    def apply_to(self, flat: torch.Tensor) -> None:
        """Write the change into `flat`, a 1-D tensor of the tensor's elements (its dtype)."""
        import torch

        if self.indices is None:
            flat.copy_(self.torch_values())
        else:
            flat[torch.from_numpy(self.indices)] = self.torch_values()

    @classmethod
    def of(cls, name: str, values: torch.Tensor, indices: torch.Tensor | None = None) -> Change:
        """A change from tensors: new values (1-D, or the whole new tensor) at `indices` (int64), if given."""
        import torch

        dtype = next(k for k, v in TORCH_NAMES.items() if getattr(torch, v) == values.dtype)
        bits = values.contiguous().reshape(-1).view(getattr(torch, BITS[values.element_size()])).numpy()
        return cls(name, dtype, tuple(values.shape), bits, None if indices is None else indices.numpy())


@dataclass(frozen=True, slots=True)
class DeltaDigests:
    """A delta's parent and child checkpoint digests, from its header alone."""

    path: Path
    parent: str
    checkpoint: str | None  # None only where the reader allowed an unnamed result (`read_delta(named=False)`)

    @property
    def claimed(self) -> str:
        """The checkpoint digest the delta names (a reader that allowed none has no claim to check)."""
        if self.checkpoint is None:
            raise DeltaError(f"{self.path} names no checkpoint digest for what it makes.")
        return self.checkpoint

    def check_parent(self, parent_checkpoint: str, what: str) -> None:
        """DeltaError unless this delta was made from the checkpoint whose digest is `parent_checkpoint`."""
        if parent_checkpoint != self.parent:
            raise DeltaError(
                f"{self.path} was made from checkpoint {self.parent[:12]}, but {what} holds checkpoint "
                f"{parent_checkpoint[:12]}; apply it to its own parent."
            )


@dataclass(frozen=True, slots=True)
class Delta(DeltaDigests):
    """A read and checked delta: its digests, and its changes by tensor name."""

    changes: dict[str, Change]
    file_bytes: int


def _fail(path: Path, what: str) -> DeltaError:
    return DeltaError(f"{path} is not a valid wcache delta: {what}.")


def _open(path: Path, fd: int | None = None) -> OpenShard:
    try:
        return OpenShard(path, fd)
    except CheckpointError as exc:
        raise DeltaError(f"the delta {str(exc)[0].lower()}{str(exc)[1:]}") from None


def _digests(path: Path, meta: Mapping[str, str], named: bool = True) -> DeltaDigests:
    if meta.get("format") != FORMAT:
        raise _fail(path, f"its metadata names format {meta.get('format')!r}, not {FORMAT!r}")
    for field in ("parent", "checkpoint"):
        if field == "checkpoint" and not named and field not in meta:
            continue
        if not _DIGEST.fullmatch(meta.get(field, "")):
            raise _fail(path, f"its metadata has no {field} checkpoint digest (64 hex digits)")
    return DeltaDigests(path, meta["parent"], meta.get("checkpoint"))


def read_digests(path: Path) -> DeltaDigests:
    """The digests a delta names (its header only: for refusing the wrong parent before any work); both are
    required."""
    with _open(path) as shard:
        return _digests(path, shard.header.metadata)


def read_delta(path: Path, parent: Mapping[str, TensorDigest], *, named: bool = True) -> Delta:
    """Read every entry of the delta at `path`, checked against the parent's manifest (name → entry). `named`
    False lets the delta leave out the checkpoint it makes (`Delta.checkpoint` is then None)."""
    with _open(path) as shard:
        return _read_changes(shard, path, parent, named, functools.partial(_read, shard))


def read_sealed_delta(fd: int, label: Path, parent: Mapping[str, TensorDigest]) -> Delta:
    """The delta in memfd `fd` (which this takes), sealed against every write, checked as `read_delta` checks a
    file, `label` naming it in messages; it may leave out the checkpoint it makes. Its entries are views of one
    read-only map of the memfd, not copies: the seals keep its bytes as they were checked for as long as any view
    lives, and a view keeps the map."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd (or one made without sealing): refused below
    if seals & SEALED != SEALED:
        os.close(fd)
        raise DeltaError(f"{label} is not a delta sealed against writes (a memfd sealed F_SEAL_WRITE, "
                         "F_SEAL_SHRINK and F_SEAL_GROW); nothing was read.")
    with _open(label, fd) as shard:
        size = shard.identity.size
        _check_bounded(shard, label, parent)
        mapped = mmap.mmap(shard.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ) \
            if size else None

        def view(info: TensorInfo) -> np.ndarray:
            if mapped is None or not info.nbytes:
                return np.empty(0, dtype=BITS[ITEMSIZE[info.dtype]])
            return np.frombuffer(mapped, dtype=BITS[ITEMSIZE[info.dtype]], count=info.nbytes // ITEMSIZE[info.dtype],
                                 offset=shard.header.data_start + info.start)

        return _read_changes(shard, label, parent, False, view)


def _check_bounded(shard: OpenShard, label: Path, parent: Mapping[str, TensorDigest]) -> None:
    """Refuse a delta larger than any delta of `parent` can be before it is mapped: a memfd's holes cost nothing
    to send but a page each to map (`OpenShard` has checked that its entries cover its data exactly)."""
    data = shard.identity.size - shard.header.data_start
    # Indices and values for every element: more than a whole replacement of every tensor.
    most = sum(math.prod(t.shape) * (ITEMSIZE["I64"] + ITEMSIZE[t.dtype]) for t in parent.values())
    if data > most:
        raise _fail(label, f"its {data} data bytes are more than any delta of its parent can hold ({most})")


def sealed_delta(parent: str, changes: Iterator[Change]) -> int:
    """A delta of `changes` to checkpoint `parent`, naming no result, in a memfd sealed against every write
    (`read_sealed_delta` reads it); its descriptor, the caller's to close."""
    fd = os.memfd_create("wcache-delta", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            write_safetensors_to(out, _entries(changes), {"format": FORMAT, "parent": parent})
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_changes(shard: OpenShard, path: Path, parent: Mapping[str, TensorDigest], named: bool,
                  read: Callable[[TensorInfo], np.ndarray]) -> Delta:
    """Every entry of an open delta, checked against the parent's manifest; `read` gives an entry's elements."""
    header = shard.header
    digests = _digests(path, header.metadata, named)
    parts: dict[str, dict[str, TensorInfo]] = {}
    for info in header.tensors:
        tensor, _, part = info.name.rpartition(":")
        if not tensor or part not in _PARTS:
            raise _fail(path, f"entry {info.name!r} is not NAME:indices, NAME:values or NAME:tensor")
        if tensor not in parent:
            raise _fail(path, f"it changes tensor {tensor!r}, which the parent checkpoint does not hold")
        parts.setdefault(tensor, {})[part] = info
    if parts and digests.checkpoint == digests.parent:
        # Changes that make the very checkpoint they start from: the metadata lies, and applying it would
        # read as "already served" (the parent's own key) whatever the changes make.
        raise _fail(path, f"its metadata names its parent's checkpoint {digests.parent[:12]} as the one it "
                    f"makes, yet it changes {len(parts)} tensor(s)")
    changes = {name: _change(read, path, name, found, parent[name]) for name, found in sorted(parts.items())}
    return Delta(path, digests.parent, digests.checkpoint, changes, shard.identity.size)


def _read(shard: OpenShard, info: TensorInfo) -> np.ndarray:
    """An entry's elements as bit patterns (BITS of its dtype's size), 1-D."""
    data = np.empty(info.nbytes, dtype=np.uint8)
    if info.nbytes:
        shard.read_into(info, 0, data.data)
    return data.view(BITS[ITEMSIZE[info.dtype]])


def _change(read: Callable[[TensorInfo], np.ndarray], path: Path, name: str, found: dict[str, TensorInfo],
            target: TensorDigest) -> Change:
    numel = math.prod(target.shape)
    if WHOLE in found:
        if len(found) > 1:
            raise _fail(path, f"tensor {name!r} has both a whole replacement and sparse entries")
        whole = found[WHOLE]
        if whole.dtype != target.dtype or tuple(whole.shape) != tuple(target.shape):
            raise _fail(path, f"the replacement of {name!r} is {whole.dtype} {list(whole.shape)}, but the parent's "
                              f"tensor is {target.dtype} {list(target.shape)}")
        return Change(name, target.dtype, tuple(target.shape), read(whole))
    if INDICES not in found or VALUES not in found:
        missing = INDICES if INDICES not in found else VALUES
        raise _fail(path, f"tensor {name!r} has no {entry_name(name, missing)!r} entry")
    index_info, value_info = found[INDICES], found[VALUES]
    if index_info.dtype != "I64" or len(index_info.shape) != 1:
        raise _fail(path, f"the indices of {name!r} are {index_info.dtype} {list(index_info.shape)}, not 1-D I64")
    if value_info.dtype != target.dtype:
        raise _fail(path, f"the values of {name!r} are {value_info.dtype}, but the tensor is {target.dtype}")
    if len(value_info.shape) != 1 or value_info.shape[0] != index_info.shape[0]:
        raise _fail(path, f"tensor {name!r} has {index_info.shape[0]} indices but values of shape "
                          f"{list(value_info.shape)}")
    if index_info.shape[0] == 0:
        raise _fail(path, f"tensor {name!r} lists no changed elements")
    indices = read(index_info)
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        bad = int(indices[0]) if int(indices[0]) < 0 else int(indices[-1])
        raise _fail(path, f"index {bad} of {name!r} is outside its {numel} elements")
    # Compared in place: a difference array would be as large as the indices (90 MB a step for a training loop).
    if indices.size > 1 and not bool((indices[1:] > indices[:-1]).all()):
        at = int(np.flatnonzero(indices[1:] <= indices[:-1])[0]) + 1
        kind = "repeated" if int(indices[at]) == int(indices[at - 1]) else "not sorted"
        raise _fail(path, f"the indices of {name!r} are {kind} (at position {at})")
    return Change(name, target.dtype, tuple(target.shape), read(value_info), indices)


def write_delta(path: Path, parent: str, checkpoint: str | None, changes: Iterator[Change]) -> int:
    """Write a delta file (through a temporary name, so a reader never sees half of one); its size in bytes.
    `checkpoint` None leaves the result unnamed, for a daemon that names it from what it builds."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        named = {} if checkpoint is None else {"checkpoint": checkpoint}
        write_safetensors(partial, _entries(changes), {"format": FORMAT, "parent": parent, **named})
        partial.replace(path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise BadInputError(f"{path} cannot be written ({exc.strerror or exc}).") from None
    return path.stat().st_size


def _entries(changes: Iterator[Change]) -> list[Entry]:
    entries: list[Entry] = []
    for change in changes:
        if change.indices is None:
            entries.append(Entry(entry_name(change.name, WHOLE), change.dtype, change.shape, change.values))
        else:
            count = (int(change.indices.size),)
            entries.append(Entry(entry_name(change.name, INDICES), "I64", count, change.indices))
            entries.append(Entry(entry_name(change.name, VALUES), change.dtype, count, change.values))
    return entries
