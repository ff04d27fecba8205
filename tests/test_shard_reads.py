"""Shards are read, never mapped: a shrinking file is one sentence, never SIGBUS; filesystems that refuse mmap
work; preload reads every byte once, hashing what it copies, and takes the key at the right moment."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import run_python, wait_past_racy_window
from wcache.checkpoint.files import locate
from wcache.checkpoint.safetensors_header import read_header
from wcache.errors import CheckpointError, UnavailableError
from wcache.ipc.arenas.daemon_side import CpuArena, plan_layout
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.digest_store import RACY_WINDOW_NS, DigestStore
from wcache.key.shard_hash import FileIdentity, ShardRecord
from wcache.load.loader import CheckpointReader, load_from_disk, load_rank, processed_digest
from wcache.load.single_pass import fill_in_one_pass
from wcache.plan.processing import build_plan, process_all
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import (
    PRESETS,
    make_tensors,
    overwrite_tensor_bytes,
    read_tensors,
    write_checkpoint,
    write_tensors,
)

BIG = "big.weight"
BIG_ELEMENTS = 16 * 1024 * 1024  # 64 MiB of float32: many reads, so the truncation lands in the middle


class Counting:
    """A HashProgress that counts the bytes reported, and runs `hook` on the first report."""

    def __init__(self, hook: object = None) -> None:
        self.bytes = 0
        self.hook = hook

    def start(self, total_bytes: int, num_files: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        if self.bytes == 0 and callable(self.hook):
            self.hook()
        self.bytes += nbytes


def _big_checkpoint(dest: Path, elements: int = BIG_ELEMENTS) -> tuple[Path, Path, int]:
    """One shard holding a big float32 tensor and a few small ones; (model dir, shard, where its data starts)."""
    tensors = {"a.small": torch.ones(8), BIG: torch.arange(elements, dtype=torch.float32), "z.small": torch.ones(8)}
    model = write_tensors(tensors, None, dest, 1)
    shard = locate(model).shards[0]
    fd = os.open(shard, os.O_RDONLY)
    try:
        data_start = read_header(fd, os.fstat(fd).st_size, shard).data_start
    finally:
        os.close(fd)
    return model, shard, data_start


# The real `wcache key`, with its progress bar's first report truncating the shard it is hashing.
_KEY_TRUNCATED = """
import os, sys
from wcache_cli import progress
shard, keep, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real = progress.HashBar.advance
def advance(self, nbytes):
    if os.path.getsize(shard) > keep:
        os.truncate(shard, keep)
    real(self, nbytes)
progress.HashBar.advance = advance
sys.argv = ["wcache", "key", model, "--rehash"]
from wcache_cli.main import main
main()
"""


def test_key_of_a_shard_truncated_while_hashed_is_one_sentence(tmp_path: Path) -> None:
    model, shard, data_start = _big_checkpoint(tmp_path / "big")
    result = run_python(_KEY_TRUNCATED, str(shard), str(data_start + 4096), str(model))
    assert result.returncode != -signal.SIGBUS, "the shard was mapped: its truncation killed the process"
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == (f"error: {shard} shrank while it was being read; wait until it is fully written and "
                        "try again."), lines[0]


# load_rank (what a preload's rank runs), its progress truncating the shard mid-pass.
_LOAD_TRUNCATED = """
import os, sys
from pathlib import Path
from wcache.errors import WcacheError
from wcache.load.loader import load_rank
from wcache.plan.spec import PlanSpec
shard, keep, model = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
class Truncating:
    def start(self, total_bytes, num_files):
        pass
    def advance(self, nbytes):
        if os.path.getsize(shard) > keep:
            os.truncate(shard, keep)
try:
    load_rank(model, PlanSpec(layout="identity"), "cpu", None, Truncating())
except WcacheError as exc:
    print(exc, file=sys.stderr)
    sys.exit(exc.exit_code)
"""


def test_preload_of_a_shard_truncated_mid_pass_is_one_sentence(tmp_path: Path) -> None:
    model, shard, data_start = _big_checkpoint(tmp_path / "big")
    result = run_python(_LOAD_TRUNCATED, str(shard), str(data_start + 4096), str(model))
    assert result.returncode != -signal.SIGBUS, "the shard was mapped: its truncation killed the rank"
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.strip() == f"{shard} shrank while it was being read; wait until it is fully written and " \
                                    "try again.", result.stderr


# A filesystem that refuses mmap (ENODEV, as some FUSE and network filesystems do): key, disk load and preload
# must all work, and no checkpoint file may be mapped while they run.
_NO_MMAP = """
import errno, mmap, os, sys
from pathlib import Path
real_mmap = mmap.mmap
def refusing(fileno, *args, **kwargs):
    if fileno >= 0 and os.readlink(f"/proc/self/fd/{fileno}").endswith(".safetensors"):
        raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
    return real_mmap(fileno, *args, **kwargs)
mmap.mmap = refusing

import torch
from wcache.key.compute import compute_key
from wcache.load.loader import load_from_disk, load_rank
from wcache.plan.spec import PlanSpec

class NoMaps:
    checks = 0
    def start(self, total_bytes, num_files):
        pass
    def advance(self, nbytes):
        maps = Path("/proc/self/maps").read_text()
        assert ".safetensors" not in maps, maps
        NoMaps.checks += 1

model = Path(sys.argv[1])
key = compute_key(model, PlanSpec(), store=None, rehash=True, progress=NoMaps())
disk = load_from_disk(key, model)
loaded = load_rank(model, PlanSpec(), "cpu", None, NoMaps())
assert loaded.key_file.key == key.key
arena = loaded.arena.tensors(loaded.entries)
assert list(arena) == list(disk)
for name, tensor in disk.items():
    assert torch.equal(arena[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
assert NoMaps.checks > 0
print("ok", NoMaps.checks)
"""


def test_every_checkpoint_read_works_where_mmap_is_refused(tiny_template: Path) -> None:
    result = run_python(_NO_MMAP, str(tiny_template))
    assert result.returncode == 0 and result.stdout.startswith("ok"), (result.stdout, result.stderr)


def _receipts(store_dir: Path) -> int:
    import sqlite3

    from wcache.key.digest_store import DB_NAME

    with sqlite3.connect(store_dir / DB_NAME) as conn:
        return int(conn.execute("SELECT count(*) FROM shards").fetchone()[0])


def test_checkpoint_rewritten_during_the_pass_is_refused(tmp_path: Path) -> None:
    # The arena never holds other bytes than its key and recorded digests describe: the rewrite shows in the
    # file's identity, and no receipt is stored for bytes that changed.
    model = write_checkpoint("tiny", tmp_path / "tiny")
    progress = Counting(lambda: overwrite_tensor_bytes(model, "model.norm.weight", 0, b"\x22" * 16))
    with DigestStore(tmp_path / "store") as store, pytest.raises(CheckpointError) as failure:
        load_rank(model, PlanSpec(), "cpu", store, progress)
    assert "changed while it was being loaded" in str(failure.value)
    assert _receipts(tmp_path / "store") == 0, "no receipt for bytes that changed"


@pytest.fixture(scope="module")
def aged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint old enough for the digest store to trust receipts taken now."""
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("aged") / "tiny")
    wait_past_racy_window()
    return model


def _arena_fds() -> int:
    """Arena memfds this process holds beyond those it held when the module began (another module's engine on
    this worker may keep one mapped: these tests judge their own loads)."""
    return _memfd_count() - _held_before[0]


def _memfd_count() -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for entry in fds.iterdir():
        try:
            count += "memfd:wcache-arena" in str(entry.readlink())
        except OSError:
            continue
    return count


_held_before = [0]


@pytest.fixture(scope="module", autouse=True)
def _count_arenas_held_before() -> None:
    _held_before[0] = _memfd_count()


def test_key_is_taken_before_any_read_when_every_shard_has_a_trusted_receipt(aged: Path, tmp_path: Path) -> None:
    with DigestStore(tmp_path / "store") as store:
        expected = compute_key(aged, PlanSpec(), store=store)
        progress = Counting()
        seen: list[tuple[KeyFile, int, int]] = []

        def on_key(key_file: KeyFile) -> None:
            seen.append((key_file, progress.bytes, _arena_fds()))
            raise UnavailableError("another daemon holds this key")

        with pytest.raises(UnavailableError):
            load_rank(aged, PlanSpec(), "cpu", store, progress, on_key=on_key)
    assert len(seen) == 1
    key_file, read_before, arenas_before = seen[0]
    assert key_file.key == expected.key
    assert read_before == 0 and progress.bytes == 0, "the key was known: nothing is read before on_key"
    assert arenas_before == 0 and _arena_fds() == 0


def test_key_is_taken_after_the_pass_on_a_cold_store_and_a_loser_drops_its_arena(aged: Path,
                                                                                tmp_path: Path) -> None:
    progress = Counting()
    seen: list[tuple[KeyFile, int]] = []

    def on_key(key_file: KeyFile) -> None:
        seen.append((key_file, progress.bytes))
        raise UnavailableError("another daemon holds this key")

    with DigestStore(tmp_path / "store") as store, pytest.raises(UnavailableError):
        load_rank(aged, PlanSpec(), "cpu", store, progress, on_key=on_key)
    data_bytes = sum(e.nbytes for e in compute_key(aged, PlanSpec()).manifest)
    assert [(k.key, n) for k, n in seen] == [(compute_key(aged, PlanSpec()).key, data_bytes)]
    assert _arena_fds() == 0, "the losing load's arena is gone"


def test_receipts_that_disagree_with_the_bytes_read_stop_the_load(aged: Path, tmp_path: Path) -> None:
    # What a same-size rewrite on a filesystem with coarse timestamps leaves: a trusted receipt, for the file's
    # unchanged identity, that no longer describes its bytes. The key was served from it; the pass must refuse.
    with DigestStore(tmp_path / "store") as store:
        compute_key(aged, PlanSpec(), store=store)
        shard = locate(aged).shards[0]
        receipt = store.lookup(shard, FileIdentity.of(os.stat(shard)))
        assert receipt is not None
        victim = receipt.header.tensors[0].name
        lying = ShardRecord(receipt.path, receipt.identity, receipt.header, ("0" * 64, *receipt.digests[1:]),
                            time.time_ns() + RACY_WINDOW_NS, receipt.sha256)
        store.put_many([lying])
        with pytest.raises(CheckpointError) as failure:
            load_rank(aged, PlanSpec(), "cpu", store)
    assert str(failure.value) == (f"{shard} changed while it was being loaded (tensor {victim!r}); load it again "
                                  "once written.")
    assert _arena_fds() == 0


def _checkpoint_with_an_unused_tensor(dest: Path) -> Path:
    # The rotary buffer is in no fused output, yet it is part of the checkpoint and so of the key.
    tensors = make_tensors(PRESETS["tiny"])
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.linspace(0, 1, 8)
    return write_tensors(tensors, PRESETS["tiny"].config, dest, 2)


@pytest.mark.parametrize("spec", [
    PlanSpec(), PlanSpec(layout="identity"), PlanSpec(tp_size=2, tp_rank=1), PlanSpec(quantization="int8"),
    PlanSpec(dtype="bfloat16"),
], ids=["fused", "identity", "tp2-rank1", "int8", "bf16-cast"])
def test_arena_holds_the_disk_loads_bytes_and_the_key_is_the_fingerprints(tmp_path: Path, spec: PlanSpec) -> None:
    model = _checkpoint_with_an_unused_tensor(tmp_path / "ckpt") if spec.layout == "fused" else (
        write_checkpoint("tiny", tmp_path / "ckpt"))
    loaded = load_rank(model, spec, "cpu", None)
    try:
        key_file = compute_key(model, spec)
        assert loaded.key_file.key == key_file.key
        disk = load_from_disk(key_file, model)
        plan = build_plan(key_file.plan, locate(model).config, key_file.manifest)
        expected = process_all(plan, read_tensors(model).__getitem__)
        arena = loaded.arena.tensors(loaded.entries)
        assert list(disk) == list(expected) == [e.name for e in loaded.entries]
        for name, reference in expected.items():
            for got in (arena[name], disk[name]):
                assert got.dtype == reference.dtype and got.shape == reference.shape, name
                assert torch.equal(got.reshape(-1).view(torch.uint8), reference.reshape(-1).view(torch.uint8)), name
            assert loaded.processed_digests[name] == processed_digest(reference), name
    finally:
        loaded.arena.close()


@pytest.mark.parametrize("spec", [PlanSpec(), PlanSpec(tp_size=2, tp_rank=0)], ids=["fused", "tp2-rank0"])
def test_a_pass_without_read_back_computes_what_it_cannot_hash_back(tmp_path: Path, spec: PlanSpec) -> None:
    # A CUDA arena cannot be read back, so outputs stacked from several tensors are computed in memory and hashed
    # there instead; the bytes and digests must be those of the pass that writes them straight to the arena.
    model = _checkpoint_with_an_unused_tensor(tmp_path / "ckpt")
    key_file = compute_key(model, spec)
    layout = locate(model)
    plan = build_plan(key_file.plan, layout.config, key_file.manifest)
    entries, total = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
    offsets = {e.name: e.offset for e in entries}
    results, contents = [], []
    for read_back in (True, False):
        arena = CpuArena(total)
        try:
            with CheckpointReader(layout) as reader:
                results.append(fill_in_one_pass(plan, reader.shards, arena.write_at, offsets, None,
                                                arena.bytes_at if read_back else None))
            with arena.bytes_at(0, total) as data:
                contents.append(bytes(data))
        finally:
            arena.close()
    assert results[0] == results[1]
    assert contents[0] == contents[1]
    expected = process_all(plan, read_tensors(model).__getitem__)
    assert results[0].processed == {name: processed_digest(t) for name, t in expected.items()}


def test_outputs_stacked_from_several_tensors_are_hashed_once_the_arena_is_sealed(tmp_path: Path) -> None:
    # A preload leaves the stacked outputs (qkv, gate_up) unhashed in its pass and hashes them from the sealed
    # arena after READY; the digests it then gives are those of the bytes the arena holds.
    model = write_checkpoint("tiny", tmp_path / "ckpt")
    key_file = compute_key(model, PlanSpec())
    layout = locate(model)
    plan = build_plan(key_file.plan, layout.config, key_file.manifest)
    entries, total = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
    arena = CpuArena(total)
    try:
        with CheckpointReader(layout) as reader:
            result = fill_in_one_pass(plan, reader.shards, arena.write_at, {e.name: e.offset for e in entries},
                                      None, arena.bytes_at, hash_stacked=False)
    finally:
        arena.close()
    stacked = {o.name for o in plan.outputs if len(o.sources) > 1}
    assert stacked and set(result.unhashed) == stacked
    assert set(result.processed) == {o.name for o in plan.outputs} - stacked
    loaded = load_rank(model, PlanSpec(), "cpu", None)
    try:
        expected = process_all(plan, read_tensors(model).__getitem__)
        assert loaded.processed_digests == {name: processed_digest(t) for name, t in expected.items()}
    finally:
        loaded.arena.close()


def _resident_fraction(path: Path) -> float:
    """Fraction of a file's pages in the page cache (a map and mincore; nothing is read)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            return (pages - bytes(vec).count(0)) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def test_preload_keeps_the_checkpoint_out_of_the_page_cache(tmp_path: Path) -> None:
    # Otherwise the weights sit in memory twice: in the daemon's arena and in the page cache behind the read.
    model, shard, _ = _big_checkpoint(tmp_path / "big", elements=2 * BIG_ELEMENTS)  # 128 MiB
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", str(shard)], capture_output=True, text=True).stdout
    if filesystem.strip() in ("tmpfs", "ramfs"):
        pytest.skip("a tmpfs file's pages are the file itself; they cannot be dropped")
    os.sync()  # dirty pages cannot be dropped
    if _resident_fraction(shard) < 0.5:
        pytest.skip("this filesystem did not keep the fresh file's pages cached")
    size = shard.stat().st_size
    sampled: list[float] = []

    class Sampling(Counting):
        def advance(self, nbytes: int) -> None:
            super().advance(nbytes)
            if not sampled and self.bytes >= 3 * size // 4:
                sampled.append(_resident_fraction(shard))

    loaded = load_rank(model, PlanSpec(layout="identity"), "cpu", None, Sampling())
    try:
        # Three quarters read: what is still cached is the kernel's read-ahead, not what was read.
        assert sampled and sampled[0] < 0.25, sampled
        assert _resident_fraction(shard) < 0.05
    finally:
        loaded.arena.close()
