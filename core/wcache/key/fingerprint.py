"""Fingerprint a whole checkpoint: concurrent stats, store lookups, and hashing of whatever is not known."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property, partial
from pathlib import Path
from typing import Protocol

import blake3

from wcache.checkpoint.file_record import FileDigest, FilesSource
from wcache.checkpoint.files import INDEX_NAME, SINGLE_NAME, CheckpointLayout, check_index, why_missing
from wcache.checkpoint.identity import FileIdentity
from wcache.checkpoint.manifest import ManifestSource, TensorDigest, build_manifest, merkle_root
from wcache.errors import CheckpointError
from wcache.key.digest_store import DigestStore, is_trusted
from wcache.key.shard_hash import ShardRecord, hash_shard

# Stats are round trips on remote storage and each blocks a thread: 256 in flight answer most checkpoints in
# one round trip. At 2,000 shards a wider fan-out helped only a filesystem that answers any number at once
# (stats taking 40 ms: 356 ms at 256, 242 ms at 512) and cost one that answers some thousands a second
# (latencyfs at 20 ms: 612 ms against 693 ms), so the cap stays where it bounds what one key asks of a server.
MAX_STAT_THREADS = 256
MAX_SHARD_THREADS = 4
# Names what checkpoint_state covers and how merkle_root builds a root; a change to either must change it,
# so that no root stored by an older wcache is taken for one this version would compute. 2: a root of version 1
# may be another checkpoint's, stored under this one's state when it was swapped while hashed (hashed_state).
ROOT_STATE_VERSION = "wcache.root-state/2"


class HashProgress(Protocol):
    """Receives progress while shards are hashed; calls may come from several threads."""

    def start(self, total_bytes: int, num_files: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


@dataclass(frozen=True, slots=True)
class FingerprintStats:
    """How a fingerprint was obtained: how much came from the store and how much was hashed."""

    num_shards: int
    shards_from_store: int
    shards_hashed: int
    bytes_hashed: int
    seconds: float
    root_from_store: bool = False  # the root itself came from the store: no receipt was decoded


@dataclass(frozen=True)
class Fingerprint:
    """A checkpoint's Merkle root, its manifest sorted by tensor name, and how it was obtained."""

    root: str
    manifest_source: ManifestSource
    stats: FingerprintStats
    files_source: FilesSource = ()  # each shard's size and SHA-256 (provenance)

    @cached_property
    def manifest(self) -> tuple[TensorDigest, ...]:
        return build_manifest(self.manifest_source)


def _stat_one(layout: CheckpointLayout, path: Path) -> FileIdentity:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file.")
        return FileIdentity.of(st)
    except FileNotFoundError:
        if layout.weight_map is not None:
            raise CheckpointError(f"{layout.root / INDEX_NAME} lists shard {path.name}, which {why_missing(path)}.") \
                from None
        if path.name == SINGLE_NAME and path.parent == layout.root and not path.is_symlink():
            raise CheckpointError(f"{layout.root} holds neither {SINGLE_NAME} nor {INDEX_NAME}.") from None
        raise CheckpointError(f"{path} {why_missing(path)}.") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path} {why_missing(path)}.") from None
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None


def _stat_all(layout: CheckpointLayout) -> list[FileIdentity]:
    """Every shard's identity, in layout order; a failure is reported for the first failing shard.

    Each thread drains a shared queue rather than taking one task per shard, and a thread is started only
    while shards remain: where a stat takes microseconds the first thread has drained the queue before a
    few more have started; where it takes a round trip, threads keep starting until every shard is in
    flight (or MAX_STAT_THREADS are).
    """
    pending = deque(enumerate(layout.shards))  # popleft is atomic: the threads share it without a lock
    identities: list[FileIdentity | None] = [None] * len(layout.shards)
    errors: dict[int, CheckpointError] = {}

    def drain() -> None:
        while True:
            try:
                i, path = pending.popleft()
            except IndexError:
                return
            try:
                identities[i] = _stat_one(layout, path)
            except CheckpointError as exc:
                errors[i] = exc

    width = min(MAX_STAT_THREADS, len(layout.shards))
    with ThreadPoolExecutor(max_workers=max(width, 1), thread_name_prefix="wcache-stat") as pool:
        try:
            # Each submit starts a thread, as none is idle until the queue is empty.
            drainers = [pool.submit(drain) for _ in range(width) if pending]
            for drainer in drainers:
                drainer.result()
        finally:
            pending.clear()  # interrupted (Ctrl-C): the threads finish the stat in hand and stop
    if errors:
        raise errors[min(errors)]
    return [identity for identity in identities if identity is not None]


def manifest_of(layout: CheckpointLayout, records: Mapping[Path, ShardRecord]) -> tuple[TensorDigest, ...]:
    """Check the index against the shards' headers and list every tensor's digest, sorted by name."""
    check_index(layout, {p: records[p].header for p in layout.shards}, layout.root / INDEX_NAME)
    manifest = tuple(
        sorted(
            (
                TensorDigest(t.name, t.dtype, t.shape, t.nbytes, digest)
                for path in layout.shards
                for t, digest in zip(records[path].header.tensors, records[path].digests, strict=True)
            ),
            key=lambda e: e.name,
        )
    )
    if not manifest:
        raise CheckpointError(f"{layout.root} holds no tensors.")
    return manifest


def checkpoint_state(layout: CheckpointLayout, identities: Sequence[FileIdentity]) -> str:
    """A digest of everything a checkpoint's Merkle root is computed from, short of reading the shards: each
    shard's file name and full stat identity (device, inode, size, mtime, ctime) in layout order, and the
    index's bytes. Any change to a shard or to the index changes it, so a root stored under it is never stale.
    """
    hasher = blake3.blake3(f"{ROOT_STATE_VERSION}\0{layout.index_digest or '-'}\0{len(identities)}\n".encode())
    for path, i in zip(layout.shards, identities, strict=True):
        # A file name holds neither NUL nor "/": the fields cannot run into each other.
        hasher.update(f"{path.name}\0{i.dev}:{i.ino}\0{i.size}\0{i.mtime_ns}\0{i.ctime_ns}\n".encode())
    return hasher.hexdigest()


class CheckpointChangedError(CheckpointError):
    """What a key (or a preload) read is not one state of the checkpoint: a file was replaced under it."""


def _changed(path: Path, layout: CheckpointLayout) -> CheckpointChangedError:
    return CheckpointChangedError(f"{path} changed while {layout.root} was being read; try again once it stays put.")


def hashed_state(layout: CheckpointLayout, started: Sequence[FileIdentity], records: Mapping[Path, ShardRecord]
                 ) -> str:
    """The checkpoint state `records` describe, the only one their root may be stored under; it must be the
    state the key started from, whose shard identities are `started` (layout order).

    A hashed shard's record holds the identity of the descriptor it was read through, a stored receipt the
    identity it was looked up by. One that is not the identity the key started from was read from another
    file than the one stat saw (a directory exchanged, a symlink flipped, a mount, a shard replaced, between
    the stat and the open): the records mix two checkpoints, and CheckpointChangedError says so before any root
    is computed from them. The one rule for key, attach, preload and the vLLM loader.
    """
    for path, identity in zip(layout.shards, started, strict=True):
        if records[path].identity != identity:
            raise _changed(path, layout)
    return checkpoint_state(layout, [records[path].identity for path in layout.shards])


def check_read_files(layout: CheckpointLayout) -> None:
    """config.json and the index still are the files `layout` was read from, after its shards were read.

    They are read before the shards: a checkpoint swapped for another in between would otherwise give a key
    of one checkpoint's config and another's tensors (the index is covered by the state, the config is not).
    Two stats, asked only where shards were read, which takes long enough for a swap to land in.
    """
    for path, identity in layout.read_files:
        try:
            now: FileIdentity | None = FileIdentity.of(os.stat(path))
        except OSError:
            now = None
        if now != identity:
            raise _changed(path, layout)


def store_root_if_trusted(store: DigestStore, state: str, records: Mapping[Path, ShardRecord], root: str) -> None:
    """Store `root` under `state` (hashed_state of `records`), so the next warm key needs no receipt.

    Only a root whose every receipt the store would trust may stand in for them; a receipt too young for the
    racy-write rule gets its root stored by a later key, once it is trusted.
    """
    if all(is_trusted(r.identity, r.hashed_at_ns) for r in records.values()):
        store.put_root(state, root)


def fingerprint_checkpoint(
    layout: CheckpointLayout,
    store: DigestStore | None,
    *,
    rehash: bool = False,
    progress: HashProgress | None = None,
) -> Fingerprint:
    """Fingerprint every tensor of `layout`; shards with a trusted receipt are not opened at all.

    Where the store holds a root for this exact checkpoint state, that root is the answer and the manifest is
    built from the receipts only when first asked for.
    """
    began = time.perf_counter()
    identities = _stat_all(layout)
    state = checkpoint_state(layout, identities)
    if store is not None and not rehash:
        root = store.lookup_root(state)
        if root is not None:
            stats = FingerprintStats(num_shards=len(layout.shards), shards_from_store=len(layout.shards),
                                     shards_hashed=0, bytes_hashed=0, seconds=time.perf_counter() - began,
                                     root_from_store=True)
            # Built once however many ask (a key file, an "auto" dtype without a config dtype).
            return Fingerprint(root, cache(partial(_manifest_behind, layout, identities, store, root)), stats,
                               cache(partial(_files_behind, layout, identities, store)))
    return _fingerprint_from_records(layout, identities, store, rehash, progress, began)


def _fingerprint_from_records(
    layout: CheckpointLayout,
    identities: list[FileIdentity],
    store: DigestStore | None,
    rehash: bool,
    progress: HashProgress | None,
    began: float,
) -> Fingerprint:
    """The fingerprint built from every shard's record, which must be of the files stat saw (`identities`); its
    root is stored under the state of those files where it may be."""
    records, hashed = _records(layout, identities, store, rehash, progress)
    state = hashed_state(layout, identities, records)
    if hashed:
        check_read_files(layout)
    manifest = manifest_of(layout, records)
    root = merkle_root(manifest)
    if store is not None:
        store_root_if_trusted(store, state, records, root)
    stats = FingerprintStats(
        num_shards=len(layout.shards),
        shards_from_store=len(layout.shards) - len(hashed),
        shards_hashed=len(hashed),
        bytes_hashed=sum(r.header.data_bytes for r in hashed),
        seconds=time.perf_counter() - began,
    )
    return Fingerprint(root, manifest, stats, files_of(layout, records))


def files_of(layout: CheckpointLayout, records: Mapping[Path, ShardRecord]) -> tuple[FileDigest, ...]:
    """Each shard's name (under the checkpoint's directory), size and SHA-256, in layout order."""
    return tuple(FileDigest(_name_under(layout.root, path), records[path].identity.size, records[path].sha256)
                 for path in layout.shards)


def _name_under(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:  # a single .safetensors file given by its own path
        return path.name


def _files_behind(layout: CheckpointLayout, identities: list[FileIdentity], store: DigestStore
                  ) -> tuple[FileDigest, ...]:
    """The files' SHA-256 of a key whose root came from the store: from the receipts, where it holds them."""
    reopened = None if store.enabled else DigestStore.open(store.directory)  # the caller closed it since
    try:
        records = (reopened or store).lookup_many(list(zip(layout.shards, identities, strict=True)))
    finally:
        if reopened is not None:
            reopened.close()
    return tuple(FileDigest(_name_under(layout.root, p), i.size, records[p].sha256 if p in records else None)
                 for p, i in zip(layout.shards, identities, strict=True))


def _records(
    layout: CheckpointLayout,
    identities: list[FileIdentity],
    store: DigestStore | None,
    rehash: bool,
    progress: HashProgress | None,
) -> tuple[dict[Path, ShardRecord], list[ShardRecord]]:
    """Every shard's record, from the store where trusted, and those hashed (and stored) because not."""
    records: dict[Path, ShardRecord] = {}
    if store is not None and not rehash:
        records = store.lookup_many(list(zip(layout.shards, identities, strict=True)))

    cold = [(p, i) for p, i in zip(layout.shards, identities, strict=True) if p not in records]
    hashed: list[ShardRecord] = []
    if cold:
        if progress is not None:
            progress.start(sum(i.size for _, i in cold), len(cold))
        on_bytes = progress.advance if progress is not None else None
        workers = os.cpu_count() or 2
        with (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wcache-hash") as tensor_pool,
            ThreadPoolExecutor(max_workers=min(MAX_SHARD_THREADS, len(cold))) as shard_pool,
        ):
            futures = [shard_pool.submit(hash_shard, path, tensor_pool, on_bytes) for path, _ in cold]
            hashed = [future.result() for future in futures]
        for record in hashed:
            records[record.path] = record
        if store is not None:
            store.put_many(hashed)
    return records, hashed


def _manifest_behind(
    layout: CheckpointLayout, identities: list[FileIdentity], store: DigestStore, root: str
) -> tuple[TensorDigest, ...]:
    """The manifest of a stored root: from the receipts of the identities the root was found under, or, where
    the store no longer holds them all, from the checkpoint as it is now, which must still have that root."""
    reopened = None if store.enabled else DigestStore.open(store.directory)  # the caller closed it since
    usable = reopened or store
    try:
        records = usable.lookup_many(list(zip(layout.shards, identities, strict=True)))
        complete = len(records) == len(layout.shards)
        if complete:
            manifest = manifest_of(layout, records)
            if merkle_root(manifest) == root:
                return manifest
        # The checkpoint as it is now, never from a stored root (that would come back here). Receipts that no
        # longer add up to their own root are not trusted again: then every shard is read.
        began = time.perf_counter()
        try:
            now = _fingerprint_from_records(layout, _stat_all(layout), usable, complete, None, began)
        except CheckpointChangedError:
            raise CheckpointError(f"{layout.root} changed after its key was computed; compute the key again.") from None
    finally:
        if reopened is not None:
            reopened.close()
    if now.root != root:
        raise CheckpointError(f"{layout.root} changed after its key was computed (its checkpoint digest was "
                              f"{root[:12]}…, it is now {now.root[:12]}…); compute the key again.")
    return now.manifest
