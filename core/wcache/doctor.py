"""`wcache doctor`: is this host right for wcache? Each check gives one finding: a status and one line that says
what was found and, when it is not right, what to do.

Statuses: "ok"; "warn" (wcache works, slower or with less safety); "fail" (something wcache needs is missing or
unsafe: a command would fail or fall back). Checks only read: nothing is created but a one-page memfd.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import resource
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from wcache.errors import WcacheError, option
from wcache.ipc.arenas.backing import ARENA_DIR_ENV, THP_SHMEM, arena_dir, backing_of, mount_of, shmem_huge_setting
from wcache.ipc.run_dir.directory import DaemonDescriptor, census, default_run_dir, run_dir_unfit
from wcache.key.digest_store import DB_NAME, default_store_dir, quick_check_read_only, untrusted_reason
from wcache.schema import Schema

if TYPE_CHECKING:
    from wcache.integrations.registry import EngineEntry

Status = Literal["ok", "warn", "fail"]
# A run dir with less free space than this cannot take the next daemon's lock, socket and descriptor (or logs).
MIN_RUN_DIR_FREE = 16 * 1024 * 1024
MEMINFO = Path("/proc/meminfo")
# What benchmarks/preload_floor.py measured on the 2-vCPU development VM (README, "Preload against its floor").
THP_COST = "on the development VM a 1.5 GB arena filled in 0.66 s without them, 0.11 s with them"
NVIDIA_VERSION = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    status: Status
    message: str  # what was found; for warn and fail, what to do


class DoctorOutput(Schema, frozen=True):
    """`wcache doctor --json`: whether every check passed (no "fail"), and each finding."""

    ok: bool
    findings: list[Finding]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point that holds it), or "?"."""
    mount = mount_of(path)
    return mount.fstype if mount is not None else "?"


def check_run_dir(run_dir: Path) -> Finding:
    """Owner, mode, filesystem and free space of the run dir (or of where it would be created)."""
    name = "run dir"
    try:
        st = os.lstat(run_dir)
    except FileNotFoundError:
        parent = next((p for p in run_dir.parents if p.exists()), Path("/"))
        free = os.statvfs(parent).f_bavail * os.statvfs(parent).f_frsize
        if free < MIN_RUN_DIR_FREE:
            return Finding(name, "fail", f"{run_dir} does not exist yet and {parent} has {_bytes(free)} free; free "
                           f"some space there or choose another {option('run_dir')}")
        return Finding(name, "ok", f"{run_dir} does not exist yet; preload creates it (mode 700) on "
                       f"{filesystem_of(parent)} with {_bytes(free)} free")
    except OSError as exc:
        return Finding(name, "fail", f"{run_dir} cannot be checked ({exc.strerror}); choose another "
                       f"{option('run_dir')}")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return Finding(name, "fail", f"{run_dir} is not a directory (or is a symlink); remove it or choose "
                       f"another {option('run_dir')}")
    if st.st_uid != os.getuid():
        return Finding(name, "fail", f"{run_dir} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                       "use a run dir of your own (WCACHE_RUN_DIR)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return Finding(name, "fail", f"{run_dir} is mode {mode:o}: group or others could plant sockets and "
                       f"descriptors there, so wcache refuses it; chmod 700 {run_dir}")
    vfs = os.statvfs(run_dir)
    free = vfs.f_bavail * vfs.f_frsize
    kind = filesystem_of(run_dir)
    unfit = run_dir_unfit(run_dir)
    if unfit is not None:
        return Finding(name, "fail", f"{run_dir} ({kind}) cannot hold daemons: {unfit}; choose another "
                       f"{option('run_dir')}")
    if free < MIN_RUN_DIR_FREE:
        return Finding(name, "fail", f"{run_dir} ({kind}) has {_bytes(free)} free, too little for a daemon's lock, "
                       f"socket, descriptor and logs; free some space or choose another {option('run_dir')}")
    return Finding(name, "ok", f"{run_dir}: yours, mode {mode:o}, {kind}, {_bytes(free)} free")


def check_memfd() -> Finding:
    """An arena is a sealed memfd: memfd_create, grow, and the seals that make it read-only for engines."""
    name = "memfd and seals"
    try:
        fd = os.memfd_create("wcache-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        return Finding(name, "fail", f"memfd_create is not available ({getattr(exc, 'strerror', exc)}); CPU arenas "
                       "need Linux 3.17 or later with memfd support")
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        return Finding(name, "fail", f"a memfd cannot be sealed ({exc.strerror}); engines could then change shared "
                       "weights, so wcache needs a kernel with memfd seals")
    finally:
        os.close(fd)
    if not seals & fcntl.F_SEAL_WRITE:
        return Finding(name, "fail", "a memfd's write seal did not hold; use a kernel with memfd seals")
    return Finding(name, "ok", "memfd_create and write seals work")


def _meminfo() -> dict[str, int]:
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in MEMINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return found


def check_shared_memory() -> Finding:
    """/dev/shm's free space and the memlock limit. wcache itself locks no memory; engines that pin host memory
    (CUDA copies) count against the limit, so it is reported, not judged."""
    name = "shared memory"
    parts = []
    try:
        vfs = os.statvfs("/dev/shm")
        parts.append(f"/dev/shm {_bytes(vfs.f_bavail * vfs.f_frsize)} free")
    except OSError:
        parts.append("no /dev/shm (arenas are memfds and do not need it)")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        parts.append("memlock unlimited")
    else:
        parts.append(f"memlock {_bytes(soft)} (wcache locks none; engines that pin host memory count against it)")
    return Finding(name, "ok", "; ".join(parts))


def check_huge_pages() -> Finding:
    """Transparent huge pages for shmem: without them an arena's fill faults once per 4 KiB page."""
    name = "huge pages"
    shmem = shmem_huge_setting()
    hugetlb = _meminfo().get("HugePages_Total", 0)
    tail = f"; {hugetlb} hugetlb pages reserved" if hugetlb else "; no hugetlb pages reserved"
    if shmem is None:
        return Finding(name, "warn", "transparent huge pages for shmem cannot be read; an arena's fill then faults "
                       f"per 4 KiB page{tail}")
    if shmem in ("never", "deny"):
        # An arena is a memfd filled by pwrite, never mapped first: only "always" or "within_size" give it
        # huge pages ("advise" needs a madvise on a mapping).
        return Finding(name, "warn", f"shmem transparent huge pages are '{shmem}': an arena's fill takes a page "
                       f"fault per 4 KiB page ({THP_COST}); echo within_size > {THP_SHMEM}, or name a directory on "
                       f"a tmpfs mounted huge=always in {ARENA_DIR_ENV}{tail}")
    if shmem == "advise":
        return Finding(name, "warn", f"shmem transparent huge pages are 'advise': arenas, filled by pwrite, get none "
                       f"and fault per 4 KiB page ({THP_COST}); echo within_size > {THP_SHMEM}{tail}")
    return Finding(name, "ok", f"shmem transparent huge pages '{shmem}'{tail}")


def check_arena_backing() -> Finding:
    """What arenas made now get: sealed memfds, or files in the directory the operator named for huge pages."""
    name = "arena backing"
    directory = arena_dir()
    try:
        backing = backing_of(directory)
    except WcacheError as exc:
        return Finding(name, "fail", str(exc))
    if directory is not None and not backing.huge:
        return Finding(name, "warn", f"{backing.describe()}; that directory gives no huge pages for the "
                       f"seal given up: mount it with huge=always, or unset {ARENA_DIR_ENV}")
    return Finding(name, "ok", backing.describe())


def _cgroup_memory_limit() -> tuple[str, int] | None:
    """This process's cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes) and where it was read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            mount, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        # A container mounts its own cgroup as the root: the group's path holds ancestors the mount does not,
        # so the longest tail of it that exists under the mount is this process's cgroup.
        parts = [p for p in group.split("/") if p]
        candidates = [mount.joinpath(*parts[i:], name) for i in range(len(parts) + 1)]
        for candidate in candidates:
            with contextlib.suppress(OSError, ValueError):
                text = candidate.read_text().strip()
                if text != "max" and int(text) < 1 << 60:
                    return str(candidate), int(text)
    return None


def check_cgroup(run_dir: Path) -> Finding:
    """The memory cgroup limit against what the daemons hold: a copy-mode engine's pages stay charged to the
    daemon's cgroup, and an arena past the limit is killed while it loads."""
    name = "cgroup memory"
    held = sum(d.weights_bytes for d in _live(run_dir))
    limit = _cgroup_memory_limit()
    if limit is None:
        return Finding(name, "ok", f"no memory cgroup limit; the daemons here hold {_bytes(held)}")
    where, value = limit
    if held > value * 0.9:
        return Finding(name, "fail", f"the cgroup limit {_bytes(value)} ({where}) leaves no room beyond the "
                       f"{_bytes(held)} the daemons here hold; raise it (MemoryMax=) before the next preload")
    available = _meminfo().get("MemAvailable")
    extra = f", {_bytes(available)} available" if available else ""
    return Finding(name, "ok", f"cgroup limit {_bytes(value)} ({where}); daemons here hold {_bytes(held)}{extra}")


def check_same_uid(run_dir: Path) -> Finding:
    """Engines attach only to daemons of their own uid."""
    name = "daemon owners"
    others = []
    for descriptor in _live(run_dir):
        with contextlib.suppress(OSError):
            uid = os.stat(f"/proc/{descriptor.pid}").st_uid
            if uid != os.getuid():
                others.append(f"{descriptor.name} (uid {uid})")
    if others:
        return Finding(name, "fail", f"daemons of another uid share this run dir: {', '.join(others)}; engines of "
                       f"uid {os.getuid()} will not attach to them: run them as this uid or use separate run dirs")
    return Finding(name, "ok", f"every daemon here runs as uid {os.getuid()}")


def _live(run_dir: Path) -> tuple[DaemonDescriptor, ...]:
    """The run dir's live daemons; none where it is missing or unusable (the run dir check says why)."""
    if not run_dir.is_dir():
        return ()
    try:
        return census(run_dir).live
    except WcacheError:
        return ()


def engine_findings() -> list[Finding]:
    """Each engine's finding (its range and its check, the registry's), under the engine's name."""
    from wcache.integrations.registry import REGISTRY

    gpu = has_nvidia_gpu()
    return [finding for entry in REGISTRY if (finding := _engine_finding(entry, gpu)) is not None]


def _engine_finding(entry: EngineEntry, gpu: bool) -> Finding | None:
    """An installed version outside the engine's range fails; otherwise the engine's own check says, or, for an
    engine without one, what is installed. None for an engine with neither a range nor a check."""
    from wcache.integrations.registry import doctor_check

    supported = entry.load_versions()
    installed = None if supported is None else supported.installed()
    if supported is not None and installed is not None and not supported.holds(installed[1]):
        (distribution, version), tested = installed, supported.range
        return Finding(entry.name, "fail", f"{distribution} {version} is outside the versions wcache is tested "
                       f"with ({tested}); install one of those (pip install '{distribution}{tested}')")
    check = doctor_check(entry)
    if check is not None:
        return Finding(entry.name, *check(gpu))
    if supported is None:
        return None
    if installed is None:
        return Finding(entry.name, "ok", f"{supported.distributions[0]} is not installed (only needed for "
                       f"{option('engine', entry.name)})")
    return Finding(entry.name, "ok", f"{installed[0]} {installed[1]} (tested: {supported.range})")


def has_nvidia_gpu() -> bool:
    """Whether this host has an NVIDIA GPU (its driver loaded, or its device node)."""
    return NVIDIA_VERSION.exists() or Path("/dev/nvidia0").exists()


def check_cuda() -> Finding:
    """The NVIDIA driver and CUDA IPC, where there is a GPU."""
    name = "cuda"
    if not has_nvidia_gpu():
        return Finding(name, "ok", "no NVIDIA GPU on this host (CPU arenas only)")
    driver = "?"
    with contextlib.suppress(OSError):
        match = re.search(r"Kernel Module\s+([\d.]+)", NVIDIA_VERSION.read_text())
        driver = match.group(1) if match else "?"
    try:
        import torch
    except ImportError:
        return Finding(name, "fail", f"NVIDIA driver {driver} but torch is not importable; reinstall wcache")
    if not torch.cuda.is_available():
        return Finding(name, "fail", f"NVIDIA driver {driver} but CUDA is not usable by torch {torch.__version__}; "
                       "check CUDA_VISIBLE_DEVICES and that the driver matches torch's CUDA")
    count = torch.cuda.device_count()
    return Finding(name, "ok", f"NVIDIA driver {driver}, {count} GPU(s) usable by torch {torch.__version__} "
                   f"(CUDA {torch.version.cuda}); CUDA arenas are shared by IPC handles")


def check_digest_store() -> Finding:
    """The store as it is, read only: a corrupt one is reported, never rebuilt here (the next key rebuilds it)."""
    name = "digest store"
    directory = default_store_dir()
    path = directory / DB_NAME
    untrusted = untrusted_reason(directory, path)
    if untrusted is not None:
        return Finding(name, "warn", f"{directory} is not used ({untrusted}); every key reads every byte again "
                       "until it is fixed")
    problem = quick_check_read_only(directory)
    if problem is not None:
        return Finding(name, "warn", f"{path} fails SQLite's check ({problem}); the next write rebuilds it, "
                       "or remove it")
    if not path.exists():
        return Finding(name, "ok", f"{path} does not exist yet; the first key creates it")
    return Finding(name, "ok", f"{path}: usable, {_bytes(path.stat().st_size)}")


def run_checks(run_dir: Path | None = None) -> list[Finding]:
    where = run_dir or default_run_dir()
    host: list[Callable[[], Finding]] = [
        lambda: check_run_dir(where), check_memfd, check_shared_memory, check_huge_pages, check_arena_backing,
        lambda: check_cgroup(where), lambda: check_same_uid(where),
    ]
    return [*(check() for check in host), *engine_findings(), check_cuda(), check_digest_store()]
