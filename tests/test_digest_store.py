"""The digest store survives corruption, bad rows, unwritable places and concurrent writers, and trusts only
receipts it may trust (racy-git rule, ctime).

Real SQLite files, real checkpoints, `wcache` through its entry point (real processes where several share one
store, or where the store belongs to another uid); every test has its own store directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
from as_nobody import NOBODY, nobody_tree, open_to_all, run_as_nobody
from helpers import WCACHE, cli_env, environment, wait_past_racy_window, wcache_in_process
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.digest_store import DB_NAME, LOOKUP_BATCH, RACY_WINDOW_NS, SCHEMA_VERSION, DigestStore, is_trusted
from wcache.key.shard_hash import FileIdentity
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint

NUM_SHARDS = 2  # the "tiny" preset
CONCURRENT = 4


# -- helpers ------------------------------------------------------------------------------------------


def cli_key_id(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["id"]


def stderr_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_store_warning(result: subprocess.CompletedProcess[str]) -> str:
    lines = stderr_lines(result)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("warning:"), lines
    assert "digest store" in lines[0], lines
    return lines[0]


def key_with(checkpoint: Path, cache: Path) -> KeyFile:
    with DigestStore(cache) as store:
        assert store.enabled
        return compute_key(checkpoint, store=store)


def reference_key(checkpoint: Path) -> KeyFile:
    """The key from hashing every byte, with no store at all."""
    return compute_key(checkpoint)


def store_rows(cache: Path) -> list[tuple[str, bytes]]:
    with sqlite3.connect(cache / DB_NAME) as conn:
        return list(conn.execute("SELECT path, record FROM shards ORDER BY path"))


def corrupt_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob(f"{DB_NAME}.corrupt-*") if not p.name.endswith(("-wal", "-shm")))


def shard_paths(checkpoint: Path) -> list[str]:
    return sorted(str(p) for p in checkpoint.glob("*.safetensors"))


@pytest.fixture(scope="module")
def aged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints written once, then left alone past the racy window so their receipts can be trusted.

    Every test gets its own store, so reading these is shared safely; a test that modifies a checkpoint
    gets its own ("mutable").
    """
    root = tmp_path_factory.mktemp("aged")
    checkpoints = {"shared": write_checkpoint("tiny", root / "shared"),
                   "mutable": write_checkpoint("tiny", root / "mutable")}
    for seed in range(CONCURRENT):
        checkpoints[f"seed{seed}"] = write_checkpoint("tiny", root / f"seed{seed}", seed=seed + 1)
    wait_past_racy_window()
    return checkpoints


# -- (a) corrupt store file ------------------------------------------------------------------------------


def _garbage(cache: Path) -> bytes:
    return random.Random(7).randbytes(8192)


def _sqlite_magic_then_garbage(cache: Path) -> bytes:
    return b"SQLite format 3\x00" + random.Random(8).randbytes(8192)


def _real_store_with_garbage_pages(cache: Path) -> bytes:
    # A real store whose page header survives but whose pages do not.
    work = cache.parent / "donor"
    DigestStore(work).close()  # the last close folds the WAL into the main file
    data = bytearray((work / DB_NAME).read_bytes())
    data[100:] = random.Random(9).randbytes(len(data) - 100)
    return bytes(data)


@pytest.mark.parametrize("make", [_garbage, _sqlite_magic_then_garbage, _real_store_with_garbage_pages])
def test_corrupt_store_is_moved_aside_and_rebuilt(make, tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    cache.mkdir()
    garbage = make(cache)
    (cache / DB_NAME).write_bytes(garbage)

    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    assert_one_store_warning(result)

    aside = corrupt_files(cache)
    assert len(aside) == 1, aside
    assert aside[0].read_bytes() == garbage
    # The new store holds this run's receipts and answers the next lookup without hashing.
    assert sorted(path for path, _ in store_rows(cache)) == shard_paths(checkpoint)
    warm = key_with(checkpoint, cache)
    assert warm.stats is not None
    assert warm.stats.shards_from_store == warm.stats.num_shards == NUM_SHARDS
    # And it stays healthy: the next process neither warns nor hashes.
    again = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(again) == warm.key.short_id
    assert stderr_lines(again) == []
    assert len(corrupt_files(cache)) == 1


# -- (b) wrong schema ------------------------------------------------------------------------------------


def test_store_with_another_schema_version_is_rebuilt(tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    key_with(checkpoint, cache)
    with sqlite3.connect(cache / DB_NAME) as conn:
        conn.execute("UPDATE meta SET value = '999' WHERE key = 'schema'")

    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    assert "schema" in assert_one_store_warning(result)
    assert len(corrupt_files(cache)) == 1
    with sqlite3.connect(cache / DB_NAME) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (SCHEMA_VERSION,)
    warm = key_with(checkpoint, cache)
    assert warm.stats is not None and warm.stats.shards_from_store == NUM_SHARDS


def test_store_with_a_foreign_table_layout_is_rebuilt(tmp_path: Path, aged: dict[str, Path]) -> None:
    # A store from another layout that never recorded a schema version: its `shards` table lacks the
    # columns wcache reads. It is as unusable as a wrong version and must be rebuilt once, not fail forever.
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    cache.mkdir()
    with sqlite3.connect(cache / DB_NAME) as conn:
        conn.execute("CREATE TABLE shards (file_id TEXT PRIMARY KEY, digest TEXT)")
        conn.execute("INSERT INTO shards VALUES ('1:2', 'abc')")

    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    assert_one_store_warning(result)
    assert len(corrupt_files(cache)) == 1
    warm = key_with(checkpoint, cache)
    assert warm.stats is not None and warm.stats.shards_from_store == NUM_SHARDS


# -- (c) garbage record blobs ----------------------------------------------------------------------------


def _valid_blob_truncated(blob: bytes) -> bytes:
    return blob[: len(blob) // 2]


def _packed(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _first_tensor_edited(blob: bytes, index: int, value: object) -> bytes:
    payload = msgpack.unpackb(blob, raw=False)
    payload["t"][0][index] = value
    return _packed(payload)


GARBAGE_BLOBS = {
    "empty": lambda blob: b"",
    "random-bytes": lambda blob: random.Random(1).randbytes(len(blob)),
    "truncated": _valid_blob_truncated,
    "trailing-junk": lambda blob: blob + b"\x00junk",
    "an-integer": lambda blob: _packed(7),
    "a-string": lambda blob: _packed("abcdef"),
    "map-without-tensors": lambda blob: _packed({"h": 1, "m": {}}),
    "tensor-rows-of-wrong-arity": lambda blob: _packed({"h": 1, "m": {}, "t": [[1, 2, 3]]}),
    "metadata-not-a-map": lambda blob: _packed({**msgpack.unpackb(blob, raw=False), "m": 5}),
    "deeply-nested": lambda blob: b"\x91" * 100_000 + b"\x00",
    "shape-a-string": lambda blob: _first_tensor_edited(blob, 2, "x"),
    "offset-nan": lambda blob: _first_tensor_edited(blob, 4, float("nan")),
    "shape-infinite": lambda blob: _first_tensor_edited(blob, 2, [float("inf")]),
    "header-size-infinite": lambda blob: _packed({**msgpack.unpackb(blob, raw=False), "h": float("inf")}),
    "sha256-not-hex": lambda blob: _packed({**msgpack.unpackb(blob, raw=False), "s": "z" * 64}),
    "metadata-value-a-number": lambda blob: _packed({**msgpack.unpackb(blob, raw=False), "m": {"format": 1}}),
    "header-size-a-bool": lambda blob: _packed({**msgpack.unpackb(blob, raw=False), "h": True}),
}


def test_a_receipt_is_the_map_msgpacks_own_packer_writes(tmp_path: Path, aged: dict[str, Path]) -> None:
    """Records are written through msgspec; a store written with msgpack's packer (before) reads on unchanged."""
    cache = tmp_path / "cache"
    key_with(aged["shared"], cache)
    with sqlite3.connect(cache / DB_NAME) as conn:
        blobs = [blob for (blob,) in conn.execute("SELECT record FROM shards")]
    assert len(blobs) == NUM_SHARDS
    for blob in blobs:
        payload = msgpack.unpackb(blob, raw=False)
        assert list(payload) == ["h", "m", "t", "s"] and len(payload["s"]) == 64
        assert _packed(payload) == blob


@pytest.mark.parametrize("case", list(GARBAGE_BLOBS))
def test_garbage_record_is_a_miss_and_the_file_is_hashed_again(
    case: str, tmp_path: Path, aged: dict[str, Path]
) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    cold = key_with(checkpoint, cache)
    warm = key_with(checkpoint, cache)
    assert warm.stats is not None and warm.stats.shards_from_store == NUM_SHARDS  # the receipts were good
    with sqlite3.connect(cache / DB_NAME) as conn:
        for file_id, blob in list(conn.execute("SELECT file_id, record FROM shards")):
            conn.execute("UPDATE shards SET record = ? WHERE file_id = ?", (GARBAGE_BLOBS[case](blob), file_id))
        conn.execute("DELETE FROM roots")  # the warm key reads the receipts only where no root is stored

    rehashed = key_with(checkpoint, cache)
    assert rehashed.key == cold.key
    assert rehashed.stats is not None and rehashed.stats.shards_hashed == NUM_SHARDS
    # The bad rows were replaced by good ones.
    healed = key_with(checkpoint, cache)
    assert healed.stats is not None and healed.stats.shards_from_store == NUM_SHARDS


def test_garbage_record_through_the_cli_is_silent_and_right(tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    expected = key_with(checkpoint, cache).key.short_id
    with sqlite3.connect(cache / DB_NAME) as conn:
        conn.execute("UPDATE shards SET record = ?", (random.Random(2).randbytes(300),))
        conn.execute("DELETE FROM roots")
    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == expected
    assert stderr_lines(result) == []


# -- (d) a store that cannot be used ---------------------------------------------------------------------


def test_store_path_that_is_a_file_is_one_warning(tmp_path: Path, aged: dict[str, Path], caplog) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "not-a-directory"
    cache.write_text("a user's file, which wcache must leave alone\n")

    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    assert_one_store_warning(result)
    assert cache.read_text() == "a user's file, which wcache must leave alone\n"

    with caplog.at_level(logging.WARNING, logger="wcache"), DigestStore(cache) as store:
        assert not store.enabled
        key = compute_key(checkpoint, store=store)
    assert key.key == reference_key(checkpoint).key
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_store_file_that_is_a_directory_is_one_warning(tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    (cache / DB_NAME).mkdir(parents=True)
    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    assert_one_store_warning(result)


# Root writes into any directory whatever its mode, so as root the unwritable-store case runs `wcache` as
# "nobody" (tests/as_nobody.py), in a store directory that uid owns and cannot write.
def _unwritable_store_as_nobody(existing_store: bool, aged: dict[str, Path]) -> None:
    with nobody_tree() as (base, env):
        # The aged checkpoints sit under root's private pytest directory; nobody reads a copy. Receipts are
        # written whether or not they could be trusted, so a fresh copy still makes the store be written.
        checkpoint = Path(shutil.copytree(aged["shared"], base / "shared"))
        open_to_all(checkpoint)
        cache = base / "cache"
        cache.mkdir()
        if existing_store:
            key_with(aged["seed0"], cache)  # receipts for another checkpoint, so this one must be written
        # The store is nobody's own, as a user's store is theirs; only the directory's mode keeps it unwritable.
        for path in [cache, *cache.rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)
        cache.chmod(0o500)
        env["WCACHE_CACHE_DIR"] = str(cache)  # this store, not the one nobody_tree() put under HOME
        result = run_as_nobody([*WCACHE, "key", str(checkpoint), "--json"],
                               env, cwd=base)
        assert cli_key_id(result) == reference_key(checkpoint).key.short_id
        assert_one_store_warning(result)


@pytest.mark.parametrize("existing_store", [False, True], ids=["empty-directory", "existing-store"])
def test_unwritable_store_directory_is_one_warning(
    existing_store: bool, tmp_path: Path, aged: dict[str, Path]
) -> None:
    if os.geteuid() == 0:
        _unwritable_store_as_nobody(existing_store, aged)
        return
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    cache.mkdir()
    if existing_store:
        key_with(aged["seed0"], cache)  # receipts for another checkpoint, so this one must be written
    cache.chmod(0o500)
    try:
        result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
        assert cli_key_id(result) == reference_key(checkpoint).key.short_id
        assert_one_store_warning(result)
    finally:
        cache.chmod(0o700)


# -- (e) concurrency -------------------------------------------------------------------------------------


def _run_concurrently(checkpoints: list[Path], cache: Path) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen([*WCACHE, "key", str(c), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=environment(cli_env(cache)))
        for c in checkpoints
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.parametrize("start", ["no-store-yet", "corrupt-store"])
def test_concurrent_processes_share_one_store(start: str, tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoints = [aged[f"seed{i}"] for i in range(CONCURRENT)]
    expected = [reference_key(c).key.short_id for c in checkpoints]
    assert len(set(expected)) == CONCURRENT
    cache = tmp_path / "cache"
    if start == "corrupt-store":
        cache.mkdir()
        (cache / DB_NAME).write_bytes(random.Random(3).randbytes(4096))

    results = _run_concurrently(checkpoints, cache)

    assert [cli_key_id(r) for r in results] == expected
    warnings = [line for r in results for line in stderr_lines(r)]
    if start == "no-store-yet":
        assert warnings == []
    else:
        # Exactly one process rebuilds; the others find the new store, so no good store is moved aside.
        assert len(corrupt_files(cache)) == 1
        assert len(warnings) == 1 and "digest store" in warnings[0], warnings
    assert [path for path, _ in store_rows(cache)] == sorted(p for c in checkpoints for p in shard_paths(c))
    for checkpoint, short_id in zip(checkpoints, expected, strict=True):
        warm = key_with(checkpoint, cache)
        assert warm.key.short_id == short_id
        assert warm.stats is not None and warm.stats.shards_from_store == NUM_SHARDS


# -- (f) racy-git rule -----------------------------------------------------------------------------------


def test_is_trusted_only_past_the_racy_window() -> None:
    hashed_at = 10 * RACY_WINDOW_NS

    def identity(mtime_ns: int, ctime_ns: int) -> FileIdentity:
        return FileIdentity(dev=1, ino=2, size=3, mtime_ns=mtime_ns, ctime_ns=ctime_ns)

    old = hashed_at - RACY_WINDOW_NS - 1
    assert is_trusted(identity(old, old), hashed_at)
    assert not is_trusted(identity(hashed_at - RACY_WINDOW_NS, old), hashed_at)
    assert not is_trusted(identity(old, hashed_at - RACY_WINDOW_NS), hashed_at)
    assert not is_trusted(identity(old, hashed_at + 1), hashed_at)


@pytest.mark.parametrize("backdate_mtime", [False, True], ids=["as-written", "mtime-backdated"])
def test_receipt_for_a_freshly_written_file_is_not_trusted(backdate_mtime: bool, tmp_path: Path) -> None:
    checkpoint = write_checkpoint("tiny", tmp_path / "fresh")
    if backdate_mtime:
        # An old mtime does not make a fresh file safe: its ctime still says it just changed.
        hour_ago = time.time_ns() - 3600 * 10**9
        for shard in checkpoint.glob("*.safetensors"):
            os.utime(shard, ns=(hour_ago, hour_ago))
    cache = tmp_path / "cache"
    first = key_with(checkpoint, cache)
    second = key_with(checkpoint, cache)
    with sqlite3.connect(cache / DB_NAME) as conn:
        racy = [h - max(m, c) for m, c, h in conn.execute("SELECT mtime_ns, ctime_ns, hashed_at_ns FROM shards")]
    if max(racy) >= RACY_WINDOW_NS:
        pytest.skip("this machine took longer than the racy window between writing and hashing")
    assert second.key == first.key
    assert second.stats is not None and second.stats.shards_hashed > 0
    assert second.stats.shards_from_store == 0


def test_receipt_taken_past_the_racy_window_is_trusted(tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    first = key_with(checkpoint, cache)
    assert first.stats is not None and first.stats.shards_hashed == NUM_SHARDS
    second = key_with(checkpoint, cache)
    assert second.key == first.key
    assert second.stats is not None
    assert second.stats.shards_from_store == second.stats.num_shards == NUM_SHARDS
    assert second.stats.shards_hashed == 0 and second.stats.bytes_hashed == 0


def test_lookup_many_answers_as_lookup_does_in_one_query_per_batch(tmp_path: Path, aged: dict[str, Path]) -> None:
    # A warm key asks for every shard's receipt at once: 2,000 shards must not cost 2,000 queries, and the
    # batch must trust exactly what one-by-one lookups trust (stored, same size and times, past the window).
    checkpoint = aged["shared"]
    cache = tmp_path / "cache"
    key_with(checkpoint, cache)
    with DigestStore(cache) as store:
        shard = Path(shard_paths(checkpoint)[0])
        real = store.lookup(shard, FileIdentity.of(os.stat(shard)))
        assert real is not None
        count = 2 * LOOKUP_BATCH + 7
        # Receipts for other inodes with the same bytes: the store keys by (device, inode) alone.
        stored = [dataclasses.replace(real, path=tmp_path / f"s{i}", identity=dataclasses.replace(
            real.identity, ino=real.identity.ino + 1_000_000 + i)) for i in range(count)]
        store.put_many(stored)
        queries = []
        for i, record in enumerate(stored):
            identity = record.identity
            if i % 5 == 1:
                identity = dataclasses.replace(identity, mtime_ns=identity.mtime_ns + 1)  # changed since
            elif i % 5 == 2:
                identity = dataclasses.replace(identity, ino=identity.ino + 10 * count)  # never hashed
            queries.append((record.path, identity))
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)  # type: ignore[union-attr]
        found = store.lookup_many(queries)
        store._conn.set_trace_callback(None)  # type: ignore[union-attr]
        assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 3
        one_by_one = {path: record for path, identity in queries if (record := store.lookup(path, identity))}
        assert found == one_by_one
        assert sorted(found) == sorted(r.path for i, r in enumerate(stored) if i % 5 not in (1, 2))
        assert all(found[r.path].digests == real.digests for r in stored if r.path in found)


# -- (g) ctime catches a disguised edit ------------------------------------------------------------------


def test_edit_with_size_and_mtime_restored_is_caught_by_ctime(tmp_path: Path, aged: dict[str, Path]) -> None:
    checkpoint = aged["mutable"]
    cache = tmp_path / "cache"
    before = key_with(checkpoint, cache)
    warm = key_with(checkpoint, cache)
    assert warm.stats is not None and warm.stats.shards_from_store == NUM_SHARDS  # receipts are trusted

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"]["model.norm.weight"]
    old = os.stat(shard)
    assert overwrite_tensor_bytes(checkpoint, "model.norm.weight", 0, b"\x00" * 4) == shard
    # Put size and mtime back as a careful editor (or a restore tool) would; only ctime can tell.
    os.utime(shard, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = os.stat(shard)
    assert (new.st_size, new.st_mtime_ns, new.st_ino) == (old.st_size, old.st_mtime_ns, old.st_ino)

    after = key_with(checkpoint, cache)
    assert after.key != before.key
    assert after.key == reference_key(checkpoint).key
    assert after.stats is not None
    assert (after.stats.shards_hashed, after.stats.shards_from_store) == (1, NUM_SHARDS - 1)
    digests_before = {e.name: e.digest for e in before.manifest}
    digests_after = {e.name: e.digest for e in after.manifest}
    assert digests_after.keys() == digests_before.keys()
    assert {n for n in digests_after if digests_after[n] != digests_before[n]} == {"model.norm.weight"}


def test_write_during_hashing_on_a_one_second_filesystem_is_never_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A filesystem with 1-second timestamps (NFSv3, ext3): a same-size write in the second the file was
    # last written leaves its identity unchanged, so only the racy rule, counted from when hashing began,
    # keeps the mixed receipt from being trusted once hashing has taken longer than the window.
    import wcache.key.shard_hash as shard_hash

    def coarse(cls: type[FileIdentity], st: os.stat_result) -> FileIdentity:
        second = 10**9
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns // second * second,
                   st.st_ctime_ns // second * second)

    real_hash = shard_hash._hash_tensor
    written: list[str] = []

    def slow_hash(shard: object, tensor: object, on_bytes: object, *rest: object) -> str:
        if not written:
            written.append("done")
            overwrite_tensor_bytes(checkpoint, "model.norm.weight", 0, b"\x11" * 16)  # same size, same second
            time.sleep(RACY_WINDOW_NS / 1e9 + 1)  # hashing outlasts the window
        return real_hash(shard, tensor, on_bytes, *rest)  # type: ignore[arg-type]

    while time.time() % 1 > 0.2:  # write, open and overwrite all within one wall-clock second
        time.sleep(0.01)
    checkpoint = write_checkpoint("tiny", tmp_path / "coarse", num_shards=1)
    monkeypatch.setattr(FileIdentity, "of", classmethod(coarse))
    monkeypatch.setattr(shard_hash, "_hash_tensor", slow_hash)
    cache = tmp_path / "cache"
    key_with(checkpoint, cache)
    monkeypatch.setattr(shard_hash, "_hash_tensor", real_hash)
    assert written
    warm = key_with(checkpoint, cache)
    assert warm.key == reference_key(checkpoint).key, "a receipt of bytes that changed under it was trusted"


@pytest.mark.parametrize("how", ["directory-0777", "database-0666", "directory-symlink", "database-symlink"])
def test_store_others_could_write_is_not_trusted(how: str, tmp_path: Path, aged: dict[str, Path]) -> None:
    # Receipts forged in a store another uid can write would make checkpoint B's key read as A's.
    checkpoint = aged["shared"]
    real = tmp_path / "real-cache"
    key_with(checkpoint, real)  # a genuine store holding receipts for this checkpoint
    cache = real
    if how == "directory-0777":
        real.chmod(0o777)
    elif how == "database-0666":
        (real / DB_NAME).chmod(0o666)
    elif how == "directory-symlink":
        cache = tmp_path / "link-cache"
        cache.symlink_to(real)
    else:
        cache = tmp_path / "cache-with-linked-db"
        cache.mkdir(mode=0o700)
        (cache / DB_NAME).symlink_to(real / DB_NAME)
    with DigestStore(cache) as store:
        assert not store.enabled
        key = compute_key(checkpoint, store=store)
    assert key.stats is not None and key.stats.shards_from_store == 0
    result = wcache_in_process("key", str(checkpoint), "--json", env=cli_env(cache))
    assert cli_key_id(result) == reference_key(checkpoint).key.short_id
    warning = assert_one_store_warning(result)
    assert ("symlink" in warning) if "symlink" in how else ("writable by group or others" in warning), warning
