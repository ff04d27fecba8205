"""An engine's views of a mapped arena: every tensor in place (mixed dtypes, empty and 0-d ones included),
viewing the map without copies, and a map reply whose entries do not fit the arena refused with one error."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch
from wcache.errors import UnavailableError
from wcache.ipc.arena import CpuArena, map_cpu_arena, plan_layout, views_from_wire

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
