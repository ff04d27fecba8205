"""vLLM at tensor parallel 2 (real CPU engines), and the vLLM API boundary (version check, one import module).

The TP 2 checkpoint is the `small-moe` preset (a Qwen3-MoE) with a vocabulary of 288 rows: vLLM pads it to 320
and gives each rank 160 (the plan must pad as vLLM does), its one key/value head is fewer than the two ranks
(vLLM replicates it), and each rank takes its slice of every expert's stacked projections. One `wcache verify
--greedy --engine vllm --tp 2` (two TP 2 engines, on the daemons' weights and vLLM's own disk load, one after
the other in one child) serves the hit, per-rank and zero-copy assertions; one more TP 2 engine, on a
checkpoint whose only daemons hold float32, serves the per-rank miss. vLLM's CPU workers need
VLLM_CPU_OMP_THREADS_BIND at TP 2 (one core each).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import DaemonRig, daemon_rig
from helpers import VLLM_IN_PYTEST, assert_one_error_sentence
from torch import nn
from wcache.integrations.vllm.runner import VllmResult, VllmRun, greedy_runs
from wcache.integrations.vllm.version import DISTRIBUTIONS, TESTED_RANGE
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.run_dir.engines import read_engine_descriptor
from wcache.plan.spec import PlanSpec, preload_command
from wcache.verify import default_prompts
from wcache_dev.synth import PRESETS, make_tensors, write_byte_tokenizer, write_checkpoint, write_tensors

ROOT = Path(__file__).resolve().parent.parent
NUM_PROMPTS = 2
MAX_NEW_TOKENS = 8
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
ODD_VOCAB = 288  # not a multiple of 64: vLLM pads it to 320 before splitting
# vLLM's Qwen3-MoE parameters for 4 layers: per layer qkv (fused), o, the q and k norms, two layer norms, the
# router and the two stacked expert projections (w13: gate and up fused, w2: down); embeddings, norm, lm_head.
PARAMETERS = 4 * 9 + 3


def _has_metadata(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def write_odd_vocab_checkpoint(dest: Path, seed: int = 0) -> Path:
    moe = PRESETS["small-moe"]
    preset = dataclasses.replace(moe, config={**moe.config, "vocab_size": ODD_VOCAB})
    path = write_tensors(make_tensors(preset, seed), preset.config, dest, preset.num_shards)
    write_byte_tokenizer(path, preset.config)
    return path


@dataclass
class Tp2Daemons:
    rig: DaemonRig
    model: Path
    daemons: list[DaemonDescriptor]  # by rank
    float32_only: Path  # another checkpoint whose only daemons hold float32 (vLLM asks for bfloat16)


@dataclass
class Tp2Rig:
    daemons: Tp2Daemons
    verify: dict[str, Any]  # `wcache verify --greedy --engine vllm --tp 2 --json`
    verify_events: list[dict[str, Any]]


@pytest.fixture(scope="module")
def tp2_daemons() -> Iterator[Tp2Daemons]:
    with daemon_rig() as rig:
        model = write_odd_vocab_checkpoint(rig.base / "odd-vocab")
        daemons = rig.preload(model, "--tp", "2")
        # Other bytes: a copy of the same bytes would be served by the bfloat16 daemons (the key is the content's).
        float32_only = write_odd_vocab_checkpoint(rig.base / "odd-vocab-float32", seed=1)
        rig.preload(float32_only, "--tp", "2", "--dtype", "float32")
        yield Tp2Daemons(rig, model, daemons, float32_only)


@pytest.fixture(scope="module")
def tp2(tp2_daemons: Tp2Daemons) -> Tp2Rig:
    rig = tp2_daemons.rig
    since = len(rig.events())
    result = rig.cli("verify", str(tp2_daemons.model), "--greedy", "--engine", "vllm", "--tp", "2", "--num-prompts",
                     str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS), "--run-dir", str(rig.run_dir),
                     "--json", timeout=900, env=TP2_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    return Tp2Rig(tp2_daemons, json.loads(result.stdout)["greedy"], rig.events()[since:])


def test_tp2_hit_gives_the_greedy_tokens_of_vllms_own_disk_load(tp2: Tp2Rig) -> None:
    greedy = tp2.verify
    assert greedy["all_match"], greedy
    assert all(len(p["cached_tokens"]) == MAX_NEW_TOKENS for p in greedy["prompts"])
    assert greedy["attach"]["outcome"] == "hit"


def test_tp2_each_rank_hits_its_own_daemon(tp2: Tp2Rig) -> None:
    hits = [e for e in tp2.verify_events if e["kind"] == "attach_hit" and e.get("engine") == "vllm"]
    daemons = [d.name for d in tp2.daemons.daemons]
    assert sorted(e["daemon"] for e in hits) == sorted(daemons), hits
    assert len({e["pid"] for e in hits}) == 2, "each rank attaches in its own worker process"
    assert [r["daemon"] for r in tp2.verify["attach"]["ranks"]] == daemons


def test_tp2_every_parameter_is_the_daemons_tensor_on_every_rank(tp2: Tp2Rig) -> None:
    # Including embed_tokens and lm_head (the vocabulary padded as vLLM pads it), qkv_proj (the replicated
    # key/value head) and the stacked experts (each rank's slice): nothing materialized, nothing copied.
    ranks = tp2.verify["attach"]["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["mode"] == "zero_copy"
        assert rank["assigned"] == rank["parameters"] == PARAMETERS and rank["copied"] == [], rank


@pytest.fixture(scope="module")
def tp2_miss(tp2_daemons: Tp2Daemons) -> VllmResult:
    """One TP 2 engine through `wcache` on the checkpoint whose only daemons hold float32."""
    rig = tp2_daemons.rig
    run = VllmRun(str(tp2_daemons.float32_only), default_prompts(NUM_PROMPTS), MAX_NEW_TOKENS,
                  load_format="wcache", extra_config={"run_dir": str(rig.run_dir)}, tensor_parallel_size=2)
    with pytest.MonkeyPatch.context() as environment:
        for name, value in {**TP2_ENV, "WCACHE_CACHE_DIR": rig.env["WCACHE_CACHE_DIR"]}.items():
            environment.setenv(name, value)  # greedy_runs hands this environment to vLLM
        [result] = greedy_runs([run], timeout=600)  # vLLM's default loader serves it, after the warnings
    return result


@pytest.mark.xdist_group("test_vllm_tp-miss")  # its engine overlaps the verify's two (tests/conftest.py)
def test_tp2_miss_is_explained_on_every_rank_with_the_command_that_serves_it(tp2_daemons: Tp2Daemons,
                                                                             tp2_miss: VllmResult) -> None:
    rig = tp2_daemons.rig
    assert [len(tokens) for tokens in tp2_miss.tokens] == [MAX_NEW_TOKENS] * NUM_PROMPTS
    command = preload_command(tp2_daemons.float32_only, PlanSpec(tp_size=2, dtype="bfloat16"))
    warnings = [line for line in tp2_miss.log.splitlines() if "wcache: weight cache miss" in line]
    assert {re.search(r"Worker_TP(\d)", line)[1] for line in warnings} == {"0", "1"}, warnings  # type: ignore[index]
    for line in warnings:
        assert "WARNING" in line and "dtype float32→bfloat16" in line and f"`{command}`" in line, line
        assert "falling back to disk loading" in line
    assert command == f"wcache preload {tp2_daemons.float32_only} --tp 2 --dtype bfloat16"
    misses = [e for e in rig.events("attach_miss") if e.get("engine") == "vllm"]
    assert len(misses) == 2 and all(e["diff"]["plan"]["dtype"] == ["float32", "bfloat16"] for e in misses), misses
    # Every rank announced its fallback, with the reason, for `wcache top` and `wcache status` (which drop the
    # announcements now that the ranks' processes are gone).
    announced = [read_engine_descriptor(path) for path in sorted((rig.run_dir / "engines").glob("*.json"))]
    fallbacks = [a for a in announced if a.engine == "vllm" and a.source == str(tp2_daemons.float32_only)]
    assert sorted(a.tp_rank for a in fallbacks) == [0, 1] and all(a.tp_size == 2 for a in fallbacks), announced
    for fallback in fallbacks:
        assert fallback.attach is not None and fallback.attach.outcome == "fallback" and fallback.url is None
        assert "float32" in (fallback.attach.reason or ""), fallback.attach


@pytest.mark.xdist_group("test_vllm_tp-miss")
def test_tp2_workers_leave_no_shared_memory_behind(tp2_miss: VllmResult) -> None:
    # vLLM names its CPU workers' all-reduce segments after their rendezvous file; they go only when the
    # workers exit on their own (the runner shuts each engine down and waits), never when they are signalled.
    [ident] = set(re.findall(r"distributed_init_method=file://\S*/(vllm_dist_\w+)", tp2_miss.log))
    assert sorted(Path("/dev/shm").glob(f"{ident}*")) == []
    assert "Executor: workers still running" not in tp2_miss.log


# -- no engine: the API boundary -----------------------------------------------------------------------------


@pytest.mark.xdist_group("test_vllm_tp-untested")
def test_an_untested_vllm_is_refused_with_one_sentence_at_start_up(tmp_path: Path) -> None:
    # The installed distribution's metadata says 0.40.0, found before the installed one, as after an upgrade of
    # the same build: vLLM tells its CPU build by that distribution's name (`vllm-cpu`), and told otherwise
    # would load kernels built for another CPU than this one.
    installed = next(name for name in DISTRIBUTIONS if _has_metadata(name))
    untested = "0.40.0"
    fake = tmp_path / "site" / f"{installed.replace('-', '_')}-{untested}.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {installed}\nVersion: {untested}\n")
    code = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from wcache.integrations.vllm import plugin
plugin.register()  # vLLM calls this in every process; it must not break vLLM for other load formats
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
for attempt in (lambda: get_model_loader(LoadConfig(load_format="wcache")),
                lambda: __import__("wcache.integrations.vllm.loader")):
    try:
        attempt()
    except Exception as exc:
        print(f"REFUSED {type(exc).__name__}: {exc}")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT / "core"), str(ROOT / "cli")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    sentence = (f"wcache's vLLM integration was tested with vLLM {TESTED_RANGE}, and vLLM {untested} is installed; "
                f"install a vLLM in that range (pip install 'vllm{TESTED_RANGE}') or a wcache that supports it.")
    refusals = [line for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert refusals == [f"REFUSED UnsupportedVllmError: {sentence}"] * 2, result.stdout
    assert f"wcache: {sentence}" in result.stdout  # the warning at registration


def test_the_tested_range_is_the_extras_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{TESTED_RANGE}"] and extras["vllm-cpu"] == [f"vllm-cpu{TESTED_RANGE}"]


def test_vllm_is_imported_only_through_vllm_api() -> None:
    # version.py registers the refusal through vLLM's plugin API
    allowed = {"core/wcache/integrations/vllm/api.py", "core/wcache/integrations/vllm/version.py"}
    offenders = [str(path.relative_to(ROOT)) for tree in ("core", "cli") for path in (ROOT / tree).rglob("*.py")
                 if str(path.relative_to(ROOT)) not in allowed
                 and re.search(r"^\s*(from|import) vllm\b", path.read_text(), re.M)]
    assert offenders == []


@VLLM_IN_PYTEST
def test_the_plans_vocab_padding_is_vllms() -> None:
    from wcache.integrations.vllm.api import DEFAULT_VOCAB_PADDING_SIZE
    from wcache.plan.fused_layout import VOCAB_PADDING

    assert VOCAB_PADDING == DEFAULT_VOCAB_PADDING_SIZE


@VLLM_IN_PYTEST
def test_parameters_go_to_meta_and_buffers_and_late_attributes_stay() -> None:
    import torch
    from wcache.integrations.placement import parameters_on_meta, same_kind

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = nn.Parameter(torch.empty(64, 32), requires_grad=False)
            self.register_parameter("weight", weight)
            weight.weight_loader = "set after registration, as vLLM's create_weights does"  # type: ignore[attr-defined]
            self.register_buffer("cache", torch.arange(4.0), persistent=False)

    with parameters_on_meta():
        layer = Layer()
    assert layer.weight.device.type == "meta" and torch.equal(layer.cache, torch.arange(4.0))
    assert layer.weight.weight_loader.startswith("set after registration")  # type: ignore[attr-defined]
    attached = same_kind(layer.weight, torch.ones(64, 32))
    assert attached.weight_loader.startswith("set after registration")  # type: ignore[attr-defined]
    assert nn.Linear(2, 2).weight.device.type == "cpu", "the patch ends with the build"


def test_verify_with_vllm_on_a_checkpoint_without_a_tokenizer_is_one_sentence(tmp_path: Path) -> None:
    from helpers import cli_env, wcache_in_process

    model = write_checkpoint("tiny", tmp_path / "no-tokenizer")
    result = wcache_in_process("verify", str(model), "--greedy", "--engine", "vllm", "--run-dir",
                               str(tmp_path / "run"), env=cli_env())
    assert_one_error_sentence(result, str(model), "has no tokenizer", "--engine reference")
