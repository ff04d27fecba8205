"""`wcache.integrations.transformers.from_pretrained` against a real daemon and transformers' own loader."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    nothing_survives,  # noqa: F401
)
from helpers import wcache_in_process
from transformers import AutoModelForCausalLM
from wcache.attach import AttachMissError
from wcache.errors import BadInputError
from wcache.integrations.transformers import from_pretrained
from wcache_dev.synth import PRESETS, make_tensors, overwrite_tensor_bytes, write_checkpoint, write_tensors

PROMPT = list(b"the weights cache keeps")


@pytest.fixture(scope="module")
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        previous = os.environ.get("WCACHE_CACHE_DIR")
        os.environ["WCACHE_CACHE_DIR"] = made.env["WCACHE_CACHE_DIR"]
        try:
            yield made
        finally:
            if previous is None:
                os.environ.pop("WCACHE_CACHE_DIR", None)
            else:
                os.environ["WCACHE_CACHE_DIR"] = previous


def greedy(model: object, steps: int = 12) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,  # type: ignore[attr-defined]
                             do_sample=False, pad_token_id=257)
    return out[0, len(PROMPT):].tolist()


def test_hit_views_the_fused_arena_and_matches_transformers(rig: DaemonRig) -> None:
    model_dir = write_checkpoint("small", rig.base / "small")
    [daemon] = rig.preload(model_dir)
    attached = from_pretrained(model_dir, run_dir=rig.run_dir, fallback=False)
    assert attached.wcache_report.outcome == "hit" and attached.wcache_report.daemon == daemon.name
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert greedy(attached) == greedy(reference)
    # Every parameter is a view of the daemon's fused tensors: q/k/v share qkv_proj's storage.
    attn = attached.model.layers[0].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    [hit] = [e for e in rig.events("attach_hit") if e.get("engine") == "transformers"]
    assert hit["daemon"] == daemon.name


def test_private_memory_stays_small_against_a_disk_load(rig: DaemonRig) -> None:
    # ~50 MB of bf16 weights: big enough that a private copy would stand out of the allocator's noise.
    config = dict(PRESETS["small"].config, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096)
    preset = PRESETS["small"].__class__(config=config, num_shards=1, write_lm_head=True)
    model_dir = write_tensors(make_tensors(preset), config, rig.base / "medium", 1)
    weights_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    rig.preload(model_dir)
    process = psutil.Process()
    warm = from_pretrained(model_dir, run_dir=rig.run_dir, fallback=False)  # imports and first-call costs
    greedy(warm, 2)
    # Measured after a generation, so every weight page has been read: a page this process alone maps (a
    # private copy, or a file page only it maps) counts as private; the daemon's shared pages do not.
    gc.collect()
    before = process.memory_full_info().uss
    attached = from_pretrained(model_dir, run_dir=rig.run_dir, fallback=False)
    greedy(attached, 2)
    gc.collect()
    attach_private = process.memory_full_info().uss - before
    before = process.memory_full_info().uss
    disk = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    greedy(disk, 2)
    gc.collect()
    disk_private = process.memory_full_info().uss - before
    print(json.dumps({"weights_bytes": weights_bytes, "attach_private": attach_private,
                      "disk_private": disk_private}))
    assert attached.wcache_report.outcome == "hit" and warm.wcache_report.outcome == "hit"
    assert disk_private > 0.8 * weights_bytes, "transformers' own load should hold the weights privately"
    assert attach_private < 0.2 * weights_bytes, (attach_private, weights_bytes)


def test_miss_falls_back_to_transformers_own_load(rig: DaemonRig) -> None:
    original = rig.base / "small"
    if not original.exists():
        write_checkpoint("small", original)
    copy = copy_checkpoint(original, rig.base / "small-zeroed")
    overwrite_tensor_bytes(copy, "lm_head.weight", 1024, bytes(320 * 128 * 2 - 1024))
    loaded = from_pretrained(copy, run_dir=rig.run_dir)
    assert loaded.wcache_report.outcome == "miss" and "lm_head.weight" in loaded.wcache_report.reason
    # The README's example names the outcomes users see: a hit's, and this one.
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = next(line for line in readme.splitlines() if line.startswith("model.wcache_report.outcome"))
    assert '"hit"' in said and f'"{loaded.wcache_report.outcome}"' in said and '"fallback"' not in said, said
    assert greedy(loaded) == greedy(AutoModelForCausalLM.from_pretrained(copy).eval())
    with pytest.raises(AttachMissError, match=r"lm_head\.weight"):
        from_pretrained(copy, run_dir=rig.run_dir, fallback=False)


def test_bad_options_are_one_sentence(rig: DaemonRig) -> None:
    with pytest.raises(BadInputError, match="mode must be zero_copy or copy"):
        from_pretrained(rig.base, mode="mmap")
    with pytest.raises(BadInputError, match=r"fallback .* cannot be 'no'"):
        from_pretrained(rig.base, fallback="no")
    with pytest.raises(BadInputError, match="TP 1"):
        from_pretrained(rig.base, device_map="auto")
    with pytest.raises(BadInputError, match="wait_s"):
        from_pretrained(rig.base, wait_s=-1)


def test_model_path_is_what_vllm_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wcache.checkpoint.files import locate
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.errors import CheckpointError

    model_dir = write_checkpoint("small", tmp_path / "small")
    # A Hugging Face cache layout: refs/main names a snapshot directory.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--Org--Small"
    snapshot = repo / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    copy_checkpoint(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("Org/Small") == snapshot
    assert resolve_model_path(f"Org/Small@{commit}") == snapshot
    with pytest.raises(CheckpointError, match=r"Org/Missing is not a path and is not in the local Hugging Face cache"):
        resolve_model_path("Org/Missing")
    # A directory of shards without an index is globbed, as vLLM does.
    (model_dir / "model.safetensors.index.json").unlink()
    assert [p.name for p in locate(model_dir).shards] == sorted(p.name for p in model_dir.glob("*.safetensors"))
    # A .safetensors file takes its directory's config.
    assert locate(sorted(model_dir.glob("*.safetensors"))[0]).config is not None
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    (bin_only / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match=r"holds only PyTorch \.bin weights"):
        locate(bin_only)


def test_verify_with_transformers_passes_and_catches_a_planted_wrong_hit(rig: DaemonRig) -> None:
    original = rig.base / "small"
    if not original.exists():
        write_checkpoint("small", original)
        rig.preload(original)
    zeroed = copy_checkpoint(original, rig.base / "small-planted")
    overwrite_tensor_bytes(zeroed, "lm_head.weight", 1024, bytes(320 * 128 * 2 - 1024))
    [planted] = rig.preload(zeroed)
    common = ("--greedy", "--engine", "transformers", "--num-prompts", "2", "--max-new-tokens", "8",
              "--run-dir", str(rig.run_dir), "--json")
    # In process: the subject is verify's report; the daemons are processes of their own.
    passing = wcache_in_process("verify", str(original), *common, env=rig.env)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    report = json.loads(passing.stdout)["greedy"]
    assert report["all_match"] and report["attach"]["engine"] == "transformers"
    assert report["attach"]["outcome"] == "hit"
    failing = wcache_in_process("verify", str(original), *common, "--trust-daemon", "--daemon", planted.name,
                                env=rig.env)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    report = json.loads(failing.stdout)["greedy"]
    assert report["attach"]["daemon"] == planted.name and not report["all_match"]
