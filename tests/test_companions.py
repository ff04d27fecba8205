"""The key covers what the answers depend on besides the tensors: the tokenizer's files, the chat templates and
generation_config.json. Two checkpoints of the same tensors and config but another tokenizer have other keys, the
diff names the file, provenance judges every file of a Hub snapshot, and a warm key reads none of them."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import wait_past_racy_window, wcache_in_process
from hub_cache import blob_of, git_blob_sha1, write_hub_cache
from wcache.checkpoint import companions
from wcache.checkpoint.companions import is_companion
from wcache.key.compute import compute_key
from wcache.key.diff import diff_keys
from wcache.key.digest_store import DigestStore
from wcache.key.provenance import refusal, verdicts_of
from wcache_dev.synth import write_checkpoint


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint with a tokenizer, and a copy of it whose tokenizer.json maps one byte elsewhere."""
    first = write_checkpoint("small", tmp_path / "first")
    assert (first / "tokenizer.json").exists()
    second = tmp_path / "second"
    shutil.copytree(first, second)
    tokenizer = json.loads((second / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, same ids: another text for the same tokens
    (second / "tokenizer.json").write_text(json.dumps(tokenizer))
    return first, second


def test_another_tokenizer_is_another_key_and_the_diff_names_the_file(pair: tuple[Path, Path]) -> None:
    first, second = pair
    a, b = compute_key(first, store=None), compute_key(second, store=None)
    assert (a.key.checkpoint, a.key.config, a.key.plan) == (b.key.checkpoint, b.key.config, b.key.plan)
    assert a.key.tokenizer != b.key.tokenizer and a.key != b.key
    diff = diff_keys(a, b)
    assert [c.name for c in diff.fields] == ["tokenizer"] and [c.name for c in diff.tokenizer] == ["tokenizer.json"]

    shown = wcache_in_process("diff", str(first), str(second), "--json")
    assert shown.returncode == 1, shown.stderr
    document = json.loads(shown.stdout)
    assert [f["name"] for f in document["fields"]] == ["tokenizer"]
    assert [t["name"] for t in document["tokenizer"]] == ["tokenizer.json"]
    table = wcache_in_process("diff", str(first), str(second), env={"COLUMNS": "200"})
    assert "tokenizer.json" in table.stdout


def test_generation_config_and_chat_templates_enter_the_key(pair: tuple[Path, Path], tmp_path: Path) -> None:
    first, _ = pair
    before = compute_key(first, store=None)
    (first / "generation_config.json").write_text('{"temperature": 0.7}')
    with_generation = compute_key(first, store=None)
    assert with_generation.key.tokenizer != before.key.tokenizer
    (first / "additional_chat_templates").mkdir()
    (first / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (first / "README.md").write_text("not read by any loader")
    after = compute_key(first, store=None)
    assert after.key.tokenizer != with_generation.key.tokenizer
    assert [c.name for c in diff_keys(with_generation, after).tokenizer] == ["additional_chat_templates/tool_use.jinja"]
    assert "README.md" not in {f.name for f in after.files}


def test_a_saved_key_file_keeps_the_tokenizer_and_an_old_one_is_one_sentence(pair: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    first, second = pair
    saved = wcache_in_process("key", str(first), "--json")
    assert saved.returncode == 0, saved.stderr
    document = json.loads(saved.stdout)
    assert document["schema"] == "wcache.key/2" and "tokenizer" in document["key"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {f["name"] for f in document["files"]}
    keyfile = tmp_path / "first.key"
    keyfile.write_text(saved.stdout)
    against = wcache_in_process("diff", str(keyfile), str(second), "--json")
    assert against.returncode == 1 and [t["name"] for t in json.loads(against.stdout)["tokenizer"]] == [
        "tokenizer.json"]

    forged = {**document, "files": [f for f in document["files"] if f["name"] != "tokenizer.json"]}
    keyfile.write_text(json.dumps(forged))
    result = wcache_in_process("diff", str(keyfile), str(second))
    assert result.returncode != 0 and "tokenizer digest" in result.stderr and "Traceback" not in result.stderr

    old = {**document, "schema": "wcache.key/1"}
    keyfile.write_text(json.dumps(old))
    result = wcache_in_process("diff", str(keyfile), str(second))
    assert result.returncode != 0 and "did not cover the tokenizer" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_warm_key_reads_no_tokenizer_file(pair: tuple[Path, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first, _ = pair
    wait_past_racy_window()
    with DigestStore(tmp_path / "store") as store:
        cold = compute_key(first, store=store)
        from wcache.key import companion_digest

        def no_reads(*args: object, **kwargs: object) -> None:
            raise AssertionError("a warm key read a tokenizer file")

        monkeypatch.setattr(companion_digest, "read_small_file", no_reads)
        warm = compute_key(first, store=store)
    assert warm.key == cold.key and warm.files == cold.files


def test_a_tokenizer_replaced_in_a_hub_snapshot_is_refused_by_name(pair: tuple[Path, Path], tmp_path: Path) -> None:
    first, second = pair
    snapshot = write_hub_cache(tmp_path / "hub", "Org/Tiny", first)
    judged = verdicts_of(snapshot, compute_key(snapshot, store=None).files)
    assert {v.name for v in judged} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert {v.verdict for v in judged} == {"matches"}  # each small file by its git SHA-1, the shards by SHA-256
    assert refusal(judged, "unknown", "Org/Tiny") is None

    # A plain file where the cache has links: unknown, refused under --refuse-unknown by name.
    (snapshot / "tokenizer.json").unlink()
    shutil.copy(second / "tokenizer.json", snapshot / "tokenizer.json")
    judged = verdicts_of(snapshot, compute_key(snapshot, store=None).files)
    reason = refusal(judged, "unknown", "Org/Tiny")
    assert reason is not None and "tokenizer.json" in reason and "a copy, not a link" in reason

    # A link to a blob whose name is not its content's hash: differs, refused under --require-provenance alone.
    (snapshot / "tokenizer.json").unlink()
    blob = blob_of(snapshot, "config.json").parent / git_blob_sha1((first / "tokenizer.json").read_bytes())
    assert blob.exists()
    blob.write_bytes((second / "tokenizer.json").read_bytes())
    (snapshot / "tokenizer.json").symlink_to(os.path.relpath(blob, snapshot))
    judged = verdicts_of(snapshot, compute_key(snapshot, store=None).files)
    reason = refusal(judged, "differs", "Org/Tiny")
    assert reason is not None and "tokenizer.json differs from what the Hub published (git SHA-1" in reason


def test_the_list_holds_every_vocabulary_file_transformers_declares() -> None:
    import transformers

    declared: set[str] = set()
    for source in Path(transformers.__file__).parent.glob("models/*/tokenization_*.py"):
        for block in re.findall(r"VOCAB_FILES_NAMES\s*=\s*\{(.*?)\}", source.read_text(), re.S):
            declared.update(re.findall(r':\s*"([^"/]+)"', block))
    assert declared, "no VOCAB_FILES_NAMES found: transformers' layout changed"
    assert sorted(n for n in declared if not is_companion(n)) == []
    assert is_companion(companions.GENERATION_CONFIG_NAME) and is_companion("tokenizer.model.v3")
    assert not is_companion("config.json") and not is_companion("README.md")
