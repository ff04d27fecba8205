"""The shipped "tiny-trained" checkpoint: the committed bytes, the tiny layout, and it speaks; so does a retraining."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from wcache.engine import Engine
from wcache.key.compute import compute_key
from wcache_dev.synth import PRESETS, TRAINED_PRESET, overwrite_tensor_bytes, tensor_shapes, write_checkpoint
from wcache_dev.trained import CORPUS, write_trained_checkpoint

# The Merkle root over every tensor's bytes. It changes whenever the corpus, the recipe or the initial weights
# do: rerun `benchmarks/train_tiny.py DIR`, check its generations still read as words, and paste its key here.
# Torch's float kernels on another CPU family may round differently, which would also move it.
TRAINED_KEY = "458b7971725335cef5029272299329b4f3672df75b73d3256e70482dcb22ebb5"
PROMPT = "the daemon keeps"
NEW_TOKENS = 32
KEEP_BYTES = 1024  # as the demo: the first KiB of the tensor stays, so a sampled fingerprint misses the change
CORPUS_WORDS = set(re.findall(r"[a-z]{4,}", CORPUS))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(TRAINED_PRESET, tmp_path_factory.mktemp("trained") / "tiny-trained")


def _speaks(text: str) -> bool:
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    return letters >= 0.9 * len(text) and bool(CORPUS_WORDS & set(re.findall(r"[a-z]{4,}", text)))


def _generate(path: Path) -> str:
    engine = Engine.from_disk(path)  # the default (fused) plan, as the demo's engines load it
    try:
        text, _ = engine.complete(PROMPT, NEW_TOKENS)
    finally:
        engine.close()
    return text


def test_trained_checkpoint_has_the_committed_bytes_and_the_tiny_layout(trained: Path) -> None:
    key = compute_key(trained)
    assert key.key.checkpoint == TRAINED_KEY
    tiny = PRESETS["tiny"]
    assert json.loads((trained / "config.json").read_text()) == json.loads(json.dumps(tiny.config))
    assert [(e.name, e.shape, e.dtype) for e in sorted(key.manifest, key=lambda e: e.name)] == sorted(
        (name, shape, "F32") for name, shape in tensor_shapes(tiny.config, tiny.write_lm_head)
    )
    assert sorted(p.name for p in trained.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert sum(p.stat().st_size for p in trained.iterdir()) < 2 * 1024 * 1024


def test_trained_checkpoint_speaks_and_its_zeroed_copy_does_not(trained: Path, tmp_path: Path) -> None:
    text = _generate(trained)
    assert _speaks(text), text

    zeroed = tmp_path / "zeroed"
    shutil.copytree(trained, zeroed)
    victim = max(compute_key(trained).manifest, key=lambda e: (e.nbytes, e.name))
    overwrite_tensor_bytes(zeroed, victim.name, KEEP_BYTES, bytes(victim.nbytes - KEEP_BYTES))
    broken = _generate(zeroed)
    assert broken != text
    assert not CORPUS_WORDS & set(re.findall(r"[a-z]{4,}", broken)), broken


def test_the_training_script_makes_a_checkpoint_that_speaks(tmp_path: Path) -> None:
    # On this machine it reproduces the shipped bytes exactly (TRAINED_KEY); that is not asserted, because
    # torch's float kernels may round differently on another CPU family and the shipped files stay the truth.
    retrained = write_trained_checkpoint(tmp_path / "retrained")
    assert _speaks(_generate(retrained))
