"""Files a user or the run dir names are read bounded and without blocking: a FIFO, a device (/dev/zero), a
directory or an oversized file given as `--expected`, `--prompts` or a rotated event log is one sentence (or, for
the log, nothing to show), never a hang or a read until memory runs out."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_one_error_sentence, cli_env, run_python, wcache_in_process, wcache_process
from wcache.bounded_read import MAX_NAMED_FILE_BYTES

# Far longer than any refusal takes; a read of /dev/zero reaches gigabytes within it, a FIFO never returns.
DEADLINE_S = 30


@pytest.fixture(params=["fifo", "/dev/zero", "directory", "oversized"])
def hostile(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A path that is no readable file of digests, and the clause the refusal gives."""
    path = tmp_path / "sums"
    if request.param == "fifo":
        os.mkfifo(path)
    elif request.param == "directory":
        path.mkdir()
    elif request.param == "oversized":
        with path.open("wb") as f:  # sparse: one byte past the cap, no disk used
            f.truncate(MAX_NAMED_FILE_BYTES + 1)
    else:
        path.symlink_to(request.param)
    yield path, "it is larger than 64 MiB" if request.param == "oversized" else "it is not a regular file"


def test_preload_refuses_expected_that_is_not_a_small_file(hostile: tuple[Path, str], tmp_path: Path,
                                                           tiny_template: Path) -> None:
    path, why = hostile
    run_dir = tmp_path / "run"
    try:
        result = wcache_process("preload", str(tiny_template), "--expected", str(path), "--detach", "--run-dir",
                                str(run_dir), env=cli_env(tmp_path / "cache"), timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"preload --expected {path} did not return")
    assert why in assert_one_error_sentence(result, str(path), "expected digests")
    assert not (run_dir / "logs").exists()  # refused before any supervisor (whose log goes there) started


def test_key_refuses_expected_that_is_not_a_small_file(hostile: tuple[Path, str], tmp_path: Path,
                                                       tiny_template: Path) -> None:
    path, why = hostile
    result = wcache_in_process("key", str(tiny_template), "--expected", str(path), env=cli_env(tmp_path / "cache"))
    assert why in assert_one_error_sentence(result, str(path))


def test_verify_refuses_prompts_that_are_not_a_small_file(hostile: tuple[Path, str], tmp_path: Path,
                                                          tiny_template: Path) -> None:
    path, why = hostile
    result = wcache_in_process("verify", str(tiny_template), "--greedy", "--prompts", str(path),
                               env=cli_env(tmp_path / "cache"))
    assert why in assert_one_error_sentence(result, str(path), "prompts")


# What `wcache top` polls, in a process of its own: it follows the log, the log rotates, and something other than
# the rotated file stands where the rotated generation should be.
_FOLLOW_ACROSS_A_ROTATION = """
import os, sys
from pathlib import Path
from wcache.monitor import event_types as ev
from wcache.monitor.collector import Collector
from wcache.monitor.events import append_event, events_path, rotated_path
run_dir, kind = Path(sys.argv[1]), sys.argv[2]
append_event(run_dir, ev.Preload(source="/before", device="cpu", tp_size=1, health_url=None))
collector = Collector(run_dir)
first = collector.poll()
log = events_path(run_dir)
log.unlink()  # rotated away, and in the rotated generation's place:
if kind == "fifo":
    os.mkfifo(rotated_path(log))
else:
    rotated_path(log).symlink_to("/dev/zero")
append_event(run_dir, ev.Preload(source="/after", device="cpu", tp_size=1, health_url=None))
second = collector.poll()
print([e.detail.get("source") for e in second.events])
"""


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_top_follows_a_rotation_whose_old_log_is_not_a_file(kind: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    try:
        result = run_python(_FOLLOW_ACROSS_A_ROTATION, str(run_dir), kind, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"top's collector blocked on events.jsonl.1 as {kind}")
    assert result.returncode == 0, result.stderr
    assert "/after" in result.stdout
