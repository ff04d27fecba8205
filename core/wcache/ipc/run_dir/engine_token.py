"""An engine's control token: the secret a request that changes what the engine serves must carry.

Each serving engine writes a fresh token to `<run dir>/engines/<pid>.token`, created with O_EXCL and mode 0600
inside the run dir (the user's own, 0700), so only the engine's user (and root) can read it, and removes it when
it stops. An operator who wants a group to switch the engine gives it a token file of their own instead
(`WCACHE_ENGINE_TOKEN_FILE`, readable by that group and closed to others); the engine still copies it into
its run dir for its own user's clients.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from wcache.errors import BadInputError
from wcache.ipc.run_dir.paths import RunPaths

TOKEN_FILE_ENV = "WCACHE_ENGINE_TOKEN_FILE"  # an operator's token file, for the engine and its clients alike
MAX_TOKEN_FILE_BYTES = 4096
MIN_TOKEN_CHARS = 16  # a shorter secret can be guessed over a port anyone on the host reaches


class TokenFileError(BadInputError):
    """A token file that cannot be used: missing, not a plain file, open to others, or holding no token."""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def write_engine_token(run_dir: Path, pid: int, token: str) -> Path:
    """`token` in the engine `pid`'s token file, made new (O_EXCL, 0600): a file already there, from a killed
    engine whose pid this one reuses, is removed first rather than written through."""
    paths = RunPaths(run_dir)
    paths.engines.mkdir(mode=0o700, exist_ok=True)
    path = paths.engine_token(pid)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def read_token_file(path: Path) -> str:
    """The token in `path`: a regular file closed to others (no bit for "other"), of at most 4 KiB, holding one
    line of at least 16 printable ASCII characters (no spaces). FileNotFoundError when it is missing; else
    TokenFileError (one sentence) for anything that is not such a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise TokenFileError(f"token file {path} cannot be read ({why}).") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"token file {path} is not a regular file.")
        if st.st_mode & 0o007:
            raise TokenFileError(f"token file {path} is open to others (mode {stat.S_IMODE(st.st_mode):o}); "
                                 "chmod o-rwx it.")
        data = f.read(MAX_TOKEN_FILE_BYTES + 1)
    token = data.strip()
    if len(data) > MAX_TOKEN_FILE_BYTES or not _printable(token):
        raise TokenFileError(f"token file {path} does not hold one line of printable ASCII of at most "
                             f"{MAX_TOKEN_FILE_BYTES} bytes.")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(f"token file {path} holds a token shorter than {MIN_TOKEN_CHARS} characters.")
    return token.decode()


def _printable(token: bytes) -> bool:
    return all(0x21 <= b <= 0x7E for b in token)


def operator_token() -> str | None:
    """The token in the operator's token file (`WCACHE_ENGINE_TOKEN_FILE`), None when that is not set."""
    value = os.environ.get(TOKEN_FILE_ENV)
    if not value:
        return None
    try:
        return read_token_file(Path(value))
    except FileNotFoundError:
        raise TokenFileError(f"token file {value} ({TOKEN_FILE_ENV}) does not exist.") from None


def engine_token() -> str:
    """The token an engine starting now serves under: the operator's, else a new one."""
    return operator_token() or new_token()
