"""Hash every tensor of one safetensors shard: one open, one header read, BLAKE3 over a memory map."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import blake3

from wcache.errors import CheckpointError
from wcache.safetensors_header import ShardHeader, TensorInfo, read_header

# Progress is reported per chunk so a single multi-GB tensor still moves the bar.
CHUNK_BYTES = 16 * 1024 * 1024
# Above this size one tensor is worth BLAKE3's own multithreading.
PARALLEL_TENSOR_BYTES = 8 * 1024 * 1024
MAX_ATTEMPTS = 3

BytesCallback = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What stat says about a file; equal identities mean the digest store may reuse a file's digests."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """A shard's validated header and its tensor digests (same order as header.tensors)."""

    path: Path
    identity: FileIdentity
    header: ShardHeader
    digests: tuple[str, ...]
    hashed_at_ns: int


def _hash_tensor(view: memoryview, base: int, tensor: TensorInfo, on_bytes: BytesCallback | None) -> str:
    hasher = (
        blake3.blake3(max_threads=blake3.blake3.AUTO)
        if tensor.nbytes >= PARALLEL_TENSOR_BYTES
        else blake3.blake3()
    )
    position = base + tensor.start
    end = base + tensor.end
    while position < end:
        step = min(CHUNK_BYTES, end - position)
        with view[position : position + step] as chunk:
            hasher.update(chunk)
        position += step
        if on_bytes is not None:
            on_bytes(step)
    return hasher.hexdigest()


def _hash_once(path: Path, pool: Executor, on_bytes: BytesCallback | None) -> tuple[ShardRecord, bool]:
    """One attempt; returns the record and whether the file stayed the same while it was read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist.") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be opened ({exc.strerror}).") from None
    try:
        before = FileIdentity.of(os.fstat(fd))
        header = read_header(fd, before.size, path)
        digests: list[str] = []
        if header.data_bytes > 0:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
                futures = [
                    pool.submit(_hash_tensor, view, header.data_start, tensor, on_bytes)
                    for tensor in header.tensors
                ]
                # Every task must finish before the map closes, even when one of them failed.
                wait(futures)
                digests = [f.result() for f in futures]
        else:
            digests = [blake3.blake3().hexdigest() for _ in header.tensors]
        after = FileIdentity.of(os.fstat(fd))
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None
    finally:
        os.close(fd)
    try:
        current = FileIdentity.of(os.stat(path))
    except FileNotFoundError:
        current = None
    record = ShardRecord(path, before, header, tuple(digests), time.time_ns())
    return record, before == after == current


def hash_shard(path: Path, pool: Executor, on_bytes: BytesCallback | None = None) -> ShardRecord:
    """Hash a shard; a file that changes while it is read is hashed again, and never half-recorded."""
    for _ in range(MAX_ATTEMPTS):
        record, stable = _hash_once(path, pool, on_bytes)
        if stable:
            return record
    raise CheckpointError(
        f"{path} changed every time it was hashed ({MAX_ATTEMPTS} tries); wait until it is fully written."
    )
