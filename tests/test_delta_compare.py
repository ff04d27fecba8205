"""`wcache delta`'s comparison (word-wide, block by block, on worker threads) against the plain element by element.

Crafted checkpoints hold what a float comparison gets wrong and what blocks could get wrong: -0.0 against 0.0
and NaNs with different payloads (changed: bytes differ), equal NaNs (unchanged), sizes that are not a multiple
of 8 bytes, a tensor across several of the workers' blocks with changes on their edges, a tensor changed so
densely that it is replaced whole, an empty one, and every element size (bf16, f16, f32, fp8, int8, int64, bool).
"""

from __future__ import annotations

import fcntl
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import wait_past_racy_window
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from wcache.checkpoint.identity import FileIdentity
from wcache.checkpoint.safetensors_write import Entry, write_safetensors
from wcache.delta.compare import BLOCK_BYTES, THREAD_PREFIX, compare_checkpoints
from wcache.delta.format import BITS, SEALED, DeltaError, read_delta, read_sealed_delta, sealed_delta
from wcache.delta.make import make_delta
from wcache.delta.wide_compare import ChangedElements
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore

TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_of(value: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """`numel` elements of `dtype`, each with the bit pattern `value`."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((numel,), value, dtype=TORCH_BITS[size]).view(dtype)


def _crafted() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}

    def pair(name: str, before: torch.Tensor, after: torch.Tensor) -> None:
        old[name], new[name] = before.contiguous(), after.contiguous()

    odd = torch.randn(7, 13, generator=generator).to(torch.bfloat16)  # 182 bytes: a 6-byte tail after 22 words
    changed = odd.clone()
    changed.view(-1)[[0, 45, 88, 89, 90]] += 1  # the first element, the middle, and the tail
    pair("bf16.odd", odd, changed)
    zeros = torch.zeros(37, dtype=torch.float16)
    signed = zeros.clone()
    signed[[3, 36]] = -0.0  # equal as floats, not as bytes
    pair("f16.negative_zero", zeros, signed)
    nans = torch.ones(19, dtype=torch.float32)
    nans[[3, 5, 18]] = _bits_of(0x7FC00000, torch.float32, 3)
    payloads = nans.clone()
    payloads[3] = _bits_of(0x7FC00001, torch.float32, 1)[0]  # another NaN: changed
    payloads[18] = _bits_of(0x7FC00000, torch.float32, 1)[0]  # the same NaN: unchanged (a float `!=` says changed)
    pair("f32.nan_payloads", nans, payloads)
    codes = torch.randint(0, 255, (1001,), generator=generator, dtype=torch.uint8)
    moved = codes.clone()
    moved[[0, 7, 8, 500, 1000]] ^= 0x5A
    pair("fp8.codes", codes.view(torch.float8_e4m3fn), moved.view(torch.float8_e4m3fn))
    small = torch.randint(-128, 127, (3, 5), generator=generator, dtype=torch.int8)
    bumped = small.clone()
    bumped[2, 4] ^= 1
    pair("int8.small", small, bumped)
    wide = torch.arange(33, dtype=torch.int64)
    wide_changed = wide.clone()
    wide_changed[[0, 31, 32]] = -1
    pair("int64.wide", wide, wide_changed)
    flags = torch.zeros(11, dtype=torch.bool)
    flipped = flags.clone()
    flipped[10] = True
    pair("bool.flags", flags, flipped)
    same = torch.randn(10, generator=generator)
    pair("f32.unchanged", same, same.clone())
    pair("bf16.empty", torch.empty(0, 4, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.bfloat16))
    dense = torch.randn(50, generator=generator).to(torch.bfloat16)
    pair("bf16.dense", dense, dense + 1)  # every element: a whole replacement is smaller than indices and values
    # Across several of the workers' blocks, with a 2-byte tail; changes on the blocks' edges.
    big = torch.randn((5 * BLOCK_BYTES // 2) // 2 + 3, generator=generator).to(torch.float16)
    edges = big.clone()
    for byte in (0, BLOCK_BYTES - 2, BLOCK_BYTES, 2 * BLOCK_BYTES - 2, 2 * BLOCK_BYTES, 2 * BLOCK_BYTES + 6,
                 big.numel() * 2 - 2):
        edges[byte // 2] = -edges[byte // 2] if edges[byte // 2] != 0 else 1
    pair("f16.big", big, edges)
    return old, new


def _reference(old: Path, new: Path) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """The plain comparison: every element's bit pattern against the other's; sparse, or whole where smaller."""
    a, b = load_file(str(old)), load_file(str(new))
    found: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for name, after in b.items():
        bits = TORCH_BITS[after.element_size()]
        x, y = a[name].reshape(-1).view(bits), after.reshape(-1).view(bits)
        indices = torch.ne(x, y).nonzero().reshape(-1)
        if indices.numel() == 0:
            continue
        size = after.element_size()
        if indices.numel() * (size + 8) >= y.numel() * size:
            found[name] = (None, y.clone())
        else:
            found[name] = (indices, y[indices])
    return found


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("crafted")
    old_tensors, new_tensors = _crafted()
    (base / "old").mkdir()
    (base / "new").mkdir()
    save_file(old_tensors, str(base / "old" / "model.safetensors"))
    save_file(new_tensors, str(base / "new" / "model.safetensors"))
    return base / "old", base / "new"


def test_the_delta_equals_the_plain_comparison(crafted: tuple[Path, Path], tmp_path: Path) -> None:
    old, new = crafted
    compared = compare_checkpoints(old, new)
    expected = _reference(old / "model.safetensors", new / "model.safetensors")
    assert {c.name for c in compared.changed} == set(expected)
    assert {"f16.negative_zero", "f32.nan_payloads", "bf16.odd", "f16.big"} <= set(expected)
    for change in compared.changed:
        indices, values = expected[change.name]
        assert change.values.dtype == np.dtype(BITS[change.itemsize])
        assert np.array_equal(change.values, values.numpy()), change.name
        if indices is None:
            assert change.indices is None, change.name
        else:
            assert change.indices is not None and np.array_equal(change.indices, indices.numpy()), change.name
    assert [c.indices is None for c in compared.changed if c.name == "bf16.dense"] == [True]
    nan_change = next(c for c in compared.changed if c.name == "f32.nan_payloads")
    assert nan_change.indices is not None and nan_change.indices.tolist() == [3]
    assert compared.parent == compute_key(old).key.checkpoint
    assert compared.checkpoint == compute_key(new).key.checkpoint


def test_the_written_delta_reads_back_and_applies(crafted: tuple[Path, Path], tmp_path: Path) -> None:
    old, new = crafted
    summary = make_delta(old, new, tmp_path / "step.safetensors")
    parent = compute_key(old)
    delta = read_delta(summary.path, {e.name: e for e in parent.manifest})
    assert delta.checkpoint == compute_key(new).key.checkpoint
    before, after = load_file(str(old / "model.safetensors")), load_file(str(new / "model.safetensors"))
    for name, change in delta.changes.items():
        flat = before[name].reshape(-1).clone()
        change.apply_to(flat)
        bits = TORCH_BITS[flat.element_size()]
        assert torch.equal(flat.view(bits), after[name].reshape(-1).view(bits)), name
    # The safetensors library reads what wcache wrote without torch.
    with safe_open(str(summary.path), "pt") as f:
        assert dict(f.metadata())["parent"] == parent.key.checkpoint
        assert f.get_tensor("bf16.odd:values").dtype == torch.bfloat16


def test_a_sealed_delta_reads_as_its_file_does_and_a_loose_one_is_refused(crafted: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """What `publish` sends its parent's daemon: the delta in a sealed memfd, read through a map, not copied."""
    old, new = crafted
    compared = compare_checkpoints(old, new)
    parent = {e.name: e for e in compute_key(old).manifest}
    from_file = read_delta(make_delta(old, new, tmp_path / "step.safetensors").path, parent)
    label = Path("memfd:test")
    sealed = read_sealed_delta(sealed_delta(compared.parent, iter(compared.changed)), label, parent)
    assert sealed.checkpoint is None and sealed.parent == from_file.parent
    assert sealed.changes.keys() == from_file.changes.keys()
    for name, change in sealed.changes.items():
        assert not change.values.flags.writeable, name  # a view of the read-only map
        assert np.array_equal(change.values, from_file.changes[name].values), name
        expected = from_file.changes[name].indices
        assert (change.indices is None) == (expected is None), name
        assert change.indices is None or np.array_equal(change.indices, expected), name

    def loose(data: bytes, seals: int = SEALED) -> int:
        fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
        os.write(fd, data)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd

    good = (tmp_path / "step.safetensors").read_bytes()
    with pytest.raises(DeltaError, match=r"^memfd:test is not a delta sealed against writes .*; nothing was read\.$"):
        read_sealed_delta(loose(good, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW), label, parent)
    with (tmp_path / "step.safetensors").open("rb") as plain, \
            pytest.raises(DeltaError, match=r"not a delta sealed against writes"):
        read_sealed_delta(os.dup(plain.fileno()), label, parent)  # a file's descriptor has no seals
    with pytest.raises(DeltaError, match=r"^the delta memfd:test: the data region holds \d+ bytes but its tensors "
                                         r"cover \d+\.$"):
        read_sealed_delta(loose(good + bytes(4096)), label, parent)  # a tail no entry names
    held = sum(math.prod(e.shape) for e in parent.values())
    huge = write_safetensors_bytes(tmp_path, [Entry("bf16.dense:tensor", "I64", (held * 2,), np.zeros(held * 2))])
    with pytest.raises(DeltaError, match=r"data bytes are more than any delta of its parent can hold"):
        read_sealed_delta(loose(huge), label, parent)


def write_safetensors_bytes(where: Path, entries: list[Entry]) -> bytes:
    path = where / "entries.safetensors"
    write_safetensors(path, entries, {"format": "wcache.delta/1", "parent": "0" * 64})
    return path.read_bytes()


def test_receipts_the_store_trusts_spare_hashing_the_parent_and_stay(tmp_path: Path) -> None:
    old_tensors, new_tensors = _crafted()
    for name, tensors in (("old", old_tensors), ("new", new_tensors)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    wait_past_racy_window()
    with DigestStore.open(tmp_path / "store") as store:
        parent = compute_key(tmp_path / "old", store=store)
        shard = tmp_path / "old" / "model.safetensors"
        stored = store.lookup(shard, parent_identity(shard))
        assert stored is not None and stored.sha256 is not None
        compared = compare_checkpoints(tmp_path / "old", tmp_path / "new", store)
        kept = store.lookup(shard, parent_identity(shard))
        assert kept is not None and kept.sha256 == stored.sha256  # the parent's receipt is left whole
    assert compared.parent == parent.key.checkpoint
    assert compared.checkpoint == compute_key(tmp_path / "new").key.checkpoint
    assert {c.name for c in compared.changed} == set(_reference(shard, tmp_path / "new" / "model.safetensors"))


def parent_identity(path: Path) -> FileIdentity:
    return FileIdentity.of(os.stat(path))


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("words", [0, 1, 3, 125, 513])
def test_changed_elements_match_an_element_comparison(itemsize: int, words: int) -> None:
    rng = np.random.default_rng(itemsize * 1000 + words)
    for tail in range(0, 8, itemsize):  # 0 to 7 bytes past the last whole word
        length = words * 8 + tail
        before = rng.integers(0, 256, length, dtype=np.uint8)
        after = before.copy()
        after[rng.choice(length, size=min(length, 1 + length // 50), replace=False)] ^= 0xFF
        elements = ChangedElements(itemsize, np.empty(words, dtype=np.bool_))
        indices, values = elements.find(before, after, 1000)
        bits = BITS[itemsize]
        expected = np.flatnonzero(before.view(bits) != after.view(bits))
        assert indices.dtype == np.int64
        assert np.array_equal(indices, expected + 1000)
        assert np.array_equal(values, after.view(bits)[expected])


def test_the_writer_lays_out_entries_aligned_for_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "entries.safetensors"
    entries = [Entry("b", "BF16", (3,), np.array([1, 2, 3], dtype=np.int16)),
               Entry("a", "I64", (2,), np.array([5, 6], dtype=np.int64)),
               Entry("c", "U8", (1,), np.array([9], dtype=np.uint8))]
    write_safetensors(path, entries, {"format": "test"})
    loaded = load_file(str(path))
    assert loaded["a"].tolist() == [5, 6] and loaded["c"].tolist() == [9]
    assert loaded["b"].view(torch.int16).tolist() == [1, 2, 3] and loaded["b"].dtype == torch.bfloat16
    with safe_open(str(path), "pt") as f:
        assert dict(f.metadata()) == {"format": "test"}


def _delta_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_a_read_that_fails_midway_is_one_error_and_stops_the_workers(crafted: tuple[Path, Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from wcache.errors import CheckpointError
    from wcache.key.shard_hash import OpenShard

    real_read = OpenShard.read_into
    calls = {"n": 0}

    def failing_read(shard: OpenShard, tensor: object, start: int, buffer: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 9:
            raise CheckpointError(f"{shard.path} shrank while it was being read; wait until it is fully written.")
        real_read(shard, tensor, start, buffer)  # type: ignore[arg-type]

    monkeypatch.setattr(OpenShard, "read_into", failing_read)
    with pytest.raises(CheckpointError, match="shrank while it was being read"):
        compare_checkpoints(*crafted)
    assert _delta_threads() == []


def test_a_whole_replacement_whose_bytes_changed_since_the_pass_is_refused(crafted: tuple[Path, Path],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from wcache.delta import compare
    from wcache.errors import CheckpointError

    class Other:
        def update(self, data: object) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 64

    monkeypatch.setattr(compare, "tensor_hasher", lambda nbytes: Other())
    with pytest.raises(CheckpointError, match="changed while it was being read"):
        compare_checkpoints(*crafted)  # bf16.dense is replaced whole: read again, and its digest must match
    assert _delta_threads() == []
