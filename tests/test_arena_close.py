"""Both arenas close twice without error (a copy-mode release, then the daemon's shutdown), refuse use after
close with one typed error, and leave an engine's view of the weights intact. The CUDA half runs only where
a device exists (benchmarks/device_check.sh runs this file there)."""

from __future__ import annotations

import os

import pytest
import torch
from wcache.ipc.arenas.daemon_side import ArenaClosedError, CpuArena, CudaArena, plan_layout
from wcache.ipc.arenas.engine_side import map_cpu_arena

ENTRIES, TOTAL = plan_layout([("w", "float32", (4, 8), 4 * 8 * 4), ("b", "float32", (8,), 8 * 4)])
WEIGHTS = {"w": torch.arange(32, dtype=torch.float32).reshape(4, 8), "b": torch.full((8,), 7.0)}

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu,
                                          pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


def make_arena(device: str) -> CpuArena | CudaArena:
    arena: CpuArena | CudaArena = CpuArena(TOTAL) if device == "cpu" else CudaArena(TOTAL, "cuda:0")
    for entry in ENTRIES:
        arena.write(entry, WEIGHTS[entry.name].to(device))
    if isinstance(arena, CpuArena):
        arena.seal()
    return arena


def engine_view(arena: CpuArena | CudaArena) -> dict[str, torch.Tensor]:
    """What an engine holds: its own map of the memfd (CPU); on CUDA, tensors viewing the block (an IPC import
    in another process is the device check's part)."""
    if isinstance(arena, CpuArena):
        return map_cpu_arena(os.dup(arena.fd), TOTAL, [e.to_wire() for e in ENTRIES]).tensors
    return arena.tensors(ENTRIES)


@pytest.mark.parametrize("device", DEVICES)
def test_close_twice_is_fine(device: str) -> None:
    arena = make_arena(device)
    arena.close()
    arena.close()


@pytest.mark.parametrize("device", DEVICES)
def test_use_after_close_is_one_typed_error(device: str) -> None:
    arena = make_arena(device)
    arena.close()
    with pytest.raises(ArenaClosedError, match="closed"):
        arena.tensors(ENTRIES)
    with pytest.raises(ArenaClosedError):
        arena.write(ENTRIES[0], WEIGHTS["w"].to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_engine_view_outlives_both_closes(device: str) -> None:
    arena = make_arena(device)
    view = engine_view(arena)
    arena.close()
    arena.close()
    for name, expected in WEIGHTS.items():
        assert torch.equal(view[name].cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_fresh_arena_after_close_serves_again(device: str) -> None:
    first = make_arena(device)
    first.close()
    second = make_arena(device)
    try:
        tensors = second.tensors(ENTRIES)
        assert torch.equal(tensors["w"].cpu(), WEIGHTS["w"])
    finally:
        second.close()
