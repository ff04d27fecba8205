"""Publish the next version from tensors in memory: what a training loop calls with the tensors a step changed.

`publish(parent, changes)` takes the parent daemon (a name or key id) and, by Hugging Face checkpoint name, either
a whole new tensor or (flat int64 indices, values). The changes are checked as a delta file's entries are (a
tensor the parent holds, its dtype and shape, indices 1-D, sorted, unique and in range) and written as a delta.
A refusal raises one sentence and leaves every daemon serving.

Where the parent can build the version in its own process (TP 1, every changed tensor held whole as its checkpoint
bytes: `wcache.daemon.version_host`), the delta goes to it as a memfd sealed against writes, names no result, and the
parent's process maps it, builds, hashes and names the version: nothing is hashed or written to disk here.
Otherwise each changed tensor is hashed here as it will be, to name the new checkpoint digest, and the delta, written
beside the run dir, is built by `start_next_version`, which computes that digest again from the built arena before
publishing. A sparse change's parent tensor then comes from the parent daemon's arena, mapped zero-copy
as the build maps it (`wcache.delta.arena.mapped_parent`), wherever the arena holds it as the checkpoint did,
checked against the parent's manifest and hashed before and after the change in one pass; where the plan transforms
the tensor, from the parent's checkpoint on disk (checked likewise); a parent built from a delta has none, and a
sparse change to such a tensor is one sentence (whole tensors still work).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.daemon.groups import parent_group
from wcache.daemon.launch import start_next_version
from wcache.delta.arena import ParentTensors, mapped_parent, parent_layout, patched_digests
from wcache.delta.format import BITS, Change, DeltaError, sealed_delta, write_delta
from wcache.errors import UnavailableError
from wcache.ipc.run_dir.directory import DaemonDescriptor, default_run_dir, ensure_run_dir
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import BuildNext, Hello, Manifest, WantedKey
from wcache.key.cache_key import WeightCacheKey
from wcache.load.loader import processed_digest

# How the sentence ends when a sparse change's parent tensor is in neither the parent's arena (as the checkpoint
# held it) nor on disk.
_SPARSE_NEEDS = ("publish of sparse changes needs the parent's tensors as the checkpoint held them; whole new "
                 "tensors work")


@dataclass(frozen=True, slots=True)
class Published:
    """The new version: its key (rank 0's), its daemons' names by rank, and, for a version built in its parent's
    process, the bytes written into its arena (None for one built by new processes)."""

    key: WeightCacheKey
    daemons: list[str]
    bytes_written: int | None = None


def _refuse(name: str, what: str) -> DeltaError:
    return DeltaError(f"the change to {name!r} is refused: {what}.")


def _change(name: str, value: object, target: TensorDigest) -> Change:
    import torch

    dtype = TORCH_NAMES[target.dtype]
    if isinstance(value, torch.Tensor):
        if str(value.dtype).removeprefix("torch.") != dtype or tuple(value.shape) != tuple(target.shape):
            raise _refuse(name, f"it is {value.dtype} {list(value.shape)}, but the parent's tensor is "
                                f"{target.dtype} {list(target.shape)}")
        bits = value.detach().cpu().contiguous().reshape(-1).view(getattr(torch, BITS[value.element_size()]))
        # No copy: the caller's tensors are read before `publish` returns (a 1.5 GB step would fault in as much).
        return Change(name, target.dtype, tuple(target.shape), bits.numpy())
    if not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value)):
        raise _refuse(name, "give a whole tensor or (indices, values)")
    indices, values = value
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise _refuse(name, f"its indices are {indices.dtype} {list(indices.shape)}, not 1-D int64")
    if str(values.dtype).removeprefix("torch.") != dtype or values.dim() != 1 or values.numel() != indices.numel():
        raise _refuse(name, f"its values are {values.dtype} {list(values.shape)}, not {indices.numel()} "
                            f"{target.dtype} values")
    if indices.numel() == 0:
        raise _refuse(name, "it lists no changed elements")
    flat = np.ascontiguousarray(indices.detach().cpu().numpy())
    numel = int(np.prod(target.shape))
    if flat.size > 1 and not bool((flat[1:] > flat[:-1]).all()):
        raise _refuse(name, "its indices are not sorted and unique")
    if int(flat[0]) < 0 or int(flat[-1]) >= numel:  # sorted: the ends are the extremes
        raise _refuse(name, f"an index is outside its {numel} elements")
    bits = values.detach().cpu().contiguous().view(getattr(torch, BITS[values.element_size()]))
    return Change(name, target.dtype, tuple(target.shape), bits.numpy(), flat)


def publish(parent: str, changes: Mapping[str, object], *, run_dir: Path | None = None) -> Published:
    """Start the next version of daemon `parent` with `changes` (name → whole tensor or (indices, values)) applied;
    it keeps serving on its own. Raises DeltaError (nothing started) for a change a delta file could not hold,
    UnavailableError when the parent cannot be read.

    A parent at TP 1 whose plan holds the changed tensors as their checkpoint bytes builds the version in its own
    process (`wcache.daemon.version_host`), which hashes it and names it: this process hashes nothing. Any other
    is built by new processes, from a delta naming the checkpoint this process computed."""
    where = ensure_run_dir(run_dir or default_run_dir())
    group = parent_group(where, parent)
    head = group[0]
    if not changes:
        raise DeltaError("publish was given no changed tensor.")
    connection = DaemonConnection(head.socket)
    try:  # the connection's lease keeps the parent serving while its arena is read
        try:
            hello = connection.request(Hello.mine(WantedKey.of(head.key)))
            if hello.status != "hit":
                raise UnavailableError(f"daemon {head.name} answered {hello.status}; it no longer serves its key.")
            manifest = {e.name: e for e in connection.request(Manifest()).tensors}
        except DaemonError as exc:
            raise UnavailableError(f"daemon {head.name} cannot be read ({str(exc).rstrip('.')}).") from None
        made: list[Change] = []
        for name in sorted(changes):
            if name not in manifest:
                raise _refuse(name, "the parent checkpoint holds no such tensor")
            made.append(_change(name, changes[name], manifest[name]))
        if len(group) == 1:
            built = _build_in_place(connection, head, made)
            if built is not None:
                return built
        with tempfile.TemporaryDirectory(prefix="publish-", dir=where) as scratch:
            delta = Path(scratch) / "step.safetensors"
            digests = _new_digests(made, manifest, connection, head)
            new_manifest = tuple(msgspec.structs.replace(e, digest=digests.get(e.name, e.digest))
                                 for e in manifest.values())
            write_delta(delta, head.key.checkpoint, merkle_root(new_manifest), iter(made))
            started = start_next_version(head.name, delta, run_dir=where)
            started.detach()
    finally:
        connection.close()
    descriptors = started.descriptors()
    return Published(descriptors[0].key, [d.name for d in descriptors])


def _build_in_place(connection: DaemonConnection, head: DaemonDescriptor, made: list[Change]) -> Published | None:
    """Ask the parent's process to build and serve the version, the delta sent as a sealed memfd (written once,
    mapped by the daemon, never copied again); None when it says another process must."""
    delta = sealed_delta(head.key.checkpoint, iter(made))
    try:
        reply = connection.request(BuildNext(), (delta,))
    except DaemonError as exc:
        raise UnavailableError(f"daemon {head.name} could not build the next version "
                               f"({str(exc).rstrip('.')}).") from None
    finally:
        os.close(delta)
    if reply.elsewhere is not None:
        return None
    if reply.name is None or reply.checkpoint is None:
        raise UnavailableError(f"daemon {head.name} built the next version but did not name it.")
    key = msgspec.structs.replace(head.key, checkpoint=reply.checkpoint)
    return Published(key, [reply.name], None if reply.already_served else reply.bytes_written)


def _new_digests(made: list[Change], manifest: dict[str, TensorDigest], connection: DaemonConnection,
                 head: DaemonDescriptor) -> dict[str, str]:
    """BLAKE3 of each changed tensor as the change makes it. The parent's arena is mapped only when a change is
    sparse (a whole new tensor needs nothing of the parent), and unmapped before this returns."""
    digests = {c.name: processed_digest(c.torch_values()) for c in made if c.indices is None}
    sparse = [c for c in made if c.indices is not None]
    if not sparse:
        return digests
    plan, entries, total = parent_layout(head, tuple(manifest.values()))
    with mapped_parent(connection, head, plan, entries, total, manifest, _SPARSE_NEEDS) as parent:
        for change in sparse:
            digests[change.name] = _sparse_digest(change, manifest[change.name], parent, head.name)
    return digests


def _sparse_digest(change: Change, target: TensorDigest, parent: ParentTensors, daemon: str) -> str:
    """BLAKE3 of the parent's tensor with sparse `change` applied; the parent's bytes checked against `target`."""
    view = parent.held(change.name)
    if view is None:  # transformed in the arena: from the checkpoint on disk, checked there
        tensor = parent.full(change.name)  # read from the file for this call alone: patched in place
        change.apply_to(tensor.reshape(-1))
        return processed_digest(tensor)
    before, after = patched_digests(view, change)
    if before != target.digest:
        raise UnavailableError(f"tensor {change.name!r} in daemon {daemon}'s arena no longer has the digest its "
                               "manifest names; nothing was published from it.")
    return after
