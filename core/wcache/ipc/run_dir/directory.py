"""The run directory: where daemons publish descriptors and sockets, checked before anything trusts it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from wcache.canonical import INT64_BITS, loads_finite
from wcache.checkpoint.provenance import FileDigest, Verdict
from wcache.errors import EXIT_OK, BadInputError, WcacheError, option
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.wire.framing import ProtocolError
from wcache.key.cache_key import WeightCacheKey
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


def check_run_dir(path: Path) -> Path:
    """Refuse a run dir that is a symlink, not ours, or open to group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RunDirError(f"run directory {path} does not exist.") from None
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


def ensure_run_dir(path: Path) -> Path:
    """Create the run dir (mode 0700) if needed, then check it."""
    if not path.exists() and not path.is_symlink():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise RunDirError(f"run directory {path} cannot be created ({exc.strerror}).") from None
    return check_run_dir(path)


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

    def __post_init__(self) -> None:
        # A pid of 0 or less would signal a process group, or every process we may signal.
        if not is_pid(self.pid) or not (self.supervisor_pid is None or is_pid(self.supervisor_pid)):
            raise ValueError(f"pid {self.pid} is not a process id")


def matches(descriptor: DaemonDescriptor, ident: str) -> bool:
    """Whether a user-given id names this daemon: a prefix of its name or of its key id."""
    return bool(ident) and (descriptor.name.startswith(ident) or descriptor.key_id.startswith(ident))


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


def hold_daemon_lock(run_dir: Path, name: str, device: str) -> int:
    """Own `<name>.lock` for this process's life (the returned descriptor), or DaemonExistsError naming the owner.

    One daemon per key and device: whoever holds the lock may replace a socket or descriptor of that name,
    nobody else. The lock file is never removed, so two processes can never lock two different files of the
    same name. The lock is also what says the daemon lives (`lock_held`): a lock is seen by every pid
    namespace that shares the run dir, a pid is not.
    """
    path = lock_path(run_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + _LOCK_RETRY_S
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                state = "serves" if descriptor_path(run_dir, name).exists() else "is loading"
                raise DaemonExistsError(f"daemon {name} (pid {owner}) already {state} this key on {device}; "
                                        "nothing more was started.") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def lock_taken_if_free(path: Path) -> Iterator[bool]:
    """True, holding the lock for the block, when no process holds `path`'s lock (or the file is missing);
    False when one does, in this pid namespace or any other sharing the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # missing, or a link no daemon could have locked (they open with O_NOFOLLOW)
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
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
    `limit` bytes; OSError or ValueError (FileNotFoundError when it is gone) for anything that is not such a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("it is a symlink") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("it is not a regular file")
        # One byte past the cap tells a file that is too large from one that fits exactly; nothing is parsed
        # before the size is known to be reasonable.
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is larger than {limit // 1024} KiB")
    return loads_finite(data, int_bits=INT64_BITS)


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
        except (OSError, ValueError, ProtocolError) as exc:
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
