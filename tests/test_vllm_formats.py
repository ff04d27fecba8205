"""Real vLLM engines (the CPU build) attach pre-quantized and mixture-of-experts checkpoints through `wcache`.

One module-wide rig: a daemon per checkpoint (compressed-tensors W8A8 int8 and fp8, and a Qwen3-MoE), each
preloaded with the default fused plan. Each configuration gets two engines, `load_format="auto"` and a
`wcache` hit with fallback off, all six started one after another in one child that imports vLLM once
(`greedy_runs`), once for the module. The mixture of experts at TP 2 is tests/test_vllm_tp.py's checkpoint.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_fixtures import DaemonRig, copy_checkpoint, daemon_rig, nothing_survives  # noqa: F401
from helpers import VLLM_IN_PYTEST
from wcache.checkpoint.files import locate
from wcache.integrations.vllm.runner import VllmResult, VllmRun, greedy_runs
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.key.fingerprint import fingerprint_checkpoint
from wcache.plan import family
from wcache.plan.family import ModelDims, UnsupportedPlanError
from wcache.plan.processing import build_plan
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS as DEV_PRESETS
from wcache_dev.synth import write_checkpoint

PROMPTS = ["the weights cache keeps", "a daemon holds the shard and"]
MAX_NEW_TOKENS = 8
# Configuration → the dev preset that writes its checkpoint.
# vLLM's own per-tensor fp8 format (dev preset small-fp8-tensor) is absent: vLLM CPU here fails in its own
# disk load of it (this build's _C::static_scaled_fp8_quant takes no arguments).
PRESETS = {"int8-w8a8": "small-w8a8", "fp8-w8a8": "small-fp8", "moe": "small-moe"}


@dataclass
class FormatsRig:
    rig: DaemonRig
    checkpoints: dict[str, Path]
    daemons: dict[str, DaemonDescriptor]

    @functools.cached_property
    def runs(self) -> dict[str, tuple[VllmResult, VllmResult]]:
        """Per configuration, vLLM's own disk load and a wcache hit (fallback off): one child for them all."""
        extra = {"run_dir": str(self.rig.run_dir), "fallback": False}
        runs = [run for path in map(str, self.checkpoints.values())
                for run in (VllmRun(path, PROMPTS, MAX_NEW_TOKENS),
                            VllmRun(path, PROMPTS, MAX_NEW_TOKENS, load_format="wcache", extra_config=extra))]
        results = greedy_runs(runs, timeout=600)
        return {configuration: (results[2 * i], results[2 * i + 1]) for i, configuration in enumerate(self.checkpoints)}


@pytest.fixture(scope="module")
def formats_rig() -> Iterator[FormatsRig]:
    with daemon_rig() as rig, pytest.MonkeyPatch.context() as environment:
        checkpoints = {c: write_checkpoint(preset, rig.base / preset) for c, preset in PRESETS.items()}
        daemons = {c: rig.preload(path)[0] for c, path in checkpoints.items()}
        # greedy_runs hands this process's environment to vLLM: the rig's digest store.
        environment.setenv("WCACHE_CACHE_DIR", rig.env["WCACHE_CACHE_DIR"])
        yield FormatsRig(rig, checkpoints, daemons)


def _hit_line(result: VllmResult) -> str:
    [line] = [line for line in result.log.splitlines() if "wcache: weight cache hit" in line]
    return line


@pytest.mark.parametrize("configuration", ["int8-w8a8", "fp8-w8a8"])
def test_pre_quantized_checkpoint_hits_with_the_tokens_of_vllms_disk_load(formats_rig: FormatsRig,
                                                                          configuration: str) -> None:
    auto, hit = formats_rig.runs[configuration]
    assert hit.tokens == auto.tokens and len(set(map(tuple, auto.tokens))) == len(PROMPTS)
    line = _hit_line(hit)
    assert f"from daemon {formats_rig.daemons[configuration].name}" in line and "zero-copy views" in line
    # Codes and per-channel scales alike are the daemon's tensors; only the attention's KV-cache scales,
    # which the checkpoint does not hold, keep vLLM's initial values.
    assert "none was materialized" in line, line
    assert "kept vLLM's initial values, as from disk" in line, line
    # vLLM's post-processing ran over the daemon's codes, as it does after a disk load (its CPU int8 and fp8
    # kernels repack them).
    assert "vLLM's post-processing" in line


def test_moe_experts_are_the_daemons_tensors_and_tokens_equal_vllms_disk_load(formats_rig: FormatsRig) -> None:
    auto, hit = formats_rig.runs["moe"]
    assert hit.tokens == auto.tokens
    line = _hit_line(hit)
    assert "none was materialized" in line, line
    # 4 layers, each with w13 and w2.
    assert "8 of 8 stacked expert parameters took the daemon's tensors" in line, line
    hits = [e for e in formats_rig.rig.events("attach_hit") if e.get("daemon") == formats_rig.daemons["moe"].name]
    assert hits and all(e["mode"] == "zero_copy" for e in hits)


def test_a_changed_quantization_config_misses_and_the_miss_names_it(formats_rig: FormatsRig) -> None:
    rig = formats_rig.rig
    changed = copy_checkpoint(formats_rig.checkpoints["int8-w8a8"], rig.base / "w8a8-changed")
    config_path = changed / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    config_path.write_text(json.dumps(config))
    result = rig.cli("attach", str(changed), "--no-fallback", "--json", "--run-dir", str(rig.run_dir))
    assert result.returncode == 3, result.stderr
    report = json.loads(result.stdout)
    assert report["outcome"] == "miss" and report["diff"]["config"] == ["quantization_config"]
    assert "quantization_config" in report["reason"]


@VLLM_IN_PYTEST
def test_vllms_model_classes_fuse_as_the_plan_does() -> None:
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    dense = ModelDims.from_config(DEV_PRESETS["small"].config)
    moe = ModelDims.from_config(DEV_PRESETS["small-moe"].config)
    for model_class, dims in ((Qwen3ForCausalLM, dense), (LlamaForCausalLM, dense), (Qwen3MoeForCausalLM, moe)):
        assert family.fuses_like_family(model_class.packed_modules_mapping)
        family.check_engine_fusions(model_class.packed_modules_mapping, dims, model_class.__name__)
    # A dense checkpoint under a class that does not fuse gate and up (or the other way round) is refused early.
    with pytest.raises(UnsupportedPlanError, match="Qwen3MoeForCausalLM does not fuse gate_up_proj"):
        family.check_engine_fusions(Qwen3MoeForCausalLM.packed_modules_mapping, dense, "Qwen3MoeForCausalLM")
    with pytest.raises(UnsupportedPlanError, match="Odd fuses gate_up_proj from gate_up, which the fused plan does"):
        family.check_engine_fusions({**Qwen3ForCausalLM.packed_modules_mapping, "gate_up_proj": ["gate_up"]}, dense,
                                    "Odd")
    # A class that fuses other modules under the same names (Phi-3's stored qkv_proj) is not of the family:
    # its tensors are served by name.
    assert not family.fuses_like_family({"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]})


@VLLM_IN_PYTEST
def test_pre_quantized_expert_stacks_have_the_shapes_of_vllms_int8_moe_parameters(tmp_path: Path) -> None:
    """No engine runs small-moe-w8a8 here (vLLM CPU: "No Int8 MoE backend supports the deployment
    configuration"), so the plan's expert stacks are checked against the parameters vLLM's compressed-tensors
    W8A8 int8 MoE method makes for each rank, which its FusedMoE weight loader fills."""
    from types import SimpleNamespace

    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8_moe,
    )

    layout = locate(write_checkpoint("small-moe-w8a8", tmp_path / "moe-w8a8"))
    manifest = fingerprint_checkpoint(layout, None).manifest
    config = DEV_PRESETS["small-moe-w8a8"].config
    # What create_weights reads of the method: gate and up fused, no bias, per-channel weights, dynamic inputs.
    method = SimpleNamespace(moe=SimpleNamespace(is_act_and_mul=True, has_bias=False), static_input_scales=False,
                             weight_quant=SimpleNamespace(strategy=QuantizationStrategy.CHANNEL))
    for tp in (1, 2):
        layer = torch.nn.Module()
        int8_moe.CompressedTensorsW8A8Int8MoEMethod.create_weights(
            method, layer, num_experts=config["num_experts"], hidden_size=config["hidden_size"],
            intermediate_size_per_partition=config["moe_intermediate_size"] // tp, params_dtype=torch.bfloat16)
        expected = {name: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
                    for name, p in layer.named_parameters()}
        assert set(expected) == set(family.EXPERT_STACK_LEAVES)
        for rank in range(tp):
            plan = build_plan(PlanSpec(tp_size=tp, tp_rank=rank, dtype="bfloat16"), layout.config, manifest)
            outputs = {o.name: (o.dtype, o.shape) for o in plan.outputs}
            for i in range(config["num_hidden_layers"]):
                for leaf, held in expected.items():
                    assert outputs[family.expert_stack(i, leaf)] == held, (tp, rank, i, leaf)
