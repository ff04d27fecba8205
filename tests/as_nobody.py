"""Running a test's processes as uid 65534 ("nobody") when the tests themselves run as root.

Root reads any file and writes into any directory whatever its mode, so a permission case (an unreadable
shard, an unwritable store) proves nothing as root. Those tests instead run `wcache` or a snippet as uid
65534 inside a `nobody_tree()`: a fresh /tmp directory that uid can reach, and an environment of its own.
Where that uid cannot even start this interpreter (a directory on the way to it is closed to others, as
under /root), `nobody_tree()` skips the test with `NOT_RUNNABLE` and the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
NOT_RUNNABLE = "the interpreter itself is not runnable by uid 65534"


def run_as_nobody(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `command` after setgroups([]), setgid(65534), setuid(65534) in the child, before exec."""
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
                          stdin=subprocess.DEVNULL, user=NOBODY, group=NOBODY, extra_groups=[])


@functools.cache
def why_nobody_cannot_run_python() -> str | None:
    """None if uid 65534 can start this interpreter; otherwise what stopped it."""
    # Cached: the answer cannot change within one run, and each probe starts an interpreter.
    try:
        probe = run_as_nobody([sys.executable, "-c", "pass"], env=dict(os.environ), cwd=Path("/"))
    except OSError as exc:  # exec refused, e.g. a directory on the way to the interpreter is closed to others
        return f"{sys.executable}: {exc.strerror}"
    if probe.returncode != 0:
        return f"{sys.executable} exited {probe.returncode}: {probe.stderr.strip()[-300:]}"
    return None


@contextlib.contextmanager
def nobody_tree() -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh /tmp directory (0755) uid 65534 can reach, and an environment for that uid whose HOME, store
    (WCACHE_CACHE_DIR, under HOME; a caller that wants the store elsewhere overwrites it in the env before
    running anything) and run dir are its own; afterwards everything in it is handed back to root, opened
    up and removed. Skips the test if uid 65534 cannot run this interpreter."""
    problem = why_nobody_cannot_run_python()
    if problem is not None:
        pytest.skip(f"{NOT_RUNNABLE} ({problem})")
    # Not pytest's tmp_path: that lies under root's private (0700) pytest directory, which uid 65534 cannot enter.
    base = Path(tempfile.mkdtemp(prefix="wcache-nobody-", dir="/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home"
        for directory in (home, home / "run"):
            directory.mkdir(mode=0o700)
            os.chown(directory, NOBODY, NOBODY)
        # Nothing of root's own setup leaks in: no debug output, no XDG dirs, root's store and run dir replaced.
        env = {k: v for k, v in os.environ.items() if k != "WCACHE_DEBUG" and not k.startswith("XDG_")}
        env.update(HOME=str(home), WCACHE_CACHE_DIR=str(home / "cache"), WCACHE_RUN_DIR=str(home / "run"),
                   NO_COLOR="1", COLUMNS="200", PYTHONDONTWRITEBYTECODE="1")
        yield base, env
    finally:
        for root, dirs, files in os.walk(base):
            for name in dirs + files:
                path = os.path.join(root, name)
                os.lchown(path, 0, 0)
                if not os.path.islink(path):
                    os.chmod(path, 0o700 if name in dirs else 0o600)
        shutil.rmtree(base)
    assert not base.exists(), base


def open_to_all(tree: Path) -> None:
    """Directories 0755 and files 0644, so another uid can read the whole tree."""
    tree.chmod(0o755)
    for path in tree.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
