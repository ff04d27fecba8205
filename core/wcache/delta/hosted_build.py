"""The next version built in the process of the daemon that serves its parent (`wcache.daemon.version_host`).

No process starts and nothing is mapped that is not mapped already: the parent's arena is this process's own.
The new arena is a fresh one, or a retired one from the version pool (sealed reusable: only this process's map
can write it). Where that retired arena holds an ancestor of the parent, and the host remembers what each step
since changed, it is brought forward by copying only those elements from the parent's arena, then the delta's
elements are written: a step writes O(delta) bytes, not the arena. The host brings a retired arena forward when it
retires (`bring_forward`) and copies a rank's first arena into the pool's spare, so a build usually finds the
parent's own bytes there and writes its delta alone. Otherwise the parent's arena is copied whole
first: into a pooled arena through the maps on every core (its pages are present in this process's map), into a
fresh one streamed with `pwrite` and the changes applied on the way (`wcache.delta.arena.copy_with_changes`: a
fresh map would fault in every page).

Either way every checkpoint tensor written is hashed again, from the new arena, on every core, and the new key's
checkpoint digest is the Merkle root of what was hashed: a delta that names a checkpoint is checked against it,
one that names none (what `publish` sends) is named by it. Only plans whose changed tensors are held whole as
checkpoint bytes build here (TP 1, no cast or quantization of them): `not_in_place` says why another does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import blake3
import msgspec
import numpy as np

from wcache._version import __version__
from wcache.checkpoint.dtypes import TORCH_ITEMSIZE
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.delta.arena import copy_with_changes, next_key
from wcache.delta.format import BITS, Change, Delta, DeltaError
from wcache.ipc.arenas.daemon_side import ArenaEntry, CpuArena
from wcache.key.cache_key import KeyFile
from wcache.load.byte_spans import Span, byte_spans
from wcache.load.loader import LoadedRank, OutputDigests, plant_fault
from wcache.plan.processing import ProcessingPlan

# A step's elements, by checkpoint tensor: sorted flat indices, or None for all of them.
Elements = dict[str, np.ndarray | None]


@dataclass(frozen=True, slots=True)
class StepChanges:
    """What one version changed from its parent (checkpoint digests `parent` → `checkpoint`)."""

    parent: str
    checkpoint: str
    elements: Elements


@dataclass(frozen=True, slots=True)
class HostedBuild:
    """A built rank, the step it made, the bytes written into its arena, and whether an ancestor was brought
    forward (else the parent's arena was copied whole)."""

    loaded: LoadedRank
    step: StepChanges
    bytes_written: int
    forwarded: bool


# Where a checkpoint tensor's bytes are, all of them: (output entry, span) for each output holding them.
Holdings = dict[str, list[tuple[ArenaEntry, Span]]]


def holdings(plan: ProcessingPlan, entries: tuple[ArenaEntry, ...],
             manifest: dict[str, TensorDigest]) -> tuple[Holdings, set[str]]:
    """The checkpoint tensors every output holding them holds whole as bytes, and those some output computes or
    holds in part (a cast, a TP slice, a quantization): the latter cannot be changed in place."""
    held: Holdings = {}
    elsewhere: set[str] = set()
    for entry, output in zip(entries, plan.outputs, strict=True):
        spans = byte_spans(plan, output)
        if spans is None:
            elsewhere.update(p.source for p in plan.recipes[output.name].pieces)
            continue
        for source, span in spans:
            if span.start == 0 and span.nbytes == manifest[source].nbytes:
                held.setdefault(source, []).append((entry, span))
            else:
                elsewhere.add(source)
    return held, elsewhere


def not_in_place(loaded: LoadedRank, names: set[str]) -> str | None:
    """Why tensors `names` cannot be changed in this process's arenas, or None when they can."""
    if not isinstance(loaded.arena, CpuArena):
        return "its arena is on a GPU"
    if loaded.key_file.plan.tp_size != 1:
        return "it is one rank of a tensor-parallel group"
    manifest = {e.name: e for e in loaded.key_file.manifest}
    held, elsewhere = holdings(loaded.plan, loaded.entries, manifest)
    computed = sorted(n for n in names if n in elsewhere or n not in held)
    if computed:
        return f"its plan casts, slices or quantizes {computed[0]!r}"
    return None


def build_hosted(parent: LoadedRank, delta: Delta, arena: CpuArena, path: list[StepChanges] | None,
                 label: str, reusable: bool, workers: ThreadPoolExecutor) -> HostedBuild:
    """Build the next version of `parent` with `delta` into `arena` (fresh, or retired: then `path` lists the
    steps from the version it holds to the parent's, or is None when it holds no ancestor). `reusable` seals a
    fresh arena for the version pool; `workers` (one per core, the host's for its life: threads made per build
    would each leave the allocator an arena of their own) write and hash. Raises DeltaError when the result is
    not the checkpoint the delta names."""
    began = time.perf_counter()
    manifest = {e.name: e for e in parent.key_file.manifest}
    held, _ = holdings(parent.plan, parent.entries, manifest)
    assert isinstance(parent.arena, CpuArena)
    if arena.reusable:  # a pooled arena: written through this process's map, its pages present
        arena.rewrite()
        copied = 0 if path is not None else copy_whole(parent.arena, arena, workers)
        steps = path or []
        changed, digests = _write_and_hash(parent.arena, arena, held, steps, delta.changes, workers)
        written = copied + changed
        outputs = _outputs(parent, held, digests)
    else:  # a fresh one: pwrite gives it its pages as it copies, where a map would fault each one in
        processed, digests = copy_with_changes(parent.plan, delta, manifest, arena, parent.entries,
                                               os.dup(parent.arena.fd))
        outputs = OutputDigests(processed)
        written = arena.total_bytes
    new_manifest = tuple(msgspec.structs.replace(e, digest=digests[e.name]) if e.name in digests else e
                         for e in parent.key_file.manifest)
    root = merkle_root(new_manifest)
    if delta.checkpoint is not None and root != delta.checkpoint:
        raise DeltaError(f"applying {delta.path} to its parent gives checkpoint {root[:12]}, not the "
                         f"{delta.checkpoint[:12]} the delta names; the delta is damaged.")
    plant_fault(arena, parent.entries, outputs)
    if not arena.reusable:
        arena.seal(reusable=reusable)
    outputs.hash_later(arena)
    key_file = KeyFile(key=next_key(parent.key_file.key, root), plan=parent.key_file.plan,
                       config=parent.key_file.config, manifest_source=new_manifest, source=label,
                       created=datetime.now(UTC).isoformat(timespec="seconds"), wcache_version=__version__)
    loaded = LoadedRank(key_file, parent.plan, parent.entries, arena, outputs, time.perf_counter() - began)
    step = StepChanges(parent.key_file.key.checkpoint, root,
                       {name: change.indices for name, change in delta.changes.items()})
    return HostedBuild(loaded, step, written, path is not None)


@contextmanager
def _elements(buffer: memoryview, entry: ArenaEntry, span: Span, itemsize: int) -> Iterator[np.ndarray]:
    """A checkpoint tensor's elements in an arena, as bit patterns of `itemsize` bytes; the view must not outlive
    the block (the arena's map cannot close while viewed)."""
    view = np.frombuffer(buffer, dtype=BITS[itemsize], count=span.nbytes // itemsize, offset=entry.offset + span.at)
    try:
        yield view
    finally:
        del view


# What one worker copies at a time when a pooled arena takes the parent's bytes whole.
_COPY_CHUNK = 64 * 1024 * 1024


def copy_whole(parent: CpuArena, arena: CpuArena, workers: ThreadPoolExecutor) -> int:
    """Every byte of the parent's arena into pooled `arena` (its pages present), in chunks on every core (numpy's
    copy leaves the GIL): the bytes written."""
    target = memoryview(arena.writable())
    try:
        with parent.bytes_at(0, parent.total_bytes) as source:
            def one(at: int) -> None:
                n = min(_COPY_CHUNK, parent.total_bytes - at)
                np.copyto(np.frombuffer(target, np.uint8, n, at), np.frombuffer(source, np.uint8, n, at))

            list(workers.map(one, range(0, parent.total_bytes, _COPY_CHUNK)))
    finally:
        target.release()
    return parent.total_bytes


def bring_forward(source: LoadedRank, arena: CpuArena, path: list[StepChanges],
                  workers: ThreadPoolExecutor) -> int:
    """Bring pooled `arena`, holding the checkpoint `path` starts from, forward to `source`'s (where `path` ends)
    by copying from `source`'s arena only the elements each step changed, then check every tensor touched against
    `source`'s manifest: the bytes written. What a retiring version's arena is given off any publish's path, so
    the next build writes only its own delta. Raises DeltaError when a tensor differs (the arena then holds
    nothing)."""
    manifest = {e.name: e for e in source.key_file.manifest}
    held, _ = holdings(source.plan, source.entries, manifest)
    assert isinstance(source.arena, CpuArena)
    arena.rewrite()
    written, digests = _write_and_hash(source.arena, arena, held, path, {}, workers)
    wrong = sorted(name for name, digest in digests.items() if digest != manifest[name].digest)
    if wrong:
        raise DeltaError(f"bringing a pooled arena forward left {wrong[0]!r} unlike the version it copied.")
    return written


def _write_and_hash(parent: CpuArena, arena: CpuArena, held: Holdings, path: list[StepChanges],
                    changes: Mapping[str, Change], workers: ThreadPoolExecutor) -> tuple[int, dict[str, str]]:
    """Each tensor a step of `path` changed, copied at those elements from the parent's arena, then `changes`'
    elements written, then the tensor hashed (BLAKE3) while its bytes are still in the cache: tensor by tensor, the
    largest first so no core idles at the end, on every core (numpy's indexing and BLAKE3 leave the GIL). The bytes
    written, and the digest of every tensor touched."""
    names = sorted(set(changes).union(*(step.elements for step in path)),
                   key=lambda name: -held[name][0][1].nbytes)
    target = memoryview(arena.writable())
    try:
        with parent.bytes_at(0, parent.total_bytes) as source:
            def one(name: str) -> tuple[int, str]:
                written = 0
                for entry, span in held[name]:
                    itemsize = TORCH_ITEMSIZE[entry.dtype]  # the tensor's own: no cast is held whole
                    with _elements(source, entry, span, itemsize) as old, \
                            _elements(target, entry, span, itemsize) as new:
                        for step in path:  # oldest first; the delta's own elements last, over them
                            if name not in step.elements:
                                continue
                            indices = step.elements[name]
                            if indices is None:
                                new[:] = old
                                written += span.nbytes
                            else:
                                new[indices] = old[indices]
                                written += indices.size * itemsize
                        change = changes.get(name)
                        if change is not None:
                            if change.indices is None:
                                new[:] = change.values
                            else:
                                new[change.indices] = change.values
                            written += change.values.nbytes
                entry, span = held[name][0]
                at = entry.offset + span.at
                return written, blake3.blake3(target[at : at + span.nbytes]).hexdigest()

            done = list(workers.map(one, names))
    finally:
        target.release()
    return sum(w for w, _ in done), {name: digest for name, (_, digest) in zip(names, done, strict=True)}


def _outputs(parent: LoadedRank, held: Holdings, digests: dict[str, str]) -> OutputDigests:
    """Every output's processed digest once the tensors in `digests` changed: an output holding one of them whole
    shares its digest; one stacked from several is left for `OutputDigests` to hash once the version is built."""
    where = {name: (held[name][0][0].offset + held[name][0][1].at, held[name][0][1].nbytes) for name in digests}
    processed = dict(parent.processed_digests)
    stacked: dict[str, tuple[int, int]] = {}
    for entry in {entry.name: entry for name in digests for entry, _ in held[name]}.values():
        same = next((n for n in digests if where[n] == (entry.offset, entry.nbytes)), None)
        if same is not None:
            processed[entry.name] = digests[same]
        else:
            del processed[entry.name]
            stacked[entry.name] = (entry.offset, entry.nbytes)
    return OutputDigests(processed, stacked)
