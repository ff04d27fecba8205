"""Shared fixtures: every test gets its own digest store; checkpoints are small real safetensors files.

Also the suite's markers, set here by module so that a test file need not carry them (pyproject.toml
registers them): `vllm` for the modules that start real vLLM engines (named `test_vllm*`), `docs` for the man
page, completion and recipe checks, `e2e` for every module that starts real processes (daemons, engines, the
CLI, interpreters: its source uses one of `STARTERS`, or it is one of `E2E_MODULES`). Under pytest-xdist each
module is one group (`xdist_group`, for `--dist loadgroup`), so that its module-scoped daemons and engines
start once, on one worker (a long vLLM test whose engines share nothing with its module's names a group of
its own, so that they start beside the others, and the tests that import vLLM into pytest's process share
one, `helpers.VLLM_IN_PYTEST`, so that one worker imports it); the vLLM modules are collected first, so that
their engine starts, the longest waits, overlap the rest, and the modules that start no process last.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from wcache_dev.synth import write_checkpoint

# As measured (`--durations`): their engine starts are the suite's longest waits, so they start first.
VLLM_LONGEST_FIRST = ("test_vllm_tp.py", "test_vllm_formats.py", "test_vllm.py", "test_vllm_switch.py")
DOCS_MODULES = frozenset({"test_docs_fresh.py", "test_docs_pages.py", "test_deploy_recipes.py"})
# End to end without a starter in their own source: the TP engine's ranks are interpreters it spawns, and the
# trained checkpoint's test runs a whole training.
E2E_MODULES = frozenset({"test_engine_tp.py", "test_trained_checkpoint.py"})
# What starts a real process in a test module: the rigs and servers of the helper modules, the CLI and
# interpreter runners, and subprocess itself.
STARTERS = re.compile(r"\b(daemon_fixtures|engine_serving|as_nobody|wcache_process|run_python|subprocess)\b")


def _is_vllm(path: Path) -> bool:
    return path.name.startswith("test_vllm")


@functools.cache
def _module_marks(path: Path) -> tuple[str, ...]:
    marks = []
    if path.name in E2E_MODULES or STARTERS.search(path.read_text()):
        marks.append("e2e")
    if _is_vllm(path):
        marks.append("vllm")
    if path.name in DOCS_MODULES:
        marks.append("docs")
    return tuple(marks)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker and xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in _module_marks(item.path):
            item.add_marker(name)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=_start_order)  # stable: the order within each module stays


def _start_order(item: pytest.Item) -> tuple[int, int]:
    """The vLLM modules first, the longest first; then the other modules that start processes; then the rest,
    quick in-process tests that fill the workers' last minute. Each as collected within its rank."""
    if item.path.name in VLLM_LONGEST_FIRST:
        return 0, VLLM_LONGEST_FIRST.index(item.path.name)
    return (1 if "e2e" in _module_marks(item.path) else 2), 0


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point WCACHE_CACHE_DIR at a private directory so tests never touch the user's digest store."""
    cache = tmp_path / "wcache-cache"
    monkeypatch.setenv("WCACHE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Event times are local times of day: pin the zone so what `top` shows does not depend on the machine's."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(scope="session")
def tiny_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint per session; copy it before modifying."""
    return write_checkpoint("tiny", tmp_path_factory.mktemp("template") / "tiny")
