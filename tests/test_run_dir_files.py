"""Files in the run dir that no wcache process wrote: `status`, `stop` and `top` read them, skip what they cannot
use with one warning, never follow a link out of the run dir, and never act on a name that leaves it.

Anything running as the user can write the run dir, so each case here is a file planted there by hand: a
loading record, a descriptor, the event log. The commands run in process (their subject is what they say and
exit with); a process to be signalled, where one is needed, is a real one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from helpers import cli_env, kill_and_wait, wcache_in_process
from wcache.ipc.run_dir.directory import (
    DaemonDescriptor,
    hold_daemon_lock,
    lock_held,
    lock_path,
    release_daemon_lock,
    write_descriptor,
)
from wcache.ipc.run_dir.loading import hold_record_lock, record_lock_path
from wcache.ipc.run_dir.paths import RunPaths
from wcache.monitor.event_types import Stop
from wcache.monitor.events import append_event, events_path, rotated_path

LOADING_WARNING = "Ignoring unreadable loading record"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    where = tmp_path / "run"
    where.mkdir(mode=0o700)
    return where


def loading_record(of: int, **changes: Any) -> dict[str, Any]:
    """A record as a rank of process `of` writes it, with `changes` applied."""
    return {"pid": of, "pid_created": psutil.Process(of).create_time(), "source": "/models/tiny", "device": "cpu",
            "tp_size": 1, "tp_rank": 0, "supervisor_pid": None, "started": 1.0, "phase": "loading",
            "done_bytes": 10, "total_bytes": 100, "name": None, **changes}


def readers(run_dir: Path, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """`status`, `status --json` and `top --once --json` over the run dir."""
    env = cli_env(tmp_path / "cache")
    return [wcache_in_process(*args, "--run-dir", str(run_dir), env=env)
            for args in (("status",), ("status", "--json"), ("top", "--once", "--json", "--interval", "0.1"))]


def assert_read_cleanly(result: subprocess.CompletedProcess[str], warning: str | None) -> None:
    everything = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in everything, everything
    if warning is not None:
        assert result.stderr.count(warning) == 1, result.stderr


# -- loading records ---------------------------------------------------------------------------------------


BAD_RECORDS: dict[str, Any] = {
    "started-string": {"started": "yesterday"},
    "started-null": {"started": None},
    "pid-400-digits": {"pid": 10**400},
    "pid-created-400-digits": {"pid_created": 10**400},
    "total-400-digits": {"total_bytes": 10**400},
    "supervisor-negative": {"supervisor_pid": -1},
}


@pytest.mark.parametrize("case", [*BAD_RECORDS, "nested", "over-the-cap"])
def test_a_forged_loading_record_is_skipped_with_one_warning(case: str, run_dir: Path, tmp_path: Path) -> None:
    # Before: TypeError (a started that is no number), OverflowError (a 400-digit int met a float) and
    # RecursionError (deep nesting, parsed even past the size cap) ended status and top with exit 1.
    (run_dir / RunPaths.LOADING).mkdir(mode=0o700)
    bad = run_dir / RunPaths.LOADING / "1.json"
    if case == "nested":
        bad.write_text("[" * 30_000 + "]" * 30_000)  # under the 64 KiB cap: the parser must refuse it
    elif case == "over-the-cap":
        bad.write_text("[" * (1 << 20))
    else:
        bad.write_text(json.dumps(loading_record(os.getpid(), **BAD_RECORDS[case])))
    # A good record beside it is still listed: one bad file hides nothing else. Its rank's lock is held, as a
    # loading rank holds it (a record whose lock is free is a dead rank's).
    lock = hold_record_lock(record_lock_path(run_dir, os.getpid()))
    (run_dir / RunPaths.LOADING / f"{os.getpid()}.json").write_text(json.dumps(loading_record(os.getpid())))
    try:
        status, status_json, top = readers(run_dir, tmp_path)
    finally:
        os.close(lock)
    for result in (status, status_json, top):
        assert_read_cleanly(result, LOADING_WARNING)
    assert [d["state"] for d in json.loads(status_json.stdout)["daemons"]] == ["loading"]
    assert [d["state"] for d in json.loads(top.stdout)["daemons"]] == ["loading"]


def test_a_symlinked_loading_dir_is_not_followed(run_dir: Path, tmp_path: Path) -> None:
    # `stop --all` signals the ranks the records name: through a planted link, any process of this user.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (elsewhere / f"{bystander.pid}.json").write_text(json.dumps(loading_record(bystander.pid)))
        (run_dir / RunPaths.LOADING).symlink_to(elsewhere)
        env = cli_env(tmp_path / "cache")
        stop = wcache_in_process("stop", "--all", "--run-dir", str(run_dir), env=env)
        status = wcache_in_process("status", "--json", "--run-dir", str(run_dir), env=env)
        assert bystander.poll() is None, "stop --all signalled a process named by a record outside the run dir"
        assert stop.returncode == 0 and "loading is a symlink" not in stop.stdout, stop.stderr
        assert "is a symlink, not a directory" in stop.stderr
        assert json.loads(status.stdout)["daemons"] == [] and (elsewhere / f"{bystander.pid}.json").exists()
    finally:
        kill_and_wait([psutil.Process(bystander.pid)])
        bystander.wait()


# -- descriptors -------------------------------------------------------------------------------------------


def dead_descriptor(**changes: Any) -> dict[str, Any]:
    """A descriptor of a daemon that is not running (no process has pid 4,000,000 here)."""
    return {
        "name": "cpu-aaaaaaaaaaaa", "pid": 4_000_000, "pid_created": 1.0, "device": "cpu", "tp_size": 1,
        "tp_rank": 0, "key_id": "aaaaaaaaaaaa",
        "key": {"checkpoint": "a", "config": "b", "tokenizer": "t", "plan": "c", "format": 1},
        "plan": {}, "config": None, "source": "/nowhere", "socket": "/nowhere.sock", "health_url": None,
        "supervisor_pid": None, "started": "2026-12-01T00:00:00Z", "weights_bytes": 0, **changes,
    }


def test_a_descriptor_named_outside_the_run_dir_removes_nothing_there(run_dir: Path, tmp_path: Path) -> None:
    # A dead daemon's descriptor is cleaned up by name: `../victim` removed ../victim.json and ../victim.sock.
    victims = [tmp_path / "victim.json", tmp_path / "victim.sock"]
    for victim in victims:
        victim.write_text("keep me")
    (run_dir / "cpu-aaaaaaaaaaaa.json").write_text(json.dumps(dead_descriptor(name="../victim")))
    status = wcache_in_process("status", "--run-dir", str(run_dir), env=cli_env(tmp_path / "cache"))
    assert_read_cleanly(status, "names daemon '../victim', not its own file")
    assert all(victim.read_text() == "keep me" for victim in victims)


def test_a_descriptor_that_is_a_symlink_is_not_followed(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(dead_descriptor()))
    (run_dir / "cpu-aaaaaaaaaaaa.json").symlink_to(elsewhere)
    status = wcache_in_process("status", "--json", "--run-dir", str(run_dir), env=cli_env(tmp_path / "cache"))
    assert_read_cleanly(status, "cpu-aaaaaaaaaaaa.json (it is a symlink)")
    assert json.loads(status.stdout)["stale_removed"] == [] and elsewhere.exists()


# -- the event log -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "shown"), [
    ('{"ts": NaN, "kind": "release"}', []), ('{"ts": 1e400, "kind": "release"}', []),
    ('{"ts": "noon", "kind": "release"}', []),
    # A field of the wrong shape: the line is not an event of its kind's schema, and is skipped like a torn one.
    ('{"ts": 1, "kind": "attach_hit", "timings_ms": [1, 2]}', []),
    ('{"ts": 1, "kind": "kind_of_a_later_version"}', []),
    ('{"ts": 1, "kind": "attach_hit", "timings_ms": {"total": 1' + "0" * 400 + '}}', []),
    ('{"ts": 1, "kind": "attach_miss", "diff": {"changed": "lm_head.weight"}}', []),
    # A miss's diff as a later version might write it (a field this one does not know, none of the counts): kept.
    ('{"ts": 1, "kind": "attach_miss", "diff": {"changed": ["lm_head.weight"], "renamed": ["a"]}}', ["attach_miss"]),
], ids=["nan-ts", "overflowing-ts", "string-ts", "list-timings", "unknown-kind", "400-digit-timing",
        "string-diff", "later-diff"])
def test_a_forged_event_line_is_skipped(line: str, shown: list[str], run_dir: Path, tmp_path: Path) -> None:
    # Before: each of these ended `top --once` with ValueError, OverflowError or AttributeError.
    good = json.dumps({"ts": 2.0, "kind": "stop", "daemon": "cpu-good"})
    events_path(run_dir).write_text(f"{line}\n{good}\n")
    results = readers(run_dir, tmp_path)
    for result in results:
        assert_read_cleanly(result, None)
    assert [e["kind"] for e in json.loads(results[2].stdout)["events"]] == [*shown, "stop"]


def test_the_event_log_as_a_symlink_is_not_appended_through(run_dir: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "someone-elses.log"
    target.write_text("untouched\n")
    events_path(run_dir).symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="wcache"):
        append_event(run_dir, Stop(daemon="cpu-x"))
    assert target.read_text() == "untouched\n"
    assert "it is a symlink" in caplog.text


def test_a_log_that_cannot_rotate_stays_bounded(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # A directory where the rotated generation goes: the rename fails. Before, the log grew without bound and
    # every event warned "Could not write" although it was written.
    limit = 4096
    monkeypatch.setenv("WCACHE_EVENTS_MAX_BYTES", str(limit))
    rotated_path(events_path(run_dir)).mkdir()
    (rotated_path(events_path(run_dir)) / "occupied").write_text("")
    line_bytes = len(msgspec.json.encode(append_event(run_dir, Stop(daemon="cpu-" + "x" * 80)))) + 1
    with caplog.at_level(logging.WARNING, logger="wcache"):
        for _ in range(20 * limit // line_bytes):
            append_event(run_dir, Stop(daemon="cpu-" + "x" * 80))
    assert events_path(run_dir).stat().st_size < limit + line_bytes
    assert "Could not write" not in caplog.text
    assert 1 <= caplog.text.count("Could not rotate") <= 20


def test_a_link_planted_where_a_descriptor_is_written_is_not_written_through(run_dir: Path, tmp_path: Path) -> None:
    descriptor = DaemonDescriptor.from_wire(dead_descriptor())
    target = tmp_path / "someone-elses.conf"
    target.write_text("untouched\n")
    (run_dir / f"{descriptor.name}.tmp-{os.getpid()}").symlink_to(target)
    with pytest.raises(OSError):
        write_descriptor(run_dir, descriptor)
    assert target.read_text() == "untouched\n" and not (run_dir / f"{descriptor.name}.json").exists()


def test_a_daemon_lock_goes_with_its_holder_and_a_waiting_taker_locks_the_file_made_after(run_dir: Path) -> None:
    """A training loop makes a daemon name per step: the holder removes its lock file when it lets go, and a
    process that opened that file before it went takes the lock on the file at the path, never on the one removed
    (two holders of one name would each think they own it)."""
    path = lock_path(run_dir, "cpu-aaaa")
    first = hold_daemon_lock(run_dir, "cpu-aaaa", "cpu")
    taken: list[int] = []
    taker = threading.Thread(target=lambda: taken.append(hold_daemon_lock(run_dir, "cpu-aaaa", "cpu")))
    taker.start()
    time.sleep(0.2)  # the taker has opened the file and waits for its lock
    release_daemon_lock(run_dir, "cpu-aaaa", first)
    taker.join(timeout=30)
    [second] = taken
    try:
        assert os.fstat(second).st_ino == os.stat(path).st_ino and lock_held(path)
    finally:
        release_daemon_lock(run_dir, "cpu-aaaa", second)
    assert not path.exists() and not lock_held(path)
    # Asking whether a missing lock is held leaves no file behind either.
    assert list(run_dir.iterdir()) == []
