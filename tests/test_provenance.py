"""Provenance: each shard's SHA-256 from the cold pass's own reads, judged against what the Hugging Face cache
(written here, classic and 2.4 shared-store layouts) or the user's digests say was published."""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_fixtures import daemon_rig, http_status, wait_for
from helpers import assert_one_error_sentence, wait_past_racy_window, wcache_in_process
from hub_cache import blob_of, write_hub_cache
from wcache.checkpoint.files import locate
from wcache.errors import CheckpointError
from wcache.key import file_digest, shard_hash
from wcache.key.compute import compute_key
from wcache.key.digest_store import RACY_WINDOW_NS, DigestStore, decode_record
from wcache.key.shard_hash import FileIdentity, OpenShard, ShardRecord
from wcache.load.loader import load_rank
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import write_checkpoint

FIRST = "model-00001-of-00002.safetensors"
SECOND = "model-00002-of-00002.safetensors"


def _sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_size_rewrite(path: Path) -> None:
    """Flip one byte in the middle of a file's data, in place: same size, other bytes."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def hub(tmp_path: Path, tiny_template: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache that repo ids resolve in."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    return write_checkpoint("tiny", tmp_path / "two", num_shards=2)


def _key_json(*args: str) -> tuple[int, dict]:
    result = wcache_in_process("key", *args, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout) if result.stdout else {}


# -- SHA-256 in the cold pass ----------------------------------------------------------------------------------


def test_key_sha256_is_the_files_own_through_reordered_parallel_reads(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks and a reorder buffer of one chunk: tensors hashed out of order must wait or be set aside,
    # and the SHA-256 must still be of the file's bytes in order, header included.
    monkeypatch.setattr(shard_hash, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(file_digest, "REORDER_BYTES", 4096)
    model = write_checkpoint("small", tmp_path / "small", num_shards=3)
    key = compute_key(model, store=None)
    shards = [f for f in key.files if f.name.endswith(".safetensors")]
    assert [f.name for f in shards] == [p.name for p in locate(model).shards]
    for entry in key.files:  # config.json's SHA-256 too
        assert entry.sha256 == _sha256_of(model / entry.name)
        assert entry.size == (model / entry.name).stat().st_size


def test_a_read_that_fails_midway_stops_the_others_instead_of_leaving_them_waiting(
        two_shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_hash, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(file_digest, "REORDER_BYTES", 4096)
    real = OpenShard.read_into
    with OpenShard(locate(two_shards).shards[0]) as shard:
        largest = max(shard.header.tensors, key=lambda t: t.nbytes)  # many chunks: it fails part way

    def failing(self: OpenShard, tensor: object, start: int, buffer: memoryview) -> None:
        if tensor == largest and start > 0:
            raise CheckpointError(f"{self.path} shrank while it was being read; wait until it is fully written.")
        real(self, tensor, start, buffer)  # type: ignore[arg-type]

    monkeypatch.setattr(OpenShard, "read_into", failing)
    with pytest.raises(CheckpointError, match="shrank"):
        compute_key(two_shards, store=None)


def test_the_daemons_single_pass_records_each_files_sha256(two_shards: Path, tmp_path: Path) -> None:
    with DigestStore(tmp_path / "store") as store:
        loaded = load_rank(two_shards, PlanSpec(), "cpu", store)
        loaded.arena.close()
        assert {f.name: f.sha256 for f in loaded.key_file.files} == {
            name: _sha256_of(two_shards / name) for name in (FIRST, SECOND, "config.json")}
        # The receipts carry it: a warm key knows it without reading.
        assert _stored_sha256(store) == {two_shards / n: _sha256_of(two_shards / n) for n in (FIRST, SECOND)}


def test_receipts_holding_sha256_spare_the_pass_streaming_it_again(two_shards: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    wait_past_racy_window()  # the receipts the first preload stores are trusted
    with DigestStore(tmp_path / "store") as store:
        load_rank(two_shards, PlanSpec(), "cpu", store).arena.close()

        def no_sha256(self: OpenShard) -> None:
            raise AssertionError("a preload with stored SHA-256s streamed a file's SHA-256 again")

        monkeypatch.setattr(OpenShard, "start_sha256", no_sha256)
        warm = load_rank(two_shards, PlanSpec(), "cpu", store)
        warm.arena.close()
    assert warm.sha256_after is None
    assert {f.name: f.sha256 for f in warm.key_file.files} == {
        n: _sha256_of(two_shards / n) for n in (FIRST, SECOND, "config.json")}


def test_a_cold_pass_can_leave_sha256_for_after_the_arena_is_sealed(two_shards: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = OpenShard.start_sha256

    def counted(self: OpenShard) -> file_digest.FileSha256:
        raise AssertionError("the pass streamed SHA-256 although it was left for after READY")

    monkeypatch.setattr(OpenShard, "start_sha256", counted)
    with DigestStore(tmp_path / "store") as store:
        loaded = load_rank(two_shards, PlanSpec(), "cpu", store, sha256_after_ready=True)
        loaded.arena.close()
        assert [f.sha256 for f in loaded.key_file.files if f.name in (FIRST, SECOND)] == [None, None]
        assert _stored_sha256(store) == {two_shards / n: None for n in (FIRST, SECOND)}
        monkeypatch.setattr(OpenShard, "start_sha256", real)
        assert loaded.sha256_after is not None
        files = loaded.sha256_after.run(store)
        expected = {n: _sha256_of(two_shards / n) for n in (FIRST, SECOND)}
        assert {f.name: f.sha256 for f in files} == expected
        # The receipts gain them: the next preload neither streams SHA-256 nor reads a file for it.
        assert _stored_sha256(store) == {two_shards / n: expected[n] for n in (FIRST, SECOND)}


def test_a_file_rewritten_before_its_later_sha256_gets_none(two_shards: Path, tmp_path: Path) -> None:
    with DigestStore(tmp_path / "store") as store:
        loaded = load_rank(two_shards, PlanSpec(), "cpu", store, sha256_after_ready=True)
        loaded.arena.close()
        time.sleep(0.01)
        _same_size_rewrite(two_shards / SECOND)
        assert loaded.sha256_after is not None
        files = loaded.sha256_after.run(store)
    assert {f.name: f.sha256 for f in files} == {FIRST: _sha256_of(two_shards / FIRST), SECOND: None}


def _stored_sha256(store: DigestStore) -> dict[Path, str | None]:
    """Each stored receipt's SHA-256, trusted yet or not."""
    found: dict[Path, str | None] = {}
    for path, blob in store._conn.execute("SELECT path, record FROM shards"):  # type: ignore[union-attr]
        decoded = decode_record(blob, Path(path), FileIdentity.of(Path(path).stat()), 0)
        assert decoded is not None
        found[Path(path)] = decoded.sha256
    return found


def test_a_warm_key_knows_each_files_sha256_without_reading(two_shards: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    wait_past_racy_window()  # receipts taken now are trusted, and the Merkle root is stored with them
    with DigestStore(tmp_path / "store") as store:
        compute_key(two_shards, store=store)

        def no_reads(*args: object) -> None:
            raise AssertionError("a warm key opened a shard")

        monkeypatch.setattr(OpenShard, "__init__", no_reads)
        warm = compute_key(two_shards, store=store)
    assert warm.stats is not None and warm.stats.root_from_store
    assert {f.name: f.sha256 for f in warm.files} == {n: _sha256_of(two_shards / n)
                                                      for n in (FIRST, SECOND, "config.json")}


def test_receipts_from_before_sha256_keep_working_and_get_it_on_the_next_pass(two_shards: Path,
                                                                              tmp_path: Path) -> None:
    with DigestStore(tmp_path / "store") as store:
        fresh = compute_key(two_shards, store=None)
        # Receipts as an older wcache wrote them: no SHA-256, trusted (hashed "later" than any write).
        old = []
        for path in locate(two_shards).shards:
            with OpenShard(path) as shard, ThreadPoolExecutor(2) as pool:
                digests = shard.hash_tensors(pool)
                old.append(ShardRecord(shard.path, shard.identity, shard.header, digests,
                                       time.time_ns() + RACY_WINDOW_NS))
        store.put_many(old)
        warm = compute_key(two_shards, store=store)
        assert warm.key == fresh.key and warm.stats is not None and warm.stats.shards_hashed == 0
        assert [f.sha256 for f in warm.files if f.name.endswith(".safetensors")] == [None, None]
        # A preload does not take them for a warm key: it reads, and writes SHA-256 into the receipts.
        load_rank(two_shards, PlanSpec(), "cpu", store).arena.close()
        assert _stored_sha256(store) == {two_shards / n: _sha256_of(two_shards / n) for n in (FIRST, SECOND)}


# -- verdicts against the Hugging Face cache -----------------------------------------------------------------


@pytest.mark.parametrize("shared_store", [False, True], ids=["classic", "shared-store"])
def test_every_file_matches_the_hub_and_a_same_size_rewrite_differs_by_name(
        hub: Path, two_shards: Path, shared_store: bool) -> None:
    snapshot = write_hub_cache(hub, "Org/Tiny", two_shards, shared_store=shared_store)
    code, before = _key_json("Org/Tiny")  # a repo id, resolved in the cache like preload, diff and verify do
    assert code == 0
    assert before["info"]["source"] == str(snapshot)
    assert before["provenance"]["verdict"] == "matches"
    assert {f["name"]: f["verdict"] for f in before["provenance"]["files"]} == {
        FIRST: "matches", SECOND: "matches", "config.json": "matches"}  # config.json by its git SHA-1

    _same_size_rewrite(Path(os.path.realpath(blob_of(snapshot, SECOND))))  # through every link to the bytes
    verify = wcache_in_process("verify", "Org/Tiny", "--provenance", "--json")
    assert verify.returncode == 1, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)["provenance"]
    assert report["verdict"] == "differs"
    assert {f["name"]: f["verdict"] for f in report["files"]} == {FIRST: "matches", SECOND: "differs",
                                                                  "config.json": "matches"}
    code, after = _key_json("Org/Tiny")
    assert after["key"]["checkpoint"] != before["key"]["checkpoint"]  # BLAKE3 sees it too, of course
    shown = wcache_in_process("verify", "Org/Tiny", "--provenance", env={"COLUMNS": "200"})  # names uncut
    assert shown.returncode == 1 and SECOND in shown.stdout and "differs" in shown.stdout


def test_a_non_lfs_shard_is_unknown(hub: Path, two_shards: Path) -> None:
    write_hub_cache(hub, "Org/Tiny", two_shards, non_lfs=frozenset({FIRST}))
    code, document = _key_json("Org/Tiny")
    assert code == 0
    verdicts = {f["name"]: f for f in document["provenance"]["files"]}
    assert verdicts[FIRST]["verdict"] == "unknown" and "git SHA-1" in verdicts[FIRST]["why"]
    assert verdicts[SECOND]["verdict"] == "matches"
    assert document["provenance"]["verdict"] == "unknown"


@pytest.mark.parametrize("how", ["dangling", "looping"])
def test_a_broken_cache_link_is_one_sentence(hub: Path, two_shards: Path, how: str) -> None:
    snapshot = write_hub_cache(hub, "Org/Tiny", two_shards, shared_store=True)
    blob = blob_of(snapshot, FIRST)
    if how == "dangling":
        Path(os.path.realpath(blob)).unlink()  # the shared store's file is gone; both links stay
    else:
        blob.unlink()
        blob.symlink_to(blob.name)
    for command in (("key", "Org/Tiny"), ("verify", "Org/Tiny", "--provenance")):
        line = assert_one_error_sentence(wcache_in_process(*command), FIRST)
        assert ("leads to no file" if how == "dangling" else "loops") in line


def test_a_plain_directory_is_unknown_unless_digests_are_given(two_shards: Path, tmp_path: Path) -> None:
    code, document = _key_json(str(two_shards))
    assert code == 0 and document["provenance"]["verdict"] == "unknown"
    assert "not from the Hugging Face cache" in document["provenance"]["files"][0]["why"]

    sums = tmp_path / "SHA256SUMS"
    sums.write_text("".join(f"{_sha256_of(two_shards / n)}  ./{n}\n" for n in (FIRST, SECOND, "config.json")))
    code, document = _key_json(str(two_shards), "--expected", str(sums))
    assert document["provenance"]["verdict"] == "matches"

    saved = tmp_path / "model.key"
    saved.write_text(json.dumps(document))  # a saved key file is an expectation too
    copy = write_checkpoint("tiny", tmp_path / "copy", num_shards=2)
    _same_size_rewrite(copy / FIRST)
    result = wcache_in_process("verify", str(copy), "--provenance", "--expected", str(saved), "--json")
    assert result.returncode == 1
    files = {f["name"]: f["verdict"] for f in json.loads(result.stdout)["provenance"]["files"]}
    assert files == {FIRST: "differs", SECOND: "matches", "config.json": "matches"}

    bad = tmp_path / "bad-sums"
    bad.write_text("not a digest line\n")
    assert_one_error_sentence(wcache_in_process("key", str(two_shards), "--expected", str(bad)), str(bad))


# -- preload --require-provenance (real daemons) ----------------------------------------------------------------


def test_preload_refuses_a_differing_file_by_name_and_by_default_warns(two_shards: Path) -> None:
    with daemon_rig() as rig:
        hub_dir = rig.base / "hub"
        snapshot = write_hub_cache(hub_dir, "Org/Tiny", two_shards, shared_store=True)
        _same_size_rewrite(Path(os.path.realpath(blob_of(snapshot, SECOND))))
        where = ("--detach", "--run-dir", str(rig.run_dir))
        env = {"HF_HUB_CACHE": str(hub_dir)}
        refused = rig.cli("preload", "Org/Tiny", *where, "--require-provenance", env=env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert SECOND in refused.stderr and "differs from what the Hub published" in refused.stderr
        assert FIRST not in refused.stderr
        assert rig.descriptors() == []

        # A store of its own: no receipt of the refused preload, so this pass is cold.
        warned = rig.cli("preload", "Org/Tiny", *where, env={**env, "WCACHE_CACHE_DIR": str(rig.base / "cold")})
        assert warned.returncode == 0, warned.stderr
        # A cold pass answers READY before each file's SHA-256 is done: the verdict follows, from the daemon (on
        # files this small, often before the command reads the descriptor: then it warns at once).
        assert ("SHA-256 is computed after READY" in warned.stderr
                or f"warning: {SECOND} differs from what the Hub published" in warned.stderr), warned.stderr
        [event] = wait_for(lambda: rig.events("provenance"), timeout=60.0, what="the provenance verdict after READY")
        [daemon] = rig.descriptors()
        assert daemon.provenance == "differs"
        assert [f.name for f in daemon.files] == [FIRST, SECOND, "config.json"]
        assert event["verdict"] == "differs" and event["differs"] == [SECOND] and event["counts"]["matches"] == 2
        # status, top and /metrics carry the verdict.
        [row] = rig.status()["daemons"]
        assert row["provenance"] == "differs"
        table = rig.cli("status", "--run-dir", str(rig.run_dir))
        assert "✗ DIFFERS" in table.stdout
        top = rig.cli("top", "--once", "--json", "--interval", "0.1", "--run-dir", str(rig.run_dir), as_json=True)
        assert [d["provenance"] for d in top["daemons"]] == ["differs"]
        assert any(e["kind"] == "provenance" and e["severity"] == "warning" and SECOND in e["summary"]
                   for e in top["events"])
        assert daemon.health_url is not None
        code, metrics = http_status(f"{daemon.health_url}/metrics")
        assert code == 200
        series = f'wcache_daemon_provenance{{key_id="{daemon.key_id}",tp_rank="0",verdict="differs"}} 1.0'
        assert series in str(metrics)
        # A daemon's key shows the verdicts too, from the digests its pass computed.
        shown = rig.cli("key", daemon.name, "--json", "--run-dir", str(rig.run_dir), as_json=True)
        assert {f["name"]: f["verdict"] for f in shown["provenance"]["files"]} == {
            FIRST: "matches", SECOND: "differs", "config.json": "matches"}


def test_preload_refuse_unknown_refuses_a_plain_directory(two_shards: Path) -> None:
    usage = wcache_in_process("preload", str(two_shards), "--refuse-unknown")
    assert_one_error_sentence(usage, "--refuse-unknown", "--require-provenance")
    with daemon_rig() as rig:
        refused = rig.cli("preload", str(two_shards), "--detach", "--run-dir", str(rig.run_dir),
                          "--require-provenance", "--refuse-unknown")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"the provenance of {FIRST} is unknown" in refused.stderr and "--expected" in refused.stderr
        assert rig.descriptors() == []
