"""An engine's views of a mapped arena: every tensor in place (mixed dtypes, empty and 0-d ones included),
viewing the map without copies, and a map reply whose entries do not fit the arena refused with one error."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch
from wcache.errors import UnavailableError
from wcache.ipc.arenas.daemon_side import CpuArena, plan_layout
from wcache.ipc.arenas.engine_side import map_cpu_arena, views_from_wire

WEIGHTS = {
    "w": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    "h": torch.arange(6, dtype=torch.bfloat16).reshape(3, 2),
    "i": torch.tensor([1, -2, 3], dtype=torch.int64),
    "s": torch.tensor(2.5, dtype=torch.float16),
    "e": torch.empty(4, 0, dtype=torch.float32),
    "q": torch.arange(5, dtype=torch.uint8),
}
ENTRIES, TOTAL = plan_layout([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
                              for n, t in WEIGHTS.items()])


@pytest.fixture
def sealed() -> Iterator[CpuArena]:
    arena = CpuArena(TOTAL)
    for entry in ENTRIES:
        arena.write(entry, WEIGHTS[entry.name])
    arena.seal()
    yield arena
    arena.close()


def test_views_match_the_weights_and_share_the_map(sealed: CpuArena) -> None:
    mapped = map_cpu_arena(os.dup(sealed.fd), TOTAL, [e.to_wire() for e in ENTRIES])
    try:
        assert mapped.tensors.keys() == WEIGHTS.keys()
        for name, expected in WEIGHTS.items():
            got = mapped.tensors[name]
            assert got.dtype == expected.dtype and got.shape == expected.shape and got.is_contiguous()
            assert torch.equal(got, expected)
        # A write lands in the engine's private copy-on-write page of the map, which every view shares.
        before = WEIGHTS["w"][0, 0, 1].item()
        mapped.tensors["w"][0, 0, 1] = 99.0
        block = torch.frombuffer(mapped.mapping, dtype=torch.uint8)
        assert block[4:8].view(torch.float32).item() == 99.0
        assert sealed.tensors(ENTRIES)["w"][0, 0, 1].item() == before
        del block
    finally:
        mapped.tensors.clear()
        mapped.mapping.close()


@pytest.mark.parametrize(("change", "why"), [
    ({3: TOTAL}, "past the end"),
    ({3: 2}, "misaligned for float32"),
    ({4: 4}, "nbytes that disagree with the shape"),
    ({1: "complex_thing"}, "an unknown dtype"),
    ({2: [-1, 4]}, "a negative dimension"),
    ({2: "x"}, "a shape that is not a list of ints"),
])
def test_entries_that_do_not_fit_are_one_error(change: dict[int, object], why: str) -> None:
    block = torch.zeros(TOTAL, dtype=torch.uint8)
    items = [e.to_wire() for e in ENTRIES]
    bad = list(items[0])
    for index, value in change.items():
        bad[index] = value
    with pytest.raises(UnavailableError, match="does not fit its"):
        views_from_wire(block, [bad, *items[1:]])


def test_views_share_one_storage_that_keeps_the_map(sealed: CpuArena) -> None:
    """One storage over the map for every view, and it holds the map: the views outlive every other reference."""
    mapped = map_cpu_arena(os.dup(sealed.fd), TOTAL, [e.to_wire() for e in ENTRIES])
    tensors = mapped.tensors
    assert len({t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}) == 1
    del mapped
    gc.collect()
    assert all(torch.equal(tensors[name], expected) for name, expected in WEIGHTS.items())


def _reference_view(block: torch.Tensor, dtype: str, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
    return block[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)


@pytest.mark.parametrize("order", ["arena", "shuffled"])
def test_layered_entries_view_exactly_their_own_bytes(order: str) -> None:
    # Layers repeat tensors of one dtype and shape (two norms, k and v), so views are made a run at a time;
    # whatever order the reply lists them in, each must view exactly its own bytes.
    per_layer = [("in_norm", "bfloat16", (8,)), ("k", "bfloat16", (4, 8)), ("v", "bfloat16", (4, 8)),
                 ("q_norm", "bfloat16", (8,)), ("up", "float32", (3, 8)), ("post_norm", "bfloat16", (8,))]
    specs = [("embed", "bfloat16", (16, 8), 256)]
    for layer in range(9):
        specs += [(f"layers.{layer}.{n}", d, s, torch.empty(s, dtype=getattr(torch, d)).nbytes)
                  for n, d, s in per_layer]
    specs += [("layers.9.odd", "bfloat16", (8,), 16), ("norm", "bfloat16", (8,), 16)]
    entries, total = plan_layout([(n, d, s, b) for n, d, s, b in specs])
    items = [e.to_wire() for e in entries]
    if order == "shuffled":
        import random

        random.Random(3).shuffle(items)
    block = torch.arange(total, dtype=torch.int64).remainder(251).to(torch.uint8)
    views = views_from_wire(block, items)
    assert list(views) == [item[0] for item in items]
    for name, dtype, shape, offset, nbytes in items:
        got, expected = views[name], _reference_view(block, dtype, shape, offset, nbytes)
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
        assert got.data_ptr() == expected.data_ptr() and got.is_contiguous()
        assert torch.equal(got, expected)


def test_a_misfit_inside_a_run_is_one_error() -> None:
    entries, total = plan_layout([(f"layers.{i}.w", "float32", (4,), 16) for i in range(8)])
    items = [list(e.to_wire()) for e in entries]
    items[5][3] = total  # one entry of a run past the end
    with pytest.raises(UnavailableError, match=r"'layers\.5\.w' is 16 bytes at"):
        views_from_wire(torch.zeros(total, dtype=torch.uint8), items)


@pytest.mark.parametrize("bad", [
    [["w", "float32", [1], 0]],
    [["w", "float32", [1], 0.0, 4]],
    [["w", "float32", [1], 0, 2**70]],
], ids=["four-fields", "float-offset", "huge-size"])
def test_malformed_entries_are_one_error(bad: list[list[object]]) -> None:
    with pytest.raises(UnavailableError, match="does not fit its"):
        views_from_wire(torch.zeros(64, dtype=torch.uint8), bad)
