"""The arena: every processed tensor of one rank in one contiguous block.

CPU: a sealed-size memfd. The daemon fills it with pwrite, then write-seals it; an engine receives the descriptor by
SCM_RIGHTS (or, for an arena in the directory an operator named for huge pages, an unsealed file: see `backing`, a
read-only descriptor) and maps it copy-on-write (MAP_PRIVATE): pages it only reads are the shared ones, and an in-place
write (engines post-process weights) lands in a private page, so no engine can corrupt or crash on the shared
weights. The engine's map stays valid after the daemon exits (the memfd lives while any map or descriptor does).

CUDA: one device allocation per rank and one IPC handle exported per client. With the legacy CUDA IPC
used by PyTorch, the memory dies with the exporting process, so an engine must treat daemon loss as fatal.

A CPU arena is made, filled and served without torch (a daemon whose outputs are checkpoint bytes unchanged
never imports it); only views as tensors and CUDA import it. This is the daemon's side; an engine's (mapping
what it receives, viewing it as tensors) is `engine_side`, which imports nothing from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wcache.errors import UnavailableError
from wcache.ipc.arenas.backing import arena_dir, open_arena_file, read_only_descriptor

if TYPE_CHECKING:
    import torch

    from wcache.ipc.wire.messages import WireEntry

# Linux 5.1's F_SEAL_FUTURE_WRITE, which Python's fcntl module does not name.
F_SEAL_FUTURE_WRITE = 0x0010
# Linux 5.14's madvise(MADV_POPULATE_WRITE): page tables of a whole shared map filled in one call.
MADV_POPULATE_WRITE = 23
# 256 bytes covers every SIMD width and CUDA's allocation granularity for vectorised loads.
ALIGNMENT = 256


def _populate_write(live: mmap.mmap) -> None:
    """madvise(MADV_POPULATE_WRITE) over all of `live`, through ctypes so the GIL is released while the kernel
    allocates the pages: `mmap.madvise` holds it, and a 1.5 GB arena's pages take seconds to allocate on a VM,
    during which the daemon's other threads (an engine's attach, the reply to the publish that asked for the
    arena) would wait."""
    anchor = ctypes.c_char.from_buffer(live)  # the map's address; the map cannot close while this exists
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(len(live)),
                        MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        del anchor


class ArenaClosedError(UnavailableError):
    """An arena used after close(): its daemon released its weights to a copy-mode engine, or stopped."""

    def __init__(self) -> None:
        super().__init__("the arena was closed; its weights are gone.")


@dataclass(frozen=True, slots=True)
class ArenaEntry:
    """Where one tensor lives in the arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> WireEntry:
        return (self.name, self.dtype, tuple(self.shape), self.offset, self.nbytes)


def plan_layout(specs: Sequence[tuple[str, str, tuple[int, ...], int]]) -> tuple[tuple[ArenaEntry, ...], int]:
    """Aligned offsets for (name, dtype, shape, nbytes) in order; returns the entries and the total size."""
    entries = []
    offset = 0
    for name, dtype, shape, nbytes in specs:
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        entries.append(ArenaEntry(name, dtype, shape, offset, nbytes))
        offset += nbytes
    return tuple(entries), max(offset, 1)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def view_tensors(buffer: Any, entries: Sequence[ArenaEntry]) -> dict[str, torch.Tensor]:
    """Tensors over a CPU buffer (no copies)."""
    import torch

    from wcache.ipc.arenas.engine_side import torch_dtype

    tensors = {}
    for e in entries:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=e.nbytes, offset=e.offset) if e.nbytes else (
            torch.empty(0, dtype=torch.uint8)
        )
        tensors[e.name] = raw.view(torch_dtype(e.dtype)).reshape(e.shape)
    return tensors


class CpuArena:
    """A memfd of fixed size (or an unnamed file in the operator's WCACHE_ARENA_DIR); writable in the daemon,
    mapped copy-on-write by engines."""

    def __init__(self, total_bytes: int, label: str = "wcache-arena") -> None:
        self.total_bytes = total_bytes
        directory = arena_dir()
        self.sealable = directory is None
        self.reusable = False  # sealed with the future-write seal: rewritable through this process's map only
        self._populated = False  # every page of the writable map present (`rewrite`): the map keeps them
        if directory is None:
            self.fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:
            self.fd = open_arena_file(directory, total_bytes)  # of that size already
        try:
            if self.sealable:
                os.ftruncate(self.fd, total_bytes)
                # Nobody may shrink it: an engine's map of a shrunk memfd faults (SIGBUS) on the lost pages. The
                # write seal comes once it is filled (seal()); F_SEAL_SEAL follows it there.
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, total_bytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, entry: ArenaEntry, tensor: torch.Tensor) -> None:
        source = _as_bytes(tensor)
        if source.numel() != entry.nbytes:
            raise ValueError(f"{entry.name}: {source.numel()} bytes do not fit an entry of {entry.nbytes}")
        self.write_at(entry.offset, source.detach().cpu().numpy().data)

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write a buffer's bytes at byte `offset`.

        pwrite, not a copy through the map: the kernel gives the memfd its pages as it copies, where a write
        through a map takes a page fault per 4 KiB page (microseconds each on a VM).
        """
        live = self._live_map()  # a closed arena refuses writes as it refuses every other use
        view = data.cast("B")
        if self.reusable:  # future-write sealed: only this process's own map writes it
            live[offset : offset + len(view)] = view
            return
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and not self.sealable:
                    # hugetlbfs has no write(): its files are filled through a map (a fault per 2 MiB page).
                    live[offset + done : offset + len(view)] = view[done:]
                    return
                raise UnavailableError(
                    f"the {self.total_bytes}-byte arena cannot be filled ({exc.strerror}); free some memory."
                ) from None

    @contextlib.contextmanager
    def bytes_at(self, offset: int, nbytes: int) -> Iterator[memoryview]:
        """The arena's bytes [offset, offset + nbytes) in the daemon's map, for reading back what was written;
        the view is released on exit (seal() cannot close a map that is still viewed)."""
        with memoryview(self._live_map()) as whole, whole[offset : offset + nbytes] as part:
            yield part

    def tensors(self, entries: Sequence[ArenaEntry]) -> dict[str, torch.Tensor]:
        """Views in the daemon's own map: writable while filling, read-only once sealed."""
        live = self._live_map()
        with warnings.catch_warnings():
            # A sealed arena's map is read-only, and torch warns it cannot protect such a buffer; PROT_READ does.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return view_tensors(live, entries)

    def seal(self, *, reusable: bool = False) -> None:
        """Once filled: no process can write the shared bytes again (write(), a writable shared map, an
        mprotect of a read-only one, or the memfd reopened through /proc all fail). Engines' copy-on-write
        maps still work. Every view of the writable map must be gone first.

        `reusable` (a daemon with a version pool): the future-write seal instead, which refuses all of the above
        to every process but leaves the daemon's own writable map working, so once no engine holds the arena
        the daemon can rewrite it as a later version (`rewrite`) without a fresh arena's page allocation."""
        if reusable and self.sealable:
            self._live_map()
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
                self.reusable = True
                return
            except OSError as exc:  # a kernel before 5.1: the write seal, and the pool closes it when retired
                if exc.errno != errno.EINVAL:
                    raise
        # F_SEAL_WRITE is refused while any writable shared map exists, our own included.
        self._live_map().close()
        self._map = None
        if self.sealable:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        else:
            # No seal for a file: read-only for its owner, so an engine of another user id, or one without
            # CAP_DAC_OVERRIDE, cannot reopen it for writing through /proc.
            os.fchmod(self.fd, 0o400)
        self._map = mmap.mmap(self.fd, self.total_bytes, prot=mmap.PROT_READ)

    def engine_descriptor(self) -> int:
        """A new descriptor to hand an engine: of the sealed memfd, or read-only of an unsealed arena file."""
        self._live_map()
        return os.dup(self.fd) if self.sealable else read_only_descriptor(self.fd)

    def rewrite(self) -> None:
        """Make a reusable arena's every page present in this process's writable map at once (what a rewrite
        writes sparsely would otherwise fault in a page at a time, microseconds each on a VM)."""
        live = self._live_map()
        if not self.reusable:
            raise ValueError("only an arena sealed reusable can be written again")
        if self._populated:
            return
        with contextlib.suppress(OSError):  # an older kernel faults the pages in as written
            _populate_write(live)
        self._populated = True

    def writable(self) -> mmap.mmap:
        """The daemon's writable map of a reusable arena (its only writer: every other process is sealed out)."""
        if not self.reusable:
            raise ValueError("only an arena sealed reusable can be written again")
        return self._live_map()

    def _live_map(self) -> mmap.mmap:
        if self._map is None:
            raise ArenaClosedError
        return self._map

    def close(self) -> None:
        """Drop the daemon's map and descriptor; engines' maps of the memfd stay valid. Closing twice is fine."""
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CudaArena:
    """One device allocation per rank, exported as a CUDA IPC handle per client.

    Written against torch.multiprocessing.reductions; it runs only where CUDA exists and has not been
    exercised on this project's CPU-only CI.
    """

    def __init__(self, total_bytes: int, device: str) -> None:
        import torch

        if not torch.cuda.is_available():
            raise UnavailableError(f"device {device} was requested but this machine has no CUDA device.")
        self.device = torch.device(device)
        self.total_bytes = total_bytes
        self._block: torch.Tensor | None = torch.empty(total_bytes, dtype=torch.uint8, device=self.device)

    @property
    def block(self) -> torch.Tensor:
        if self._block is None:
            raise ArenaClosedError
        return self._block

    def write(self, entry: ArenaEntry, tensor: torch.Tensor) -> None:
        if entry.nbytes:
            self.block[entry.offset : entry.offset + entry.nbytes].copy_(_as_bytes(tensor), non_blocking=False)

    def write_at(self, offset: int, data: memoryview) -> None:
        """Copy a buffer's bytes to byte `offset`; synchronous, so `data` may be reused at once."""
        import torch

        if len(data):
            source = torch.frombuffer(data, dtype=torch.uint8)
            self.block[offset : offset + source.numel()].copy_(source, non_blocking=False)

    def tensors(self, entries: Sequence[ArenaEntry]) -> dict[str, torch.Tensor]:
        from wcache.ipc.arenas.engine_side import torch_dtype

        block = self.block
        return {
            e.name: block[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).reshape(e.shape)
            for e in entries
        }

    def export_handle(self) -> dict[str, Any]:
        """The IPC fields a client needs to rebuild the block (msgpack-safe: bytes and ints only)."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.block)
        # args: (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
        #        requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        return {
            "handle": bytes(args[7]), "storage_size": int(args[8]), "storage_offset": int(args[9]),
            "ref_counter_handle": bytes(args[11]), "ref_counter_offset": int(args[12]),
            "event_handle": bytes(args[13]) if args[13] is not None else b"",
            "event_sync_required": bool(args[14]), "total_bytes": self.total_bytes,
        }

    def close(self) -> None:
        """Free the block (a copy-mode release, then shutdown, both close); engines' IPC maps keep theirs."""
        if self._block is None:
            return
        self._block = None
        import torch

        torch.cuda.empty_cache()
