"""Read a checkpoint once and run the processing plan on it: for a daemon's arena or for an engine's disk load.

Both paths make every output with `ProcessingPlan.produce` (or, for an output that is a checkpoint tensor's bytes
unchanged, those bytes), from one read of each tensor, so a daemon's arena and a disk load hold byte-identical
tensors. Shards are read with pread, never mapped (see shard_hash).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from wcache.checkpoint.files import CheckpointLayout, locate
from wcache.checkpoint.manifest import TensorDigest
from wcache.errors import BadInputError, CheckpointError
from wcache.ipc.arenas.daemon_side import ArenaEntry, CpuArena, CudaArena, plan_layout
from wcache.key.cache_key import KeyFile
from wcache.key.compute import make_key_file, resolve_plan
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import (
    FingerprintStats,
    HashProgress,
    check_read_files,
    files_of,
    hashed_state,
    manifest_of,
    store_root_if_trusted,
)
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard, ShardRecord, tensor_hasher
from wcache.load.disk_read import read_outputs
from wcache.load.sha256_after import Sha256After
from wcache.load.single_pass import fill_in_one_pass
from wcache.plan.processing import ProcessingPlan, build_plan
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    import torch


class CheckpointReader:
    """All shards of a checkpoint open at once: one open and one header read each."""

    def __init__(self, layout: CheckpointLayout) -> None:
        self.layout = layout
        self.shards: list[OpenShard] = []
        try:
            for path in layout.shards:
                self.shards.append(OpenShard(path))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    def header_manifest(self) -> tuple[TensorDigest, ...]:
        """The manifest without digests (names, dtypes, shapes: all a plan needs), the index checked."""
        return manifest_of(self.layout, {s.path: s.record(("",) * len(s.header.tensors)) for s in self.shards})

    def trusted_receipts(self, store: DigestStore | None) -> dict[Path, ShardRecord] | None:
        """Every shard's stored record when the store trusts one for each, for the headers just read; else None."""
        if store is None:
            return None
        receipts = {}
        for shard in self.shards:
            receipt = store.lookup(shard.path, shard.identity)
            # A receipt from before SHA-256 was recorded: the pass computes it, and the key follows the pass.
            if receipt is None or receipt.header != shard.header or receipt.sha256 is None:
                return None
            receipts[shard.path] = receipt
        return receipts

    def records(self, digests: dict[str, str], sha256: dict[Path, str | None] | None = None
                ) -> tuple[dict[Path, ShardRecord], str]:
        """Each shard's record from one pass's digests (and files' SHA-256), once every file read is known to
        have stayed as it was opened, and the checkpoint state they describe (config.json and the index still
        the files read)."""
        changed = [s.path for s in self.shards if not s.unchanged()]
        if changed:
            raise CheckpointError(f"{changed[0]} changed while it was being loaded; load it again once written.")
        files = sha256 or {}
        records = {s.path: s.record(tuple(digests[t.name] for t in s.header.tensors), files.get(s.path))
                   for s in self.shards}
        # The files were opened without a stat before: the state the load started from is that of the opens.
        state = hashed_state(self.layout, [s.identity for s in self.shards], records)
        check_read_files(self.layout)
        return records, state


def _check_receipts(records: dict[Path, ShardRecord], receipts: dict[Path, ShardRecord]) -> None:
    """The pass read what the receipts (and so the key served) describe; a same-size rewrite that kept the
    file's identity (coarse timestamps) would otherwise go unseen."""
    for path, record in records.items():
        for tensor, now, before in zip(record.header.tensors, record.digests, receipts[path].digests, strict=True):
            if now != before:
                raise CheckpointError(
                    f"{path} changed while it was being loaded (tensor {tensor.name!r}); load it again once written."
                )
        if record.sha256 is not None and record.sha256 != receipts[path].sha256:
            raise CheckpointError(f"{path} changed while it was being loaded; load it again once written.")


def processed_digest(tensor: torch.Tensor) -> str:
    """BLAKE3 of a processed tensor's bytes, for later checks of an arena against what was built."""
    import torch

    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    hasher = tensor_hasher(data.numel())
    if data.numel():
        hasher.update(data.numpy().data)
    return hasher.hexdigest()


def changed_in_arena(arena: CpuArena | CudaArena, entries: tuple[ArenaEntry, ...],
                     digests: dict[str, str]) -> tuple[str, ...]:
    """The tensors whose bytes in the arena no longer hash to `digests` (what processed_digest gave at build).

    A CPU arena is hashed from the daemon's map directly (arena_digest): no torch (a daemon that never needed it
    does not import it for a check), and BLAKE3 releases the GIL, so the daemon's other threads answer meanwhile.
    ArenaClosedError when the arena is closed (released or stopping) before the check begins.
    """
    if isinstance(arena, CudaArena):
        return tuple(name for name, tensor in arena.tensors(entries).items()
                     if processed_digest(tensor) != digests[name])
    return tuple(e.name for e in entries if arena_digest(arena, e.offset, e.nbytes) != digests[e.name])


def arena_digest(arena: CpuArena, offset: int, nbytes: int, *,
                 each_chunk: Callable[[memoryview], None] | None = None) -> str:
    """BLAKE3 of arena bytes [offset, offset + nbytes), equal to `processed_digest` of the tensor they hold, read
    without torch. With `each_chunk`, hashes on this thread alone, CHUNK_BYTES at a time, and hands each chunk to
    it once hashed (a background re-check paces itself there)."""
    hasher = tensor_hasher(nbytes) if each_chunk is None else blake3.blake3()
    done = 0
    while done < nbytes:
        step = nbytes - done if each_chunk is None else min(CHUNK_BYTES, nbytes - done)
        with arena.bytes_at(offset + done, step) as data:
            hasher.update(data)
            if each_chunk is not None:
                each_chunk(data)
        done += step
    return hasher.hexdigest()


class OutputDigests:
    """Every output's BLAKE3 as the arena holds it, for later checks of the arena (the background re-check,
    `CheckArena`, a version built from this one).

    A build knows most of them from the bytes it wrote; an output stacked from several tensors (qkv, gate_up: a
    third of a fused arena's bytes) has to be hashed back from the arena, which on two cores lengthens a preload's
    pass by about a seventh. Nothing before READY needs those digests (the key is the checkpoint's), so they are
    hashed from the sealed arena on a thread of their own (`hash_later`), and `result` waits for them.
    """

    def __init__(self, known: Mapping[str, str], stacked: Mapping[str, tuple[int, int]] | None = None) -> None:
        self._digests = dict(known)
        self._stacked = dict(stacked or {})  # output → (offset, nbytes) in the arena, not hashed yet
        self._error: BaseException | None = None
        self._done = threading.Event()
        if not self._stacked:
            self._done.set()

    def hash_now(self, arena: CpuArena) -> None:
        """Hash what is left in this thread (before a planted fault: it stands for a memory error after every
        digest was taken)."""
        if not self._done.is_set():
            self._hash(arena)

    def hash_later(self, arena: CpuArena) -> None:
        """Hash what is left on a thread of its own; the arena is sealed (its map cannot close while viewed)."""
        if not self._done.is_set():
            threading.Thread(target=self._hash, args=(arena,), daemon=True, name="wcache-stacked-digests").start()

    def _hash(self, arena: CpuArena) -> None:
        try:
            # BLAKE3 releases the GIL: the daemon's serve threads answer meanwhile.
            self._digests.update({name: arena_digest(arena, offset, nbytes)
                                  for name, (offset, nbytes) in self._stacked.items()})
        except BaseException as exc:  # ArenaClosedError: released or stopping before it was hashed
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> dict[str, str]:
        """Every output's digest, once hashed; what hashing raised (ArenaClosedError) otherwise."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._digests


FAULT_ENV = "WCACHE_FAULT_FLIP"


def plant_fault(arena: CpuArena | CudaArena, entries: tuple[ArenaEntry, ...], outputs: OutputDigests,
                rank: int = 0) -> None:
    """Fault injection for tests and benchmarks: with WCACHE_FAULT_FLIP=TENSOR:BYTE, flip the low bit of byte BYTE
    of engine tensor TENSOR just before the arena is sealed, after its digests were taken: what a memory error
    does to a filled arena. TENSOR:BYTE@RANK flips it in tensor-parallel rank RANK's arena only (`rank` is this
    arena's). Unset (always, outside tests), it does nothing."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted or not isinstance(arena, CpuArena):
        return
    where, _, only_rank = wanted.partition("@")
    if only_rank and not only_rank.isdigit():
        raise BadInputError(f"{FAULT_ENV}={wanted} does not name a tensor-parallel rank after its @.")
    if only_rank and int(only_rank) != rank:
        return
    name, _, at = where.rpartition(":")
    entry = next((e for e in entries if e.name == name), None)
    if entry is None or not at.isdigit() or int(at) >= entry.nbytes:
        raise BadInputError(f"{FAULT_ENV}={wanted} does not name a byte of an engine tensor.")
    outputs.hash_now(arena)  # the digests of what was built, not of the fault
    with arena.bytes_at(entry.offset + int(at), 1) as byte:
        flipped = bytes([byte[0] ^ 1])
    arena.write_at(entry.offset + int(at), memoryview(flipped))


@dataclass
class LoadedRank:
    """What a daemon holds for one rank."""

    key_file: KeyFile
    plan: ProcessingPlan
    entries: tuple[ArenaEntry, ...]
    arena: CpuArena | CudaArena
    outputs: OutputDigests
    load_seconds: float
    # A cold pass that left each file's SHA-256 for after READY (`sha256_after_ready`): what computes it.
    sha256_after: Sha256After | None = None

    @property
    def processed_digests(self) -> dict[str, str]:
        """Every output's digest as built; waits for those still being hashed (`OutputDigests`)."""
        return self.outputs.result()


def load_rank(
    path: Path, spec: PlanSpec, device: str, store: DigestStore | None, progress: HashProgress | None = None,
    on_key: Callable[[KeyFile], None] | None = None, file_sha256: bool = True, sha256_after_ready: bool = False,
    reusable_arena: bool = False,
) -> LoadedRank:
    """Read and hash the checkpoint in one pass that also fills a fresh arena on `device` with the plan's outputs.

    `on_key` runs once the key is known, and what it raises ends the load: before any arena memory is taken when
    the digest store holds a trusted receipt for every shard (the pass then checks the bytes against them), else
    after the pass, before the rank can serve. Receipts are stored only for a pass that read unchanged files.
    `file_sha256` off skips each shard's SHA-256 (what benchmarks/provenance.py compares against).

    Where the store's receipts hold every file's SHA-256 and the pass finds the header and every tensor's BLAKE3
    as they say, the file's bytes are the ones the SHA-256 was taken of: the pass does not stream it again. On a
    cold pass with `sha256_after_ready`, the key file's SHA-256s are None and the result's `sha256_after`
    computes them once the caller has published the rank (it owns the shards' descriptors until then).
    `reusable_arena` seals the arena so this process may write it again once retired (a version pool's).
    """
    began = time.perf_counter()
    layout = locate(path)
    with CheckpointReader(layout) as reader:
        num_shards = len(reader.shards)
        data_bytes = sum(s.header.data_bytes for s in reader.shards)
        receipts = reader.trusted_receipts(store)
        if receipts is not None:
            stats = FingerprintStats(num_shards, num_shards, 0, 0, time.perf_counter() - began)
            key_file = make_key_file(path, layout, manifest_of(layout, receipts), spec, stats,
                                     files=files_of(layout, receipts), store=store)
            if on_key is not None:
                on_key(key_file)
            resolved, manifest = key_file.plan, key_file.manifest
        else:
            manifest = reader.header_manifest()
            resolved = resolve_plan(layout, manifest, spec)
        plan = build_plan(resolved, layout.config, manifest)
        entries, total = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
        arena: CpuArena | CudaArena = CudaArena(total, device) if device.startswith("cuda") else CpuArena(total)
        try:
            if progress is not None:
                progress.start(sum(s.identity.size for s in reader.shards), num_shards)
            read_back = arena.bytes_at if isinstance(arena, CpuArena) else None
            in_pass = file_sha256 and receipts is None and not sha256_after_ready
            result = fill_in_one_pass(plan, reader.shards, arena.write_at, {e.name: e.offset for e in entries},
                                      progress, read_back, in_pass, hash_stacked=False)
            records, state = reader.records(result.digests, result.sha256)
            if receipts is not None:
                _check_receipts(records, receipts)
            else:
                stats = FingerprintStats(num_shards, 0, num_shards, data_bytes, time.perf_counter() - began)
                key_file = make_key_file(path, layout, manifest_of(layout, records), spec, stats,
                                         files=files_of(layout, records), store=store)
                if store is not None:
                    store.put_many(list(records.values()))
                if on_key is not None:
                    on_key(key_file)
            if store is not None:
                # The root too: an engine's first key after this preload then reads no receipt.
                store_root_if_trusted(store, state, records, key_file.key.checkpoint)
            outputs = OutputDigests(result.processed,
                                    {e.name: (e.offset, e.nbytes) for e in entries if e.name in result.unhashed})
            plant_fault(arena, entries, outputs, spec.tp_rank)
            if isinstance(arena, CpuArena):
                arena.seal(reusable=reusable_arena)
                outputs.hash_later(arena)
        except BaseException:
            arena.close()
            raise
        after = None
        if file_sha256 and receipts is None and sha256_after_ready:
            after = Sha256After(layout, reader.shards, records)
            reader.shards = []  # the descriptors the pass read are the later SHA-256's now
    return LoadedRank(key_file, plan, entries, arena, outputs, time.perf_counter() - began, after)


def load_from_disk(key_file: KeyFile, path: Path) -> dict[str, torch.Tensor]:
    """An engine's disk load: the same plan over the checkpoint, into tensors the engine owns."""
    layout = locate(path)
    plan = build_plan(key_file.plan, layout.config, key_file.manifest)
    with CheckpointReader(layout) as reader:
        return read_outputs(plan, reader.shards)
