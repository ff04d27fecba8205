"""Running a test's processes as uid 65534 ("nobody") when the tests themselves run as root.

Root reads any file and writes into any directory whatever its mode, so a permission case (an unreadable
shard, an unwritable store) proves nothing as root. Those tests instead run `wcache` or a snippet as uid
65534 inside a `nobody_tree()`: a fresh /tmp directory that uid can reach, and an environment of its own.
Where that uid cannot start this interpreter because a directory on the way to it is closed to others (a
pyenv or venv interpreter under /root, 0700), it runs a copy instead: the interpreter, its shared library and
its standard library hard-linked (or copied) into a /tmp directory, with a venv whose site-packages is this
venv's own, so the same code and packages run. Only when even that copy cannot run does `nobody_tree()` skip
the test with `NOT_RUNNABLE` and the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
NOT_RUNNABLE = "the interpreter itself is not runnable by uid 65534"


def run_as_nobody(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `command` after setgroups([]), setgid(65534), setuid(65534) in the child, before exec; a command
    that starts this interpreter starts the one uid 65534 can run (see the module's docstring)."""
    if command and command[0] == sys.executable:
        python, extra_env = nobody_python()
        command, env = [python, *command[1:]], {**env, **extra_env}
    return _run_as_nobody(command, env, cwd)


def _run_as_nobody(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
                          stdin=subprocess.DEVNULL, user=NOBODY, group=NOBODY, extra_groups=[])


# What uid 65534 imports must be the code under test: where a source directory on sys.path is closed to it,
# another install (an editable one elsewhere) could answer instead, and the test would prove nothing.
_WHERE = "import wcache, wcache_cli; print(wcache.__file__); print(wcache_cli.__file__)"


def _why_not_runnable(python: str, extra_env: dict[str, str]) -> str | None:
    import wcache
    import wcache_cli

    try:
        probe = _run_as_nobody([python, "-c", _WHERE], env={**os.environ, **extra_env}, cwd=Path("/"))
    except OSError as exc:  # exec refused, e.g. a directory on the way to the interpreter is closed to others
        return f"{python}: {exc.strerror}"
    if probe.returncode != 0:
        return f"{python} exited {probe.returncode}: {probe.stderr.strip()[-300:]}"
    if probe.stdout.split() != [wcache.__file__, wcache_cli.__file__]:
        return f"{python} imports {' and '.join(probe.stdout.split())}, not the code under test"
    return None


@functools.cache
def nobody_python() -> tuple[str, dict[str, str]]:
    """An interpreter uid 65534 can run with this venv's packages, and the environment it needs: this one,
    or else a copy of it under /tmp (removed when this process exits)."""
    # Cached: the answer cannot change within one run, and each probe starts an interpreter.
    if _why_not_runnable(sys.executable, {}) is None:
        return sys.executable, {}
    return _interpreter_copy()


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)  # same filesystem: instant, and the modes are the source's
    except OSError:
        shutil.copy2(source, dest)


def _interpreter_copy() -> tuple[str, dict[str, str]]:
    """The base interpreter, its libpython and its standard library in a 0755 /tmp directory, and a venv there
    whose site-packages is a link to this venv's (readable by all, like the source tree it points to)."""
    base = Path(tempfile.mkdtemp(prefix="wcache-nobody-python-", dir="/tmp"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    base.chmod(0o755)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    binary = os.path.realpath(sys.executable)
    (base / "bin").mkdir(mode=0o755)
    _link_or_copy(binary, str(base / "bin" / version))
    libdir = base / "lib"
    libdir.mkdir(mode=0o755)
    library = sysconfig.get_config_var("INSTSONAME") or ""
    source_libdir = sysconfig.get_config_var("LIBDIR") or ""
    if library and os.path.exists(os.path.join(source_libdir, library)):
        _link_or_copy(os.path.join(source_libdir, library), str(libdir / library))
    shutil.copytree(os.path.join(sys.base_prefix, "lib", version), libdir / version, copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns("site-packages", "test"))
    venv = base / "venv"
    (venv / "bin").mkdir(mode=0o755, parents=True)
    (venv / "lib" / version).mkdir(mode=0o755, parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {base / 'bin'}\ninclude-system-site-packages = false\n")
    (venv / "bin" / "python").symlink_to(base / "bin" / version)
    site_packages = sysconfig.get_path("purelib")
    (venv / "lib" / version / "site-packages").symlink_to(site_packages)
    for directory in (base / "bin", libdir, venv, venv / "bin", venv / "lib", venv / "lib" / version):
        directory.chmod(0o755)  # whatever the umask; copytree gave the rest their source's modes
    # The binary looks for libpython under its build prefix first (RUNPATH), which is what is closed.
    extra_env = {"LD_LIBRARY_PATH": str(libdir)}
    python = str(venv / "bin" / "python")
    problem = _why_not_runnable(python, extra_env)
    if problem is not None:
        pytest.skip(f"{NOT_RUNNABLE} ({sys.executable}, nor a copy of it: {problem})")
    return python, extra_env


@contextlib.contextmanager
def nobody_tree() -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh /tmp directory (0755) uid 65534 can reach, and an environment for that uid whose HOME, store
    (WCACHE_CACHE_DIR, under HOME; a caller that wants the store elsewhere overwrites it in the env before
    running anything) and run dir are its own; afterwards everything in it is handed back to root, opened
    up and removed. Skips the test if uid 65534 cannot run this interpreter."""
    nobody_python()  # skips the test if neither this interpreter nor a copy of it runs as uid 65534
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
