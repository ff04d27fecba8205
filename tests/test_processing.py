"""Processing plans on real tiny checkpoints: TP shards reassemble, fusions, casts, quantization, refusals."""

from __future__ import annotations

import copy
import mmap
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from helpers import run_python
from wcache.checkpoint.dtypes import TORCH_NAMES
from wcache.checkpoint.files import locate
from wcache.checkpoint.manifest import TensorDigest
from wcache.checkpoint.safetensors_header import read_header
from wcache.errors import BadInputError, CheckpointError
from wcache.ipc.arenas.engine_side import torch_dtype
from wcache.key.fingerprint import fingerprint_checkpoint
from wcache.plan.load_time_quantization import dequantize_rows
from wcache.plan.processing import (
    OutputSpec,
    ProcessingPlan,
    UnsupportedPlanError,
    build_plan,
    process_all,
)
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, Preset, make_tensors, read_tensors, tensor_shapes, write_tensors

TINY = PRESETS["tiny"].config


class MmapSource:
    """Checkpoint tensors as views over read-only memory maps, like the daemon's: a write would crash."""

    def __init__(self, path: Path) -> None:
        self.views: dict[str, torch.Tensor] = {}
        self.requested: list[str] = []
        self._maps: list[mmap.mmap] = []
        for shard in locate(path).shards:
            fd = os.open(shard, os.O_RDONLY)
            try:
                header = read_header(fd, os.fstat(fd).st_size, shard)
                mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps.append(mapped)
            for t in header.tensors:
                dtype = torch_dtype(TORCH_NAMES[t.dtype])
                numel = t.nbytes // dtype.itemsize
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "buffer is not writable": that is the point
                    flat = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=header.data_start + t.start)
                self.views[t.name] = flat.reshape(t.shape)

    def __call__(self, name: str) -> torch.Tensor:
        self.requested.append(name)
        return self.views[name]


def manifest(path: Path) -> tuple[TensorDigest, ...]:
    return fingerprint_checkpoint(locate(path), None).manifest


def fake_manifest(config: dict[str, Any], write_lm_head: bool = True,
                  extra: dict[str, tuple[int, ...]] | None = None, dtype: str = "F32") -> list[TensorDigest]:
    """A manifest without files, for plans that must be refused before any byte is read."""
    shapes = dict(tensor_shapes(config, write_lm_head))
    shapes.update(extra or {})
    return [TensorDigest(name, dtype, shape, 0, "0" * 64) for name, shape in shapes.items()]


def config_with(**overrides: Any) -> dict[str, Any]:
    config = copy.deepcopy(dict(TINY))
    config.update(overrides)
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return config


def write_custom(dest: Path, config: dict[str, Any], *, write_lm_head: bool = True,
                 edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    tensors = make_tensors(Preset(config=config, num_shards=1, write_lm_head=write_lm_head))
    if edit is not None:
        edit(tensors)
    return write_tensors(tensors, config, dest, 1)


def run_plan(path: Path, config: dict[str, Any] | None, **spec: Any) -> tuple[ProcessingPlan, dict[str, torch.Tensor]]:
    plan = build_plan(PlanSpec(**spec), config, manifest(path))
    return plan, process_all(plan, MmapSource(path))


def check_outputs_match_specs(plan: ProcessingPlan, outputs: dict[str, torch.Tensor]) -> None:
    assert list(outputs) == [o.name for o in plan.outputs]
    for o in plan.outputs:
        t = outputs[o.name]
        assert str(t.dtype) == f"torch.{o.dtype}", o.name
        assert tuple(t.shape) == o.shape, o.name
        assert t.is_contiguous() and t.device.type == "cpu"
        assert t.numel() * t.element_size() == o.nbytes
    assert plan.nbytes == sum(o.nbytes for o in plan.outputs)


def split_qkv(t: torch.Tensor, q_rows: int, kv_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return t[:q_rows], t[q_rows:q_rows + kv_rows], t[q_rows + kv_rows:]


@pytest.fixture(scope="module")
def tiny_full(tiny_template: Path) -> dict[str, torch.Tensor]:
    return read_tensors(tiny_template)


def test_tp1_fused_is_plain_concatenation(tiny_template: Path, tiny_full: dict[str, torch.Tensor]) -> None:
    plan, out = run_plan(tiny_template, dict(TINY), dtype="float32")
    check_outputs_match_specs(plan, out)
    for i in range(TINY["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = torch.cat([tiny_full[f"{a}.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(out[f"{a}.qkv_proj.weight"], qkv)
        assert torch.equal(out[f"{m}.gate_up_proj.weight"],
                           torch.cat([tiny_full[f"{m}.gate_proj.weight"], tiny_full[f"{m}.up_proj.weight"]]))
        for same in (f"{a}.o_proj.weight", f"{m}.down_proj.weight", f"{a}.q_norm.weight", f"{a}.k_norm.weight"):
            assert torch.equal(out[same], tiny_full[same])
    for same in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(out[same], tiny_full[same])
    assert f"{a}.qkv_proj.bias" not in out and f"{a}.q_proj.weight" not in out
    # Each output names exactly the checkpoint tensors it reads.
    for o in plan.outputs:
        source = MmapSource(tiny_template)
        plan.produce(o, source)
        assert set(source.requested) == set(o.sources), o.name


def test_tp2_shards_reassemble_the_full_tensors(tiny_template: Path, tiny_full: dict[str, torch.Tensor]) -> None:
    shards = [run_plan(tiny_template, dict(TINY), tp_size=2, tp_rank=r, dtype="float32") for r in range(2)]
    for plan, out in shards:
        check_outputs_match_specs(plan, out)
    ranks = [out for _, out in shards]
    hd = TINY["head_dim"]
    q_rows, kv_rows = TINY["num_attention_heads"] // 2 * hd, TINY["num_key_value_heads"] // 2 * hd
    for i in range(TINY["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        parts = [split_qkv(r[f"{a}.qkv_proj.weight"], q_rows, kv_rows) for r in ranks]
        for j, x in enumerate("qkv"):
            assert torch.equal(torch.cat([p[j] for p in parts]), tiny_full[f"{a}.{x}_proj.weight"])
        assert torch.equal(torch.cat([r[f"{a}.o_proj.weight"] for r in ranks], dim=1), tiny_full[f"{a}.o_proj.weight"])
        inter = TINY["intermediate_size"] // 2
        gate = torch.cat([r[f"{m}.gate_up_proj.weight"][:inter] for r in ranks])
        up = torch.cat([r[f"{m}.gate_up_proj.weight"][inter:] for r in ranks])
        assert torch.equal(gate, tiny_full[f"{m}.gate_proj.weight"])
        assert torch.equal(up, tiny_full[f"{m}.up_proj.weight"])
        down = torch.cat([r[f"{m}.down_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(down, tiny_full[f"{m}.down_proj.weight"])
        for replicated in (f"{a}.q_norm.weight", f"model.layers.{i}.input_layernorm.weight"):
            assert all(torch.equal(r[replicated], tiny_full[replicated]) for r in ranks)
    for vocab in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([r[vocab] for r in ranks]), tiny_full[vocab])
    assert all(torch.equal(r["model.norm.weight"], tiny_full["model.norm.weight"]) for r in ranks)


def test_kv_heads_are_replicated_when_fewer_than_ranks(tiny_template: Path,
                                                       tiny_full: dict[str, torch.Tensor]) -> None:
    hd, kv = TINY["head_dim"], TINY["num_key_value_heads"]
    assert kv == 2
    for rank in range(4):
        _, out = run_plan(tiny_template, dict(TINY), tp_size=4, tp_rank=rank, dtype="float32")
        qkv = out["model.layers.1.self_attn.qkv_proj.weight"]
        assert qkv.shape == (hd + 2 * hd, TINY["hidden_size"])  # one q head, one k head, one v head
        q, k, v = split_qkv(qkv, hd, hd)
        head = rank * kv // 4  # ranks 0 and 1 share kv head 0, ranks 2 and 3 share kv head 1
        full = {x: tiny_full[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"}
        assert torch.equal(q, full["q"][rank * hd:(rank + 1) * hd])
        assert torch.equal(k, full["k"][head * hd:(head + 1) * hd])
        assert torch.equal(v, full["v"][head * hd:(head + 1) * hd])


def test_vocab_is_padded_as_vllm_pads_it_before_it_is_split(tmp_path: Path) -> None:
    # vLLM pads 321 rows to 384 (a multiple of 64) and gives each of 2 ranks 192: the daemon's shard is vLLM's.
    config = config_with(vocab_size=321, num_hidden_layers=1)
    path = write_custom(tmp_path / "odd-vocab", config)
    full = read_tensors(path)
    ranks = []
    for rank in range(2):
        plan, out = run_plan(path, config, tp_size=2, tp_rank=rank, dtype="float32")
        check_outputs_match_specs(plan, out)
        spec = next(o for o in plan.outputs if o.name == "model.embed_tokens.weight")
        assert spec.shape == (192, config["hidden_size"])
        ranks.append(out)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        joined = torch.cat([r[name] for r in ranks])
        assert joined.shape[0] == 384
        assert torch.equal(joined[:321], full[name])
        assert not joined[321:].any()


def test_vocab_padding_leaves_a_rank_without_real_rows(tmp_path: Path) -> None:
    config = config_with(vocab_size=5, num_hidden_layers=1)  # 5 rows over 4 ranks: 2, 2, 1 and 0 real rows
    path = write_custom(tmp_path / "tiny-vocab", config)
    full = read_tensors(path)
    shards = [run_plan(path, config, tp_size=4, tp_rank=r, dtype="float32")[1] for r in range(4)]
    joined = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(joined[:5], full["model.embed_tokens.weight"]) and not joined[5:].any()


def test_identity_plan_is_a_cast_and_keeps_other_dtypes(tmp_path: Path, tiny_template: Path,
                                                        tiny_full: dict[str, torch.Tensor]) -> None:
    plan, out = run_plan(tiny_template, None, layout="identity", dtype="bfloat16")
    check_outputs_match_specs(plan, out)
    assert set(out) == set(tiny_full)
    for name, tensor in tiny_full.items():
        assert torch.equal(out[name], tensor.to(torch.bfloat16))
    # Any names, no config; integers and float8 codes are kept exactly as stored.
    odd = {"encoder.thing.weight": torch.randn(3, 5), "counts": torch.arange(7, dtype=torch.int64),
           "codes": torch.randn(4, 4).to(torch.float8_e4m3fn)}
    path = write_tensors(odd, None, tmp_path / "odd", 1)
    plan, out = run_plan(path, None, layout="identity", dtype="float16")
    check_outputs_match_specs(plan, out)
    assert torch.equal(out["encoder.thing.weight"], odd["encoder.thing.weight"].to(torch.float16))
    assert torch.equal(out["counts"], odd["counts"])
    assert out["codes"].view(torch.uint8).equal(odd["codes"].view(torch.uint8))


def test_fused_plan_casts_floating_outputs(tiny_template: Path, tiny_full: dict[str, torch.Tensor]) -> None:
    plan, out = run_plan(tiny_template, dict(TINY), tp_size=2, tp_rank=1, dtype="bfloat16")
    check_outputs_match_specs(plan, out)
    assert {o.dtype for o in plan.outputs} == {"bfloat16"}
    assert torch.equal(out["model.norm.weight"], tiny_full["model.norm.weight"].to(torch.bfloat16))


def zero_first_q_row(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.0.self_attn.q_proj.weight"][0].zero_()


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_weights_dequantize_within_bounds(tmp_path: Path, method: str) -> None:
    config = config_with(num_hidden_layers=2)
    path = write_custom(tmp_path / "q", config, edit=zero_first_q_row)
    full = read_tensors(path)
    plan, out = run_plan(path, config, tp_size=2, tp_rank=0, dtype="bfloat16", quantization=method)
    check_outputs_match_specs(plan, out)
    qdtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
    reference, _ = run_plan(path, config, tp_size=2, tp_rank=0, dtype="float32")
    unquantized = process_all(reference, MmapSource(path))
    linear = [n for n in unquantized if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                                                    "down_proj.weight"))]
    assert len(linear) == 8
    for name in linear:
        q, scale = out[name], out[name.removesuffix(".weight") + ".weight_scale"]
        w = unquantized[name]
        assert q.dtype == qdtype and q.shape == w.shape
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
        error = (w - dequantize_rows(q, scale)).abs()
        if method == "int8":
            assert bool((error <= scale.unsqueeze(1) / 2 + 1e-6).all()), name
            assert int(q.abs().max()) == 127
        else:
            # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, plus the subnormal step near zero.
            assert bool((error <= w.abs() / 16 + scale.unsqueeze(1) * 2.0**-9 + 1e-7).all()), name
            assert float(q.to(torch.float32).abs().max()) == 448.0
    # The zeroed row gets scale 1 and all-zero codes, not a division by zero.
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert float(out[f"{qkv}.weight_scale"][0]) == 1.0 and not out[f"{qkv}.weight"][0].to(torch.float32).any()
    assert torch.equal(full["model.layers.0.self_attn.q_proj.weight"][0], torch.zeros(config["hidden_size"]))
    # Embeddings, lm_head and norms stay in the plan's floating dtype.
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert out[name].dtype == torch.bfloat16


def test_identity_plan_quantizes_unfused_linear_weights(tiny_template: Path) -> None:
    plan, out = run_plan(tiny_template, None, layout="identity", dtype="float32", quantization="int8")
    check_outputs_match_specs(plan, out)
    for x in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"):
        assert out[f"model.layers.2.{x}.weight"].dtype == torch.int8
        assert out[f"model.layers.2.{x}.weight_scale"].shape == (out[f"model.layers.2.{x}.weight"].shape[0],)
    assert out["lm_head.weight"].dtype == torch.float32
    assert out["model.layers.2.self_attn.k_norm.weight"].dtype == torch.float32


def test_qkv_biases_are_fused_and_sharded(tmp_path: Path) -> None:
    config = config_with(model_type="qwen2", num_hidden_layers=1)
    config.pop("head_dim")  # Qwen2 configs derive head_dim from hidden_size / heads (64 / 4 = 16)

    def add_biases(tensors: dict[str, torch.Tensor]) -> None:
        for x in "qkv":
            rows = tensors[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0]
            tensors[f"model.layers.0.self_attn.{x}_proj.bias"] = torch.arange(rows, dtype=torch.float32) + 1000 * ord(x)

    path = write_custom(tmp_path / "qwen2", config, edit=add_biases)
    full = read_tensors(path)
    biases = []
    for rank in range(2):
        plan, out = run_plan(path, config, tp_size=2, tp_rank=rank, dtype="float32", quantization="int8")
        check_outputs_match_specs(plan, out)
        assert out["model.layers.0.self_attn.qkv_proj.bias"].dtype == torch.float32
        biases.append(split_qkv(out["model.layers.0.self_attn.qkv_proj.bias"], 32, 16))
    for j, x in enumerate("qkv"):
        assert torch.equal(torch.cat([b[j] for b in biases]), full[f"model.layers.0.self_attn.{x}_proj.bias"])


def test_tied_embeddings(tmp_path: Path) -> None:
    config = config_with(tie_word_embeddings=True, num_hidden_layers=1)
    untied = write_custom(tmp_path / "tied", config, write_lm_head=False)
    plan, _ = run_plan(untied, config, dtype="float32")
    assert "lm_head.weight" not in {o.name for o in plan.outputs}
    stored = write_custom(tmp_path / "tied-stored", config, write_lm_head=True)  # like Qwen3-0.6B's file
    plan, out = run_plan(stored, config, tp_size=2, tp_rank=0, dtype="float32")
    assert out["lm_head.weight"].shape == (config["vocab_size"] // 2, config["hidden_size"])
    untied_config = config_with(tie_word_embeddings=False, num_hidden_layers=1)
    with pytest.raises(UnsupportedPlanError, match=r"lacks 'lm_head\.weight'"):
        build_plan(PlanSpec(dtype="float32"), untied_config, manifest(untied))


def test_rotary_buffers_are_skipped() -> None:
    config = config_with(num_hidden_layers=1)
    entries = fake_manifest(config, extra={"model.layers.0.self_attn.rotary_emb.inv_freq": (8,)})
    plan = build_plan(PlanSpec(dtype="float32"), config, entries)
    assert not any("inv_freq" in s for o in plan.outputs for s in o.sources)


# (plan options, config.json overrides or NO_CONFIG, manifest shape overrides, extra tensors, expected message)
NO_CONFIG = "no-config"
HEADS_6_KV_3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}
REFUSALS = [
    (dict(layout="identity", tp_size=2), {}, {}, {}, "identity plan holds unsharded weights"),
    ({}, NO_CONFIG, {}, {}, "needs the model's config.json"),
    (dict(tp_size=3), {}, {}, {}, "4 attention heads cannot be split evenly across tp_size=3"),
    (dict(tp_size=2), HEADS_6_KV_3, HEADS_6_KV_3, {}, "3 key/value heads can be neither split nor replicated"),
    (dict(tp_size=2), {"intermediate_size": 127}, {"intermediate_size": 127}, {}, "intermediate_size 127"),
    ({}, {"hidden_size": None}, {}, {}, "config.json has no hidden_size"),
    ({}, {"num_hidden_layers": "4"}, {}, {}, "needs a positive integer"),
    ({}, {}, {}, {"model.layers.0.mlp.experts.0.w1.weight": (4, 4)}, "does not know tensor"),
    ({}, {}, {}, {"model.layers.9.input_layernorm.weight": (64,)}, "does not know tensor"),
    ({}, {}, {}, {"model.layers.0.self_attn.q_proj.bias": (64,)}, "bias for only some of q, k and v"),
    ({}, {}, {}, {"model.norm.weight": (65,)}, "has shape (65,) but config.json implies (64,)"),
    ({}, {"num_hidden_layers": 5}, {}, {}, "lacks 'model.layers.4.input_layernorm.weight'"),
]


@pytest.mark.parametrize(("spec", "overrides", "shapes", "extra", "message"), REFUSALS)
def test_unsupported_plans_are_refused_in_one_sentence(spec: dict[str, Any], overrides: Any,
                                                       shapes: dict[str, Any], extra: dict[str, tuple[int, ...]],
                                                       message: str) -> None:
    config = None if overrides == NO_CONFIG else {**config_with(), **overrides}
    entries = fake_manifest(config_with(**shapes), extra=extra)
    with pytest.raises(UnsupportedPlanError) as caught:
        build_plan(PlanSpec(**{"dtype": "float32", **spec}), config, entries)
    text = str(caught.value)
    assert message in text
    assert isinstance(caught.value, BadInputError) and caught.value.exit_code == 2
    assert text.endswith(".") and "\n" not in text and ". " not in text  # one sentence


def test_fp8_checkpoints_are_refused_by_the_fused_and_quantizing_plans() -> None:
    config = config_with(num_hidden_layers=1)
    entries = fake_manifest(config, dtype="F8_E4M3")
    with pytest.raises(UnsupportedPlanError, match="cannot shard or cast"):
        build_plan(PlanSpec(dtype="bfloat16"), config, entries)
    with pytest.raises(UnsupportedPlanError, match="already quantized"):
        build_plan(PlanSpec(dtype="bfloat16", layout="identity", quantization="fp8"), None, entries)


def test_checkpoint_with_scales_is_not_quantized_again() -> None:
    entries = [TensorDigest("model.layers.0.mlp.down_proj.weight", "BF16", (4, 8), 64, "0" * 64),
               TensorDigest("model.layers.0.mlp.down_proj.weight_scale", "F32", (4,), 16, "0" * 64)]
    assert len(build_plan(PlanSpec(dtype="bfloat16", layout="identity"), None, entries).outputs) == 2
    with pytest.raises(UnsupportedPlanError, match="would be made twice"):
        build_plan(PlanSpec(dtype="bfloat16", layout="identity", quantization="int8"), None, entries)


def test_produce_refuses_an_output_of_another_plan(tiny_template: Path) -> None:
    plan = build_plan(PlanSpec(dtype="float32"), dict(TINY), manifest(tiny_template))
    other = build_plan(PlanSpec(tp_size=2, dtype="float32"), dict(TINY), manifest(tiny_template))
    with pytest.raises(KeyError):
        plan.produce(other.outputs[0], MmapSource(tiny_template))


def test_unresolved_dtype_is_a_programming_error(tiny_template: Path) -> None:
    with pytest.raises(ValueError, match="resolve"):
        build_plan(PlanSpec(), dict(TINY), manifest(tiny_template))


def test_source_that_disagrees_with_the_manifest_is_caught(tiny_template: Path) -> None:
    plan = build_plan(PlanSpec(dtype="float32"), dict(TINY), manifest(tiny_template))
    real = MmapSource(tiny_template)
    with pytest.raises(CheckpointError, match="header says float32"):
        plan.produce(plan.outputs[1], lambda name: real(name).to(torch.float16))


def test_produce_into_a_preallocated_slot(tiny_template: Path) -> None:
    plan = build_plan(PlanSpec(tp_size=2, tp_rank=1, dtype="bfloat16", quantization="fp8"), dict(TINY),
                      manifest(tiny_template))
    source = MmapSource(tiny_template)
    arena = torch.zeros(plan.nbytes, dtype=torch.uint8)
    offset = 0
    for o in plan.outputs:
        slot = arena[offset:offset + o.nbytes].view(getattr(torch, o.dtype)).view(o.shape)
        assert plan.produce(o, source, out=slot) is slot
        expected = plan.produce(o, source)
        assert slot.view(torch.uint8).equal(expected.view(torch.uint8)), o.name
        offset += o.nbytes
    wrong = torch.empty(plan.outputs[0].shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        plan.produce(plan.outputs[0], source, out=wrong)


def digest_outputs(plan: ProcessingPlan, source: Callable[[str], torch.Tensor]) -> dict[str, str]:
    return {o.name: blake3.blake3(plan.produce(o, source).view(torch.uint8).numpy().tobytes()).hexdigest()
            for o in plan.outputs}


DIGEST_SCRIPT = """
import sys, blake3, torch
from pathlib import Path
from wcache.checkpoint.files import locate
from wcache.key.fingerprint import fingerprint_checkpoint
from wcache.plan.spec import PlanSpec
from wcache.plan.processing import build_plan
from wcache_dev.synth import PRESETS, read_tensors
path = Path(sys.argv[1])
tensors = read_tensors(path)
for method in ("int8", "fp8"):
    plan = build_plan(PlanSpec(tp_size=2, tp_rank=1, dtype="bfloat16", quantization=method),
                      dict(PRESETS["tiny"].config), fingerprint_checkpoint(locate(path), None).manifest)
    for o in plan.outputs:
        data = plan.produce(o, tensors.__getitem__).view(torch.uint8).numpy().tobytes()
        print(method, o.name, blake3.blake3(data).hexdigest())
"""


def test_produce_is_byte_identical_across_calls_and_processes(tiny_template: Path) -> None:
    source = MmapSource(tiny_template)
    here: list[str] = []
    for method in ("int8", "fp8"):
        plan = build_plan(PlanSpec(tp_size=2, tp_rank=1, dtype="bfloat16", quantization=method), dict(TINY),
                          manifest(tiny_template))
        first, second = digest_outputs(plan, source), digest_outputs(plan, source)
        assert first == second
        here.extend(f"{method} {name} {digest}" for name, digest in first.items())
    # Another process, another source (a loaded copy instead of memory maps), the same bytes.
    result = run_python(DIGEST_SCRIPT, str(tiny_template), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == here


def test_output_spec_nbytes() -> None:
    assert OutputSpec("x", "bfloat16", (3, 4), ("x",)).nbytes == 24
    assert OutputSpec("x", "float8_e4m3fn", (3, 4), ("x",)).nbytes == 12
    assert OutputSpec("x", "float32", (), ("x",)).nbytes == 4
