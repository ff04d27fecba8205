"""Every Python child wcache starts imports the installed package, whatever the working directory holds.

`python -m` puts the working directory first on `sys.path`; a `wcache/` package or `wcache.py` there would
run inside a daemon rank. The commands here run from such directories, with the CLI itself started as the
installed console script starts it (`-P`: no working directory on its path), and must neither execute the
planted code nor fail.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import (
    DaemonRig,
    daemon_rig,
    nothing_survives,  # noqa: F401
)
from helpers import CLI_TIMEOUT_S, environment, plant_wcache
from wcache.ipc.interpreter import python_module_argv
from wcache_dev.synth import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MARKER = "planted-code-ran"  # written by the planted package if anything imports it


@pytest.fixture
def rig() -> Iterator[DaemonRig]:
    with daemon_rig() as made:
        yield made


def _clone(where: Path) -> Path:
    """A directory holding a clone of this project named `wcache`: a namespace package without `__version__`.

    It shadows an editable install (found by a meta-path finder, after every `sys.path` entry), not a
    package on `PYTHONPATH` or in site-packages: this case fails without `-P` where the suite runs on the
    editable install."""
    where.mkdir()
    clone = where / "wcache"
    (clone / "core" / "wcache").mkdir(parents=True)
    (clone / "README.md").write_text("# wcache\n")
    (clone / "core" / "wcache" / "__init__.py").write_text("raise SystemExit('the clone was imported')\n")
    return where


def _wcache(cwd: Path, rig: DaemonRig, *args: str) -> subprocess.CompletedProcess[str]:
    # The console script's interpreter has no working directory on its path; `-m` would add one.
    return subprocess.run([sys.executable, "-P", "-m", "wcache_cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, env=environment(rig.env), timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)


def test_every_python_child_is_started_through_the_one_argv_helper() -> None:
    """No module of the library or CLI builds an interpreter command line of its own."""
    own = ROOT / "core" / "wcache" / "ipc" / "interpreter.py"
    offenders = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        if path == own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "executable" and \
                    isinstance(node.value, ast.Name) and node.value.id == "sys":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
    assert python_module_argv("wcache.daemon", "--x")[1:] == ["-P", "-m", "wcache.daemon", "--x"]


@pytest.mark.parametrize("layout", ["planted", "clone"])
def test_preload_from_a_directory_holding_wcache_runs_the_installed_package(rig: DaemonRig, layout: str) -> None:
    marker = rig.base / MARKER
    cwd = plant_wcache(rig.base / "cwd", marker) if layout == "planted" else _clone(rig.base / "cwd")
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    result = _wcache(cwd, rig, "preload", str(tiny), "--detach", "--json", "--run-dir", str(rig.run_dir))
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), marker.read_text()
    [rank] = json.loads(result.stdout)["ranks"]
    hit = _wcache(cwd, rig, "attach", str(tiny), "--no-fallback", "--json", "--run-dir", str(rig.run_dir))
    assert hit.returncode == 0, hit.stderr
    assert json.loads(hit.stdout)["outcome"] == "hit" and rank["name"] in hit.stdout
    assert not marker.exists(), marker.read_text()


def test_tp2_engine_ranks_from_a_directory_holding_wcache_run_the_installed_package(rig: DaemonRig) -> None:
    marker = rig.base / MARKER
    cwd = plant_wcache(rig.base / "cwd", marker)
    tiny = write_checkpoint("tiny", rig.base / "tiny")
    result = _wcache(cwd, rig, "attach", str(tiny), "--tp", "2", "--prompt", "hi", "--run-dir", str(rig.run_dir))
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), marker.read_text()
