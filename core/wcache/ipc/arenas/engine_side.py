"""An engine's side of a daemon's arena: map a received CPU arena, open a CUDA handle, and view either as tensors,
one view per entry of a map reply, made a run of layers at a time.

It imports nothing from `daemon_side` (the daemon's side: making, filling and sealing one), and torch and numpy only
where tensors are made: an attach that only reports checks the arena's size without loading them.
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wcache.errors import UnavailableError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from wcache.ipc.wire.messages import WireEntry

# Tensors of one dtype and shape per layer that a run may interleave (a layer's norms, its k and v projections).
MAX_PERIOD = 8


def _contiguous(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Row-major strides as torch gives them (a zero-sized dimension counts as 1), and the element count."""
    strides: list[int] = []
    step = numel = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
        numel *= dim
    return tuple(reversed(strides)), numel


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass
class MappedArena:
    """An engine's copy-on-write map of a daemon's CPU arena, and the tensors viewing it."""

    mapping: mmap.mmap
    tensors: dict[str, torch.Tensor]


def check_arena_size(fd: int, total_bytes: int) -> None:
    """A received memfd holds at least the bytes its daemon announced (mapping past its end would be SIGBUS)."""
    size = os.fstat(fd).st_size
    if size < total_bytes:
        raise UnavailableError(f"the daemon's arena holds {size} bytes, fewer than the {total_bytes} it announced.")


def map_cpu_arena(fd: int, total_bytes: int, entries: Sequence[WireEntry]) -> MappedArena:
    """Map a received memfd copy-on-write and view its tensors; the descriptor is closed afterwards."""
    import torch

    try:
        check_arena_size(fd, total_bytes)
        mapping = mmap.mmap(fd, total_bytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # One tensor over the whole map; its storage holds the map object, so the map lives while any view does.
    return MappedArena(mapping, views_from_wire(torch.frombuffer(mapping, dtype=torch.uint8), entries))


def open_cuda_handle(fields: dict[str, Any], device_index: int) -> torch.Tensor:
    """Rebuild a daemon's CUDA block in this process from its exported IPC fields."""
    import torch

    if not torch.cuda.is_available():
        raise UnavailableError("the daemon serves CUDA memory but this process sees no CUDA device.")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    total = int(fields["total_bytes"])
    return rebuild_cuda_tensor(
        torch.Tensor, (total,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device_index,
        fields["handle"], int(fields["storage_size"]), int(fields["storage_offset"]), False,
        fields["ref_counter_handle"], int(fields["ref_counter_offset"]),
        fields["event_handle"] or None, bool(fields["event_sync_required"]),
    )


def views_from_wire(block: torch.Tensor, items: Sequence[WireEntry]) -> dict[str, torch.Tensor]:
    """Tensors viewing `block`, one uint8 tensor over a whole arena, where the map reply's entries place them.

    An attach builds one tensor per checkpoint tensor, so the per-tensor work is kept to torch's own: entries of
    one dtype and shape that follow each other at a fixed step (the same tensor of every layer) are one
    as_strided over all of them, unbound into views in one call (a third of one as_strided per tensor); the
    fields are checked per column with numpy. An entry that does not fit the block is one UnavailableError.
    """

    total = block.numel()
    try:
        return _views(block, total, items)
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        raise UnavailableError(f"the daemon sent a tensor that does not fit its {total}-byte arena ({exc}).") from None


def _views(block: torch.Tensor, total: int, items: Sequence[WireEntry]) -> dict[str, torch.Tensor]:
    import numpy as np

    if not items:
        return {}
    if set(map(len, items)) != {5}:
        raise ValueError("an entry is not [name, dtype, shape, offset, nbytes]")
    names, dtypes, shapes, offsets, sizes = zip(*items, strict=True)
    starts, lengths = np.array(offsets), np.array(sizes)
    if starts.dtype.kind != "i" or lengths.dtype.kind != "i":
        raise ValueError("offsets and sizes must be integers")
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for position, group in enumerate(zip(dtypes, map(tuple, shapes), strict=True)):
        members = groups.get(group)
        if members is None:
            groups[group] = [position]
        else:
            members.append(position)
    out: list[torch.Tensor | None] = [None] * len(items)
    typed: dict[str, tuple[torch.Tensor, int]] = {}
    for (dtype, dims), members in groups.items():
        if dtype not in typed:
            kind = torch_dtype(dtype)
            typed[dtype] = (block[: total - total % kind.itemsize].view(kind), kind.itemsize)
        base, itemsize = typed[dtype]
        strides, numel = _contiguous(dims)
        at, nbytes = starts[members], lengths[members]
        bad = (at < 0) | (at % itemsize != 0) | (nbytes != numel * itemsize) | (at > total - nbytes)
        if bad.any():
            first = members[int(np.flatnonzero(bad)[0])]
            raise ValueError(f"{names[first]!r} is {sizes[first]} bytes at {offsets[first]} as {dtype} {list(dims)}")
        for run, element_offset, step in _runs(at // itemsize):
            positions = members[run]
            if len(positions) == 1:
                out[positions[0]] = base.as_strided(dims, strides, element_offset)
            else:
                stacked = base.as_strided((len(positions), *dims), (step, *strides), element_offset)
                for position, view in zip(positions, stacked.unbind(0), strict=True):
                    out[position] = view
    return dict(zip(names, out, strict=True))


def _runs(element_offsets: np.ndarray) -> Iterator[tuple[slice, int, int]]:
    """Split one group's element offsets (in reply order) into runs at a fixed positive step, as (which of the
    group's members, first offset, step).

    A layer may hold several tensors of one dtype and shape (two norms; k and v), so a group interleaves them,
    and a last one (the final norm) may follow: every `period`-th member is taken together, with the period
    that leaves the fewest runs.
    """

    count = len(element_offsets)
    best_period, fewest = 1, count + 1
    for period in range(1, min(MAX_PERIOD, count) + 1):
        runs = sum(_run_estimate(element_offsets[start::period]) for start in range(period))
        if runs < fewest:
            best_period, fewest = period, runs
        if runs == period:  # every member of each class at one step: no period does better
            break
    for start in range(best_period):
        for run, first, step in _step_runs(element_offsets[start::best_period]):
            stop = start + (run.stop - 1) * best_period + 1
            yield slice(start + run.start * best_period, stop, best_period), first, step


def _run_estimate(element_offsets: np.ndarray) -> int:
    """About how many runs _step_runs makes of these offsets: one more than the times the step changes."""
    import numpy as np

    return 1 + int(np.count_nonzero(np.diff(element_offsets, 2))) if len(element_offsets) > 2 else 1


def _step_runs(element_offsets: np.ndarray) -> Iterator[tuple[slice, int, int]]:
    """Runs of consecutive offsets at one positive step, split where the step changes."""
    import numpy as np

    count = len(element_offsets)
    offsets = element_offsets.tolist()
    steps = np.diff(element_offsets)
    # Where the step changes; a run from member j ends where its step first changes after j.
    changes = (np.flatnonzero(steps[1:] != steps[:-1]) + 1).tolist()
    j = 0
    while j < count:
        step = int(steps[j]) if j < count - 1 else 0
        if step <= 0:  # the last member, or one at or before the member it follows: a view of its own
            yield slice(j, j + 1), offsets[j], 0
            j += 1
            continue
        end = changes[bisect.bisect_right(changes, j)] if changes and changes[-1] > j else count - 1
        yield slice(j, end + 1), offsets[j], step
        j = end + 1
