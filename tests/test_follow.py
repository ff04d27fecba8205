"""Engines follow: `wcache attach --serve --follow` moves to each version published from the weights it serves.

Real daemons, two real served engines side by side (one following, one not), real `publish` calls from tensors
in memory; an unrelated checkpoint's version is published first and must never be followed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import DaemonRig, daemon_rig, nothing_survives, wait_for  # noqa: F401
from engine_serving import Server, http_status, post, serving
from helpers import one_sentence, wcache_process
from wcache_dev.synth import write_training_step

PROMPT = "The weights"
MAX_TOKENS = 12

@pytest.fixture(scope="module")
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_template: Path) -> dict[str, Path]:
    """N, N+1 and N+2 (training steps), an unrelated checkpoint U of the same shape, and U+1."""
    base = tmp_path_factory.mktemp("follow")
    unrelated = write_training_step(tiny_template, base / "u", 0.5, seed=7)
    n1 = write_training_step(tiny_template, base / "n1", 0.02)
    return {"n": tiny_template, "n1": n1, "n2": write_training_step(n1, base / "n2", 0.02, seed=5),
            "u": unrelated, "u1": write_training_step(unrelated, base / "u1", 0.02, seed=3)}


def _served_key(server: Server) -> str:
    code, document = http_status(f"{server.url}/v1/weights")
    assert code == 200 and isinstance(document, dict)
    return str(document["key_id"])


def _tokens(server: Server) -> tuple[list[int], str]:
    code, answer = post(server.url, json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode())
    assert code == 200, answer
    return answer["choices"][0]["token_ids"], answer["wcache"]["weights_key"]


def _disk_tokens(checkpoint: Path, empty_run_dir: Path) -> list[int]:
    """Greedy tokens of `checkpoint` loaded from disk (a run dir with no daemon: the attach falls back)."""
    done = wcache_process("attach", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", str(MAX_TOKENS),
                          "--json", "--run-dir", str(empty_run_dir))
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["token_ids"])


def _mapped_arenas(pid: int) -> set[str]:
    """The inodes of the wcache arenas (memfds) process `pid` maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[4] for line in lines if "memfd:wcache-arena" in line}


def test_a_following_engine_moves_to_the_published_version_and_no_other(
        rig: DaemonRig, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    [parent] = rig.preload(checkpoints["n"])
    [unrelated] = rig.preload(checkpoints["u"])
    with serving(rig, checkpoints["n"], "--follow") as follower, serving(rig, checkpoints["n"]) as still:
        assert _served_key(follower) == _served_key(still) == parent.key_id
        code, document = http_status(f"{follower.url}/v1/weights")
        assert code == 200
        assert isinstance(document, dict) and document["follows"] is True
        # A version of another checkpoint first: nothing leads to it from N, so nobody moves.
        u1_key, _ = rig.publish_step(unrelated.name, checkpoints["u"], checkpoints["u1"])
        n1_key, n1_daemon = rig.publish_step(parent.name, checkpoints["n"], checkpoints["n1"])
        wait_for(lambda: _served_key(follower) == n1_key, timeout=30, what="the follower on N+1")
        tokens, key = _tokens(follower)
        assert key == n1_key  # the whole request ran on N+1
        assert tokens == _disk_tokens(checkpoints["n1"], tmp_path / "no-daemons")
        assert _served_key(still) == parent.key_id  # without --follow: N until someone switches it
        switches = [e for e in rig.events("engine_switch") if e.get("engine_pid") == follower.process.pid]
        assert [e["key_id"] for e in switches] == [n1_key] and u1_key != n1_key
        # The follower let go of N's lease: only the engine without --follow holds it now.
        assert rig.stats(parent)["leases"] == 1
        [n1] = [d for d in rig.descriptors() if d.name == n1_daemon]
        assert rig.stats(n1)["leases"] == 1
        # Its announcement and `wcache status` say which version it is on, and that it follows.
        engines = {e["id"]: e for e in rig.status()["engines"]}
        shown = engines[f"pid {follower.process.pid}"]
        assert shown["key_id"] == n1_key and shown["follows"] is True and shown["daemon"] == n1_daemon
        assert engines[f"pid {still.process.pid}"]["key_id"] == parent.key_id
        assert engines[f"pid {still.process.pid}"]["follows"] is False
        # A second step follows from the version it followed.
        n2_key, _ = rig.publish_step(n1_daemon, checkpoints["n1"], checkpoints["n2"])
        wait_for(lambda: _served_key(follower) == n2_key, timeout=30, what="the follower on N+2")
        assert _served_key(still) == parent.key_id
        # No file holds a published version's weights (its delta is gone once built): verify says so.
        unverifiable = rig.cli("verify", follower.url, "--greedy")
        assert unverifiable.returncode == 3, unverifiable.stdout + unverifiable.stderr
        assert f"serves key {n2_key}, a version built from a delta" in one_sentence(unverifiable.stderr)
        # Two versions later the follower maps one arena (N+2's): each one it left was unmapped.
        assert len(_mapped_arenas(follower.process.pid)) == 1
        assert len(_mapped_arenas(still.process.pid)) == 1
    assert not rig.cleanup()
    assert not list((rig.run_dir / "engines").glob("*.json"))


def test_follow_needs_serve(tiny_template: Path, tmp_path: Path) -> None:
    done = wcache_process("attach", str(tiny_template), "--follow", "--run-dir", str(tmp_path))
    assert done.returncode == 2 and "--serve" in done.stderr and "Traceback" not in done.stderr
