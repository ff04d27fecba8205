"""`wcache verify --greedy` and `--content` end to end on CPU, through real daemons and the CLI's entry point
(run in this interpreter: tests/helpers.py; the daemons, and the ranks of a TP run, are processes of their own).

The daemons live in private run dirs (tests/daemon_fixtures.py) that are stopped, swept and removed however
the tests end:

- a correct hit passes both checks (TP=1 and TP=2);
- a daemon holding a copy of the checkpoint with `model.embed_tokens.weight` zeroed past its first KiB,
  used through `--trust-daemon` (so the key never looked at the shards), fails both checks and names the
  tensor; without `--trust-daemon` the same run dir has no daemon for the original (exit 3);
- a daemon whose arena was overwritten through /proc after it loaded fails both checks and names the tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    preloaded_tiny,
)
from helpers import one_sentence, wcache_in_process
from wcache.errors import EXIT_BAD_INPUT, EXIT_DIFFERENCE, EXIT_OK, EXIT_UNAVAILABLE
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import DaemonConnection
from wcache.ipc.wire.messages import Hello, MapRequest, WantedKey
from wcache_dev.synth import overwrite_tensor_bytes

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
KEEP_BYTES = 1024  # the zeroed copy keeps the first KiB of the embedding
# Few prompts and tokens: the tiny model diverges at once when its weights are wrong, and time is short.
SHORT = ("--num-prompts", "1", "--max-new-tokens", "4")


@pytest.fixture(scope="module")
def hit(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, DaemonDescriptor]]:
    """`tiny` preloaded (TP=1) in a private run dir."""
    with preloaded_tiny(tiny_template) as preloaded:
        yield preloaded


@pytest.fixture(scope="module")
def zeroed(tiny_template: Path) -> Iterator[tuple[DaemonRig, Path, DaemonDescriptor]]:
    """A run dir whose only daemon holds a copy of `tiny` with the embedding zeroed past its first KiB;
    the original checkpoint sits beside it on disk, never preloaded."""
    with daemon_rig() as rig:
        original = copy_checkpoint(tiny_template, rig.base / "tiny")
        copy = copy_checkpoint(tiny_template, rig.base / "tiny-zeroed")
        nbytes = 320 * 64 * 4  # tiny's embedding: vocab 320 x hidden 64, float32
        overwrite_tensor_bytes(copy, EMBED, KEEP_BYTES, bytes(nbytes - KEEP_BYTES))
        (daemon,) = rig.preload(copy)
        yield rig, original, daemon


def verify(rig: DaemonRig, model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return wcache_in_process("verify", str(model), "--run-dir", str(rig.run_dir), *args, env=rig.env)


def verify_json(rig: DaemonRig, model: Path, *args: str, expect: int) -> dict[str, Any]:
    result = verify(rig, model, *args, "--json")
    assert result.returncode == expect, (
        f"verify {' '.join(args)} exited {result.returncode}, not {expect}: {result.stderr}{result.stdout}"
    )
    return json.loads(result.stdout)


# -- 1. a correct hit passes -----------------------------------------------------------------------------


def test_correct_hit_passes_greedy_and_content(hit: tuple[DaemonRig, Path, DaemonDescriptor]) -> None:
    rig, model, daemon = hit
    document = verify_json(
        rig, model, "--greedy", "--content", "--num-prompts", "2", "--max-new-tokens", "8", expect=EXIT_OK
    )
    assert document["ok"] is True
    content = document["content"]
    assert content["ok"] is True and content["daemon"] == daemon.name
    assert content["source"] == {"changed": [], "added": [], "removed": []}
    assert content["arena"]["checked"] > 0 and content["arena"]["changed"] == []
    greedy = document["greedy"]
    assert greedy["all_match"] is True
    attach = greedy["attach"]
    assert (attach["engine"], attach["outcome"], attach["daemon"]) == ("reference", "hit", daemon.name)
    # The head is the whole report's, which the reference engine, attaching in reach, adds.
    report = attach["report"]
    assert [report[k] for k in ("outcome", "daemon", "mode", "key_id")] == [
        attach[k] for k in ("outcome", "daemon", "mode", "key_id")]
    assert report["num_tensors"] > 0 and report["reason"] is None and report["daemon_lost"] is False
    assert len(greedy["prompts"]) == 2
    for prompt in greedy["prompts"]:
        assert prompt["match"] is True and prompt["first_divergence"] is None
        assert prompt["cached_tokens"] == prompt["disk_tokens"] and len(prompt["cached_tokens"]) > 0

    human = verify(rig, model, "--greedy", "--content", "--num-prompts", "1", "--max-new-tokens", "2")
    assert human.returncode == EXIT_OK, human.stderr
    assert "VERIFIED" in human.stdout and "MISMATCH" not in human.stdout
    assert "SOURCE OK" in human.stdout and "ARENA OK" in human.stdout
    assert f"cached reference engine: hit from {daemon.name} ({attach['mode']})" in human.stdout


# -- 2. a trusted daemon holding the zeroed-tensor copy fails, naming the tensor ------------------------


def test_trusted_daemon_with_zeroed_copy_fails_both_checks(
    zeroed: tuple[DaemonRig, Path, DaemonDescriptor],
) -> None:
    rig, original, daemon = zeroed
    trust = ("--trust-daemon", "--daemon", daemon.key_id)

    content = verify_json(rig, original, "--content", *trust, expect=EXIT_DIFFERENCE)
    assert content["ok"] is False
    report = content["content"]
    assert report["ok"] is False and report["daemon"] == daemon.name
    assert report["source"] == {"changed": [EMBED], "added": [], "removed": []}
    assert report["arena"]["changed"] == [], "the daemon's arena is what it built: only the source differs"

    greedy = verify_json(rig, original, "--greedy", *trust, *SHORT, expect=EXIT_DIFFERENCE)
    assert greedy["ok"] is False
    assert (greedy["greedy"]["attach"]["outcome"], greedy["greedy"]["attach"]["daemon"]) == ("hit", daemon.name)
    assert greedy["greedy"]["all_match"] is False
    (prompt,) = greedy["greedy"]["prompts"]
    assert prompt["match"] is False and isinstance(prompt["first_divergence"], int)
    position = prompt["first_divergence"]
    assert prompt["cached_tokens"][:position] == prompt["disk_tokens"][:position]
    assert prompt["cached_tokens"][position : position + 1] != prompt["disk_tokens"][position : position + 1]

    human = verify(rig, original, "--greedy", "--content", *trust, *SHORT)
    assert human.returncode == EXIT_DIFFERENCE, human.stderr
    assert "SOURCE DIFFERS" in human.stdout and EMBED in human.stdout
    assert "MISMATCH" in human.stdout and f"diverges at token {position}" in human.stdout
    assert "VERIFIED" not in human.stdout


def test_untrusted_verify_finds_no_daemon_for_the_original(
    zeroed: tuple[DaemonRig, Path, DaemonDescriptor],
) -> None:
    rig, original, _ = zeroed
    result = verify(rig, original, "--greedy", *SHORT)
    assert result.returncode == EXIT_UNAVAILABLE, result.stdout + result.stderr
    sentence = one_sentence(result.stderr)
    assert EMBED in sentence, "the miss should say which tensor keeps the daemon's key from matching"
    assert "VERIFIED" not in result.stdout and "MISMATCH" not in result.stdout


# -- 3. bad input ----------------------------------------------------------------------------------------


def test_empty_prompts_file_and_no_check_are_bad_input(tiny_template: Path) -> None:
    with daemon_rig() as rig:
        empty = rig.base / "prompts.txt"
        empty.write_text("\n  \n")
        result = verify(rig, tiny_template, "--greedy", "--prompts", str(empty))
        assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
        assert "no prompts" in one_sentence(result.stderr)
        assert result.stdout == ""

        result = verify(rig, tiny_template)
        assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
        sentence = one_sentence(result.stderr)
        assert "--greedy" in sentence and "--content" in sentence
        assert result.stdout == ""


# -- 4. TP=2 -----------------------------------------------------------------------------------------------


def test_tp2_verify_greedy_passes(hit: tuple[DaemonRig, Path, DaemonDescriptor]) -> None:
    rig, model, _ = hit
    daemons = rig.preload(model, "--tp", "2")
    assert [d.tp_rank for d in daemons] == [0, 1]
    document = verify_json(rig, model, "--greedy", "--tp", "2", *SHORT, expect=EXIT_OK)
    greedy = document["greedy"]
    assert document["ok"] is True and greedy["all_match"] is True
    assert (greedy["attach"]["outcome"], greedy["attach"]["daemon"]) == ("hit", daemons[0].name)
    (prompt,) = greedy["prompts"]
    assert prompt["cached_tokens"] == prompt["disk_tokens"] and len(prompt["cached_tokens"]) > 0


# -- 5. a daemon whose arena was modified after loading fails, naming the tensor ------------------------
# (Last in the module: it spoils the shared daemon of `hit` for good.)


def arena_entries(daemon: DaemonDescriptor) -> dict[str, tuple[int, int]]:
    """name -> (offset, nbytes) of each processed tensor in the daemon's arena, from its map reply."""
    with DaemonConnection(daemon.socket) as connection:
        hello = connection.request(Hello.mine(WantedKey.of(daemon.key)))
        assert hello.status == "hit"
        reply = connection.request(MapRequest("zero_copy"))
        for fd in reply.fds:
            os.close(fd)
    return {name: (offset, nbytes) for name, _dtype, _shape, offset, nbytes in reply.entries}


def overwrite_arena(daemon: DaemonDescriptor, offset: int, data: bytes) -> None:
    """Write into the daemon's memfd through /proc/<pid>/fd, as a stray process running as root could."""
    fd_dir = f"/proc/{daemon.pid}/fd"
    targets = []
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{name}").startswith("/memfd:wcache-arena"):
                targets.append(f"{fd_dir}/{name}")
        except OSError:
            continue
    assert targets, f"daemon {daemon.pid} holds no wcache arena memfd"
    fd = os.open(targets[0], os.O_RDWR)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)


def test_arena_cannot_be_modified_after_loading(hit: tuple[DaemonRig, Path, DaemonDescriptor]) -> None:
    # Before the arena was sealed, this write (the final norm zeroed) went through and only --content and
    # --greedy could tell; now the memfd refuses it, so both checks keep passing.
    rig, model, daemon = hit
    offset, nbytes = arena_entries(daemon)[NORM]
    with pytest.raises(PermissionError):
        overwrite_arena(daemon, offset, bytes(nbytes))

    content = verify_json(rig, model, "--content", expect=0)
    assert content["ok"] is True
    assert content["content"]["arena"]["changed"] == []
    greedy = verify(rig, model, "--greedy", *SHORT)
    assert greedy.returncode == 0, greedy.stdout + greedy.stderr
    assert "VERIFIED" in greedy.stdout


def test_greedy_without_a_daemon_names_what_to_run_not_an_option_verify_lacks(tiny_template: Path,
                                                                              tmp_path: Path) -> None:
    empty = tmp_path / "run"
    empty.mkdir(mode=0o700)
    result = wcache_in_process("verify", str(tiny_template), "--greedy", "--run-dir", str(empty))
    assert result.returncode == EXIT_UNAVAILABLE, result.stderr
    sentence = one_sentence(result.stderr)
    assert "--no-fallback" not in sentence and f"run `wcache preload {tiny_template}` first" in sentence, sentence
