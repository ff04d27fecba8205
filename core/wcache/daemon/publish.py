"""Publish the next version from tensors in memory: what a training loop calls with the tensors a step changed.

`publish(parent, changes)` takes the parent daemon (a name or key id) and, by Hugging Face checkpoint name, either
a whole new tensor or (flat int64 indices, values). The changes are checked as a delta file's entries are (a
tensor the parent holds, its dtype and shape, indices 1-D, sorted, unique and in range), each changed tensor is
hashed as it will be (the parent's bytes read from the parent's checkpoint on disk, checked against the parent's
manifest, with the change applied) to name the new checkpoint digest, and the delta is written beside the run dir
and built by `start_next_version`, which computes that digest again from the built arena before publishing. A
refusal raises one sentence and leaves every daemon serving.

Not yet here (issue 29): builds inside the parent's daemon group, a pool of retired arenas, the parent's tensors
from its arena instead of its checkpoint.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.daemon.launch import parent_group, start_next_version
from wcache.delta.format import BITS, Change, DeltaError, write_delta
from wcache.delta.make import read_tensor, tensor_locations
from wcache.errors import UnavailableError
from wcache.ipc.run_dir.directory import default_run_dir, ensure_run_dir
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import Hello, Manifest, WantedKey
from wcache.key.cache_key import WeightCacheKey
from wcache.load.loader import processed_digest


@dataclass(frozen=True, slots=True)
class Published:
    """The new version: its key (rank 0's) and its daemons' names, by rank."""

    key: WeightCacheKey
    daemons: list[str]


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
        return Change(name, target.dtype, tuple(target.shape), bits.clone().numpy())
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
    flat = indices.detach().cpu().numpy()
    numel = int(np.prod(target.shape))
    if int(flat.min()) < 0 or int(flat.max()) >= numel:
        raise _refuse(name, f"an index is outside its {numel} elements")
    if flat.size > 1 and not bool((np.diff(flat) > 0).all()):
        raise _refuse(name, "its indices are not sorted and unique")
    bits = values.detach().cpu().contiguous().view(getattr(torch, BITS[values.element_size()]))
    return Change(name, target.dtype, tuple(target.shape), bits.clone().numpy(), flat.copy())


def publish(parent: str, changes: Mapping[str, object], *, run_dir: Path | None = None) -> Published:
    """Start the next version of daemon `parent` with `changes` (name → whole tensor or (indices, values)) applied;
    its daemons keep running on their own. Raises DeltaError (nothing started) for a change a delta file could not
    hold, UnavailableError when the parent cannot be read."""
    where = ensure_run_dir(run_dir or default_run_dir())
    head = parent_group(where, parent)[0]
    connection = DaemonConnection(head.socket)
    try:
        hello = connection.request(Hello.mine(WantedKey.of(head.key)))
        if hello.status != "hit":
            raise UnavailableError(f"daemon {head.name} answered {hello.status}; it no longer serves its key.")
        manifest = {e.name: e for e in connection.request(Manifest()).tensors}
    except DaemonError as exc:
        raise UnavailableError(f"daemon {head.name} cannot be read ({str(exc).rstrip('.')}).") from None
    finally:
        connection.close()
    if not changes:
        raise DeltaError("publish was given no changed tensor.")
    made: list[Change] = []
    for name in sorted(changes):
        if name not in manifest:
            raise _refuse(name, "the parent checkpoint holds no such tensor")
        made.append(_change(name, changes[name], manifest[name]))
    digests = {c.name: _new_digest(c, manifest[c.name], Path(head.source)) for c in made}
    new_manifest = tuple(msgspec.structs.replace(e, digest=digests.get(e.name, e.digest))
                         for e in manifest.values())
    checkpoint = merkle_root(tuple(sorted(new_manifest, key=lambda e: e.name)))
    with tempfile.TemporaryDirectory(prefix="publish-", dir=where) as scratch:
        delta = Path(scratch) / "step.safetensors"
        write_delta(delta, head.key.checkpoint, checkpoint, iter(made))
        group = start_next_version(head.name, delta, run_dir=where)
        group.detach()
    descriptors = group.descriptors()
    return Published(descriptors[0].key, [d.name for d in descriptors])


def _new_digest(change: Change, target: TensorDigest, source: Path) -> str:
    if change.indices is None:
        return processed_digest(change.torch_values())
    try:
        shard_path, info = tensor_locations(source)[change.name]
    except KeyError:
        raise UnavailableError(f"the parent's checkpoint {source} no longer holds {change.name!r}.") from None
    tensor = read_tensor(shard_path, info)
    if processed_digest(tensor) != target.digest:
        raise UnavailableError(f"{change.name!r} in {shard_path} is no longer the parent daemon's.")
    change.apply_to(tensor.reshape(-1))
    return processed_digest(tensor)
