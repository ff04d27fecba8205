"""Arenas in the directory an operator names (WCACHE_ARENA_DIR) for huge pages: where they may live, what engines
get of them, and a daemon serving from one.

This machine has no tmpfs mounted huge=always and no hugetlb pages: the directory here is a plain tmpfs one
(/dev/shm), a huge=always mount is a mount table written for the test, and hugetlbfs' missing write() is
simulated. Whether the pages are then 2 MiB is the kernel's; `wcache doctor` reports what the mount promises.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import daemon_rig
from helpers import one_sentence
from wcache.attach import attach
from wcache.errors import BadInputError
from wcache.ipc.arenas import backing
from wcache.ipc.arenas.backing import ARENA_DIR_ENV, backing_of
from wcache.ipc.arenas.daemon_side import CpuArena
from wcache.ipc.arenas.engine_side import map_cpu_arena
from wcache_dev.synth import write_checkpoint

SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    mount = backing.mount_of(SHM)
    assert mount is not None and mount.fstype == "tmpfs", "these tests need /dev/shm on a tmpfs"
    where = Path(tempfile.mkdtemp(prefix="wcache-arena-test-", dir=SHM))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_memfds_unless_a_directory_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARENA_DIR_ENV, raising=False)
    chosen = backing_of(backing.arena_dir())
    assert chosen.directory is None and chosen.sealed and chosen.fstype == "memfd"
    assert "sealed memfds" in chosen.describe()


def test_a_directory_on_storage_or_missing_is_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"not tmpfs or hugetlbfs: an arena there would be written"):
        backing_of(tmp_path)  # the test's tmp dir is on the root filesystem, not memory
    with pytest.raises(BadInputError, match="is not a directory"):
        backing_of(tmp_path / "missing")


def test_huge_pages_follow_the_mount_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "mounts"
    huge, plain, hugetlb = tmp_path / "huge", tmp_path / "plain", tmp_path / "hugetlb"
    for path in (huge, plain, hugetlb):
        path.mkdir()
    table.write_text(f"/dev/vda / ext4 rw,relatime 0 0\ntmpfs {huge} tmpfs rw,size=4g,huge=always 0 0\n"
                     f"tmpfs {plain} tmpfs rw,size=4g 0 0\nnone {hugetlb} hugetlbfs rw,pagesize=2M 0 0\n")
    monkeypatch.setattr(backing, "MOUNTS", table)
    assert backing_of(huge).huge and not backing_of(huge).sealed
    assert not backing_of(plain).huge
    assert backing_of(hugetlb).huge and backing_of(hugetlb).fstype == "hugetlbfs"
    assert "2 MiB pages" in backing_of(huge).describe() and "read-only descriptors" in backing_of(huge).describe()


def test_an_arena_in_the_directory_is_unnamed_and_engines_get_it_read_only(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_DIR_ENV, str(shm_dir))
    arena = CpuArena(3 * 4096 + 5)
    try:
        assert not arena.sealable
        assert list(shm_dir.iterdir()) == []  # nothing to open it by
        arena.write_at(4096, memoryview(b"weights"))
        arena.seal()
        assert stat.S_IMODE(os.fstat(arena.fd).st_mode) == 0o400
        given = arena.engine_descriptor()
        with pytest.raises(OSError) as refused:
            os.pwrite(given, b"x", 0)
        assert refused.value.errno == errno.EBADF
        mapped = map_cpu_arena(given, arena.total_bytes, ())  # copy-on-write, as an engine maps a memfd
        try:
            assert mapped.mapping[4096:4103] == b"weights"
            mapped.mapping[4096:4097] = b"W"  # a private page: the shared bytes stay
        finally:
            mapped.mapping.close()
        with arena.bytes_at(4096, 7) as data:
            assert bytes(data) == b"weights"
    finally:
        arena.close()
    assert list(shm_dir.iterdir()) == []


def test_a_filesystem_without_write_is_filled_through_the_map(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_DIR_ENV, str(shm_dir))
    arena = CpuArena(8192)
    real_pwrite = os.pwrite

    def hugetlbfs_pwrite(fd: int, data: object, offset: int) -> int:
        if fd == arena.fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", hugetlbfs_pwrite)
    try:
        arena.write_at(100, memoryview(b"through the map"))
        with arena.bytes_at(100, 15) as data:
            assert bytes(data) == b"through the map"
    finally:
        arena.close()


def test_a_daemon_serves_from_an_arena_in_the_directory(shm_dir: Path) -> None:
    with daemon_rig() as rig:
        rig.env[ARENA_DIR_ENV] = str(shm_dir)
        model = write_checkpoint("tiny", rig.base / "tiny")
        [daemon] = rig.preload(model)
        held = [os.readlink(f"/proc/{daemon.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{daemon.pid}/fd")]
        assert any(link.startswith(f"{shm_dir}/") for link in held), held  # its arena is a file there
        assert not any(link.startswith("/memfd:wcache-arena") for link in held), held
        doctor = rig.cli("doctor", "--json", "--run-dir", str(rig.run_dir))
        assert f"unnamed files in {shm_dir} (tmpfs)" in doctor.stdout
        with attach(model, run_dir=rig.run_dir, fallback=False) as weights:
            assert weights.report.outcome == "hit"
        verified = rig.cli("verify", str(model), "--greedy", "--content", "--run-dir", str(rig.run_dir))
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert daemon.name in verified.stdout
        assert list(shm_dir.iterdir()) == []
        # A directory on storage: the rank refuses it in one sentence, as bad input, and nothing is left running.
        other = write_checkpoint("tiny", rig.base / "other", seed=5)
        refused = rig.cli("preload", str(other), "--detach", "--run-dir", str(rig.run_dir),
                          env={ARENA_DIR_ENV: str(rig.base)})
        assert refused.returncode == 2
        assert "not tmpfs or hugetlbfs" in one_sentence(refused.stderr)
