"""What backs a CPU arena: a sealed memfd, or an unnamed file in a directory the operator names for huge pages.

`WCACHE_ARENA_DIR` names a directory on a tmpfs mounted `huge=always` (or `within_size`) or on a hugetlbfs mount:
arenas are then unnamed files there (`O_TMPFILE`), given 2 MiB pages where the host's shmem gives memfds 4 KiB
ones. Linux write-seals only memfds, so such an arena is not sealed: engines get a read-only descriptor of it
(they map it copy-on-write, as they map a memfd) and the file has no name to be opened by. A directory on any
other filesystem is refused: an arena there would be written back to storage.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wcache.errors import BadInputError, UnavailableError

ARENA_DIR_ENV = "WCACHE_ARENA_DIR"
MOUNTS = Path("/proc/self/mounts")
THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
# Filesystems whose files are memory: the only ones an arena may live on.
MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
# tmpfs `huge=` values (and shmem_enabled values) that give a file written from its start huge pages.
HUGE_VALUES = ("always", "within_size", "force")


@dataclass(frozen=True, slots=True)
class Mount:
    """The mount a path is on: its mount point, filesystem type and options."""

    point: str
    fstype: str
    options: tuple[str, ...]

    def value_of(self, name: str) -> str | None:
        """The value of mount option `name=value`, or None."""
        return next((o.partition("=")[2] for o in self.options if o.startswith(f"{name}=")), None)


def mount_of(path: Path) -> Mount | None:
    """The mount holding `path` (the longest mount point that does), or None where the mount table is unreadable."""
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return None
    best: Mount | None = None
    target = os.path.realpath(path)
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fields[2], tuple(fields[3].split(",")))
    return best


def shmem_huge_setting() -> str | None:
    """The host's transparent huge page setting for shmem (what memfds get), or None where it cannot be read."""
    try:
        match = re.search(r"\[(\w[\w-]*)\]", THP_SHMEM.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def arena_dir() -> Path | None:
    """The directory the operator named for arenas, or None (memfds)."""
    value = os.environ.get(ARENA_DIR_ENV, "")
    return Path(value) if value else None


@dataclass(frozen=True, slots=True)
class Backing:
    """What arenas get: where they live, the filesystem, whether their pages are huge, whether they are sealed."""

    directory: Path | None
    fstype: str
    huge: bool
    sealed: bool

    def describe(self) -> str:
        pages = "2 MiB pages" if self.huge else "4 KiB pages"
        if self.directory is None:
            return f"sealed memfds, {pages} (shmem transparent huge pages '{shmem_huge_setting() or '?'}')"
        return (f"unnamed files in {self.directory} ({self.fstype}), {pages}, not write-sealed (Linux seals only "
                "memfds): engines get read-only descriptors")


def backing_of(directory: Path | None) -> Backing:
    """What an arena made now gets; BadInputError (one sentence) for a directory an arena cannot live in."""
    if directory is None:
        return Backing(None, "memfd", shmem_huge_setting() in HUGE_VALUES, True)
    if not directory.is_dir():
        raise BadInputError(f"{ARENA_DIR_ENV}={directory} is not a directory; create it on a tmpfs mounted "
                               "huge=always or on a hugetlbfs mount, or unset it.")
    mount = mount_of(directory)
    fstype = mount.fstype if mount is not None else "?"
    if mount is None or fstype not in MEMORY_FILESYSTEMS:
        raise BadInputError(f"{ARENA_DIR_ENV}={directory} is on {fstype}, not tmpfs or hugetlbfs: an arena there "
                               "would be written to storage; name a directory on a tmpfs mounted huge=always or on a "
                               "hugetlbfs mount, or unset it.")
    huge = fstype == "hugetlbfs" or mount.value_of("huge") in HUGE_VALUES
    return Backing(directory, fstype, huge, False)


def open_arena_file(directory: Path, total_bytes: int) -> int:
    """A read-write descriptor of a new unnamed file of `total_bytes` in `directory` (checked by backing_of)."""
    backing_of(directory)
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            # A filesystem without O_TMPFILE: a named file, unlinked at once.
            fd, name = tempfile.mkstemp(prefix=".wcache-arena-", dir=directory)
            Path(name).unlink()
        try:
            os.ftruncate(fd, total_bytes)
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise UnavailableError(f"no {total_bytes}-byte arena can be made in {ARENA_DIR_ENV}={directory} "
                               f"({exc.strerror}); free some memory there, or unset it.") from None
    return fd


def read_only_descriptor(fd: int) -> int:
    """A new read-only descriptor of the file `fd` is open on (what an engine gets of an unsealed arena)."""
    with contextlib.suppress(OSError):
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    raise UnavailableError("the arena cannot be reopened read-only (/proc is not mounted); engines cannot be given "
                           "it safely.")
