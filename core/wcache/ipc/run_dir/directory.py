"""The run directory: where daemons publish descriptors and sockets, checked before anything trusts it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from wcache.bounded_read import read_bounded
from wcache.canonical import INT64_BITS, loads_finite
from wcache.checkpoint.file_record import FileDigest, Verdict
from wcache.errors import EXIT_OK, BadInputError, WcacheError, option
from wcache.ipc.run_dir.paths import RunPaths
from wcache.key.cache_key import SHORT_ID_HEX, WeightCacheKey
from wcache.plan.spec import PlanSpec
from wcache.schema import Schema

log = logging.getLogger("wcache")

# AF_UNIX paths are limited to 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
# A descriptor holds a key, a plan and a model's config: kilobytes. Anything far larger is not one.
MAX_DESCRIPTOR_BYTES = 1 << 20
# Linux's PID_MAX_LIMIT: no pid is this large, so a file naming one was not written by a process of ours.
PID_LIMIT = 1 << 22
Pid = Annotated[int, msgspec.Meta(gt=0, lt=PID_LIMIT)]  # a field that names a process (is_pid, for a schema)


class RunDirError(BadInputError):
    """The run directory is missing, not ours, or readable by others."""


def default_run_dir() -> Path:
    """`WCACHE_RUN_DIR`, else `$XDG_RUNTIME_DIR/wcache`, else `/tmp/wcache-<uid>`."""
    override = os.environ.get("WCACHE_RUN_DIR")
    if override:
        return Path(override)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "wcache"
    return Path(f"/tmp/wcache-{os.getuid()}")


def _refuse_nul(path: Path) -> None:
    if "\0" in os.fspath(path):
        raise RunDirError(f"run directory {str(path)!r} holds a NUL byte, which no path can; choose another "
                          f"{option('run_dir')}.")


def check_run_dir(path: Path) -> Path:
    """Refuse a run dir that is a symlink, not ours, or open to group or others."""
    _refuse_nul(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RunDirError(f"run directory {path} does not exist.") from None
    except OSError as exc:  # a path through a regular file (ENOTDIR), one too long, one we may not search
        raise RunDirError(f"run directory {path} cannot be used ({exc.strerror}); choose another "
                          f"{option('run_dir')}.") from None
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"run directory {path} is a symlink; refusing to use it.")
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"run directory {path} is not a directory.")
    if st.st_uid != os.getuid():
        raise RunDirError(f"run directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}).")
    if st.st_mode & 0o077:
        raise RunDirError(
            f"run directory {path} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"use chmod 700 or another {option('run_dir')}."
        )
    return path


# A daemon's lock, socket, descriptor and loading record, and the logs: a run dir with fewer free inodes than this
# cannot take the next preload.
MIN_FREE_INODES = 16
# The longest device part of a daemon's name (`cuda15`): its socket path must fit AF_UNIX.
_LONGEST_DEVICE = "cuda:15"


def run_dir_unfit(path: Path) -> str | None:
    """Why the existing directory `path` cannot hold daemons, as a clause (read-only, no free inodes, socket paths
    too long for AF_UNIX), or None; what preload refuses before it starts and `wcache doctor` reports."""
    longest = RunPaths(path).socket(daemon_name(_LONGEST_DEVICE, "0" * SHORT_ID_HEX))
    if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
        return (f"its daemons' socket paths ({len(os.fsencode(longest))} bytes) would pass the {MAX_SOCKET_PATH} "
                "AF_UNIX allows")
    vfs = os.statvfs(path)
    if vfs.f_flag & os.ST_RDONLY:
        return "it is on a read-only mount"
    if vfs.f_files and vfs.f_favail < MIN_FREE_INODES:  # f_files 0: the filesystem does not count inodes
        return f"its filesystem has {vfs.f_favail} free inode(s), too few for a daemon's files"
    return None


def ensure_run_dir(path: Path) -> Path:
    """Create the run dir (mode 0700) if needed, then check it."""
    _refuse_nul(path)
    if not path.exists() and not path.is_symlink():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile, or a path through a regular file: the check says which
        except OSError as exc:
            raise RunDirError(f"run directory {path} cannot be created ({exc.strerror}).") from None
    return check_run_dir(path)


def ensure_daemon_run_dir(path: Path) -> Path:
    """`ensure_run_dir`, and refuse a run dir that cannot hold a daemon's files (`run_dir_unfit`): a preload
    says so before it starts, not after loading."""
    ensure_run_dir(path)
    unfit = run_dir_unfit(path)
    if unfit is not None:
        raise RunDirError(f"run directory {path} cannot hold daemons: {unfit}; choose another {option('run_dir')}.")
    return path


class DaemonDescriptor(Schema, frozen=True):
    """What a ready daemon publishes about itself; static for the daemon's life, but for `files` and `provenance`,
    published once more when a cold preload's SHA-256s are done after READY."""

    name: str
    pid: int
    pid_created: float
    device: str
    tp_size: int
    tp_rank: int
    key_id: str
    key: WeightCacheKey
    plan: PlanSpec
    config: dict[str, Any] | None
    source: str
    socket: str
    health_url: str | None
    supervisor_pid: int | None
    started: str
    weights_bytes: int
    files: tuple[FileDigest, ...] = ()  # each shard's size and SHA-256, as read by this daemon's pass
    provenance: Verdict | None = None  # the files against the Hugging Face cache (or --expected), at load
    # A version built from another daemon's arena and a delta: that daemon's key id and name (its lineage).
    parent_key_id: str | None = None
    parent: str | None = None
    # The checkpoint the lineage began from (its first daemon's source): what a version is named by, not the
    # delta file it was built from.
    origin: str | None = None

    @property
    def model_source(self) -> str:
        """The checkpoint a person names this daemon's model by: the lineage's origin, else its own source."""
        return self.origin or self.source

    def __post_init__(self) -> None:
        # A pid of 0 or less would signal a process group, or every process we may signal.
        if not is_pid(self.pid) or not (self.supervisor_pid is None or is_pid(self.supervisor_pid)):
            raise ValueError(f"pid {self.pid} is not a process id")


def matches(descriptor: DaemonDescriptor, ident: str) -> bool:
    """Whether a user-given id names this daemon: a prefix of its name or of its key id."""
    return bool(ident) and (descriptor.name.startswith(ident) or descriptor.key_id.startswith(ident))


def group_of(descriptor: DaemonDescriptor, live: Sequence[DaemonDescriptor]) -> list[DaemonDescriptor]:
    """The ranks one preload started together; a TP group only serves whole."""
    if descriptor.tp_size == 1 or descriptor.supervisor_pid is None:
        return [descriptor]
    return sorted((d for d in live if d.supervisor_pid == descriptor.supervisor_pid), key=lambda d: d.tp_rank)


def daemon_name(device: str, key_id: str) -> str:
    """File stem for a daemon: device and key, so two models on one device never collide."""
    return f"{device.replace(':', '')}-{key_id}"


def socket_path(run_dir: Path, name: str) -> Path:
    path = RunPaths(run_dir).socket(name)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise RunDirError(f"socket path {path} is longer than AF_UNIX allows; choose a shorter {option('run_dir')}.")
    return path


def descriptor_path(run_dir: Path, name: str) -> Path:
    return RunPaths(run_dir).descriptor(name)


def write_descriptor(run_dir: Path, descriptor: DaemonDescriptor) -> Path:
    """Write atomically (temp file, then rename), mode 0600."""
    final = descriptor_path(run_dir, descriptor.name)
    temporary = final.with_suffix(f".tmp-{os.getpid()}")
    # O_NOFOLLOW: a link planted at the temporary name would have the daemon write wherever it points.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(descriptor.to_wire(), f, indent=2)
    temporary.replace(final)
    return final


class DaemonExistsError(WcacheError):
    """A daemon for this key and device already runs (or is loading); nothing more was started. Not a failure."""

    exit_code = EXIT_OK


def lock_path(run_dir: Path, name: str) -> Path:
    return RunPaths(run_dir).lock(name)


# How long a starting daemon retries a lock that is busy: a reader deciding liveness holds it for microseconds.
_LOCK_RETRY_S = 0.5
# How often a rank waiting on another's load of the same key looks again.
_LOADING_POLL_S = 0.05


def hold_daemon_lock(run_dir: Path, name: str, device: str) -> int:
    """Own `<name>.lock` for this process's life (the returned descriptor), or DaemonExistsError naming the owner
    once it serves the key: while it is still loading, this waits for its outcome (a holder that fails frees the
    lock, and this process takes it).

    One daemon per key and device: whoever holds the lock may replace a socket or descriptor of that name,
    nobody else. Whoever holds it may also remove the lock file (`release_daemon_lock`: a training loop makes a
    name per step), so a lock taken on a file that is no longer the one at its path is let go and taken again on
    the file there now: two processes never hold two files of the same name. The lock is also what says the
    daemon lives (`lock_held`): a lock is seen by every pid namespace that shares the run dir, a pid is not.
    """
    path = lock_path(run_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + _LOCK_RETRY_S
    waiting = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if still_at(fd, path):
                    break
                os.close(fd)  # its holder removed it after we opened it: lock the file at the path now
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                continue
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if descriptor_path(run_dir, name).exists():
                    raise DaemonExistsError(f"daemon {name} (pid {owner}) already serves this key on {device}; "
                                            "nothing more was started.") from None
                # The holder is still loading (or stopping): its outcome is awaited, never taken for success. If
                # it publishes, this key is served; if it fails (a damaged delta claiming this key), the lock is
                # freed and this process loads the key itself.
                if not waiting:
                    log.info("daemon %s (pid %s) is loading this key on %s; waiting for its outcome", name, owner,
                             device)
                    waiting = True
                time.sleep(_LOADING_POLL_S)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_daemon_lock(run_dir: Path, name: str, fd: int) -> None:
    """Let go of `hold_daemon_lock`'s lock and remove its file, which only its holder may do: a loop that
    publishes a version per step would otherwise leave a lock file per step behind."""
    try:
        path = lock_path(run_dir, name)
        if still_at(fd, path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    finally:
        os.close(fd)


def still_at(fd: int, path: Path) -> bool:
    """Whether the file open at `fd` is the one at `path` (a lock file's holder may have removed it, and another
    taken its place): what every taker of a lock file checks once it holds the lock."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def lock_taken_if_free(path: Path) -> Iterator[bool]:
    """True, holding the lock for the block, when no process holds `path`'s lock; False when one does, in this
    pid namespace or any other sharing the file.

    A missing file is made and locked for the block, then removed again: otherwise a process taking the name
    meanwhile (`hold_daemon_lock`) could make and lock its own, and find what it just published removed by a
    caller that thought the name free."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError:  # a link no daemon could have locked (they open with O_NOFOLLOW), or a directory we may
            yield True   # not write: no daemon of ours holds it
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            if not still_at(fd, path):
                continue  # removed by its holder as we opened it: look at the file there now
            try:
                yield True
            finally:
                # Nobody held it: whoever comes next makes it again (as a daemon's own stop removes it).
                if still_at(fd, path):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            return
        finally:
            os.close(fd)  # releases the lock


def remove_daemon_files(run_dir: Path, name: str) -> None:
    paths = RunPaths(run_dir)
    for path in (paths.descriptor(name), paths.socket(name)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def is_pid(value: object) -> bool:
    """Whether `value` can be a process id: an int in 1..PID_LIMIT-1 (0 and less would signal process groups)."""
    return type(value) is int and 0 < value < PID_LIMIT


def process_created(pid: int) -> float | None:
    """The start time psutil reports for `pid`, or None when no such process runs."""
    import psutil  # here, not at the top: listing an empty run dir should not pay for it

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def process_exited(pid: int) -> bool:
    """Whether `pid` has exited, reaped or not: a process whose parent has not reaped it yet still has a start
    time (a rank whose server died is reparented to PID 1, which may reap it only later)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


def lock_held(path: Path) -> bool:
    """Whether a live process holds `path`'s lock: how wcache tells a running daemon or loading rank from a
    dead one. Never a pid lookup, which another pid namespace (a daemon in its own container sharing the run
    dir) answers wrongly."""
    with lock_taken_if_free(path) as free:
        return not free


def run_subdir(run_dir: Path, name: str) -> Path | None:
    """`<run dir>/<name>` when it is a directory of its own, else None; a symlink there is refused with a warning,
    never followed: what its records name (pids to signal, files to remove) would then come from anywhere."""
    path = run_dir / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("Ignoring %s (%s).", path, exc.strerror)
        return None
    if not stat.S_ISDIR(st.st_mode):
        log.warning("Ignoring %s: it is %s, not a directory.", path, "a symlink" if stat.S_ISLNK(st.st_mode)
                    else "not a directory")
        return None
    return path


def read_run_file(path: Path, limit: int) -> Any:
    """The JSON of a small file in the run dir, read without following a link, blocking on a FIFO or reading past
    `limit` bytes; OSError (FileNotFoundError when it is gone) or ValueError for anything that is not such a
    file."""
    return loads_finite(read_bounded(path, limit, follow_links=False), int_bits=INT64_BITS)


def read_descriptors(run_dir: Path) -> list[DaemonDescriptor]:
    """Every readable descriptor in the run dir, sorted by name; unreadable ones are warned about."""
    if not run_dir.exists():
        return []
    check_run_dir(run_dir)
    found = []
    for path in RunPaths(run_dir).descriptors():
        try:
            descriptor = DaemonDescriptor.from_wire(read_run_file(path, MAX_DESCRIPTOR_BYTES))
        except FileNotFoundError:
            continue  # removed by its daemon while we listed
        except (OSError, ValueError) as exc:  # unreadable, not JSON, or not a descriptor (SchemaError)
            log.warning("Ignoring unreadable daemon descriptor %s (%s).", path, getattr(exc, "strerror", None) or exc)
            continue
        # The name is what stale cleanup and `stop` turn back into paths: a descriptor must name its own file,
        # never `../elsewhere`, or cleaning it up would remove files outside the run dir.
        if descriptor.name != RunPaths.daemon_of(path):
            log.warning("Ignoring daemon descriptor %s: it names daemon %r, not its own file.", path, descriptor.name)
            continue
        found.append(descriptor)
    return found


@dataclass(frozen=True, slots=True)
class Census:
    """Live daemons, and the stale descriptors that were found (and removed) on the way."""

    live: tuple[DaemonDescriptor, ...]
    stale: tuple[DaemonDescriptor, ...]


def census(run_dir: Path, *, clean: bool = True) -> Census:
    """List daemons; descriptors of dead daemons are removed along with their sockets when `clean`.

    Dead is a lock nobody holds (`lock_held`); the files are removed while we hold it, so a daemon of the
    same name that starts meanwhile waits for us instead of losing the descriptor it just wrote.
    """
    live, stale = [], []
    for descriptor in read_descriptors(run_dir):
        with lock_taken_if_free(lock_path(run_dir, descriptor.name)) as free:
            if not free:
                live.append(descriptor)
                continue
            stale.append(descriptor)
            if clean:
                remove_daemon_files(run_dir, descriptor.name)
    return Census(tuple(live), tuple(stale))
