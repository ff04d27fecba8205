"""Memory a read lands in: fresh anonymous buffers, a pool that reuses them, and their bytes seen as tensors."""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import TYPE_CHECKING

from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.ipc.arenas.engine_side import torch_dtype

if TYPE_CHECKING:
    import torch

# Buffers (chunks, whole tensors, computed outputs) in use before the reader waits for the workers to catch up;
# also about what the pool keeps for reuse.
HELD_BYTES = 64 * 1024 * 1024


def typed(buffer: memoryview, tensor: TensorInfo) -> torch.Tensor:
    """The checkpoint tensor's bytes in `buffer` seen as a torch tensor of its own dtype and shape."""
    import torch

    dtype = torch_dtype(TORCH_NAMES[tensor.dtype])
    if tensor.nbytes == 0:
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=tensor.nbytes).view(dtype).reshape(tensor.shape)


def fresh_buffer(nbytes: int) -> memoryview:
    """`nbytes` of anonymous memory, in huge pages where the kernel offers them (the first touch of a 4 KiB page
    costs microseconds on a VM), given back to the system as soon as it is dropped."""
    if nbytes == 0:
        return memoryview(bytearray())
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous memory, not a file
    with contextlib.suppress(AttributeError, OSError):
        region.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(region)


class BufferPool:
    """Reused uint8 buffers: a buffer given back serves the next request it fits, since fresh memory costs a
    page fault per page. Keeps at most `cap` bytes; a buffer given back past that returns to the system."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._owned = 0  # bytes of the buffers handed out or free
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes` (slice it); give it back whole."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
            while self._free and self._owned + nbytes > self._cap:
                self._owned -= len(self._free.pop(0))
            self._owned += nbytes
        return fresh_buffer(nbytes)

    def give(self, buffer: memoryview) -> None:
        with self._lock:
            if self._owned > self._cap:
                self._owned -= len(buffer)
            else:
                self._free.append(buffer)

    def clear(self) -> None:
        """Return every free buffer to the system now, not whenever the garbage collector gets to them."""
        with self._lock:
            for buffer in self._free:
                self._owned -= len(buffer)
            self._free.clear()


def as_buffer(data: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU uint8 tensor's bytes, for preadv and BLAKE3."""
    return data.numpy().data

