"""Helpers every benchmark script shares: a work directory, raw reads, preloads, and how numbers are printed."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from wcache.ipc.run_dir.directory import read_descriptors
from wcache.key.digest_store import RACY_WINDOW_NS

READ_CHUNK_BYTES = 16 * 1024 * 1024
# The store ignores receipts for files changed within this long of being hashed (racy-git rule).
RACY_WINDOW_S = RACY_WINDOW_NS / 1e9


@contextlib.contextmanager
def workspace(workdir: Path | None) -> Iterator[Path]:
    """The given directory (kept), or a temporary one removed afterwards."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir.absolute()
        return
    tmp = Path(tempfile.mkdtemp(prefix="wcache-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_all(paths: list[Path]) -> int:
    """Read every file start to end with large reads into one reused buffer; the bytes read."""
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def fmt_seconds(seconds: float) -> str:
    """A duration in µs, ms or s, whichever reads best."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:,.0f} µs"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def fmt_rate(rate: float) -> str:
    """Bytes per second as GB/s (10^9)."""
    return f"{rate / 1e9:,.2f} GB/s"


def speed_ratio(base: float, seconds: float) -> str:
    """How much faster (or slower) `seconds` is than `base`."""
    speed = base / seconds
    return f"{speed:,.1f}× faster" if speed >= 1 else f"{1 / speed:,.1f}× slower"


# -- daemons started through the CLI, as an operator would ---------------------------------------------------

STOP_GRACE_S = 10.0


def timed_preload(command: list[str], env: dict[str, str], run_dir: Path, spawned: list[psutil.Process],
                  on_start: Callable[[int], None] | None = None) -> tuple[float, dict[str, Any]]:
    """Run a `wcache preload --detach --json` command line; seconds from start to READY, and the READY fields.

    The daemons and supervisors it started are appended to `spawned`, for `stop_preloaded`.
    """
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               text=True, env=env)
    if on_start is not None:
        on_start(process.pid)
    ready: dict[str, Any] | None = None
    try:
        assert process.stdout is not None
        text = ""
        for line in process.stdout:  # the READY object, on one line or pretty-printed over several
            text += line
            with contextlib.suppress(ValueError):
                message = json.loads(text)
                text = ""
                if isinstance(message, dict) and "ranks" in message:
                    ready = message
                    break
        seconds = time.perf_counter() - began
        _, stderr = process.communicate(timeout=60)
    except BaseException:
        # Interrupted: the CLI stops its supervisor (and so the daemons) on SIGINT.
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_S)
        raise
    if ready is None or process.returncode != 0:
        raise RuntimeError(f"wcache preload failed (exit {process.returncode}): {stderr.strip()}")
    for descriptor in read_descriptors(run_dir):
        for pid in (descriptor.pid, descriptor.supervisor_pid):
            with contextlib.suppress(psutil.Error, TypeError):
                spawned.append(psutil.Process(pid))
    return seconds, ready


def stop_preloaded(cli: list[str], run_dir: Path, spawned: list[psutil.Process]) -> list[str]:
    """`wcache stop --all --force`, then kill whatever in `spawned` still runs (by pid, never by name).

    Returns one line per process that had to be killed.
    """
    if run_dir.exists():
        subprocess.run([*cli, "stop", "--all", "--force", "--run-dir", str(run_dir)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=60)
    alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    _, alive = psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    killed = []
    for process in alive:
        killed.append(f"pid {process.pid} outlived `wcache stop`; killed")
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    spawned.clear()
    return killed


def wcache_command() -> list[str]:
    """The `wcache` console script next to this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("wcache")
    found = str(beside) if beside.exists() else shutil.which("wcache")
    if found is None:
        raise SystemExit("cannot find the `wcache` command; install the project (pip install -e .)")
    return [found]


def benchmark_arguments(description: str, preset: str = "qwen3-0.6b",
                        presets: list[str] | None = None) -> argparse.ArgumentParser:
    """The options every benchmark of one checkpoint takes: --preset, --repeat, --workdir."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=preset, choices=presets, help=f"wcache_dev.synth preset ({preset})")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is shown")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: temp dir)")
    return parser


def preload_arguments(description: str) -> argparse.ArgumentParser:
    """The options every preload benchmark takes: --preset, --repeat, --workdir, --plan."""
    parser = benchmark_arguments(description)
    parser.add_argument("--plan", choices=("fused", "identity"), default="fused", help="processing plan (fused)")
    return parser
