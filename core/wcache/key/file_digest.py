"""A whole file's SHA-256 from the buffers that a read which goes in no particular order fills.

SHA-256 takes a file's bytes in order, while a shard's tensors are read and BLAKE3-hashed concurrently. Each
reader hands its chunk over by file offset: the chunk that comes next is hashed at once, from the reader's own
buffer; one that arrives early is copied aside, up to REORDER_BYTES, and hashed when its turn comes; past that
its reader waits. Tensors are handed out in offset order (the pool takes them first in, first out), so the
reader holding the next bytes has started and never waits: the stream always moves. hashlib releases the GIL
while it hashes, so SHA-256 runs beside BLAKE3 on another core.
"""

from __future__ import annotations

import hashlib
import threading

# Early chunks kept per file before their readers wait: eight 4 MiB chunks.
REORDER_BYTES = 32 * 1024 * 1024


class FileSha256:
    """The SHA-256 of a file of `size` bytes, fed its bytes by offset from any thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sha = hashlib.sha256()
        self._next = 0  # the first byte not hashed yet
        self._busy = False  # a thread is hashing the bytes at _next (and any that follow in _early)
        self._early: dict[int, bytes] = {}
        self._early_bytes = 0
        self._abandoned = False
        self._cond = threading.Condition()

    def feed(self, offset: int, data: memoryview | bytes) -> None:
        """The file's bytes at `offset`; returns once they are hashed or copied aside (`data` may be reused)."""
        if not len(data):
            return
        with self._cond:
            while offset != self._next:
                if self._abandoned:
                    return
                if self._early_bytes + len(data) <= REORDER_BYTES:
                    self._early[offset] = bytes(data)
                    self._early_bytes += len(data)
                    return
                self._cond.wait()
            # No one else can be busy: whoever is hashes the bytes at _next, and those are ours.
            self._busy = True
        self._hash_from(data)

    def _hash_from(self, data: memoryview | bytes) -> None:
        try:
            while True:
                self._sha.update(data)
                with self._cond:
                    self._next += len(data)
                    following = self._early.pop(self._next, None)
                    if following is None:
                        self._busy = False
                        self._cond.notify_all()
                        return
                    self._early_bytes -= len(following)
                    self._cond.notify_all()
                data = following
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise

    def abandon(self) -> None:
        """A reader failed: the bytes it held will never come, so no one waits for them (no digest results)."""
        with self._cond:
            self._abandoned = True
            self._early.clear()
            self._early_bytes = 0
            self._cond.notify_all()

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._next == self.size and not self._busy and not self._abandoned

    def hexdigest(self) -> str | None:
        """The digest once every byte has been fed; None while any is missing (a read that failed part way)."""
        return self._sha.hexdigest() if self.complete else None
