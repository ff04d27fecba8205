"""Shared fixtures: every test gets its own digest store; checkpoints are small real safetensors files."""

from __future__ import annotations

from pathlib import Path

import pytest
from wcache_dev.synth import write_checkpoint


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point WCACHE_CACHE_DIR at a private directory so tests never touch the user's digest store."""
    cache = tmp_path / "wcache-cache"
    monkeypatch.setenv("WCACHE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def tiny_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint per session; copy it before modifying."""
    return write_checkpoint("tiny", tmp_path_factory.mktemp("template") / "tiny")
