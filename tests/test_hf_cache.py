"""A Hugging Face id whose local cache was damaged or planted: one sentence and exit 2, never a hang or a traceback.

Each test builds the cache as `hf download` leaves it (models--Org--Name/ with blobs/, snapshots/<commit>/ of
links into blobs/, refs/main) and runs `wcache diff Org/Name Org/Name` (which resolves MODEL as attach,
preload and verify do) as a real process pointed at it, so a read that blocks ends in the test's timeout
instead of the suite's.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from helpers import assert_one_error_sentence, cli_env, wcache_process
from wcache_dev.synth import write_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "Org/Tiny"
DEADLINE_S = 60  # a process start and a tiny key take a few seconds; a hang takes forever


def hf_cache(root: Path, template: Path) -> Path:
    """A cache holding REPO at COMMIT with refs/main naming it; returns the repo's storage folder."""
    storage = root / "models--Org--Tiny"
    blobs, snapshot = storage / "blobs", storage / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for source in sorted(template.iterdir()):
        data = source.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return storage


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("hf") / "tiny")


def resolve(tmp_path: Path, model: str) -> subprocess.CompletedProcess[str]:
    env = {**cli_env(tmp_path / "wcache-cache"), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    try:
        return wcache_process("diff", model, REPO, env=env, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`wcache diff {model}` did not end within {DEADLINE_S} s")


def test_the_cache_the_cases_start_from_resolves(tmp_path: Path, template: Path) -> None:
    hf_cache(tmp_path / "hub", template)
    result = resolve(tmp_path, REPO)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "not-a-commit"])
def test_a_damaged_ref_is_one_sentence(kind: str, tmp_path: Path, template: Path) -> None:
    # A FIFO hung huggingface_hub's open(); /dev/zero was read until memory ran out.
    ref = hf_cache(tmp_path / "hub", template) / "refs" / "main"
    ref.unlink()
    if kind == "fifo":
        os.mkfifo(ref)
    elif kind == "/dev/zero":
        ref.symlink_to(kind)
    else:
        ref.write_text("../../../../etc\n")
    line = assert_one_error_sentence(resolve(tmp_path, REPO), "refs/main")
    assert ("is not a regular file" in line) if kind != "not-a-commit" else ("does not hold a commit hash" in line)


@pytest.mark.parametrize("listing", ["list", "nested", "bad-entry", "fifo"])
def test_a_corrupt_tree_listing_is_one_sentence(listing: str, tmp_path: Path, template: Path) -> None:
    # huggingface_hub checks a snapshot against trees/<commit>.json; a damaged one ended in its traceback
    # (AttributeError, RecursionError, TypeError) or, as a FIFO, hung its open().
    trees = hf_cache(tmp_path / "hub", template) / "trees"
    trees.mkdir()
    path = trees / f"{COMMIT}.json"
    if listing == "fifo":
        os.mkfifo(path)
    else:
        path.write_text({"list": "[1, 2]", "nested": "[" * 100_000,
                         "bad-entry": '{"format_version": 1, "files": {"config.json": {"size": 1, "blob_id": 3,'
                                      ' "xet_hash": 7}}}'}[listing])
    assert_one_error_sentence(resolve(tmp_path, REPO), f"{COMMIT}.json")


def test_a_revision_with_a_newline_is_shown_escaped(tmp_path: Path, template: Path) -> None:
    # The revision is the user's text, echoed in the error: raw, its newline would forge a second line.
    hf_cache(tmp_path / "hub", template)
    line = assert_one_error_sentence(resolve(tmp_path, f"{REPO}@main\nerror: forged"), "not a branch, tag or commit")
    assert "main\\nerror: forged" in line


def test_a_revision_that_climbs_out_of_refs_is_refused(tmp_path: Path, template: Path) -> None:
    # refs/../../.. would read any file on the machine as a ref.
    hf_cache(tmp_path / "hub", template)
    assert_one_error_sentence(resolve(tmp_path, f"{REPO}@../../x"), "not a branch, tag or commit")
