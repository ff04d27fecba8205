"""Hash every tensor of one safetensors shard: one open, one header read, BLAKE3 over positioned reads.

Shards are read with pread into buffers, never memory-mapped: a file that shrinks while it is read then gives
a short read, one error sentence, where a map's missing page kills the process with SIGBUS; and the network and
FUSE filesystems that refuse mmap (ENODEV) read like any other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path

import blake3

from wcache.checkpoint.files import why_missing
from wcache.checkpoint.identity import FileIdentity
from wcache.checkpoint.safetensors_header import ShardHeader, TensorInfo, read_header
from wcache.errors import CheckpointError, closed_on_error
from wcache.key.file_digest import FileSha256

# Reads are this size, and progress is reported per read, so a single multi-GB tensor still moves the bar; a
# chunk this small stays in the CPU's cache between the read that copies it and the hash that consumes it.
CHUNK_BYTES = 4 * 1024 * 1024
# Above this size one tensor is worth BLAKE3's own multithreading.
PARALLEL_TENSOR_BYTES = 8 * 1024 * 1024
MAX_ATTEMPTS = 3
# The largest page-cache folio (a PMD) on x86-64 and arm64 with 4 KiB pages.
FORGET_ALIGN = 2 * 1024 * 1024

BytesCallback = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """A shard's validated header and its tensor digests (same order as header.tensors)."""

    path: Path
    identity: FileIdentity
    header: ShardHeader
    digests: tuple[str, ...]
    hashed_at_ns: int  # when reading the file began, not when hashing ended
    sha256: str | None = None  # the whole file's, as the Hub names an LFS blob; None where it was not computed


def tensor_hasher(nbytes: int) -> blake3.blake3:
    """A BLAKE3 hasher for `nbytes` of data: multi-threaded when that many bytes are worth it."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO) if nbytes >= PARALLEL_TENSOR_BYTES else blake3.blake3()


_thread_buffers = threading.local()


def _chunk_buffer() -> memoryview:
    # One buffer per hashing thread, reused for every chunk it reads: fresh memory costs a page fault per page.
    buffer: memoryview | None = getattr(_thread_buffers, "buffer", None)
    if buffer is None:
        buffer = _thread_buffers.buffer = memoryview(bytearray(CHUNK_BYTES))
    return buffer


def _hash_tensor(shard: OpenShard, tensor: TensorInfo, on_bytes: BytesCallback | None,
                 file_sha: FileSha256 | None = None) -> str:
    """Read one tensor in chunks into this thread's buffer and hash each chunk as it arrives (and hand it to
    the file's SHA-256, which hashes or copies it before the buffer is reused)."""
    hasher = tensor_hasher(tensor.nbytes)
    buffer = _chunk_buffer()
    done = 0
    try:
        while done < tensor.nbytes:
            chunk = buffer[: min(CHUNK_BYTES, tensor.nbytes - done)]
            shard.read_into(tensor, done, chunk)
            hasher.update(chunk)
            if file_sha is not None:
                file_sha.feed(shard.header.data_start + tensor.start + done, chunk)
            done += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    except BaseException:
        if file_sha is not None:
            file_sha.abandon()  # the other readers must not wait for bytes that will never come
        raise
    return hasher.hexdigest()


class OpenShard:
    """One open shard: a single open, a validated header, and positioned reads of its tensors' bytes.

    The fingerprint hashes through it; the daemon reads each tensor's bytes through it once, to hash them and
    to fill its arena from the same buffer.
    """

    def __init__(self, path: Path, fd: int | None = None) -> None:
        """Open the file at `path`; or, given `fd` (which this shard then owns), read that descriptor's file,
        `path` naming it in messages."""
        self.path = path
        # Taken before the file is opened: a receipt is dated when reading began, so that a write during the
        # read, stamped with a coarse timestamp that does not move the file's identity, is still inside the
        # racy window (digest_store.is_trusted).
        self.opened_ns = time.time_ns()
        try:
            # O_NONBLOCK: opening a FIFO planted as a shard must fail below, not wait for a writer forever.
            self._fd = fd if fd is not None else os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CheckpointError(f"{path} {why_missing(path)}.") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"{path} {why_missing(path)}.") from None
            raise CheckpointError(f"{path} cannot be opened ({exc.strerror}).") from None
        self._forgotten = 0  # forget_read() has dropped the file's pages before this offset
        with closed_on_error(self.close, lambda exc: CheckpointError(f"{path} cannot be read ({exc.strerror}).")):
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path} is not a regular file.")
            # Reads of a regular file ignore O_NONBLOCK on local filesystems; some remote ones honour it.
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            self.identity = FileIdentity.of(st)
            self.header = read_header(self._fd, self.identity.size, path)

    def __enter__(self) -> OpenShard:
        return self

    def fileno(self) -> int:
        return self._fd

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_into(self, tensor: TensorInfo, start: int, buffer: memoryview) -> None:
        """Fill `buffer` with the tensor's bytes from byte `start` of its data on; a file that is now too short
        for them is a CheckpointError."""
        self.read_at(self.header.data_start + tensor.start + start, buffer)

    def start_sha256(self) -> FileSha256:
        """A SHA-256 of the whole file, fed its prefix and header here; the tensors' bytes follow as read."""
        file_sha = FileSha256(self.identity.size)
        head = memoryview(bytearray(self.header.data_start))
        self.read_at(0, head)
        file_sha.feed(0, head)
        return file_sha

    def read_at(self, position: int, buffer: memoryview) -> None:
        """Fill `buffer` with the file's bytes from `position` on; a file now too short is a CheckpointError."""
        done, wanted = 0, len(buffer)
        while done < wanted:
            try:
                got = os.preadv(self._fd, [buffer[done:]], position + done)
            except OSError as exc:
                raise CheckpointError(f"{self.path} cannot be read ({exc.strerror}).") from None
            if got == 0:
                raise CheckpointError(
                    f"{self.path} shrank while it was being read; wait until it is fully written and try again."
                )
            done += got

    def advise_sequential(self) -> None:
        """Tell the kernel the file will be read start to end once: it reads further ahead."""
        self._advise(0, 0, os.POSIX_FADV_SEQUENTIAL)

    def forget_read(self, tensor: TensorInfo, end: int) -> None:
        """A reader going through the file in order has copied out `tensor`'s bytes up to `end`: let the kernel
        drop the file's pages before them from the page cache, so that it and the arena do not both hold the
        weights. Rounded down to FORGET_ALIGN: the kernel keeps a large folio that the range only partly covers."""
        self.forget_until(self.header.data_start + tensor.start + end)

    def forget_until(self, position: int) -> None:
        """A reader going through the file in order has copied out its bytes before `position`: as forget_read."""
        until = position // FORGET_ALIGN * FORGET_ALIGN
        if until > self._forgotten:
            self._advise(self._forgotten, until - self._forgotten, os.POSIX_FADV_DONTNEED)
            self._forgotten = until

    def forget_all(self) -> None:
        """Drop all of the file's pages from the page cache, once it has been read."""
        self._advise(0, 0, os.POSIX_FADV_DONTNEED)
        self._forgotten = self.identity.size

    def _advise(self, offset: int, nbytes: int, advice: int) -> None:
        # Advice only: a filesystem that ignores it costs memory or speed, never correctness.
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, offset, nbytes, advice)

    def hash_tensors(self, pool: Executor, on_bytes: BytesCallback | None = None,
                     file_sha: FileSha256 | None = None) -> tuple[str, ...]:
        """BLAKE3 of every tensor, in header order, hashed concurrently; with `file_sha`, the file's SHA-256
        from the same reads (tensors are submitted by offset, so the one whose bytes come next has started)."""
        by_offset = sorted(range(len(self.header.tensors)), key=lambda i: self.header.tensors[i].start)
        futures = {i: pool.submit(_hash_tensor, self, self.header.tensors[i], on_bytes, file_sha) for i in by_offset}
        # Every task must finish before the descriptor can close, even when one of them failed.
        wait(futures.values())
        return tuple(futures[i].result() for i in range(len(self.header.tensors)))

    def unchanged(self) -> bool:
        """Whether the file read through this descriptor still has the identity it had when opened.

        Asked of the descriptor, never of the path: by now the path may name another file (a directory
        exchanged, a symlink flipped, a mount), and a record must describe the file that was read. Whether
        that is still the checkpoint's file is the key's question (fingerprint.hashed_state).
        """
        try:
            return self.identity == FileIdentity.of(os.fstat(self._fd))
        except OSError:
            return False

    def record(self, digests: tuple[str, ...], sha256: str | None = None) -> ShardRecord:
        return ShardRecord(self.path, self.identity, self.header, digests, self.opened_ns, sha256)


def _hash_once(path: Path, pool: Executor, on_bytes: BytesCallback | None) -> tuple[ShardRecord, bool]:
    """One attempt; returns the record and whether the file stayed the same while it was read."""
    with OpenShard(path) as shard:
        file_sha = shard.start_sha256()
        digests = shard.hash_tensors(pool, on_bytes, file_sha)
        record = shard.record(digests, file_sha.hexdigest())
        return record, shard.unchanged()


def hash_shard(path: Path, pool: Executor, on_bytes: BytesCallback | None = None) -> ShardRecord:
    """Hash a shard; a file that changes while it is read is hashed again, and never half-recorded.

    The record holds the identity of the descriptor read, so a retry that opens the path again may describe
    another file than the first attempt: the caller compares it with the identity it expected."""
    for _ in range(MAX_ATTEMPTS):
        record, stable = _hash_once(path, pool, on_bytes)
        if stable:
            return record
    raise CheckpointError(
        f"{path} changed every time it was hashed ({MAX_ATTEMPTS} tries); wait until it is fully written."
    )
