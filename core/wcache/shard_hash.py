"""Hash every tensor of one safetensors shard: one open, one header read, BLAKE3 over a memory map."""

from __future__ import annotations

import mmap
import os
import stat
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
    hashed_at_ns: int  # when reading the file began, not when hashing ended


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


class OpenShard:
    """One open shard: a single open, a validated header, and a read-only map of the whole file.

    The fingerprint hashes through it; the daemon also builds its tensors from the same map, so a shard's
    bytes come off the disk once for both.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # Taken before the file is opened: a receipt is dated when reading began, so that a write during the
        # read, stamped with a coarse timestamp that does not move the file's identity, is still inside the
        # racy window (digest_store.is_trusted).
        self.opened_ns = time.time_ns()
        try:
            # O_NONBLOCK: opening a FIFO planted as a shard must fail below, not wait for a writer forever.
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist.") from None
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be opened ({exc.strerror}).") from None
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path} is not a regular file.")
            self.identity = FileIdentity.of(st)
            self.header = read_header(self._fd, self.identity.size, path)
            if self.header.data_bytes > 0:
                self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
                self._view = memoryview(self._map)
        except OSError as exc:
            self.close()
            raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> OpenShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def tensor_bytes(self, tensor: TensorInfo) -> memoryview:
        """A read-only view of one tensor's data; release it before the shard closes."""
        if self._view is None:
            return memoryview(b"")
        start = self.header.data_start + tensor.start
        return self._view[start : start + tensor.nbytes]

    def hash_tensors(self, pool: Executor, on_bytes: BytesCallback | None = None) -> tuple[str, ...]:
        """BLAKE3 of every tensor, in header order, hashed concurrently."""
        if self._view is None:
            return tuple(blake3.blake3().hexdigest() for _ in self.header.tensors)
        futures = [
            pool.submit(_hash_tensor, self._view, self.header.data_start, tensor, on_bytes)
            for tensor in self.header.tensors
        ]
        # Every task must finish before the map can close, even when one of them failed.
        wait(futures)
        try:
            return tuple(f.result() for f in futures)
        except OSError as exc:
            raise CheckpointError(f"{self.path} cannot be read ({exc.strerror}).") from None

    def unchanged(self) -> bool:
        """Whether the file still has the identity it had when opened, by descriptor and by path."""
        try:
            after = FileIdentity.of(os.fstat(self._fd))
            current = FileIdentity.of(os.stat(self.path))
        except OSError:
            return False
        return self.identity == after == current

    def record(self, digests: tuple[str, ...]) -> ShardRecord:
        return ShardRecord(self.path, self.identity, self.header, digests, self.opened_ns)


def _hash_once(path: Path, pool: Executor, on_bytes: BytesCallback | None) -> tuple[ShardRecord, bool]:
    """One attempt; returns the record and whether the file stayed the same while it was read."""
    with OpenShard(path) as shard:
        record = shard.record(shard.hash_tensors(pool, on_bytes))
        return record, shard.unchanged()


def hash_shard(path: Path, pool: Executor, on_bytes: BytesCallback | None = None) -> ShardRecord:
    """Hash a shard; a file that changes while it is read is hashed again, and never half-recorded."""
    for _ in range(MAX_ATTEMPTS):
        record, stable = _hash_once(path, pool, on_bytes)
        if stable:
            return record
    raise CheckpointError(
        f"{path} changed every time it was hashed ({MAX_ATTEMPTS} tries); wait until it is fully written."
    )
