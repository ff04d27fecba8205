"""`wcache preload` failures: one sentence, the right exit code, and no rank left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import WCACHE, cli_env, environment, processes_mentioning, wcache_process


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="wc-pf-", dir="/tmp"))
    yield path
    leftovers = processes_mentioning(str(path))
    for process in leftovers:
        process.kill()
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, "a failed preload left processes running"


def _preload(model: Path, run_dir: Path, *extra: str) -> tuple[int, str]:
    result = wcache_process("preload", str(model), "--detach", "--run-dir", str(run_dir), *extra)
    assert "Traceback" not in result.stderr
    return result.returncode, result.stderr.strip()


def test_missing_checkpoint_is_bad_input(run_dir: Path, tmp_path: Path) -> None:
    code, stderr = _preload(tmp_path / "nowhere", run_dir)
    assert code == 2
    assert stderr.startswith("error: rank 0:") and "nowhere" in stderr and stderr.count("\n") == 0


def test_a_failing_preload_on_a_pipe_prints_one_sentence_and_no_traceback(run_dir: Path, tmp_path: Path) -> None:
    """In the foreground with stderr a pipe (journald, `docker logs`, CI) the ranks share it. The supervisor
    stops every rank once one reports its failure, often while that rank is still reporting: the stop must
    not show as a KeyboardInterrupt traceback, nor break the JSON log stream. Runs side by side load the
    machine, which is what widens that window."""
    runs = [(log_format, subprocess.Popen(
        [*WCACHE, "preload", str(tmp_path / "nowhere"), "--run-dir", str(run_dir), "--log-format", log_format],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=environment(cli_env()))) for log_format in ("text", "json") * 4]
    said_by_each = [(log_format, process.communicate(timeout=120)[1], process.returncode)
                    for log_format, process in runs]
    for log_format, stderr, returncode in said_by_each:
        *logged, said = stderr.strip().splitlines()
        assert returncode == 2 and said.startswith("error: rank 0:") and "nowhere" in said, stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
        if log_format == "json":
            assert all(isinstance(json.loads(line), dict) for line in logged), stderr


def test_lying_header_names_the_shard(run_dir: Path, tiny_template: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tiny_template, tmp_path / "broken"))
    shard = sorted(broken.glob("*.safetensors"))[0]
    with shard.open("r+b") as f:
        f.write((10**6).to_bytes(8, "little"))  # a header longer than the file, under the size cap
    code, stderr = _preload(broken, run_dir)
    assert code == 2 and shard.name in stderr and "truncated" in stderr


def test_indivisible_tensor_parallel_stops_every_rank(run_dir: Path, tiny_template: Path) -> None:
    code, stderr = _preload(tiny_template, run_dir, "--tp", "3")
    assert code == 2 and "--tp 3" in stderr
    assert not list(run_dir.glob("*.sock")) and not list(run_dir.glob("cpu-*.json"))


def test_cuda_without_a_gpu_is_unavailable(run_dir: Path, tiny_template: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU-only refusal cannot be observed here")
    code, stderr = _preload(tiny_template, run_dir, "--device", "cuda")
    assert code == 3 and "no CUDA device" in stderr


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_health_host_beyond_loopback_is_warned_once(run_dir: Path, tiny_template: Path, host: str,
                                                    warned: bool) -> None:
    code, stderr = _preload(tiny_template, run_dir, "--health-host", host)
    try:
        assert code == 0, stderr
        warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
        assert warnings == ([f"warning: --health-host {host} serves /health, /metrics and /stats without "
                             "authentication to every network that reaches it."] if warned else []), stderr
    finally:
        wcache_process("stop", "--all", "--force", "--run-dir", str(run_dir))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and processes_mentioning(str(run_dir)):
            time.sleep(0.1)  # the supervisor exits once its rank has



# Put first on a rank's path, this makes its loader raise what no check expects: a bug, not the user's input.
_CRASHING_LOADER = '''
import importlib.abc, importlib.util, sys

class _Crash(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "wcache.load.loader":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)

            def load_rank(*args, **kwargs):
                raise RuntimeError("a bug in the loader")

            module.load_rank = load_rank

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Crash())
'''


def test_a_rank_that_crashes_is_unavailable_not_a_difference(run_dir: Path, tiny_template: Path,
                                                              tmp_path: Path) -> None:
    """Exit 1 means a check found a difference; a rank that crashed leaves no daemon: exit 3, one sentence."""
    import os

    from wcache.errors import EXIT_UNAVAILABLE

    (tmp_path / "sitecustomize.py").write_text(_CRASHING_LOADER)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = wcache_process("preload", str(tiny_template), "--detach", "--run-dir", str(run_dir),
                            env={"PYTHONPATH": path})
    assert result.returncode == EXIT_UNAVAILABLE, result.stderr
    assert result.stderr.strip().splitlines() == ["error: rank 0: RuntimeError: a bug in the loader."], result.stderr
    assert not list(run_dir.glob("*.sock")) and not list(run_dir.glob("cpu-*.json"))
