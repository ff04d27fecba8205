"""A checkpoint swapped for another while its key is hashed never leaves the other's root under its state.

Checkpoints A and B share a config and differ in their weights; a real daemon holds B. A cold `wcache key A`
(a fresh digest store) is run with `swap_during_key.py`, which swaps A for B right after the key has opened
A's shard, and A is swapped back once the key is done: A then holds its own files again, with their own
inodes and times. The `wcache attach A` that follows must not hit B's daemon: it computes A's own key. Three
swaps, each what a deploy does: the directory entries exchanged (renameat2), a symlink flipped, a bind mount.
Then the two other windows a swap can land in (between the stats and the opens, between config.json and the
shards), a checkpoint swapped at every try, which ends in one sentence, and roots stored before the rule.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import wcache.key.fingerprint as fingerprint
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    nothing_survives,  # noqa: F401
)
from helpers import CLI_TIMEOUT_S, environment, wait_past_racy_window
from swap_during_key import exchange, flip, unbind
from wcache.checkpoint.files import CONFIG_NAME, SINGLE_NAME, locate
from wcache.errors import CheckpointError
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache_dev.synth import write_checkpoint

WRAPPER = Path(__file__).with_name("swap_during_key.py")


@dataclass(frozen=True)
class Served:
    """A and B on disk, old enough for their receipts to be trusted, and the daemon that holds B."""

    rig: DaemonRig
    a: Path
    b: Path
    daemon: DaemonDescriptor
    key_a: str
    key_b: str


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with daemon_rig() as rig:
        a = write_checkpoint("tiny", rig.base / "A", num_shards=1, seed=0)
        b = write_checkpoint("tiny", rig.base / "B", num_shards=1, seed=1)
        key_a, key_b = compute_key(a).key, compute_key(b).key
        assert key_a.config == key_b.config and key_a.checkpoint != key_b.checkpoint
        wait_past_racy_window()
        (daemon,) = rig.preload(b)
        assert daemon.key_id == key_b.short_id
        yield Served(rig, a, b, daemon, key_a.short_id, key_b.short_id)


def key_during_swap(served: Served, model: Path, swap: str, source: Path, target: Path,
                    cache: Path) -> subprocess.CompletedProcess[str]:
    """`wcache key MODEL` with a fresh store `cache`, `source` swapped for `target` once MODEL's shard is open."""
    env = environment({**served.rig.env, "WCACHE_CACHE_DIR": str(cache)})
    return subprocess.run(
        [sys.executable, str(WRAPPER), swap, str(model / SINGLE_NAME), str(source), str(target), "--",
         "key", str(model), "--json", "--run-dir", str(served.rig.run_dir)],
        capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )


def attach_report(served: Served, model: Path, cache: Path) -> dict[str, object]:
    result = served.rig.cli("attach", str(model), "--json", "--no-fallback", "--run-dir", str(served.rig.run_dir),
                            env={"WCACHE_CACHE_DIR": str(cache)})
    assert result.returncode in (0, 3), result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


def check_swap_back(served: Served, model: Path, key: subprocess.CompletedProcess[str], cache: Path) -> None:
    """The key ran (it gave the key of A or of B, whole), and the attach after the swap back is A's own."""
    assert key.returncode == 0, key.stderr
    assert json.loads(key.stdout)["id"] in (served.key_a, served.key_b)
    report = attach_report(served, model, cache)
    assert report["outcome"] != "hit", f"attach of A after the swap back hit B's daemon: {report}"
    assert report["key_id"] == served.key_a, report


def fresh_cache(served: Served, name: str) -> Path:
    cache = served.rig.base / f"cache-{name}"
    cache.mkdir(mode=0o700)
    return cache


def is_mount_point(path: Path) -> bool:
    # Not os.path.ismount: a bind mount from the same filesystem has the parent's device.
    with open("/proc/self/mountinfo") as mounts:
        return any(line.split()[4] == str(path) for line in mounts)


def test_directories_exchanged_during_a_cold_key(served: Served) -> None:
    cache = fresh_cache(served, "exchange")
    b_shard = os.stat(served.b / SINGLE_NAME).st_ino
    try:
        key = key_during_swap(served, served.a, "exchange", served.a, served.b, cache)
    finally:
        if os.stat(served.a / SINGLE_NAME).st_ino == b_shard:
            exchange(served.a, served.b)
        else:
            pytest.fail("the directories were not exchanged during the key")
    check_swap_back(served, served.a, key, cache)


def test_symlink_flipped_during_a_cold_key(served: Served) -> None:
    cache = fresh_cache(served, "flip")
    current = served.rig.base / "current"
    current.symlink_to(served.a)
    try:
        key = key_during_swap(served, current, "flip", current, served.b, cache)
        assert os.readlink(current) == str(served.b), "the symlink was not flipped during the key"
        flip(current, served.a)
        check_swap_back(served, current, key, cache)
    finally:
        current.unlink()


def test_bind_mount_over_the_model_during_a_cold_key(served: Served) -> None:
    cache = fresh_cache(served, "bind")
    try:
        key = key_during_swap(served, served.a, "bind", served.b, served.a, cache)
    finally:
        mounted = is_mount_point(served.a)
        if mounted:
            unbind(served.a)
    if not mounted and "Operation not permitted" in key.stderr:
        pytest.fail(f"bind mounts need CAP_SYS_ADMIN here: {key.stderr}")
    assert mounted, f"B was not mounted over A during the key: {key.stderr}"
    check_swap_back(served, served.a, key, cache)


def test_directories_exchanged_between_the_stat_and_the_open(served: Served, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    # The stat saw A's shard, the open finds B's: the records are B's, under A's stat identities. The key is
    # computed again (B's, whole) and no root is stored under A's state.
    stat_all = fingerprint._stat_all  # the real one: the test only adds the exchange after it
    swaps: list[int] = []

    def stat_then_exchange(layout):  # type: ignore[no-untyped-def]
        identities = stat_all(layout)
        if not swaps:
            swaps.append(1)
            exchange(served.a, served.b)
        return identities

    monkeypatch.setattr(fingerprint, "_stat_all", stat_then_exchange)
    cache = fresh_cache(served, "stat-open")
    try:
        with DigestStore(cache) as store:
            during = compute_key(served.a, store=store)
    finally:
        if swaps:
            exchange(served.a, served.b)
    monkeypatch.undo()
    assert swaps and during.key.short_id == served.key_b
    with DigestStore(cache) as store:
        after = compute_key(served.a, store=store)
    assert after.key.short_id == served.key_a


def test_config_replaced_while_the_shards_are_read(served: Served) -> None:
    # config.json is read before the shards: replaced in between, the key would pair the old config with the
    # tensors read after. The key is of one state: computed again, with the config as it now is.
    model = Path(shutil.copytree(served.a, served.rig.base / "config-swap"))
    layout = locate(model)
    config = json.loads((model / CONFIG_NAME).read_text())
    replacement = model / "config.new"
    replacement.write_text(json.dumps({**config, "rope_theta": 12345.0}))
    os.replace(replacement, model / CONFIG_NAME)
    with pytest.raises(CheckpointError, match=r"config\.json changed while"):
        fingerprint.fingerprint_checkpoint(layout, None)
    assert compute_key(model).key.config != compute_key(served.a).key.config


def test_a_checkpoint_swapped_at_every_try_is_one_sentence(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    stat_all = fingerprint._stat_all
    swaps: list[int] = []

    def stat_then_exchange(layout):  # type: ignore[no-untyped-def]
        identities = stat_all(layout)
        swaps.append(1)
        exchange(served.a, served.b)
        return identities

    monkeypatch.setattr(fingerprint, "_stat_all", stat_then_exchange)
    try:
        with pytest.raises(CheckpointError) as failure:
            compute_key(served.a)
    finally:
        if len(swaps) % 2:
            exchange(served.a, served.b)
    assert len(swaps) == 3
    assert str(failure.value) == (f"{served.a} had files replaced every time its key was computed (3 tries); "
                                  "try again once it stays put.")


def test_a_root_stored_before_the_rule_is_not_used(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # Roots stored by a wcache without hashed_state may be another checkpoint's (as above): the state they were
    # stored under names an older version, and none of them is taken for A's.
    cache = fresh_cache(served, "old-root")
    layout = locate(served.a)
    with monkeypatch.context() as old:
        old.setattr(fingerprint, "ROOT_STATE_VERSION", "wcache.root-state/1")
        old_state = fingerprint.checkpoint_state(layout, fingerprint._stat_all(layout))
    with DigestStore(cache) as store:
        store.put_root(old_state, compute_key(served.b).key.checkpoint)
        key = compute_key(served.a, store=store)
    assert key.stats is not None and not key.stats.root_from_store
    assert key.key.short_id == served.key_a
