"""Reading a file a user or the run dir names, trusting nothing about what it is: open() never blocks (a FIFO in
its place is refused, not waited on), nothing but a regular file is read (a device such as /dev/zero would be read
until memory runs out), and no more than a cap is read.

Every refusal is an OSError whose `strerror` is a clause for the caller's sentence ("it is not a regular file").
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

CHUNK_BYTES = 1 << 20
# What a user names to be read whole (expected digests, a saved key file, prompts) is megabytes at most: a key
# file of an 11,000-tensor checkpoint is about 2 MiB.
MAX_NAMED_FILE_BYTES = 64 << 20


def open_regular(path: Path, *, follow_links: bool = True) -> int:
    """A read-only descriptor of the regular file at `path` (the caller closes it), opened without blocking.

    OSError as `os.open` raises it; or ELOOP ("it is a symlink") where `follow_links` is off and it is one, and
    EINVAL ("it is not a regular file") for a FIFO, device, socket or directory.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise OSError(errno.ELOOP, "it is a symlink", str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The whole regular file at `path`, at most `limit` bytes of it: OSError EFBIG ("it is larger than …") for
    a larger one, and as `open_regular` for what is not such a file."""
    fd = open_regular(path, follow_links=follow_links)
    try:
        return read_bounded_fd(fd, limit, str(path))
    finally:
        os.close(fd)


def read_named_text(path: Path, limit: int = MAX_NAMED_FILE_BYTES) -> str:
    """A text file the user named, as UTF-8: OSError as `read_bounded` raises it, UnicodeDecodeError."""
    return read_bounded(path, limit).decode("utf-8")


def read_bounded_fd(fd: int, limit: int, name: str = "") -> bytes:
    """What is left to read of `fd`, at most `limit` bytes: OSError EFBIG past that."""
    chunks, size = [], 0
    # One byte past the cap tells a file that is too large from one that fits exactly.
    while size <= limit and (chunk := os.read(fd, min(CHUNK_BYTES, limit + 1 - size))):
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise OSError(errno.EFBIG, f"it is larger than {shown_size(limit)}", name)
    return b"".join(chunks)


def unreadable_why(exc: OSError | UnicodeDecodeError) -> str:
    """Why a named file could not be read, as a clause: its OSError's words, or that it is not UTF-8 text."""
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    return exc.strerror or str(exc)


def shown_size(nbytes: int) -> str:
    """A cap in words: 64 MiB, 1 KiB, 300 bytes."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"
