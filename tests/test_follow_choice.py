"""Which version a following engine moves to (`newest_descendant`), and when it moves at all (`Follower.look`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from wcache.errors import BadInputError
from wcache.ipc.attach_summary import AttachSummary
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.run_dir.engines import VLLM_ENGINE, EngineDescriptor, write_engine_descriptor
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec
from wcache.serve.follow import AnnouncedKey, served_key
from wcache.serving.follow import Follower, check_followable, newest_descendant


def _daemon(key_id: str, parent: str | None = None, *, started: str = "2026-01-01T00:00:00+00:00",
            device: str = "cpu", tp_size: int = 1, tp_rank: int = 0, supervisor: int | None = None
            ) -> DaemonDescriptor:
    name = f"{device}-{key_id}"
    return DaemonDescriptor(
        name=name, pid=1, pid_created=0.0, device=device, tp_size=tp_size, tp_rank=tp_rank, key_id=key_id,
        key=WeightCacheKey(checkpoint=key_id, config="c", tokenizer="t", plan="p", format=1), plan=PlanSpec(),
        config=None, source=f"/{key_id}", socket=f"/{name}.sock", health_url=None, supervisor_pid=supervisor,
        started=started, weights_bytes=0, parent_key_id=parent, parent=f"{device}-{parent}" if parent else None)


def test_the_newest_descendant_is_the_tip_of_the_chain_from_the_served_key() -> None:
    live = [_daemon("aaaa"), _daemon("bbbb", "aaaa"), _daemon("cccc", "bbbb"), _daemon("uuuu"),
            _daemon("vvvv", "uuuu")]
    assert newest_descendant(live, "aaaa", "cpu") == live[2]
    assert newest_descendant(live, "bbbb", "cpu") == live[2]
    assert newest_descendant(live, "cccc", "cpu") is None  # nothing newer
    assert newest_descendant(live, "zzzz", "cpu") is None  # an engine on a key no version descends from


def test_unrelated_other_device_and_partial_group_versions_are_not_followed() -> None:
    live = [_daemon("aaaa"), _daemon("uuuu"), _daemon("vvvv", "uuuu"), _daemon("bbbb", "aaaa", device="cuda0"),
            _daemon("dddd", "aaaa", tp_size=2, supervisor=7)]  # rank 1 of its group not live (yet)
    assert newest_descendant(live, "aaaa", "cpu") is None


def test_a_tensor_parallel_version_is_followed_through_rank_0_once_its_whole_group_runs() -> None:
    # Rank r of each version descends from rank r of the one before; an engine's rank 0 serves key a0.
    n = [_daemon("a0", tp_size=2, supervisor=1), _daemon("a1", tp_size=2, tp_rank=1, supervisor=1)]
    n1 = [_daemon("b0", "a0", tp_size=2, supervisor=2), _daemon("b1", "a1", tp_size=2, tp_rank=1, supervisor=2)]
    n2_rank0 = _daemon("c0", "b0", tp_size=2, supervisor=3)
    assert newest_descendant([*n, *n1, n2_rank0], "a0", "cpu") == n1[0]  # N+2 until its rank 1 runs
    n2 = [n2_rank0, _daemon("c1", "b1", tp_size=2, tp_rank=1, supervisor=3)]
    assert newest_descendant([*n, *n1, *n2], "a0", "cpu") == n2[0]
    assert newest_descendant([*n, *n1, *n2], "a1", "cpu") is None  # rank 1's keys name no group


def test_of_two_branches_the_one_started_last() -> None:
    early = _daemon("bbbb", "aaaa", started="2026-01-01T00:00:01+00:00")
    late = _daemon("cccc", "aaaa", started="2026-01-01T00:00:02+00:00")
    assert newest_descendant([late, early, _daemon("aaaa")], "aaaa", "cpu") == late


def test_a_cycle_of_parents_ends() -> None:
    assert newest_descendant([_daemon("aaaa", "bbbb"), _daemon("bbbb", "aaaa")], "aaaa", "cpu") is not None


def test_a_corrupt_or_unkeyed_engine_does_not_look(tmp_path: Path) -> None:
    switched: list[str] = []
    corrupt = Follower(tmp_path, "cpu", lambda: "aaaa", lambda: True, switched.append)
    unkeyed = Follower(tmp_path, "cpu", lambda: None, lambda: False, switched.append)
    assert corrupt.look() is None and unkeyed.look() is None and switched == []


def test_a_tensor_parallel_engine_cannot_follow() -> None:
    with pytest.raises(BadInputError, match="TP 2"):
        check_followable(2)
    check_followable(1)


def test_a_following_launcher_reads_the_key_its_server_announces_again_after_each_announcement(
        tmp_path: Path) -> None:
    """`wcache serve --follow` asks 20 times a second which key its server's rank 0 serves; it reads the
    announcements again whenever one is rewritten (a reload), and keeps the last answer otherwise."""
    url = "http://127.0.0.1:8000"

    def announce(key_id: str | None, tp_rank: int = 0) -> None:
        attach = None if key_id is None else AttachSummary(
            outcome="hit", mode="zero_copy", device="cpu", key_id=key_id, daemon=f"cpu-{key_id}",
            daemon_key_id=key_id, reason=None, mismatched=(), diff=None, timings_ms={}, bytes_mapped=0,
            num_tensors=0, daemon_lost=False)
        write_engine_descriptor(tmp_path, EngineDescriptor(
            pid=os.getpid(), url=url, model="m", source="/m", attach=attach, key_id=key_id, started=time.time(),
            engine=VLLM_ENGINE, tp_rank=tp_rank))

    announced = AnnouncedKey(tmp_path, url)
    assert announced() is None  # nothing announced yet
    announce("aaaa")
    assert announced() == "aaaa"
    time.sleep(0.2)  # past the timestamp tick: the answer is kept until the directory changes
    assert announced() == "aaaa"
    announce("bbbb")
    assert announced() == "bbbb"
    announce(None)  # a rank that fell back to disk serves no daemon's key
    assert announced() is None
    assert served_key(tmp_path, "http://127.0.0.1:9000") is None  # another server's announcements are not its
