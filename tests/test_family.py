"""The model family's one owner (plan/family.py) and the plans it shapes: pre-quantized and mixture-of-experts
checkpoints, stacked as vLLM holds them, refused with a reason where an engine's model class disagrees."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from wcache.checkpoint.files import locate
from wcache.checkpoint.manifest import TensorDigest
from wcache.checkpoint.model_config import config_digest
from wcache.engine.config import ModelConfig, UnsupportedModelError
from wcache.key.fingerprint import fingerprint_checkpoint
from wcache.plan import family
from wcache.plan.family import ModelDims, UnsupportedPlanError
from wcache.plan.load_time_quantization import quantized_at_load
from wcache.plan.processing import ProcessingPlan, build_plan
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, read_tensors, tensor_shapes, write_checkpoint


def _plan(path: Path, tp: int = 1, rank: int = 0) -> tuple[ProcessingPlan, dict[str, torch.Tensor]]:
    layout = locate(path)
    plan = build_plan(PlanSpec(tp_size=tp, tp_rank=rank, dtype="bfloat16"), layout.config,
                      fingerprint_checkpoint(layout, None).manifest)
    source = read_tensors(path)
    return plan, {o.name: plan.produce(o, source.__getitem__) for o in plan.outputs}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, Path]:
    base = tmp_path_factory.mktemp("family")
    return {name: write_checkpoint(name, base / name) for name in ("small-w8a8", "small-fp8-tensor", "small-moe",
                                                                   "small-moe-w8a8")}


@pytest.mark.parametrize("tp", [1, 2])
def test_int8_codes_and_channel_scales_are_fused_and_sharded_as_stored(checkpoints: Mapping[str, Path],
                                                                       tp: int) -> None:
    path = checkpoints["small-w8a8"]
    source = read_tensors(path)
    a, m = family.attention(0), family.mlp(0)
    for rank in range(tp):
        plan, out = _plan(path, tp, rank)
        kinds = {o.name: o.dtype for o in plan.outputs}
        assert kinds[f"{a}.qkv_proj.weight"] == "int8" and kinds[f"{a}.qkv_proj.weight_scale"] == "float32"
        inter = 256 // tp
        rows = slice(rank * inter, (rank + 1) * inter)
        for suffix in ("weight", "weight_scale"):
            expected = torch.cat([source[f"{m}.gate_proj.{suffix}"][rows], source[f"{m}.up_proj.{suffix}"][rows]])
            assert torch.equal(out[f"{m}.gate_up_proj.{suffix}"], expected)
        # Row-parallel: the codes' columns are this rank's, the per-output-row scales all of them.
        assert torch.equal(out[f"{m}.down_proj.weight"], source[f"{m}.down_proj.weight"][:, rows])
        assert torch.equal(out[f"{m}.down_proj.weight_scale"], source[f"{m}.down_proj.weight_scale"])
        assert out[family.LM_HEAD].dtype == torch.bfloat16  # compressed-tensors leaves lm_head unquantized


def test_per_tensor_scales_are_held_whole_under_their_checkpoint_names(checkpoints: Mapping[str, Path]) -> None:
    plan, out = _plan(checkpoints["small-fp8-tensor"])
    a = family.attention(0)
    assert out[f"{a}.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    names = {o.name for o in plan.outputs}
    assert {f"{a}.q_proj.weight_scale", f"{a}.k_proj.weight_scale", f"{a}.v_proj.weight_scale"} <= names
    assert f"{a}.qkv_proj.weight_scale" not in names
    # An engine loading by checkpoint name (vLLM's load_weights) finds them.
    assert f"{a}.q_proj.weight_scale" in plan.checkpoint_views(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_experts_are_stacked_as_vllms_fused_moe_holds_them(checkpoints: Mapping[str, Path], tp: int) -> None:
    path = checkpoints["small-moe"]
    source = read_tensors(path)
    config = PRESETS["small-moe"].config
    experts, inter = config["num_experts"], config["moe_intermediate_size"] // tp
    for rank in range(tp):
        plan, out = _plan(path, tp, rank)
        rows = slice(rank * inter, (rank + 1) * inter)
        w13 = out[family.expert_stack(1, "w13_weight")]
        w2 = out[family.expert_stack(1, "w2_weight")]
        assert tuple(w13.shape) == (experts, 2 * inter, 128) and tuple(w2.shape) == (experts, 128, inter)
        for e in range(experts):
            prefix = family.expert(1, e)
            gate_up = torch.cat([source[f"{prefix}.gate_proj.weight"][rows], source[f"{prefix}.up_proj.weight"][rows]])
            assert torch.equal(w13[e], gate_up)
            assert torch.equal(w2[e], source[f"{prefix}.down_proj.weight"][:, rows])
        assert torch.equal(out[f"{family.mlp(1)}.gate.weight"], source[f"{family.mlp(1)}.gate.weight"])
        assert not any(".experts.0." in o.name or "gate_up_proj" in o.name for o in plan.outputs)
    # At TP 1 every expert's projection is a view of the stack, for engines that load checkpoint names.
    plan, out = _plan(path)
    views = plan.checkpoint_views(out)
    for name, tensor in source.items():
        assert torch.equal(views[name].to(tensor.dtype), tensor), name


@pytest.mark.parametrize("tp", [1, 2])
def test_pre_quantized_experts_keep_their_channel_scales_stacked_as_vllms_fused_moe_holds_them(
        checkpoints: Mapping[str, Path], tp: int) -> None:
    path = checkpoints["small-moe-w8a8"]
    source = read_tensors(path)
    config = PRESETS["small-moe-w8a8"].config
    experts, hidden = config["num_experts"], config["hidden_size"]
    inter = config["moe_intermediate_size"] // tp
    scales = {name for name in source if name.endswith(".weight_scale") and ".experts." in name}
    assert len(scales) == 3 * experts * config["num_hidden_layers"]
    for rank in range(tp):
        plan, out = _plan(path, tp, rank)
        # Every checkpoint scale reaches the plan: none is dropped on the way to the engine.
        assert scales <= {source for o in plan.outputs for source in o.sources}
        rows = slice(rank * inter, (rank + 1) * inter)
        for i in range(config["num_hidden_layers"]):
            assert out[family.expert_stack(i, "w13_weight")].dtype == torch.int8
            w13 = out[family.expert_stack(i, "w13_weight_scale")]
            w2 = out[family.expert_stack(i, "w2_weight_scale")]
            # vLLM's CompressedTensorsW8A8Int8MoEMethod: [experts, 2 × inter per rank, 1] and [experts, hidden, 1].
            assert (w13.dtype, tuple(w13.shape)) == (torch.float32, (experts, 2 * inter, 1))
            assert (w2.dtype, tuple(w2.shape)) == (torch.float32, (experts, hidden, 1))
            for e in range(experts):
                prefix = family.expert(i, e)
                gate_up = torch.cat([source[f"{prefix}.gate_proj.weight_scale"][rows],
                                     source[f"{prefix}.up_proj.weight_scale"][rows]])
                assert torch.equal(w13[e], gate_up)
                assert torch.equal(w2[e], source[f"{prefix}.down_proj.weight_scale"])
    plan, out = _plan(path)
    views = plan.checkpoint_views(out)
    for name, tensor in source.items():
        assert torch.equal(views[name].to(tensor.dtype), tensor), name


@pytest.mark.parametrize(("suffix", "shape", "reason"), [
    ("weight_scale", (), r"cannot be stacked: the fused layout holds only per-channel expert weight scales"),
    ("input_scale", (), r"cannot be stacked"),
    ("weight_scale", None, r"is missing beside .*, so the experts' scales cannot be stacked"),
])
def test_expert_companions_the_fused_layout_cannot_hold_are_refused(suffix: str, shape: tuple[int, ...] | None,
                                                                    reason: str) -> None:
    config = PRESETS["small-moe-w8a8"].config
    manifest = [TensorDigest(name, "F32", shape, 0, "0" * 64) for name, shape in tensor_shapes(config, True)]
    expert_weights = [entry for entry in manifest if family.is_expert_projection(entry.name)]
    if shape is None:  # every expert's per-channel scale but the last one's
        extra = [TensorDigest(family.companion(e.name, suffix), "F32", (e.shape[0], 1), 0, "0" * 64)
                 for e in expert_weights[:-1]]
    else:
        extra = [TensorDigest(family.companion(expert_weights[0].name, suffix), "F32", shape, 0, "0" * 64)]
    with pytest.raises(UnsupportedPlanError, match=reason):
        build_plan(PlanSpec(dtype="float32"), config, manifest + extra)


@pytest.mark.parametrize("layout", ["fused", "identity"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_load_time_quantization_and_the_fused_layout_agree_on_projections_and_experts(preset: str,
                                                                                       layout: str) -> None:
    # Floating tensors of the preset's names and shapes: load-time quantization takes floating weights only.
    config = {key: value for key, value in PRESETS[preset].config.items() if key != "quantization_config"}
    manifest = [TensorDigest(name, "F32", shape, 0, "0" * 64) for name, shape in tensor_shapes(config, True)]
    floating = build_plan(PlanSpec(dtype="float32", layout=layout), config, manifest)
    shapes = {**{e.name: e.shape for e in manifest}, **{o.name: o.shape for o in floating.outputs}}
    # Checkpoint and engine names alike: q_proj and qkv_proj, each expert's up_proj and the experts' w13_weight.
    taken = {name for name, shape in shapes.items() if quantized_at_load(name, shape)}
    projections = {name for name, shape in shapes.items() if family.is_projection(name) and len(shape) == 2}
    experts = {e.name for e in manifest if family.is_expert_projection(e.name)}
    assert taken <= projections and projections - taken == experts
    assert bool(experts) == ModelDims.from_config(config).is_moe
    # The layout's expert stacks are made of exactly the tensors the family calls experts' projections.
    stacks = {o.name: o for o in floating.outputs if o.name.rpartition(".")[2] in family.EXPERT_STACKS}
    assert {source for o in stacks.values() for source in o.sources} == (experts if layout == "fused" else set())
    quantized = build_plan(PlanSpec(dtype="float32", layout=layout, quantization="int8"), config, manifest)
    codes = {o.name: o for o in quantized.outputs if o.dtype == "int8"}
    # Every dense projection becomes codes and nothing else does; the experts stay floating, stacked or not.
    assert set(codes) == {o.name for o in floating.outputs if family.is_dense_projection(o.name)} != set()
    assert {source for o in codes.values() for source in o.sources} == {
        e.name for e in manifest if family.is_dense_projection(e.name)}
    assert not experts & {source for o in codes.values() for source in o.sources}
    assert all(quantized.recipes[name].kind == "tensor" for name in stacks)
    # The layers may sit under another prefix (a multimodal checkpoint's language model) in the identity layout.
    assert quantized_at_load("model.language_model.layers.0.self_attn.q_proj.weight", (8, 8))


def test_the_config_digest_covers_the_quantization_config() -> None:
    config = dict(PRESETS["small-w8a8"].config)
    changed = json.loads(json.dumps(config))
    changed["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    assert config_digest(config) != config_digest(changed)
    assert config_digest(config) != config_digest({k: v for k, v in config.items() if k != "quantization_config"})


def test_quantized_codes_without_a_quantization_config_are_still_refused(checkpoints: Mapping[str, Path]) -> None:
    layout = locate(checkpoints["small-w8a8"])
    config = {k: v for k, v in (layout.config or {}).items() if k != "quantization_config"}
    manifest = fingerprint_checkpoint(layout, None).manifest
    with pytest.raises(UnsupportedPlanError, match=r"does not know tensor '.*\.weight_scale'"):
        build_plan(PlanSpec(dtype="bfloat16"), config, manifest)
    codes_only = [entry for entry in manifest if not entry.name.endswith(".weight_scale")]
    with pytest.raises(UnsupportedPlanError, match=r"without a quantization_config in config\.json"):
        build_plan(PlanSpec(dtype="bfloat16"), config, codes_only)


def test_one_strict_parser_reads_the_dimensions() -> None:
    dims = ModelDims.from_config(PRESETS["small-moe"].config)
    assert dims.is_moe and dims.sparse_layers == (0, 1, 2, 3) and dims.experts_per_token == 2
    assert dims.fusions() == {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    assert ModelDims.from_config(PRESETS["small"].config).fusions() == family.FUSIONS
    bad: dict[str, Any] = {**PRESETS["small-moe"].config, "num_experts_per_tok": 8}
    with pytest.raises(UnsupportedPlanError, match="routes each token to 8 of 4 experts"):
        ModelDims.from_config(bad)
    with pytest.raises(UnsupportedPlanError, match="needs a positive integer"):
        ModelDims.from_config({**PRESETS["small"].config, "hidden_size": "128"})


@pytest.mark.vllm  # imports vLLM (10-20 s here): out of the inner loop
def test_formats_vllm_cannot_be_served_are_named_in_one_sentence() -> None:
    from wcache.integrations.vllm.formats import check_quantization

    for method in ("compressed-tensors", "fp8", None):
        check_quantization(SimpleNamespace(quantization=method))  # type: ignore[arg-type]
    for method in ("awq", "gptq"):
        with pytest.raises(UnsupportedPlanError) as refused:
            check_quantization(SimpleNamespace(quantization=method))  # type: ignore[arg-type]
        text = str(refused.value)
        assert text.startswith(f"wcache does not serve {method} checkpoints to vLLM") and text.count(". ") == 0


def test_the_reference_engine_refuses_moe_and_quantized_checkpoints_in_one_sentence() -> None:
    with pytest.raises(UnsupportedModelError, match=r"dense models only.*mixture of 4 experts.*vLLM"):
        ModelConfig.from_hf(PRESETS["small-moe"].config)
    with pytest.raises(UnsupportedModelError, match=r"unquantized checkpoints only.*compressed-tensors"):
        ModelConfig.from_hf(PRESETS["small-w8a8"].config)
