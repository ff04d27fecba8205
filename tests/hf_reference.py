"""Oracles for engine tests: an independent, deliberately naive Qwen3/Qwen2/Llama/Mistral forward pass in float64,
and thin wrappers around Hugging Face `transformers` (imported lazily; it is a test-only dependency).

The reference reads config.json and the safetensors shards directly (no wcache code) and recomputes the whole
sequence for every token: no KV cache, explicit masks, so it is easy to check by eye against the HF modelling code
(transformers 5.x `models/qwen3/modeling_qwen3.py`, `masking_utils.py`, `modeling_rope_utils.py`):

- RMSNorm `w * x / sqrt(mean(x²) + eps)`; q_norm/k_norm per head over head_dim, before RoPE (Qwen3 only).
- RoPE with the half-split `rotate_half`, `inv_freq = 1 / theta^(2i/d)`, `linear` and `llama3` scaling.
- GQA: query head h reads KV head h // (num_heads // num_kv_heads).
- Sliding-window layers: query i sees keys j with i - W < j <= i (W keys including itself).
- MLP `down(silu(gate(x)) * up(x))`; `lm_head.weight` if the checkpoint has it, else the tied embeddings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class RefConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    layer_windows: tuple[int | None, ...]  # per layer: sliding window W, or None for full attention
    rope: Mapping[str, Any]
    max_position_embeddings: int


def layer_windows(config: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Per-layer sliding window (or None) following transformers' config post-init rules for each family."""
    n = config["num_hidden_layers"]
    model_type = config.get("model_type", "llama")
    window = config.get("sliding_window")
    if model_type == "mistral":
        # Mistral: one window for every layer when set; layer_types is ignored by MistralConfig.
        return (window,) * n
    if model_type == "llama":
        return (None,) * n
    # Qwen2 / Qwen3: use_sliding_window gates the window; explicit layer_types wins over max_window_layers.
    if not config.get("use_sliding_window", False):
        window = None
    types = config.get("layer_types")
    if types is None:
        max_window_layers = config.get("max_window_layers", 28)
        types = [
            "sliding_attention" if window is not None and i >= max_window_layers else "full_attention" for i in range(n)
        ]
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """`rope_parameters` as transformers 5.x standardises it (legacy `rope_scaling`/`rope_theta` folded in)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def read_config(checkpoint_dir: Path) -> RefConfig:
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    model_type = config.get("model_type", "llama")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    return RefConfig(
        model_type=model_type,
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6),
        qk_norm=model_type == "qwen3",
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        layer_windows=layer_windows(config),
        rope=rope_params(config),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
    )


def read_weights(checkpoint_dir: Path, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        weights.update({name: t.to(dtype) for name, t in load_file(str(shard)).items()})
    return weights


def inv_freq(cfg: RefConfig, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    d = cfg.head_dim
    p = cfg.rope
    freqs = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, d, 2, dtype=dtype) / d))
    kind = p["rope_type"]
    if kind == "default":
        return freqs
    if kind == "linear":
        return freqs / p["factor"]
    if kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        out = []
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return torch.tensor(out, dtype=dtype)
    raise NotImplementedError(f"rope_type {kind!r} is not in the reference")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, T, d]; half split: pairs are (i, i + d/2), not interleaved.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_mask(n: int, window: int | None) -> torch.Tensor:
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def forward(
    cfg: RefConfig,
    w: Mapping[str, torch.Tensor],
    token_ids: Sequence[int],
    *,
    windows: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Logits [T, vocab] for every position, in the weights' dtype; `windows` overrides the per-layer windows."""
    windows = cfg.layer_windows if windows is None else tuple(windows)
    dtype = w["model.embed_tokens.weight"].dtype
    n = len(token_ids)
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    angles = torch.arange(n, dtype=dtype)[:, None] * inv_freq(cfg, dtype)[None, :]  # [T, d/2]
    cos, sin = angles.cos(), angles.sin()

    def linear(x: torch.Tensor, name: str, bias: bool = False) -> torch.Tensor:
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if bias else y

    h = w["model.embed_tokens.weight"][torch.tensor(list(token_ids), dtype=torch.long)]
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        x = rms_norm(h, w[f"{p}.input_layernorm.weight"], cfg.eps)
        q = linear(x, f"{p}.self_attn.q_proj", cfg.qkv_bias).view(n, nh, hd)
        k = linear(x, f"{p}.self_attn.k_proj", cfg.qkv_bias).view(n, nkv, hd)
        v = linear(x, f"{p}.self_attn.v_proj", cfg.qkv_bias).view(n, nkv, hd)
        if cfg.qk_norm:
            q = rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], cfg.eps)
            k = rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], cfg.eps)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [nh, T, hd]
        k = apply_rope(k.transpose(0, 1), cos, sin)  # [nkv, T, hd]
        v = v.transpose(0, 1)
        mask = attention_mask(n, windows[layer])
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = (q[head] @ k[kv].T) * hd**-0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[kv])
        attn = torch.stack(heads, dim=1).reshape(n, nh * hd)
        h = h + linear(attn, f"{p}.self_attn.o_proj", cfg.o_bias)
        x = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], cfg.eps)
        gate = linear(x, f"{p}.mlp.gate_proj")
        h = h + linear(torch.nn.functional.silu(gate) * linear(x, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj")
    h = rms_norm(h, w["model.norm.weight"], cfg.eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T


@lru_cache(maxsize=4)
def _loaded(checkpoint_dir: str) -> tuple[RefConfig, dict[str, torch.Tensor]]:
    return read_config(Path(checkpoint_dir)), read_weights(Path(checkpoint_dir))


def reference_logits(checkpoint_dir: Path, token_ids: Sequence[int]) -> torch.Tensor:
    """Cold-prefill logits [len(token_ids), vocab] as float32, computed in float64 by the naive reference."""
    cfg, w = _loaded(str(Path(checkpoint_dir).resolve()))
    return forward(cfg, w, token_ids).float()


def reference_greedy(
    checkpoint_dir: Path, token_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Greedy continuation (new tokens only, up to and including eos) by full recomputation each step."""
    cfg, w = _loaded(str(Path(checkpoint_dir).resolve()))
    seq, new = list(token_ids), []
    for _ in range(max_new_tokens):
        token = int(forward(cfg, w, seq)[-1].argmax())
        new.append(token)
        seq.append(token)
        if token == eos_token_id:
            break
    return new


# --- Hugging Face transformers ---------------------------------------------------------------------------------


def hf_model(checkpoint_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """`AutoModelForCausalLM` in eval mode with the default attention implementation (sdpa on CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype)
    return model.eval()


def hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Cold-prefill logits [T, vocab] as float32."""
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float()


def hf_greedy(model: Any, token_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """HF greedy generation through its KV cache; new tokens only, ending with eos if it was produced."""
    ids = torch.tensor([list(token_ids)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, ids.shape[1] :].tolist()


def truncate_at_eos(tokens: Sequence[int], eos_token_id: int | None) -> list[int]:
    """Tokens up to and including the first eos."""
    tokens = list(tokens)
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens
