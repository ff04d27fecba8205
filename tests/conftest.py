"""Shared fixtures: every test gets its own digest store; checkpoints are small real safetensors files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wcache.key.digest_store import RACY_WINDOW_NS
from wcache_dev.synth import write_checkpoint


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point WCACHE_CACHE_DIR at a private directory so tests never touch the user's digest store."""
    cache = tmp_path / "wcache-cache"
    monkeypatch.setenv("WCACHE_CACHE_DIR", str(cache))
    return cache


def wait_past_racy_window() -> None:
    """Sleep until files written now are old enough for their receipts to be trusted."""
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.1)


@pytest.fixture(scope="session")
def tiny_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint per session; copy it before modifying."""
    return write_checkpoint("tiny", tmp_path_factory.mktemp("template") / "tiny")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `wcache` entry point in a subprocess, with the test's environment."""
    return subprocess.run(
        [sys.executable, "-m", "wcache_cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh interpreter (for import and audit-hook checks)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
