"""A warm key returns the Merkle root stored for its checkpoint state, and never a stale one.

The state is every shard's name and stat identity and the index's bytes: a change to any shard's content,
size, mtime, ctime or inode, to the index or to the set of shards must miss the stored root and give the key
that hashing every byte gives. The manifest behind a stored root is built only when read, and it is the
manifest of the bytes the root was computed from. Real files and a real SQLite store in every test.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import wcache.key.fingerprint as fingerprint
from helpers import edited_index, wait_past_racy_window
from wcache.errors import CheckpointError
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.digest_store import DB_NAME, DigestStore
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint

INDEX = "model.safetensors.index.json"
COPIES = 24


@pytest.fixture(scope="module")
def aged_copies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    """Copies of one tiny checkpoint old enough for their receipts (and so their roots) to be trusted: one
    wait for all of them, not one per test."""
    root = tmp_path_factory.mktemp("aged")
    template = write_checkpoint("tiny", root / "template")
    copies = [Path(shutil.copytree(template, root / f"copy{i}")) for i in range(COPIES)]
    wait_past_racy_window()
    yield copies


@pytest.fixture
def checkpoint(aged_copies: list[Path], tmp_path: Path) -> Path:
    """An aged checkpoint of this test's own (a fresh copy, and a wait, once the aged ones are used up)."""
    if aged_copies:
        return aged_copies.pop()
    copy = Path(shutil.copytree(write_checkpoint("tiny", tmp_path / "template"), tmp_path / "copy"))
    wait_past_racy_window()
    return copy


def key_with(path: Path, cache: Path, **kwargs: object) -> KeyFile:
    with DigestStore(cache) as store:
        assert store.enabled
        return compute_key(path, store=store, **kwargs)  # type: ignore[arg-type]


def reference(path: Path) -> KeyFile:
    """Every byte hashed, no store."""
    return compute_key(path)


def stored_roots(cache: Path) -> int:
    with sqlite3.connect(cache / DB_NAME) as conn:
        return conn.execute("SELECT count(*) FROM roots").fetchone()[0]


def shard_of(path: Path, tensor: str) -> Path:
    return path / json.loads((path / INDEX).read_text())["weight_map"][tensor]


def warm_hit(path: Path, cache: Path) -> KeyFile:
    """Fill the store (the first key), then the key that comes from the stored root."""
    first = key_with(path, cache)
    assert first.stats is not None and not first.stats.root_from_store
    hit = key_with(path, cache)
    assert hit.stats is not None and hit.stats.root_from_store, "the second key did not use the stored root"
    assert hit.key == first.key
    return hit


def assert_recomputed(path: Path, cache: Path) -> KeyFile:
    """The key after a change: not from the stored root, and the key of the bytes as they are."""
    after = key_with(path, cache)
    assert after.stats is not None and not after.stats.root_from_store, "a changed checkpoint used a stored root"
    expected = reference(path)
    assert after.key == expected.key
    assert after.manifest == expected.manifest
    return after


# -- the hit ---------------------------------------------------------------------------------------------


def test_warm_key_returns_the_stored_root_without_reading_a_receipt(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key_with(checkpoint, cache)
    assert stored_roots(cache) == 1
    with DigestStore(cache) as store:
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)  # type: ignore[union-attr]
        hit = compute_key(checkpoint, store=store)
        store._conn.set_trace_callback(None)  # type: ignore[union-attr]
        assert hit.stats is not None and hit.stats.root_from_store
        assert hit.stats.shards_from_store == hit.stats.num_shards and hit.stats.shards_hashed == 0
        assert not any("FROM shards" in s for s in statements), statements  # no receipt was decoded
        assert "manifest" not in vars(hit)  # built only when read
        expected = reference(checkpoint)
        assert hit.key == expected.key
        assert hit.manifest == expected.manifest  # built now, from the receipts
        assert hit.to_json()["tensors"] == expected.to_json()["tensors"]


def test_manifest_of_a_stored_root_is_built_after_the_store_is_closed(checkpoint: Path, tmp_path: Path) -> None:
    hit = warm_hit(checkpoint, tmp_path / "cache")  # key_with closed its store
    assert hit.manifest == reference(checkpoint).manifest


def test_rehash_ignores_the_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    rehashed = key_with(checkpoint, cache, rehash=True)
    assert rehashed.stats is not None and not rehashed.stats.root_from_store
    assert rehashed.stats.shards_hashed == rehashed.stats.num_shards


def test_config_still_feeds_the_key_on_a_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    # The root covers the tensors only; config.json is read and digested on every key.
    cache = tmp_path / "cache"
    before = warm_hit(checkpoint, cache)
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_theta"] = 12345.0
    (checkpoint / "config.json").write_text(json.dumps(config))
    after = key_with(checkpoint, cache)
    assert after.stats is not None and after.stats.root_from_store
    assert after.key.checkpoint == before.key.checkpoint and after.key.config != before.key.config
    assert after.key == reference(checkpoint).key


def test_auto_dtype_without_a_config_dtype_comes_from_the_lazy_manifest(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with DigestStore(cache) as store:
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)  # type: ignore[union-attr]
        hit = compute_key(checkpoint, PlanSpec(), store=store)
        assert hit.stats is not None and hit.stats.root_from_store
        assert len(hit.manifest) > 0
        store._conn.set_trace_callback(None)  # type: ignore[union-attr]
    assert sum("FROM shards" in s for s in statements) == 1  # built once, for the dtype and the key file
    assert hit.key == compute_key(checkpoint, PlanSpec()).key
    assert hit.plan.dtype != "auto"


def test_a_root_too_young_to_trust_is_not_stored(tmp_path: Path) -> None:
    fresh = write_checkpoint("tiny", tmp_path / "fresh")  # written now: inside the racy window
    cache = tmp_path / "cache"
    began = time.time_ns()
    key_with(fresh, cache)
    again = key_with(fresh, cache)
    if time.time_ns() - began >= 2_000_000_000:
        pytest.skip("this machine took longer than the racy window between writing and the second key")
    assert stored_roots(cache) == 0
    assert again.stats is not None and not again.stats.root_from_store


def test_a_stored_root_that_is_not_a_root_is_a_miss(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with sqlite3.connect(cache / DB_NAME) as conn:
        conn.execute("UPDATE roots SET root = 'not a root'")
    assert_recomputed(checkpoint, cache)


def test_oldest_roots_are_dropped_past_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wcache.key.digest_store as digest_store

    monkeypatch.setattr(digest_store, "MAX_ROOTS", 3)
    with DigestStore(tmp_path / "cache") as store:
        for i in range(5):
            store.put_root(f"state{i}", f"{i:064x}")
        assert [store.lookup_root(f"state{i}") for i in range(5)] == [None, None, *(f"{i:064x}" for i in (2, 3, 4))]


# -- every way the stored root must be missed -----------------------------------------------------------


def test_changed_bytes_miss_the_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    before = warm_hit(checkpoint, cache)
    overwrite_tensor_bytes(checkpoint, "model.norm.weight", 0, b"\x00" * 4)
    after = assert_recomputed(checkpoint, cache)
    assert after.key.checkpoint != before.key.checkpoint


def test_changed_bytes_with_size_and_mtime_restored_miss_the_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    before = warm_hit(checkpoint, cache)
    shard = shard_of(checkpoint, "model.norm.weight")
    old = os.stat(shard)
    overwrite_tensor_bytes(checkpoint, "model.norm.weight", 0, b"\x00" * 4)
    os.utime(shard, ns=(old.st_atime_ns, old.st_mtime_ns))  # only ctime tells
    assert (os.stat(shard).st_size, os.stat(shard).st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    after = assert_recomputed(checkpoint, cache)
    assert after.key.checkpoint != before.key.checkpoint


def test_a_longer_shard_misses_the_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    # Bytes appended after the last tensor: the shard no longer matches its header, so no key exists.
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with open(shard_of(checkpoint, "model.norm.weight"), "ab") as f:
        f.write(b"\x00" * 8)
    with pytest.raises(CheckpointError):
        key_with(checkpoint, cache)


def _older_mtime(checkpoint: Path) -> None:
    shard = shard_of(checkpoint, "model.norm.weight")
    os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns - 10**9))


def _new_ctime(checkpoint: Path) -> None:
    shard = shard_of(checkpoint, "model.norm.weight")
    os.chmod(shard, os.stat(shard).st_mode)  # changes ctime only


def _new_inode_with_the_same_times(checkpoint: Path) -> None:
    shard = shard_of(checkpoint, "model.norm.weight")
    old = os.stat(shard)
    replacement = shard.with_suffix(".new")
    shutil.copy2(shard, replacement)
    os.replace(replacement, shard)
    assert os.stat(shard).st_ino != old.st_ino and os.stat(shard).st_mtime_ns == old.st_mtime_ns


def _rewritten_but_equal_index(checkpoint: Path) -> None:
    index = json.loads((checkpoint / INDEX).read_text())
    (checkpoint / INDEX).write_text(json.dumps(index, indent=4))


def _shard_renamed_with_its_index(checkpoint: Path) -> None:
    with edited_index(checkpoint) as index:
        old_name = sorted(set(index["weight_map"].values()))[0]
        (checkpoint / old_name).rename(checkpoint / "renamed.safetensors")
        index["weight_map"] = {t: ("renamed.safetensors" if s == old_name else s)
                               for t, s in index["weight_map"].items()}


# Changes to the files' identities, not to their bytes.
SAME_BYTES_CHANGES: dict[str, Callable[[Path], None]] = {
    "mtime": _older_mtime,
    "ctime": _new_ctime,
    "new inode with the same times": _new_inode_with_the_same_times,
    "rewritten but equal index": _rewritten_but_equal_index,
    "shard renamed with its index": _shard_renamed_with_its_index,
}


@pytest.mark.parametrize("change", SAME_BYTES_CHANGES.values(), ids=SAME_BYTES_CHANGES.keys())
def test_the_same_bytes_under_a_new_identity_miss_the_stored_root(
    change: Callable[[Path], None], checkpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    before = warm_hit(checkpoint, cache)
    change(checkpoint)
    after = assert_recomputed(checkpoint, cache)
    assert after.key == before.key  # same bytes, same key: only the shortcut was refused


def test_an_index_that_now_lies_is_an_error_not_a_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with edited_index(checkpoint) as index:
        names = sorted(set(index["weight_map"].values()))
        moved = next(t for t, s in index["weight_map"].items() if s == names[0])
        index["weight_map"][moved] = names[1]  # the same shard files, a wrong place for one tensor
    with pytest.raises(CheckpointError, match="lists tensor"):
        key_with(checkpoint, cache)


def test_a_shard_left_out_of_the_index_misses_the_stored_root(checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with edited_index(checkpoint) as index:
        dropped = sorted(set(index["weight_map"].values()))[0]
        index["weight_map"] = {t: s for t, s in index["weight_map"].items() if s != dropped}
    (checkpoint / dropped).unlink()
    after = assert_recomputed(checkpoint, cache)
    assert after.stats is not None and after.stats.num_shards == len(set(index["weight_map"].values()))


# -- the manifest behind a stored root --------------------------------------------------------------------


def test_manifest_behind_a_stored_root_whose_receipts_are_gone_is_hashed_again(
    checkpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with DigestStore(cache) as store:
        hit = compute_key(checkpoint, store=store)
        assert hit.stats is not None and hit.stats.root_from_store
        with sqlite3.connect(cache / DB_NAME) as conn:
            conn.execute("DELETE FROM shards")
        assert hit.manifest == reference(checkpoint).manifest


def test_manifest_behind_a_stored_root_is_of_the_bytes_the_key_was_computed_from(
    checkpoint: Path, tmp_path: Path
) -> None:
    # A key is a snapshot: its manifest, built later, still lists the digests its root was computed from,
    # as an eagerly built one would; where those receipts are gone and the bytes changed, it is an error.
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    before = reference(checkpoint).manifest
    with DigestStore(cache) as store:
        kept = compute_key(checkpoint, store=store)
        lost = compute_key(checkpoint, store=store)
        assert kept.stats is not None and kept.stats.root_from_store
        overwrite_tensor_bytes(checkpoint, "model.norm.weight", 0, b"\x00" * 4)
        assert kept.manifest == before
        with sqlite3.connect(cache / DB_NAME) as conn:
            conn.execute("DELETE FROM shards")
        with pytest.raises(CheckpointError, match="changed after its key was computed"):
            _ = lost.manifest


def test_manifest_behind_a_stored_root_never_trusts_receipts_that_miss_it(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Receipts that do not add up to the stored root (a store edited by hand): every shard is read again.
    cache = tmp_path / "cache"
    warm_hit(checkpoint, cache)
    with DigestStore(cache) as store:
        hit = compute_key(checkpoint, store=store)
        expected = reference(checkpoint).manifest
        real_root = fingerprint.merkle_root
        calls: list[int] = []

        def wrong_once(entries):  # type: ignore[no-untyped-def]
            calls.append(1)
            return "0" * 64 if len(calls) == 1 else real_root(entries)

        monkeypatch.setattr(fingerprint, "merkle_root", wrong_once)
        assert hit.manifest == expected
        assert len(calls) == 2  # the receipts' root disagreed, then the bytes' root agreed


def test_a_preload_stores_the_root_so_an_engines_first_key_reads_no_receipt(checkpoint: Path, tmp_path: Path) -> None:
    """The daemon's one-pass load leaves the root beside its receipts: an engine restarting after a preload
    computes its first key from the stored root, and it is the key every byte gives."""
    from wcache.load.loader import load_rank

    cache = tmp_path / "cache"
    with DigestStore(cache) as store:
        loaded = load_rank(checkpoint, PlanSpec(), "cpu", store)
        loaded.arena.close()
    assert stored_roots(cache) == 1
    first = key_with(checkpoint, cache)
    assert first.stats is not None and first.stats.root_from_store and first.stats.shards_hashed == 0
    assert first.key == loaded.key_file.key == reference(checkpoint).key


def test_a_preload_of_a_checkpoint_still_being_written_stores_no_root(tmp_path: Path) -> None:
    """Files changed within the racy window are hashed, never trusted: their root is not stored either."""
    from wcache.load.loader import load_rank

    young = write_checkpoint("tiny", tmp_path / "young")
    cache = tmp_path / "cache"
    with DigestStore(cache) as store:
        load_rank(young, PlanSpec(), "cpu", store).arena.close()
    assert stored_roots(cache) == 0
