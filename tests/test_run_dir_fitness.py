"""A run dir that cannot hold daemons, on real mounts: read-only, out of inodes, or so deep that a daemon's socket
path passes AF_UNIX's 108 bytes. `wcache doctor` says so (not ok, and only reading), and preload refuses it in one
sentence before starting anything."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import assert_one_error_sentence, cli_env, mounted_tmpfs, wcache_in_process


def _check(run_dir: Path, tmp_path: Path, template: Path, words: str) -> None:
    env = cli_env(tmp_path / "cache")
    doctor = wcache_in_process("doctor", "--json", "--run-dir", str(run_dir), env=env)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    finding = next(f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "run dir")
    assert finding["status"] == "fail" and words in finding["message"], finding
    preload = wcache_in_process("preload", str(template), "--detach", "--run-dir", str(run_dir), env=env)
    assert words in assert_one_error_sentence(preload, str(run_dir), "--run-dir")


def test_a_read_only_run_dir(tmp_path: Path, tiny_template: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "size=1m,mode=700,ro") as mount:
        _check(mount, tmp_path, tiny_template, "read-only")


def test_a_run_dir_without_free_inodes(tmp_path: Path, tiny_template: Path) -> None:
    with mounted_tmpfs(tmp_path / "few", "size=1m,mode=700,nr_inodes=8") as mount:
        _check(mount, tmp_path, tiny_template, "free inode")


def test_a_run_dir_too_deep_for_a_socket(tmp_path: Path, tiny_template: Path) -> None:
    deep = Path("/tmp") / f"wc-deep-{os.getpid()}-{'d' * 80}"
    deep.mkdir(mode=0o700)
    try:
        _check(deep, tmp_path, tiny_template, "AF_UNIX")
    finally:
        deep.rmdir()


def test_doctor_reports_a_corrupt_digest_store_without_rebuilding_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    database = store / "digests.sqlite3"
    database.write_bytes(b"not a database " * 400)
    database.chmod(0o600)
    before = sorted(p.name for p in store.iterdir()), database.read_bytes()
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    doctor = wcache_in_process("doctor", "--json", "--run-dir", str(run_dir), env=cli_env(store))
    finding = next(f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "digest store")
    assert finding["status"] == "warn" and "fails SQLite's check" in finding["message"], finding
    assert (sorted(p.name for p in store.iterdir()), database.read_bytes()) == before  # nothing moved or rebuilt
