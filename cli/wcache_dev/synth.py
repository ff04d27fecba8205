"""Write Hugging Face–style test checkpoints with deterministic random weights (Llama/Qwen3/Qwen3-MoE family)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
from wcache.checkpoint.files import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, locate
from wcache.checkpoint.safetensors_header import read_header
from wcache.errors import BadInputError, CheckpointError
from wcache.plan import family

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Preset:
    """A checkpoint shape: its config.json, how many shards it is written in, and its dtype."""

    config: Mapping[str, Any]
    num_shards: int
    write_lm_head: bool
    tokenizer: bool = False  # write a byte-level tokenizer.json (token i < 256 is byte i, as ByteTokenizer)
    # Pre-quantize the projections: "int8" or "fp8" per channel (compressed-tensors), "fp8-tensor" with one
    # scale per tensor (vLLM's own fp8 format).
    quantized: str | None = None
    # Standard deviation of matrices. 0.02 leaves the layers so faint against the embeddings that greedy tokens
    # hardly depend on them; about 1/sqrt(hidden) makes every projection (and every expert) move the tokens.
    matrix_std: float = 0.02


def _qwen3_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
    }
    config.update(overrides)
    config["layer_types"] = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return config


def _compressed_tensors(kind: str) -> dict[str, Any]:
    """config.json's quantization_config for W8A8 (int or float codes) as compressed-tensors writes it."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token",
                                  "dynamic": True},
            "output_activations": None,
        }},
    }


# What "tiny" and "small" share: four layers alternating sliding (W = 32) and full attention over a byte
# vocabulary (token i < 256 is byte i, then BOS and EOS) padded to 320.
_BYTE_VOCAB_MIXED_WINDOWS: dict[str, Any] = {
    "num_hidden_layers": 4, "vocab_size": 320, "max_position_embeddings": 2048, "bos_token_id": 256,
    "eos_token_id": 257, "tie_word_embeddings": False, "sliding_window": 32, "use_sliding_window": True,
    "max_window_layers": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}

# A Qwen3-MoE as small as vLLM's CPU backend runs it: head_dim 64, 4 experts of which each token takes 2,
# every layer sparse, over the byte vocabulary.
_SMALL_MOE = _qwen3_config(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    router_aux_loss_coef=0.001, output_router_logits=False, torch_dtype="bfloat16",
    num_hidden_layers=4, vocab_size=320, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
    tie_word_embeddings=False,
)

# The smallest checkpoint vLLM's CPU attention runs: see the "small" preset.
_SMALL = _qwen3_config(
    hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    torch_dtype="bfloat16", **_BYTE_VOCAB_MIXED_WINDOWS,
)


def _prequantized(config: Mapping[str, Any], quantization_config: Mapping[str, Any], quantized: str) -> Preset:
    """A small checkpoint written pre-quantized: two shards and a tokenizer, matrices of std 0.09 (about
    1/sqrt(hidden), so every projection moves the tokens)."""
    return Preset(config={**config, "quantization_config": quantization_config}, num_shards=2, write_lm_head=True,
                  tokenizer=True, quantized=quantized, matrix_std=0.09)


def _bfloat16_qwen3(num_shards: int, **sizes: Any) -> Preset:
    """A bfloat16 Qwen3 of these sizes, lm_head.weight written even when tied (as published checkpoints do)."""
    return Preset(config=_qwen3_config(torch_dtype="bfloat16", **sizes), num_shards=num_shards, write_lm_head=True)


PRESETS: dict[str, Preset] = {
    # Mixed full and sliding-window layers so the engine's SWA paths have something to chew on; float32
    # so outputs can be compared with transformers to 1e-4. Written as two shards to exercise the index.
    "tiny": Preset(
        config=_qwen3_config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            torch_dtype="float32", **_BYTE_VOCAB_MIXED_WINDOWS,
        ),
        num_shards=2,
        write_lm_head=True,
    ),
    # The smallest checkpoint vLLM's CPU attention runs (head_dim 64; it refuses 16), with the same mixed
    # sliding/full layers and byte vocabulary as "tiny", and a byte-level tokenizer.json so that vLLM and
    # transformers can tokenize text for it. bfloat16, the dtype vLLM's "auto" picks on CPU.
    "small": Preset(config=_SMALL, num_shards=2, write_lm_head=True, tokenizer=True),
    # "small" as compressed-tensors W8A8 int8 (what llm-compressor writes): every projection per-channel int8
    # with a float32 weight_scale [rows, 1], activations quantized per token at run time; lm_head unquantized.
    "small-w8a8": _prequantized(_SMALL, _compressed_tensors("int"), "int8"),
    # The same as compressed-tensors W8A8 fp8 (float8_e4m3fn codes, per-channel scales, dynamic per-token
    # activations).
    "small-fp8": _prequantized(_SMALL, _compressed_tensors("float"), "fp8"),
    # The same in vLLM's own fp8 format: float8_e4m3fn codes with one float32 weight_scale per tensor.
    "small-fp8-tensor": _prequantized(_SMALL, {"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8-tensor"),
    "small-moe": Preset(
        config=_SMALL_MOE,
        num_shards=2, write_lm_head=True, tokenizer=True, matrix_std=0.09,
    ),
    # The same pre-quantized as compressed-tensors W8A8 int8: every projection, each expert's too, as int8 codes
    # with a float32 weight_scale [rows, 1]; the router and lm_head unquantized.
    "small-moe-w8a8": _prequantized(_SMALL_MOE, _compressed_tensors("int"), "int8"),
    # Qwen/Qwen3-0.6B's exact tensor names, shapes and dtype. Its published file also stores lm_head.weight
    # although the embeddings are tied: 311 tensors, 1,503,264,768 data bytes.
    "qwen3-0.6b": _bfloat16_qwen3(
        1, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True,
    ),
    # The shard count of the #60944 report (66 shards) with small tensors: the cost is per file, not per byte.
    "many-shards": _bfloat16_qwen3(
        66, hidden_size=128, intermediate_size=384, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096,
        bos_token_id=1000, eos_token_id=1001, tie_word_embeddings=False,
    ),
    # 2,000 shards of a few KB each (182 layers, 2,005 tensors, ~13 MB): whether a warm key's cost grows with
    # the shard count behind a remote filesystem, with almost no bytes to hash.
    "many-shards-2000": _bfloat16_qwen3(
        2000, hidden_size=64, intermediate_size=128, num_hidden_layers=182, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=256, max_position_embeddings=4096,
        bos_token_id=250, eos_token_id=251, tie_word_embeddings=False, max_window_layers=182,
    ),
}


# Not a Preset: the "tiny" architecture with weights trained (in seconds, deterministically) by wcache_dev.trained,
# shipped in the package (`benchmarks/train_tiny.py DIR` trains them again) so that nobody waits for training.
TRAINED_PRESET = "tiny-trained"
TRAINED_DATA = Path(__file__).parent / "data" / TRAINED_PRESET


def _copy_trained(dest: Path, num_shards: int | None) -> Path:
    if dest.exists() and any(dest.iterdir()):
        raise BadInputError(f"{dest} already exists and is not empty; choose a new directory.")
    if num_shards is not None:
        return write_tensors(read_tensors(TRAINED_DATA), PRESETS["tiny"].config, dest, num_shards)
    dest.mkdir(parents=True, exist_ok=True)
    for source in sorted(TRAINED_DATA.iterdir()):
        shutil.copyfile(source, dest / source.name)
    return dest


def tensor_shapes(config: Mapping[str, Any], write_lm_head: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor names and shapes of a Llama/Qwen3/Qwen3-MoE model, in module order."""
    dims = family.ModelDims.from_config(config)
    yield family.EMBED, (dims.vocab, dims.hidden)
    for i in range(dims.layers):
        for leaf in family.layer_leaves(dims, i, qk_norm=config.get("model_type", "").startswith("qwen3")):
            yield leaf.name, leaf.shape
    yield family.FINAL_NORM, (dims.hidden,)
    if write_lm_head or not dims.tie:
        yield family.LM_HEAD, (dims.vocab, dims.hidden)


def _tensor_seed(seed: int, name: str) -> int:
    # Seeded per tensor name, so the same tensor has the same bytes however the checkpoint is sharded.
    return int.from_bytes(blake3.blake3(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensors(preset: Preset, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights: N(0, 0.02) matrices and norms near 1, in the preset's dtype."""
    import torch

    dtype = getattr(torch, preset.config["torch_dtype"])
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(preset.config, preset.write_lm_head):
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        values = 1.0 + 0.1 * values if len(shape) == 1 else preset.matrix_std * values
        if preset.quantized and family.is_projection(name):
            tensors.update(_quantized(name, values, preset.quantized))
        else:
            tensors[name] = values.to(dtype)
    return tensors


def _quantized(name: str, weight: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """A float32 projection as symmetric codes and their float32 scales: [rows, 1] per channel, [] per tensor."""
    import torch

    qmax = 127.0 if kind == "int8" else 448.0
    scale = weight.abs().amax() / qmax if kind == "fp8-tensor" else weight.abs().amax(dim=1, keepdim=True) / qmax
    scaled = weight / scale
    codes = torch.round(scaled).clamp(-qmax, qmax).to(torch.int8) if kind == "int8" else scaled.to(
        torch.float8_e4m3fn)
    return {name: codes, family.companion(name, "weight_scale"): scale}


def split_names(sizes: list[tuple[str, int]], num_shards: int) -> list[list[str]]:
    """Split names, in order, into exactly `num_shards` non-empty groups of roughly equal bytes."""
    if not 1 <= num_shards <= len(sizes):
        raise BadInputError(f"cannot split {len(sizes)} tensors into {num_shards} shards.")
    target = sum(n for _, n in sizes) / num_shards
    groups: list[list[str]] = [[]]
    filled = 0
    for i, (name, nbytes) in enumerate(sizes):
        shards_to_open = num_shards - len(groups)
        if groups[-1] and shards_to_open > 0 and (filled >= target or len(sizes) - i <= shards_to_open):
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    return groups


def write_tensors(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None, dest: Path, num_shards: int
) -> Path:
    """Write `tensors` to a new directory `dest` as `num_shards` shards (an index when more than one)."""
    from safetensors.torch import save_file

    if dest.exists() and any(dest.iterdir()):
        raise BadInputError(f"{dest} already exists and is not empty; choose a new directory.")
    dest.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (dest / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    groups = split_names(sizes, num_shards)
    if num_shards == 1:
        save_file(dict(tensors), str(dest / SINGLE_NAME), metadata={"format": "pt"})
        return dest
    weight_map: dict[str, str] = {}
    for number, names in enumerate(groups, start=1):
        shard = f"model-{number:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(dest / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
    (dest / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return dest


def write_checkpoint(preset: str, dest: Path, *, seed: int = 0, num_shards: int | None = None) -> Path:
    """Write preset `preset` (one of PRESETS, or TRAINED_PRESET) to the new directory `dest`."""
    if preset == TRAINED_PRESET:  # "tiny" trained on a few paragraphs, so that its generations are words
        return _copy_trained(dest, num_shards)
    if preset not in PRESETS:
        raise BadInputError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, TRAINED_PRESET])}.")
    chosen = PRESETS[preset]
    written = write_tensors(make_tensors(chosen, seed), chosen.config, dest, num_shards or chosen.num_shards)
    if chosen.tokenizer:
        write_byte_tokenizer(written, chosen.config)
    return written


def _byte_symbols() -> list[str]:
    # The printable stand-in byte-level BPE uses for each byte (GPT-2's table): bytes that are printable
    # Latin-1 stand for themselves, the others are shifted past U+0100, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, int] = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + shifted
            shifted += 1
    return [chr(symbols[b]) for b in range(256)]


def write_byte_tokenizer(dest: Path, config: Mapping[str, Any]) -> None:
    """tokenizer.json and tokenizer_config.json whose ids are the UTF-8 bytes, plus BOS and EOS from config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    bos, eos = "<|bos|>", "<|eos|>"
    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    vocab.update({bos: config["bos_token_id"], eos: config["eos_token_id"]})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([bos, eos])
    tokenizer.save(str(dest / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                        "model_max_length": config["max_position_embeddings"], "add_bos_token": False}
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, by name (for re-splitting and tests)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in locate(path).shards:
        tensors.update(load_file(str(shard)))
    return tensors


def overwrite_tensor_bytes(path: Path, name: str, start: int, data: bytes) -> Path:
    """Overwrite bytes of tensor `name` from byte `start` of its data, in place; the header is untouched."""
    for shard in locate(path).shards:
        fd = os.open(shard, os.O_RDWR)
        try:
            header = read_header(fd, os.fstat(fd).st_size, shard)
            tensor = next((t for t in header.tensors if t.name == name), None)
            if tensor is None:
                continue
            if start < 0 or start + len(data) > tensor.nbytes:
                raise BadInputError(f"tensor {name!r} has {tensor.nbytes} bytes; cannot write there.")
            os.pwrite(fd, data, header.data_start + tensor.start + start)
            return shard
        finally:
            os.close(fd)
    raise CheckpointError(f"{path} has no tensor {name!r}.")


def training_step(tensors: Mapping[str, torch.Tensor], fraction: float, seed: int = 1,
                  frozen: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """What one optimizer step does to bf16 weights, roughly: `fraction` of the elements of every tensor (but
    those named in `frozen`) nudged by a small relative amount, chosen at random; the rest bit-identical."""
    import torch

    stepped: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in frozen or fraction <= 0:
            stepped[name] = tensor
            continue
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        flat = tensor.reshape(-1).clone()
        count = max(1, int(flat.numel() * fraction))
        where = torch.randperm(flat.numel(), generator=generator)[:count]
        nudge = 1.0 + 0.05 * torch.randn(count, generator=generator)
        moved = (flat[where].float() * nudge).to(tensor.dtype)
        # A nudge that rounds back to the same value would not be a change: those move by one ulp instead.
        bits = moved.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
        bits[bits == flat[where].view(bits.dtype)] += 1
        flat[where] = moved
        stepped[name] = flat.reshape(tensor.shape)
    return stepped


def write_training_step(parent: Path, dest: Path, fraction: float, *, seed: int = 1,
                        frozen: tuple[str, ...] = ()) -> Path:
    """`parent`'s next checkpoint after `training_step`, written to `dest` with its config and tokenizer files."""
    import shutil

    tensors = read_tensors(parent)
    config = json.loads((parent / CONFIG_NAME).read_text()) if (parent / CONFIG_NAME).exists() else None
    shards = sorted(parent.glob("*.safetensors"))
    written = write_tensors(training_step(tensors, fraction, seed, frozen), config, dest, len(shards))
    for extra in parent.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and not (written / extra.name).exists():
            shutil.copyfile(extra, written / extra.name)
    return written
