"""A read-only FUSE passthrough that sleeps in every operation, to emulate a remote filesystem's latency.

Network filesystems such as OSSFS or s3fs answer every ``stat``, ``open`` and ``read`` with a round trip
to a server. This module mirrors a local directory through FUSE (``fusepy``, libfuse 2) and sleeps
``--latency-ms`` milliseconds at the start of every FUSE request: lookup/getattr, access, open, read,
flush, release, opendir, readdir, releasedir, statfs, readlink, xattr calls, and the refused writes.

The kernel is told not to cache anything between requests: ``attr_timeout=0``, ``entry_timeout=0`` and
``negative_timeout=0`` make every path walk and every ``stat`` ask the daemon again, and ``kernel_cache``
and ``auto_cache`` stay off, so each ``open`` drops the file's cached pages and its data is read through
the daemon again (``--direct-io`` additionally bypasses the page cache within one open). The daemon is
multi-threaded, so requests issued concurrently overlap their sleeps, as they would on a real network.

Files keep their real inode numbers (``use_ino``) and nanosecond timestamps, so a cache keyed by
``(dev, inode, size, mtime_ns, ctime_ns)`` sees the same identity on every ``stat`` through one mount;
``st_dev`` is the mount's own device number and changes from one mount to the next.

Usage::

    python benchmarks/latencyfs.py SRC MOUNTPOINT --latency-ms 20      # foreground, Ctrl-C unmounts

    with mounted(Path("ckpt"), latency_ms=20) as mnt:                  # from Python
        ...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from fuse import FUSE, FuseOSError, Operations

# Operations that are bookkeeping inside the daemon, not requests from the kernel: they cost no trip.
_FREE_OPERATIONS: frozenset[str] = frozenset({"init", "destroy"})
_WRITE_FLAGS: int = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_EXCL
# Longer than any request holds the GIL, so waiting threads never force a switch (see main).
GIL_SWITCH_INTERVAL_S = 0.5


class LatencyPassthrough(Operations):  # type: ignore[misc]
    """Read-only mirror of ``root`` that sleeps ``latency_s`` before answering each request."""

    # Timestamps cross the fusepy boundary as integer nanoseconds, so mtime_ns/ctime_ns are exact.
    use_ns = True

    def __init__(self, root: Path, latency_s: float, trace: TextIO | None = None) -> None:
        self.root: Path = Path(root).resolve()
        self.latency_s: float = latency_s
        self.trace: TextIO | None = trace
        self._trace_lock = threading.Lock()

    def __call__(self, op: str, *args: Any) -> Any:
        if op in _FREE_OPERATIONS:
            return super().__call__(op, *args)
        if self.trace is not None:
            path = args[0] if args and isinstance(args[0], str) else ""
            with self._trace_lock:
                self.trace.write(f"{time.monotonic():.6f} {threading.get_native_id()} {op} {path}\n")
                self.trace.flush()
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        return super().__call__(op, *args)

    def _full(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    # -- metadata -------------------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        return {
            "st_mode": st.st_mode,
            "st_ino": st.st_ino,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_size": st.st_size,
            "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        if not os.access(self._full(path), amode):
            raise FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path: str) -> str:
        return str(self._full(path).readlink())

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        out = {key: getattr(sv, key) for key in keys}
        out.update(f_flag=sv.f_flag | os.ST_RDONLY, f_frsize=sv.f_frsize, f_namemax=sv.f_namemax)
        return out

    # -- directories ----------------------------------------------------------------------------------

    def opendir(self, path: str) -> int:
        if not self._full(path).is_dir():
            raise FuseOSError(errno.ENOTDIR)
        return 0

    def readdir(self, path: str, fh: int) -> list[str | tuple[str, dict[str, int], int]]:
        entries: list[str | tuple[str, dict[str, int], int]] = [".", ".."]
        with os.scandir(self._full(path)) as it:
            for entry in it:
                # Type bits and inode let the kernel fill d_type/d_ino without another getattr.
                mode = stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
                entries.append((entry.name, {"st_ino": entry.inode(), "st_mode": mode}, 0))
        return entries

    # -- files ----------------------------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        if flags & _WRITE_FLAGS:
            raise FuseOSError(errno.EROFS)
        return os.open(self._full(path), os.O_RDONLY | os.O_CLOEXEC)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def mount_options(*, direct_io: bool = False) -> dict[str, Any]:
    """FUSE mount options that keep the kernel from answering anything from its own caches."""
    options: dict[str, Any] = {
        "ro": True,
        "use_ino": True,
        "attr_timeout": 0,
        "entry_timeout": 0,
        "negative_timeout": 0,
        "fsname": "latencyfs",
    }
    if direct_io:
        options["direct_io"] = True
    return options


def serve(
    src: Path, mountpoint: Path, latency_ms: float, *, direct_io: bool = False, trace: Path | None = None
) -> None:
    """Mount ``src`` at ``mountpoint`` and serve in the foreground until unmounted or signalled.

    With ``trace``, one line per request (monotonic time, thread, operation, path) is appended to it.
    """
    if not src.is_dir():
        raise SystemExit(f"latencyfs: source {src} is not a directory")
    if not mountpoint.is_dir():
        raise SystemExit(f"latencyfs: mount point {mountpoint} is not a directory")
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(trace.open("a", encoding="utf-8")) if trace is not None else None
        FUSE(
            LatencyPassthrough(src, latency_ms / 1000.0, log),
            str(mountpoint),
            foreground=True,
            nothreads=False,
            **mount_options(direct_io=direct_io),
        )


# -- mounting from Python -----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it (libfuse then unmounts) if the parent dies first."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(libc_name, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _unmount(mountpoint: Path, *, lazy: bool = False) -> bool:
    """Unmount with fusermount3/fusermount (or umount); True when the command succeeded."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is not None:
        cmd = [tool, "-u", "-z", str(mountpoint)] if lazy else [tool, "-u", str(mountpoint)]
    else:
        cmd = ["umount", "-l", str(mountpoint)] if lazy else ["umount", str(mountpoint)]
    result = subprocess.run(cmd, capture_output=True, check=False)
    return result.returncode == 0


def fuse_available() -> str | None:
    """None when latencyfs can mount here, else one sentence saying what is missing."""
    if not Path("/dev/fuse").exists():
        return "/dev/fuse does not exist"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "neither fusermount3 nor fusermount is installed (apt-get install fuse3)"
    try:
        import fuse  # noqa: F401  (the import finds libfuse.so.2 or raises)
    except (ImportError, OSError) as exc:
        return f"fusepy cannot load libfuse 2 ({exc}); pip install fusepy and apt-get install libfuse2"
    return None


@contextlib.contextmanager
def mounted(
    src: Path,
    latency_ms: float,
    *,
    mountpoint: Path | None = None,
    direct_io: bool = False,
    trace: Path | None = None,
    timeout_s: float = 15.0,
) -> Iterator[Path]:
    """Serve ``src`` through latencyfs in a subprocess and yield the live mount point.

    On exit, even after an exception, the mount is unmounted (lazily if it is busy), the server process
    is ended, and a mount point this function created is removed.
    """
    made_dir = mountpoint is None
    mnt = Path(tempfile.mkdtemp(prefix="latencyfs-")) if mountpoint is None else mountpoint
    cmd = [sys.executable, str(Path(__file__).resolve()), str(src), str(mnt), "--latency-ms", str(latency_ms)]
    if direct_io:
        cmd.append("--direct-io")
    if trace is not None:
        cmd += ["--trace", str(trace)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent)
        try:
            deadline = time.monotonic() + timeout_s
            while not os.path.ismount(mnt):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    detail = log.read().decode(errors="replace").strip()
                    raise RuntimeError(f"latencyfs did not mount {src} at {mnt}: {detail or 'timed out'}")
                time.sleep(0.02)
            yield mnt
        finally:
            _stop(proc, mnt)
            if made_dir:
                with contextlib.suppress(OSError):
                    mnt.rmdir()


def _stop(proc: subprocess.Popen[bytes], mnt: Path) -> None:
    """Unmount ``mnt`` and end its server ``proc``, escalating until both are gone."""
    if os.path.ismount(mnt) and not _unmount(mnt):
        _unmount(mnt, lazy=True)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if os.path.ismount(mnt):
        _unmount(mnt, lazy=True)


def main(argv: list[str] | None = None) -> None:
    """Command line: mount SRC at MOUNTPOINT in the foreground."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="directory to mirror (read-only)")
    parser.add_argument("mountpoint", type=Path, help="empty directory to mount on")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="sleep per FUSE request (20)")
    parser.add_argument("--direct-io", action="store_true", help="bypass the page cache for reads within one open too")
    parser.add_argument("--trace", type=Path, default=None, help="append one line per request to this file")
    args = parser.parse_args(argv)
    # Each request is a thread that sleeps, then holds the GIL for microseconds. A thread waiting for the GIL
    # demands it anew every switch interval (5 ms): with a thousand requests in flight that polling, not the
    # requests, took the daemon's CPU (4,000 stats: 2.4 s of CPU, against 0.55 s with this interval).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    serve(args.src, args.mountpoint, args.latency_ms, direct_io=args.direct_io, trace=args.trace)


if __name__ == "__main__":
    main()
