"""What wcache prints about paths and run-dir files is true, and shown as text, never acted on by the terminal.

A dangling symlink exists (it is what the user must mend), so no message may say the path does not exist. A
forged record's fields (descriptors, loading records, events) may hold bidirectional controls (U+202E shows
text in another order than it is read), newlines (a forged line of output) and escape sequences: each reaches
the terminal escaped, in errors as in tables. And a directory vLLM loads is one wcache keys: dotfiles beside
the shards are not shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import assert_one_error_sentence, cli_env, wcache_in_process
from wcache.ipc.run_dir.loading import hold_record_lock, record_lock_path
from wcache.ipc.run_dir.paths import RunPaths
from wcache.monitor.events import events_path

HOSTILE = "\u202eevil\x1b[31m\nerror: forged line"
RAW = ("\u202e", "\x1b", "\nerror: forged")
# A stand-in for a loading rank: it holds its record's lock, as a rank does (a record whose lock is free is a
# dead rank's, removed by the next reader), and says so once it does.
HOLDS_ITS_LOCK = ("import os, sys, time; from wcache.ipc.run_dir.loading import hold_record_lock, record_lock_path; "
                  "from pathlib import Path; hold_record_lock(record_lock_path(Path(sys.argv[1]), os.getpid())); "
                  "print('locked', flush=True); time.sleep(60)")


@pytest.fixture
def template(tiny_template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_template, tmp_path / "tiny"))


def key(tmp_path: Path, path: Path) -> str:
    return assert_one_error_sentence(wcache_in_process("key", str(path), env=cli_env(tmp_path / "cache")))


# -- dangling symlinks -------------------------------------------------------------------------------------


def test_a_dangling_model_symlink_is_called_one(tmp_path: Path) -> None:
    # Was: "model does not exist." — it does; what it points at does not.
    link = tmp_path / "model"
    link.symlink_to(tmp_path / "gone")
    assert key(tmp_path, link).endswith(f"error: {link} is a symlink to {tmp_path / 'gone'}, which does not exist.")


def test_a_dangling_shard_symlink_is_called_one(tmp_path: Path, template: Path) -> None:
    # Was: "… lists shard X, which does not exist." — X is there, as a link to nothing.
    shard = sorted(template.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(tmp_path / "gone")
    line = key(tmp_path, template)
    assert f"lists shard {shard.name}, which is a symlink to {tmp_path / 'gone'}, which does not exist." in line


def test_a_dangling_single_file_symlink_is_called_one(tmp_path: Path, template: Path) -> None:
    # Was: "DIR holds neither model.safetensors nor model.safetensors.index.json." — it holds the first.
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(template / "config.json", single)
    (single / "model.safetensors").symlink_to(tmp_path / "gone")
    line = key(tmp_path, single)
    assert f"{single / 'model.safetensors'} is a symlink to {tmp_path / 'gone'}, which does not exist." in line


# -- shards in a directory without an index ----------------------------------------------------------------


def test_dotfiles_are_not_shards(tmp_path: Path, template: Path) -> None:
    # macOS copies leave `._NAME` beside every file; vLLM's glob skips dotfiles, and a directory it loads must
    # not be refused as holding its tensors twice.
    env = cli_env(tmp_path / "cache")
    (template / "model.safetensors.index.json").unlink()
    plain = wcache_in_process("key", str(template), "--json", env=env)
    assert plain.returncode == 0, plain.stderr
    for shard in sorted(template.glob("*.safetensors")):
        shutil.copy(shard, template / f"._{shard.name}")
    with_dotfiles = wcache_in_process("key", str(template), "--json", env=env)
    assert with_dotfiles.returncode == 0, with_dotfiles.stderr
    assert json.loads(with_dotfiles.stdout)["key"] == json.loads(plain.stdout)["key"]


# -- control characters from outside ------------------------------------------------------------------------


def test_an_error_echoes_a_path_on_one_line_escaped(tmp_path: Path) -> None:
    line = key(tmp_path, tmp_path / HOSTILE)
    assert not any(raw in line for raw in RAW), repr(line)
    assert "\\u202eevil\\x1b[31m\\x0aerror: forged line" in line


def test_forged_records_are_shown_escaped_in_tables(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / RunPaths.LOADING).mkdir(mode=0o700)
    me = os.getpid()
    record = {"pid": me, "pid_created": psutil.Process(me).create_time(), "source": f"/models/{HOSTILE}",
              "device": HOSTILE, "tp_size": 1, "tp_rank": 0, "supervisor_pid": None, "started": 1.0,
              "phase": HOSTILE, "done_bytes": 0, "total_bytes": 0, "name": HOSTILE}
    lock = hold_record_lock(record_lock_path(run_dir, me))
    (run_dir / RunPaths.LOADING / f"{me}.json").write_text(json.dumps(record))
    events_path(run_dir).write_text(json.dumps({"ts": 1.0, "kind": "attach_miss", "device": HOSTILE,
                                                "reason": HOSTILE}) + "\n")
    env = cli_env(tmp_path / "cache")
    try:
        status = wcache_in_process("status", "--run-dir", str(run_dir), env=env)
        top = wcache_in_process("top", "--once", "--interval", "0.1", "--run-dir", str(run_dir), env=env)
    finally:
        os.close(lock)
    for result in (status, top):
        assert result.returncode == 0, result.stderr
        assert not any(raw in result.stdout + result.stderr for raw in RAW), result.stdout
        assert "\\u202eevil" in result.stdout


def test_stop_names_a_forged_rank_escaped(tmp_path: Path) -> None:
    # `stop --all` stops ranks still loading and says which, by the name their record gives.
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / RunPaths.LOADING).mkdir(mode=0o700)
    rank = subprocess.Popen([sys.executable, "-c", HOLDS_ITS_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "locked\n"
        record = {"pid": rank.pid, "pid_created": psutil.Process(rank.pid).create_time(), "source": "/m",
                  "device": "cpu", "tp_size": 1, "tp_rank": 0, "supervisor_pid": None, "started": 1.0,
                  "phase": "loading", "done_bytes": 0, "total_bytes": 0, "name": f"[bold]{HOSTILE}"}
        (run_dir / RunPaths.LOADING / f"{rank.pid}.json").write_text(json.dumps(record))
        stop = wcache_in_process("stop", "--all", "--run-dir", str(run_dir), env=cli_env(tmp_path / "cache"))
        assert stop.returncode == 0, stop.stderr
        assert not any(raw in stop.stdout for raw in RAW), repr(stop.stdout)
        assert "stopped [bold]\\u202eevil" in stop.stdout  # markup in a name is shown, not applied
    finally:
        rank.kill()
        rank.wait()
