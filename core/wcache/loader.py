"""Read a checkpoint once and run the processing plan on it: for a daemon's arena or for an engine's disk load.

Both paths go through `ProcessingPlan.produce` with tensors viewed straight from the shards' maps, so a
daemon's arena and a disk load hold byte-identical tensors.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from wcache.arena import ArenaEntry, CpuArena, CudaArena, plan_layout, torch_dtype
from wcache.checkpoint import CheckpointLayout, locate
from wcache.digest_store import DigestStore
from wcache.dtypes import ITEMSIZE
from wcache.errors import CheckpointError
from wcache.fingerprint import FingerprintStats, HashProgress, manifest_of
from wcache.key import KeyFile, make_key_file
from wcache.plan import PlanSpec
from wcache.processing import OutputSpec, ProcessingPlan, build_plan
from wcache.safetensors_header import TensorInfo
from wcache.shard_hash import OpenShard, ShardRecord

# safetensors dtype names to torch dtypes, for viewing checkpoint bytes.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E8M0": torch.float8_e8m0fnu,
}
assert set(_TORCH_DTYPES) == set(ITEMSIZE)


class CheckpointReader:
    """All shards of a checkpoint open at once (one open each); tensors are read-only views of their maps."""

    def __init__(self, layout: CheckpointLayout) -> None:
        self.layout = layout
        self.shards: list[OpenShard] = []
        self.records: dict[Path, ShardRecord] = {}  # filled by fingerprint()
        self._where: dict[str, tuple[OpenShard, TensorInfo]] = {}
        try:
            for path in layout.shards:
                self.shards.append(OpenShard(path))
        except BaseException:
            self.close()
            raise
        for shard in self.shards:
            for tensor in shard.header.tensors:
                self._where[tensor.name] = (shard, tensor)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Views handed out by tensor() pin the maps until they are collected.
        gc.collect()
        for shard in self.shards:
            with contextlib.suppress(BufferError):
                shard.close()

    def tensor(self, name: str) -> torch.Tensor:
        """A read-only view of checkpoint tensor `name`; never write into it, never keep it past close()."""
        found = self._where.get(name)
        if found is None:
            raise CheckpointError(f"{self.layout.root} has no tensor {name!r}.")
        shard, info = found
        dtype = _TORCH_DTYPES[info.dtype]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(shard.tensor_bytes(info), dtype=torch.uint8)
        return raw.view(dtype).reshape(info.shape)

    def fingerprint(
        self, path: Path, spec: PlanSpec, store: DigestStore | None, progress: HashProgress | None
    ) -> KeyFile:
        """Hash every tensor from the open maps, fill the digest store, and return the key."""
        began = time.perf_counter()
        if progress is not None:
            progress.start(sum(s.identity.size for s in self.shards), len(self.shards))
        on_bytes = progress.advance if progress is not None else None
        with ThreadPoolExecutor(thread_name_prefix="wcache-hash") as pool:
            records = {s.path: s.record(s.hash_tensors(pool, on_bytes)) for s in self.shards}
        changed = [s.path for s in self.shards if not s.unchanged()]
        if changed:
            raise CheckpointError(f"{changed[0]} changed while it was being loaded; load it again once written.")
        self.records = records
        if store is not None:
            store.put_many(list(records.values()))
        manifest = manifest_of(self.layout, records)
        total = sum(e.nbytes for e in manifest)
        stats = FingerprintStats(len(self.shards), 0, len(self.shards), total, time.perf_counter() - began)
        return make_key_file(path, self.layout, manifest, spec, stats)


    def check_unchanged(self) -> None:
        """Hash every tensor again and compare with fingerprint(): the bytes a fill copied are the hashed ones.

        A rewrite between hashing and filling (with a same-size write a filesystem with coarse timestamps
        does not even show in the file's identity) would otherwise leave an arena holding other bytes than its
        key and recorded digests describe.
        """
        with ThreadPoolExecutor(thread_name_prefix="wcache-hash") as pool:
            for shard in self.shards:
                again = shard.hash_tensors(pool)
                for tensor, before, now in zip(shard.header.tensors, self.records[shard.path].digests, again,
                                               strict=True):
                    if before != now:
                        raise CheckpointError(
                            f"{shard.path} changed while it was being loaded (tensor {tensor.name!r}); load it "
                            "again once written."
                        )


def produce_all(
    plan: ProcessingPlan, reader: CheckpointReader, slot: Callable[[OutputSpec], torch.Tensor]
) -> None:
    """Run every plan output over the reader's views, writing each into the tensor `slot(output)` gives."""
    for output in plan.outputs:
        plan.produce(output, reader.tensor, out=slot(output))


def processed_digest(tensor: torch.Tensor) -> str:
    """BLAKE3 of a processed tensor's bytes, for later checks of an arena against what was built."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return blake3.blake3(data.numpy()).hexdigest()


@dataclass
class LoadedRank:
    """What a daemon holds for one rank."""

    key_file: KeyFile
    plan: ProcessingPlan
    entries: tuple[ArenaEntry, ...]
    arena: CpuArena | CudaArena
    processed_digests: dict[str, str]
    load_seconds: float


def load_rank(
    path: Path, spec: PlanSpec, device: str, store: DigestStore | None, progress: HashProgress | None = None,
    on_key: Callable[[KeyFile], None] | None = None,
) -> LoadedRank:
    """Read and hash the checkpoint once, run the plan, and fill a fresh arena on `device`.

    `on_key` runs once the key is known and before any arena memory is taken; what it raises ends the load.
    """
    began = time.perf_counter()
    layout = locate(path)
    with CheckpointReader(layout) as reader:
        # Receipts go to the store only once the fill is known to have copied the bytes that were hashed.
        key_file = reader.fingerprint(path, spec, None, progress)
        if on_key is not None:
            on_key(key_file)
        plan = build_plan(key_file.plan, layout.config, key_file.manifest)
        entries, total = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
        arena: CpuArena | CudaArena = CudaArena(total, device) if device.startswith("cuda") else CpuArena(total)
        try:
            slots = arena.tensors(entries)
            produce_all(plan, reader, lambda output: slots[output.name])
            digests = {name: processed_digest(tensor) for name, tensor in slots.items()}
            if isinstance(arena, CpuArena):
                del slots
                gc.collect()  # the views of the writable map must be gone before it is unmapped
                arena.seal()
            reader.check_unchanged()
        except BaseException:
            arena.close()
            raise
        if store is not None:
            store.put_many(list(reader.records.values()))
    return LoadedRank(key_file, plan, entries, arena, digests, time.perf_counter() - began)


def load_from_disk(key_file: KeyFile, path: Path) -> dict[str, torch.Tensor]:
    """An engine's disk load: the same plan over the checkpoint, into tensors the engine owns."""
    layout = locate(path)
    plan = build_plan(key_file.plan, layout.config, key_file.manifest)
    tensors = {o.name: torch.empty(o.shape, dtype=torch_dtype(o.dtype)) for o in plan.outputs}
    with CheckpointReader(layout) as reader:
        produce_all(plan, reader, lambda output: tensors[output.name])
    return tensors
