"""The content key changes with any tensor byte, and only then: the must-show cases of the foundation."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from helpers import HEAVY, loaded_of, modules_after_cli, wait_past_racy_window, wcache_in_process
from wcache.checkpoint.safetensors_header import read_header
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.diff import diff_keys
from wcache.key.digest_store import DigestStore
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import overwrite_tensor_bytes, read_tensors, write_tensors
from wcache_dev.vllm_compat import header_fingerprint


def _copy(template: Path, dest: Path) -> Path:
    return Path(shutil.copytree(template, dest))


def _key(path: Path, **plan: object) -> KeyFile:
    with DigestStore.open() as store:
        return compute_key(path, PlanSpec(**plan), store=store)  # type: ignore[arg-type]


def _locate_tensor(checkpoint: Path, name: str) -> tuple[Path, int, int]:
    """(shard, absolute start, nbytes) of a tensor's data."""
    for shard in sorted(checkpoint.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            header = read_header(fd, os.fstat(fd).st_size, shard)
        finally:
            os.close(fd)
        for t in header.tensors:
            if t.name == name:
                return shard, header.data_start + t.start, t.nbytes
    raise KeyError(name)


def _changed_names(a: Path, b: Path) -> list[str]:
    diff = diff_keys(_key(a), _key(b))
    assert [f.name for f in diff.fields] == ["checkpoint"]
    assert not diff.added and not diff.removed
    return [c.name for c in diff.changed]


def test_zeroed_tensor_with_header_untouched_changes_key(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    _, _, nbytes = _locate_tensor(copy, "model.norm.weight")
    overwrite_tensor_bytes(copy, "model.norm.weight", 0, bytes(nbytes))
    # The method vLLM 0.31 uses cannot see this change; ours must.
    assert header_fingerprint(copy) == header_fingerprint(tiny_template)
    assert _changed_names(tiny_template, copy) == ["model.norm.weight"]


def test_last_byte_of_largest_tensor_changes_key(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    largest = max(_key(copy).manifest, key=lambda e: (e.nbytes, e.name))
    shard, start, nbytes = _locate_tensor(copy, largest.name)
    with shard.open("r+b") as f:
        f.seek(start + nbytes - 1)
        last = f.read(1)
        f.seek(start + nbytes - 1)
        f.write(bytes([last[0] ^ 0x01]))
    assert _changed_names(tiny_template, copy) == [largest.name]


def test_swapped_same_shape_tensors_change_key(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    (shard_g, start_g, n_g), (shard_u, start_u, n_u) = _locate_tensor(copy, gate), _locate_tensor(copy, up)
    assert n_g == n_u
    data_g = shard_g.read_bytes()[start_g : start_g + n_g]
    data_u = shard_u.read_bytes()[start_u : start_u + n_u]
    overwrite_tensor_bytes(copy, gate, 0, data_u)
    overwrite_tensor_bytes(copy, up, 0, data_g)
    assert _changed_names(tiny_template, copy) == [gate, up]


def test_content_change_with_size_and_mtime_restored_is_caught(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    wait_past_racy_window()
    before = _key(copy)
    assert _key(copy).stats.shards_from_store == 2  # type: ignore[union-attr]  # the store is warm
    shard, start, _ = _locate_tensor(copy, "model.layers.1.self_attn.v_proj.weight")
    st = shard.stat()
    with shard.open("r+b") as f:
        f.seek(start + 100)
        f.write(b"\x7f\x7f\x7f\x7f")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    after = _key(copy)
    assert after.key != before.key
    assert [c.name for c in diff_keys(before, after).changed] == ["model.layers.1.self_attn.v_proj.weight"]


def test_same_key_for_copy_touch_and_resplit(tiny_template: Path, tmp_path: Path) -> None:
    original = _key(tiny_template).key
    copy = _copy(tiny_template, tmp_path / "elsewhere" / "copy")
    assert _key(copy).key == original
    for shard in copy.glob("*.safetensors"):
        shard.touch()
    assert _key(copy).key == original
    tensors = read_tensors(tiny_template)
    config = json.loads((tiny_template / "config.json").read_text())
    for num_shards in (1, 5):
        resplit = write_tensors(tensors, config, tmp_path / f"resplit-{num_shards}", num_shards)
        assert len(list(resplit.glob("*.safetensors"))) == num_shards
        assert _key(resplit).key == original


def test_single_file_operand(tiny_template: Path, tmp_path: Path) -> None:
    single = write_tensors(read_tensors(tiny_template), None, tmp_path / "single", 1) / "model.safetensors"
    key = _key(single)
    assert key.key.checkpoint == _key(tiny_template).key.checkpoint
    assert key.key.config == "none"


def test_plan_and_config_fields(tiny_template: Path, tmp_path: Path) -> None:
    base = _key(tiny_template)
    # "auto" resolves to the config's dtype, so naming that dtype gives the same key.
    assert _key(tiny_template, dtype="float32").key == base.key
    rank1 = _key(tiny_template, tp_size=2, tp_rank=1)
    diff = diff_keys(base, rank1)
    assert [f.name for f in diff.fields] == ["plan"]
    assert {c.name for c in diff.plan} == {"tp_size", "tp_rank"}
    assert not diff.changed

    copy = _copy(tiny_template, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config["_name_or_path"] = "somewhere/else"  # informational: same key
    config["transformers_version"] = "9.9.9"
    (copy / "config.json").write_text(json.dumps(config))
    assert _key(copy).key == base.key
    config["rope_theta"] = 10000
    (copy / "config.json").write_text(json.dumps(config))
    diff = diff_keys(base, _key(copy))
    assert [f.name for f in diff.fields] == ["config"]
    assert [c.name for c in diff.config] == ["rope_theta"]


def test_file_changing_while_hashed_is_rehashed(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    shard, start, _ = _locate_tensor(copy, "model.embed_tokens.weight")

    class ChangeOnce:
        changed = False

        def start(self, total_bytes: int, num_files: int) -> None:
            pass

        def advance(self, nbytes: int) -> None:
            if not self.changed:
                self.changed = True
                with shard.open("r+b") as f:
                    f.seek(start)
                    f.write(struct.pack("<f", 123.0))

    with DigestStore.open() as store:
        during = compute_key(copy, store=store, progress=ChangeOnce())
        # The result describes the bytes now on disk, not a mix of before and after.
        assert during.key == compute_key(copy, store=store, rehash=True).key
    assert during.key != _key(tiny_template).key


def test_key_file_roundtrip_and_diff_cli(tiny_template: Path, tmp_path: Path) -> None:
    copy = _copy(tiny_template, tmp_path / "copy")
    saved = wcache_in_process("key", str(copy), "--json")
    assert saved.returncode == 0, saved.stderr
    key_path = tmp_path / "copy.key"
    key_path.write_text(saved.stdout)
    document = json.loads(saved.stdout)
    assert document["tensors"] and isinstance(document["info"]["total_bytes"], int)

    same = wcache_in_process("diff", str(key_path), str(copy), "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["identical"] is True

    overwrite_tensor_bytes(copy, "model.layers.2.self_attn.k_norm.weight", 4, b"\0\0\0\0")
    changed = wcache_in_process("diff", str(key_path), str(copy), "--json")
    assert changed.returncode == 1, changed.stderr
    report = json.loads(changed.stdout)
    assert report["identical"] is False
    assert [f["name"] for f in report["fields"]] == ["checkpoint"]
    assert [t["name"] for t in report["tensors"]["changed"]] == ["model.layers.2.self_attn.k_norm.weight"]
    assert report["tensors"]["changed"][0]["a"]["shape"] == [16]

    human = wcache_in_process("diff", str(copy), str(tiny_template), env={"COLUMNS": "200"})  # names uncut
    assert human.returncode == 1
    assert "model.layers.2.self_attn.k_norm.weight" in human.stdout


def test_added_and_removed_tensors(tiny_template: Path, tmp_path: Path) -> None:
    tensors = read_tensors(tiny_template)
    config = json.loads((tiny_template / "config.json").read_text())
    extra = dict(tensors)
    extra["model.extra.weight"] = extra.pop("lm_head.weight")
    other = write_tensors(extra, config, tmp_path / "other", 2)
    diff = diff_keys(_key(tiny_template), _key(other))
    assert [e.name for e in diff.added] == ["model.extra.weight"]
    assert [e.name for e in diff.removed] == ["lm_head.weight"]
    assert not diff.changed


@pytest.mark.parametrize(
    "argv", [["--help"], ["key", "{tiny}"], ["diff", "{tiny}", "{tiny}"], ["--version"], ["status"]]
)
def test_light_commands_do_not_import_torch_or_textual(argv: list[str], tiny_template: Path, tmp_path: Path,
                                                        ) -> None:
    args = [a.format(tiny=tiny_template) for a in argv]
    result, modules = modules_after_cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert loaded_of(modules, HEAVY) == []

