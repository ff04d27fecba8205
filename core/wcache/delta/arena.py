"""The next version from the daemon holding the parent: its arena, copied, with a delta applied through the plan.

A rank receives the parent daemon's arena as an engine does (hello with the parent's key, a zero-copy map: the
lease keeps the parent serving and unstoppable without --force while the build runs), streams it into a fresh
memfd through two reused buffers (pread, patch, hash, pwrite on a writer thread: no page of either arena is mapped,
which on a VM costs microseconds per 4 KiB page), and writes each change where the plan put those elements:

- an output made of checkpoint bytes unchanged (runs of rows: fused q/k/v and gate/up at TP 1, TP row slices, no
  cast) gets the new bit patterns at their byte offsets while it streams, with no torch;
- another output made of checkpoint slices (TP column slices, a cast, vocab padding) gets the changed elements
  that fall inside its slices, at the coordinates the plan maps them to, cast to its dtype as
  `ProcessingPlan.produce` would cast them, through torch views of the streamed arena;
- an output that is computed from whole tensors (quantized weights and their scales) is made again by the plan
  from its new sources.

Every changed checkpoint tensor is then hashed as it now is, so the new key's checkpoint digest is computed, not
taken from the delta: where the arena holds the tensor whole in its checkpoint dtype (TP 1 without a cast: every
tensor of the default plan) it is hashed from the new arena; otherwise the parent's bytes are read from the
parent's checkpoint on disk (checked against the parent's manifest) and patched. The digest must equal the one
the delta names. Nothing is published until it does; a failure closes the fresh arena and leaves the parent as
it was. A key already served is "already served" (exit 0) only once the changed tensors, made and hashed without an
arena, give that digest too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from wcache._version import __version__
from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest, merkle_root
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.delta.format import Change, Delta, DeltaError, read_delta
from wcache.errors import BadInputError, CheckpointError, UnavailableError
from wcache.ipc.arenas.daemon_side import ArenaEntry, CpuArena, plan_layout
from wcache.ipc.run_dir.directory import DaemonDescriptor, DaemonExistsError
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import Hello, Manifest, MapRequest, WantedKey
from wcache.key.cache_key import KeyFile, WeightCacheKey
from wcache.key.shard_hash import tensor_hasher
from wcache.load.byte_spans import Span, byte_spans
from wcache.load.loader import LoadedRank, OutputDigests, arena_digest, plant_fault, processed_digest
from wcache.plan.processing import Piece, ProcessingPlan, build_plan

if TYPE_CHECKING:
    import torch

# The arena is copied through one buffer of this size: it stays in the CPU's cache between read, patch, hash, write.
_STREAM_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class NextVersion:
    """A built rank, and what it took: the bytes read from files (the delta, and parent tensors the arena could
    not give back), and the tensors and outputs that changed."""

    loaded: LoadedRank
    parent: DaemonDescriptor
    bytes_read: int
    tensors_changed: int
    outputs_changed: int


def find_parent(run_dir: Path, name: str) -> DaemonDescriptor:
    """The running daemon called `name` (a new version's rank starts from it)."""
    from wcache.ipc.run_dir.directory import census

    for descriptor in census(run_dir).live:
        if descriptor.name == name:
            return descriptor
    raise UnavailableError(f"daemon {name} is no longer running; nothing to build the new version from.")


def next_key(parent: WeightCacheKey, checkpoint: str) -> WeightCacheKey:
    """The key of the parent's config, tokenizer, plan and format over checkpoint digest `checkpoint` (a delta
    carries tensors only: a version with another tokenizer is preloaded, not built)."""
    return msgspec.structs.replace(parent, checkpoint=checkpoint)


def build_next(parent: DaemonDescriptor, delta_path: Path, source_label: str,
               on_key: Callable[[WeightCacheKey], None] | None = None) -> NextVersion:
    """Build one rank of the next version from daemon `parent` and the delta at `delta_path`.

    `on_key` runs with the key the delta claims before any arena memory is taken (a daemon takes its lock
    there); the built arena is checked to hold exactly that key. When `on_key` finds that key already served
    (DaemonExistsError, an exit 0), the delta's changes are first checked to make it: a delta that claims a
    served key it does not make is damaged, never "already served".
    """
    began = time.perf_counter()
    if not parent.device == "cpu":
        raise BadInputError(f"building a version from daemon {parent.name} on {parent.device} is not implemented; "
                            "only CPU arenas are.")
    connection = DaemonConnection(parent.socket)
    arena: CpuArena | None = None
    try:
        try:
            hello = connection.request(Hello.mine(WantedKey.of(parent.key)))
            if hello.status != "hit":
                raise UnavailableError(f"daemon {parent.name} answered {hello.status}; it no longer serves its key.")
            manifest = connection.request(Manifest()).tensors
        except DaemonError as exc:
            raise UnavailableError(f"daemon {parent.name} cannot be read ({str(exc).rstrip('.')}).") from None
        by_name = {e.name: e for e in manifest}
        delta = read_delta(delta_path, by_name)
        delta.check_parent(parent.key.checkpoint, f"daemon {parent.name}")
        claimed = next_key(parent.key, delta.claimed)
        plan, entries, total = parent_layout(parent, manifest)
        if on_key is not None:
            try:
                on_key(claimed)
            except DaemonExistsError:
                _check_makes_claim(delta, parent, connection, plan, entries, total, by_name)
                raise
        parent_fd, wire_entries = _map_parent(connection, parent, entries, total)
        try:
            arena = CpuArena(total, "wcache-arena-next")
            build = _Build(plan, delta, by_name, arena, entries, os.dup(parent_fd), wire_entries, Path(parent.source))
        finally:
            os.close(parent_fd)
        try:
            outputs = build.stream()
            outputs += build.apply_computed()
            digests = {name: build.new_digest(name) for name in delta.changes}
            bytes_read = delta.file_bytes + build.bytes_read
        finally:
            build.close()  # every view of the writable map goes before seal() can close it
        new_manifest = _check_root(delta, parent, manifest, digests)
        processed = OutputDigests({e.name: build.processed[e.name] for e in entries})
        plant_fault(arena, entries, processed)
        arena.seal()
        key_file = KeyFile(key=claimed, plan=parent.plan, config=parent.config, manifest_source=new_manifest,
                           source=source_label, created=datetime.now(UTC).isoformat(timespec="seconds"),
                           wcache_version=__version__)
        loaded = LoadedRank(key_file, plan, entries, arena, processed, time.perf_counter() - began)
        return NextVersion(loaded, parent, bytes_read, len(delta.changes), outputs)
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    finally:
        connection.close()  # the lease on the parent ends here, built or not


def copy_with_changes(plan: ProcessingPlan, delta: Delta, manifest: dict[str, TensorDigest], arena: CpuArena,
                      entries: tuple[ArenaEntry, ...], parent_fd: int) -> tuple[dict[str, str], dict[str, str]]:
    """Stream the parent arena open on `parent_fd` (closed here) into `arena` with `delta`'s changes, where every
    output holding a changed tensor is its bytes unchanged (`wcache.delta.hosted_build.not_in_place` says so):
    (every output's processed digest, each changed checkpoint tensor's digest)."""
    build = _Build(plan, delta, manifest, arena, entries, parent_fd, [], Path())
    try:
        build.stream()
        if build.computed:
            raise ValueError(f"output {build.computed[0]!r} is computed; it cannot be streamed")
        return dict(build.processed), {name: build.new_digest(name) for name in delta.changes}
    finally:
        build.close()


def parent_layout(parent: DaemonDescriptor, manifest: tuple[TensorDigest, ...]
                  ) -> tuple[ProcessingPlan, tuple[ArenaEntry, ...], int]:
    """Daemon `parent`'s plan over its manifest, and the arena layout (entries, total bytes) that plan gives: its
    arena's, which `_map_parent` checks the daemon's map reply against."""
    plan = build_plan(parent.plan, parent.config, manifest)
    entries, total = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
    return plan, entries, total


@contextlib.contextmanager
def mapped_parent(connection: DaemonConnection, parent: DaemonDescriptor, plan: ProcessingPlan,
                  entries: tuple[ArenaEntry, ...], total: int, manifest: dict[str, TensorDigest],
                  why: str) -> Iterator[ParentTensors]:
    """The parent's checkpoint tensors, from a zero-copy map of its arena (the lease `connection` holds keeps it
    serving meanwhile) where it holds them whole, else from its checkpoint on disk; `why` ends the sentence raised
    when neither has one. A CUDA arena is not mapped here (it would need the device): its tensors come from disk.
    The map is gone once the block ends, unless the caller still holds a view of it."""
    from wcache.ipc.arenas.engine_side import map_cpu_arena

    views: dict[str, torch.Tensor] = {}
    if parent.device == "cpu":
        fd, wire_entries = _map_parent(connection, parent, entries, total)
        views = map_cpu_arena(fd, total, wire_entries).tensors  # closes fd; the views hold the map
    tensors = ParentTensors(plan, views, manifest, Path(parent.source), why)
    del views
    try:
        yield tensors
    finally:
        tensors.close()


def _map_parent(connection: DaemonConnection, parent: DaemonDescriptor, entries: tuple[ArenaEntry, ...],
                total: int) -> tuple[int, list[Any]]:
    """A zero-copy map of the parent's arena (its memfd, which the caller closes, and its wire entries), checked
    to be laid out as the parent's plan says."""
    try:
        reply = connection.request(MapRequest("zero_copy"))
    except DaemonError as exc:
        raise UnavailableError(f"daemon {parent.name} cannot be mapped ({str(exc).rstrip('.')}).") from None
    if reply.kind != "memfd" or len(reply.fds) != 1:
        raise UnavailableError(f"daemon {parent.name} sent no arena descriptor.")
    if reply.total_bytes != total or [e.to_wire() for e in entries] != reply.entries:
        os.close(reply.fds[0])
        raise UnavailableError(f"daemon {parent.name}'s arena is not laid out as its plan says; it cannot be "
                               "the parent of a new version.")
    return reply.fds[0], reply.entries


def _check_root(delta: Delta, parent: DaemonDescriptor, manifest: tuple[TensorDigest, ...],
                digests: dict[str, str]) -> tuple[TensorDigest, ...]:
    """The parent's manifest with the changed tensors' new `digests`; DeltaError unless its root is the checkpoint
    the delta names."""
    new_manifest = tuple(msgspec.structs.replace(e, digest=digests[e.name]) if e.name in digests else e
                         for e in manifest)
    root = merkle_root(new_manifest)
    if root != delta.claimed:
        raise DeltaError(f"applying {delta.path} to daemon {parent.name} gives checkpoint {root[:12]}, not the "
                         f"{delta.claimed[:12]} the delta names; the delta is damaged.")
    return new_manifest


def _check_makes_claim(delta: Delta, parent: DaemonDescriptor, connection: DaemonConnection, plan: ProcessingPlan,
                       entries: tuple[ArenaEntry, ...], total: int, manifest: dict[str, TensorDigest]) -> None:
    """DeltaError unless the delta's changes, applied to the parent, make the checkpoint it names: only the
    changed tensors are made and hashed (from the parent's arena where it holds them whole, else its files)."""
    with mapped_parent(connection, parent, plan, entries, total, manifest, _REMAKE) as tensors:
        digests = {name: processed_digest(_applied(change, tensors.full, manifest[name].shape))
                   for name, change in delta.changes.items()}
    _check_root(delta, parent, tuple(manifest.values()), digests)


def _applied(change: Change, parent_full: Callable[[str], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Checkpoint tensor `change.name` with `change` applied (a new tensor; the parent's is left as it was). The
    parent's tensor is fetched only for a sparse change: a whole new tensor needs none, so it works where the
    parent's tensor is in neither its arena nor on disk (a parent built from a delta, whose plan casts)."""
    if change.indices is None:
        return change.torch_values().reshape(shape)
    made = parent_full(change.name).clone()
    change.apply_to(made.reshape(-1))
    return made


def patched_digests(tensor: torch.Tensor, change: Change) -> tuple[str, str]:
    """BLAKE3 of contiguous `tensor`'s bytes as they are and with sparse `change` applied, in one pass over them a
    chunk at a time (read, hash, copy into one reused buffer, patch, hash): no copy of the whole tensor is made,
    and each chunk is still in the CPU's cache when hashed the second time."""
    import torch

    data = tensor.reshape(-1).view(torch.uint8).numpy()
    nbytes = data.size
    whole = Span(change.name, 0, nbytes, 0)  # the tensor's bytes, at their own offsets
    before, after = tensor_hasher(nbytes), tensor_hasher(nbytes)
    buffer = np.empty(min(_STREAM_CHUNK, nbytes), dtype=np.uint8)
    for done in range(0, nbytes, _STREAM_CHUNK):
        n = min(_STREAM_CHUNK, nbytes - done)
        np.copyto(buffer[:n], data[done : done + n])
        chunk = buffer.data[:n]
        before.update(chunk)
        _patch(chunk, done, whole, change)
        after.update(chunk)
    return before.hexdigest(), after.hexdigest()




class _Build:
    """One rank's new arena being changed: bytes where the plan keeps checkpoint bytes, torch where it computes.

    An output made of checkpoint bytes unchanged (runs of rows, no cast: all of a TP 1 plan that casts nothing)
    takes each change as bit patterns at byte offsets, with no torch; any other output goes through torch views
    of both arenas, imported only then.
    """

    def __init__(self, plan: ProcessingPlan, delta: Delta, manifest: dict[str, TensorDigest], arena: CpuArena,
                 entries: tuple[ArenaEntry, ...], parent_fd: int, parent_entries: list[Any],
                 parent_source: Path) -> None:
        self.plan = plan
        self.delta = delta
        self.manifest = manifest
        self.arena = arena
        self.entries = entries
        self.offsets = {e.name: e.offset for e in entries}
        self._parent_fd = parent_fd
        self._parent_entries = parent_entries
        self.parent_source = parent_source
        self.spans = {o.name: byte_spans(plan, o) for o in plan.outputs}
        self.processed: dict[str, str] = {}  # output → digest of its new bytes
        self.source_digests: dict[str, str] = {}  # changed checkpoint tensor → digest, where an output holds it whole
        self.computed: list[str] = []  # changed outputs that are not checkpoint bytes: made through torch
        self._torch: _TorchSide | None = None
        self.bytes_read = 0  # from the parent's checkpoint files, for tensors the arena cannot give back

    def torch_side(self) -> _TorchSide:
        if self._torch is None:
            self._torch = _TorchSide(self)
        return self._torch

    def stream(self) -> int:
        """Copy every output from the parent's arena a chunk at a time (pread into one reused buffer, pwrite out:
        no page of either arena is mapped here), writing the changes of outputs made of checkpoint bytes into each
        chunk on the way and hashing it: their digests, and those of the changed checkpoint tensors they hold whole.
        Returns how many of them changed; outputs the plan computes are left for `apply_computed`."""
        changed = 0
        # Two buffers and a writer thread: a chunk is written while the next one is read, patched and hashed.
        buffers = [np.empty(_STREAM_CHUNK, dtype=np.uint8) for _ in range(2)]
        writing: list[Future[None] | None] = [None, None]
        turn = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-next-write") as writer:
            for entry in self.entries:
                spans = self.spans[entry.name]
                pieces = self.plan.recipes[entry.name].pieces
                if any(p.source in self.delta.changes for p in pieces) and spans is None:
                    self.computed.append(entry.name)
                patches = [(source, span, self.delta.changes[source]) for source, span in spans or ()
                           if source in self.delta.changes]
                held_whole = [source for source, span, _ in patches
                              if span.start == 0 and span.nbytes == self.manifest[source].nbytes]
                # An output that is one changed tensor's bytes, all of them, hashes to that tensor's digest: its
                # bytes are hashed once, not twice (half the arena under the fused plan at TP 1).
                alone = next((source for source in held_whole if self.manifest[source].nbytes == entry.nbytes), None)
                wholes = {source: (span, tensor_hasher(span.nbytes)) for source, span, _ in patches
                          if source in held_whole and source != alone}
                changed += bool(patches)
                hasher = tensor_hasher(entry.nbytes)
                done = 0
                while done < entry.nbytes:
                    n = min(_STREAM_CHUNK, entry.nbytes - done)
                    pending = writing[turn]
                    if pending is not None:
                        pending.result()  # this buffer's last write is done: it may be reused
                    chunk = buffers[turn].data[:n]
                    _pread_exact(self._parent_fd, chunk, entry.offset + done)
                    for _, span, change in patches:
                        _patch(chunk, done, span, change)
                    writing[turn] = writer.submit(self.arena.write_at, entry.offset + done, chunk)
                    hasher.update(chunk)
                    for whole_span, whole in wholes.values():
                        lo, hi = max(done, whole_span.at), min(done + n, whole_span.at + whole_span.nbytes)
                        if lo < hi:
                            whole.update(chunk[lo - done : hi - done])
                    done += n
                    turn ^= 1
                self.processed[entry.name] = hasher.hexdigest()
                if alone is not None:
                    self.source_digests[alone] = self.processed[entry.name]
                for source, (_, whole) in wholes.items():
                    self.source_digests[source] = whole.hexdigest()
            for pending in writing:
                if pending is not None:
                    pending.result()
        return changed

    def apply_computed(self) -> int:
        """The changed outputs that are not checkpoint bytes (casts, column slices, quantized weights), through
        torch views of the arena as streamed; their digests hashed back. Returns how many there were."""
        if not self.computed:
            return 0
        side = self.torch_side()
        for name in self.computed:
            recipe = self.plan.recipes[name]
            if recipe.kind == "tensor":
                side.scatter(name, recipe.pieces)
        # Computed outputs last: they read new sources, which the scatter above made in the arena where it could.
        for output in self.plan.outputs:
            if output.name in self.computed and self.plan.recipes[output.name].kind != "tensor":
                self.plan.produce(output, side.new_full, out=side.new_tensors[output.name])
        for entry in self.entries:
            if entry.name in self.computed:
                self.processed[entry.name] = arena_digest(self.arena, entry.offset, entry.nbytes)
        return len(self.computed)

    def new_digest(self, name: str) -> str:
        """BLAKE3 of checkpoint tensor `name` as the delta makes it: hashed while streamed where an output holds
        it whole, else made through torch."""
        digest = self.source_digests.get(name)
        if digest is not None:
            return digest
        return processed_digest(self.torch_side().new_full(name))

    def close(self) -> None:
        if self._torch is not None:
            self._torch = None
            gc.collect()  # torch views hold the maps; nothing else refers to them now
        if self._parent_fd >= 0:
            os.close(self._parent_fd)
            self._parent_fd = -1


def _pread_exact(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise UnavailableError("the parent's arena ended before its announced size.")
        done += got


def _patch(chunk: memoryview, at: int, span: Span, change: Change) -> None:
    """The elements of `change` that land in `chunk` (the output's bytes from `at`), through the run `span` of
    the tensor's bytes that the output holds, as bit patterns."""
    lo, hi = max(at, span.at), min(at + len(chunk), span.at + span.nbytes)
    if lo >= hi:
        return
    itemsize = change.itemsize
    first = (span.start + lo - span.at) // itemsize  # the tensor's element at chunk byte lo - at
    count = (hi - lo) // itemsize
    out = np.frombuffer(chunk, dtype=change.values.dtype, count=count, offset=lo - at)
    if change.indices is None:
        out[:] = change.values[first : first + count]
    else:
        start, stop = np.searchsorted(change.indices, (first, first + count))
        out[change.indices[start:stop] - first] = change.values[start:stop]


class _TorchSide:
    """Torch views of both arenas, and whole checkpoint tensors before and after the delta, from the cheapest
    place that holds them: the arena, else the parent's checkpoint on disk (checked against its manifest)."""

    def __init__(self, build: _Build) -> None:
        from wcache.ipc.arenas.engine_side import map_cpu_arena

        self.build = build
        self.new_tensors = build.arena.tensors(build.entries)
        parent = map_cpu_arena(os.dup(build._parent_fd), build.arena.total_bytes, build._parent_entries)
        self.parent = ParentTensors(build.plan, parent.tensors, build.manifest, build.parent_source, _REMAKE)
        self.new_views = _exact_views(build.plan, self.new_tensors, build.manifest)
        self._made: dict[str, torch.Tensor] = {}

    def parent_full(self, name: str) -> torch.Tensor:
        tensor = self.parent.full(name)
        self.build.bytes_read = self.parent.bytes_read
        return tensor

    def new_full(self, name: str) -> torch.Tensor:
        """Tensor `name` as the delta makes it; the new arena's own view once the plan has written it there."""
        change = self.build.delta.changes.get(name)
        if change is None:
            return self.parent_full(name)
        view = self.new_views.get(name)
        if view is not None:
            return view
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = _applied(change, self.parent_full, self.build.manifest[name].shape)
        return made

    def scatter(self, output: str, pieces: tuple[Piece, ...]) -> None:
        target = self.new_tensors[output]
        row = 0
        for piece in pieces:
            change = self.build.delta.changes.get(piece.source)
            if change is not None:
                _scatter(change, piece, target, row)
            if piece.dim is None:
                return
            row += piece.length if piece.dim == 0 else piece.source_shape[0]


# How a build's sentence ends when a parent tensor is in neither the parent's arena nor its checkpoint on disk.
_REMAKE = "the plan cannot be re-made without it"


class ParentTensors:
    """Whole checkpoint tensors of the parent: views of its arena where it holds them whole in their checkpoint
    dtype, else read from its checkpoint on disk (checked against its manifest; `bytes_read` counts them). `why`
    ends the one sentence raised when the disk has no such tensor (a caller's reason for needing it)."""

    def __init__(self, plan: ProcessingPlan, arena_tensors: dict[str, torch.Tensor],
                 manifest: dict[str, TensorDigest], source: Path, why: str) -> None:
        self.views = _exact_views(plan, arena_tensors, manifest)
        self.manifest = manifest
        self.source = source
        self.why = why
        self.bytes_read = 0
        self._locations: dict[str, tuple[Path, TensorInfo]] | None = None  # the source's headers, read once

    def held(self, name: str) -> torch.Tensor | None:
        """The arena's view of tensor `name` (its checkpoint bytes, not yet checked), or None where the arena
        does not hold it so."""
        return self.views.get(name)

    def full(self, name: str) -> torch.Tensor:
        view = self.views.get(name)
        return view if view is not None else self._from_disk(name)

    def close(self) -> None:
        """Drop the views, so the arena's map goes once nothing else holds one."""
        self.views = {}
        gc.collect()  # torch views hold the map; nothing else refers to them now

    def _from_disk(self, name: str) -> torch.Tensor:
        from wcache.delta.make import read_tensor, tensor_locations

        entry = self.manifest[name]
        source = self.source
        try:
            if self._locations is None:
                self._locations = tensor_locations(source)
            shard_path, info = self._locations[name]
        except (CheckpointError, KeyError):
            raise UnavailableError(
                f"tensor {name!r} is not held whole in the parent's arena (its plan shards, casts or quantizes it) "
                f"and its checkpoint {source} no longer holds it; {self.why}."
            ) from None
        tensor = read_tensor(shard_path, info).reshape(entry.shape)
        self.bytes_read += info.nbytes
        if processed_digest(tensor) != entry.digest:
            raise UnavailableError(f"tensor {name!r} in {shard_path} is no longer the parent daemon's; {self.why}.")
        return tensor


def _exact_views(plan: ProcessingPlan, tensors: dict[str, torch.Tensor],
                 manifest: dict[str, TensorDigest]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors the arena holds whole with their checkpoint dtype (their bytes, unchanged)."""
    return {name: view for name, view in plan.checkpoint_views(tensors).items()
            if str(view.dtype).removeprefix("torch.") == TORCH_NAMES[manifest[name].dtype]}


def _scatter(change: Change, piece: Piece, target: torch.Tensor, row: int) -> None:
    """The elements of `change` inside `piece`'s slice, written at rows from `row` of `target`, cast to its dtype."""
    import torch

    if change.indices is None:
        whole = change.torch_values().reshape(piece.source_shape)
        if piece.dim is None:
            target.copy_(whole)
        else:
            part = whole.narrow(piece.dim, piece.start, piece.length)
            target.narrow(0, row, part.shape[0]).copy_(part)
        return
    values = change.torch_values()
    indices = torch.from_numpy(change.indices)
    if piece.dim is None:
        target.view(-1)[indices] = values.to(target.dtype)
        return
    coords = list(torch.unravel_index(indices, piece.source_shape))
    inside = (coords[piece.dim] >= piece.start) & (coords[piece.dim] < piece.start + piece.length)
    if not bool(inside.any()):
        return
    coords = [c[inside] for c in coords]
    coords[piece.dim] = coords[piece.dim] - piece.start
    coords[0] = coords[0] + row
    flat = torch.zeros_like(coords[0])
    for axis, size in enumerate(target.shape):
        flat = flat * size + coords[axis]
    target.view(-1)[flat] = values[inside].to(target.dtype)
