"""The decoder-only transformer (Llama/Qwen2/Qwen3/Mistral) over processed weights of one TP rank.

The model holds no cache: each layer hands q, k and v to an attention backend the engine supplies for the
step (`kv_cache.StepAttention`), which decides what is read from and written to the KV caches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from wcache.engine.config import ModelConfig
from wcache.engine.parallel import TensorParallel
from wcache.errors import BadInputError
from wcache.plan import family


class AttentionBackend(Protocol):
    """Per step: store this layer's k and v as the cache policy says, and attend."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [n, heads, d], k and v: [n, kv_heads, d] for this step's positions; returns [n, heads, d]."""
        ...


@dataclass(frozen=True, slots=True)
class Linear:
    """A weight and, for int8/fp8 plans, its per-output-channel scales."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.scale is not None:
            # Dequantize on the fly: the arena keeps the compact codes, shared by every engine.
            weight = (weight.to(torch.float32) * self.scale[:, None]).to(x.dtype)
        return F.linear(x, weight, self.bias)


@dataclass(frozen=True, slots=True)
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[Linear, ...]  # one fused projection, or q, k, v
    o: Linear
    o_bias: torch.Tensor | None  # replicated on every rank, so added once, after the all-reduce
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: tuple[Linear, ...]  # one fused projection, or gate, up
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _projection_macs(layer: Layer) -> int:
    return sum(p.weight.numel() for p in (*layer.qkv, layer.o, *layer.gate_up, layer.down))


class Transformer:
    """Forward passes over one rank's weights; heads and MLP columns are this rank's share."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], tp: TensorParallel) -> None:
        self.config = config
        self.tp = tp
        if config.num_heads % tp.size:
            raise BadInputError(f"{config.num_heads} attention heads do not split over TP {tp.size}.")
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = max(1, config.num_kv_heads // tp.size)
        self.head_dim = config.head_dim
        self.weights = weights
        self.embed = self._get(family.EMBED)
        self.norm = self._get(family.FINAL_NORM)
        self.lm_head = weights.get(family.LM_HEAD, self.embed) if config.tie_word_embeddings else self._get(
            family.LM_HEAD
        )
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        # Multiply-adds of one layer's projections per token (this rank's share): what sizes a step's threads.
        self.layer_macs = _projection_macs(self.layers[0]) if self.layers else 0
        self.dtype = self.norm.dtype
        self.inv_freq = torch.tensor(config.inv_freq(), dtype=torch.float32)
        self.vocab_per_rank = self.embed.shape[0]

    def _get(self, name: str) -> torch.Tensor:
        tensor = self.weights.get(name)
        if tensor is None:
            raise BadInputError(f"the weights have no tensor {name!r}; was the checkpoint processed with this plan?")
        return tensor

    def _linear(self, name: str) -> Linear:
        return Linear(self._get(f"{name}.weight"), self.weights.get(f"{name}.weight_scale"),
                      self.weights.get(f"{name}.bias"))

    def _layer(self, i: int) -> Layer:
        p = family.layer(i)
        fused = f"{p}.self_attn.qkv_proj.weight" in self.weights
        qkv = (self._linear(f"{p}.self_attn.qkv_proj"),) if fused else tuple(
            self._linear(f"{p}.self_attn.{n}_proj") for n in "qkv"
        )
        gate_up = (self._linear(f"{p}.mlp.gate_up_proj"),) if fused else tuple(
            self._linear(f"{p}.mlp.{n}_proj") for n in ("gate", "up")
        )
        return Layer(
            input_norm=self._get(f"{p}.input_layernorm.weight"),
            post_norm=self._get(f"{p}.post_attention_layernorm.weight"),
            qkv=qkv,
            o=Linear(self._get(f"{p}.self_attn.o_proj.weight"), self.weights.get(f"{p}.self_attn.o_proj.weight_scale")),
            o_bias=self.weights.get(f"{p}.self_attn.o_proj.bias"),
            q_norm=self.weights.get(f"{p}.self_attn.q_norm.weight") if self.config.qk_norm else None,
            k_norm=self.weights.get(f"{p}.self_attn.k_norm.weight") if self.config.qk_norm else None,
            gate_up=gate_up,
            down=self._linear(f"{p}.mlp.down_proj"),
        )

    # -- pieces --------------------------------------------------------------------------------------

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.embed)
        # Vocab-parallel: each rank embeds the ids in its slice and the ranks sum.
        start = self.tp.rank * self.vocab_per_rank
        local = token_ids - start
        inside = (local >= 0) & (local < self.vocab_per_rank)
        out = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.embed) * inside[:, None].to(self.embed.dtype)
        return self.tp.all_reduce(out)

    def rope_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [n, 1, d] (computed once per step: every layer uses the same)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)

    @staticmethod
    def rope(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = angles
        return x * cos + rotate_half(x) * sin

    def _project_qkv(self, layer: Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if len(layer.qkv) == 1:
            q, k, v = layer.qkv[0](x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = (proj(x) for proj in layer.qkv)
        n = x.shape[0]
        return (q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        if len(layer.gate_up) == 1:
            gate, up = layer.gate_up[0](x).chunk(2, dim=-1)
        else:
            gate, up = (proj(x) for proj in layer.gate_up)
        return self.tp.all_reduce(layer.down(F.silu(gate) * up))

    # -- forward -------------------------------------------------------------------------------------

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm for the step's tokens: [n, hidden]."""
        eps = self.config.rms_norm_eps
        hidden = self.embed_tokens(token_ids)
        angles = self.rope_angles(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps)
            q, k, v = self._project_qkv(layer, x)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
            q, k = self.rope(q, angles), self.rope(k, angles)
            attn = attention.attend(i, q, k, v).reshape(q.shape[0], self.num_heads * self.head_dim)
            out = self.tp.all_reduce(layer.o(attn))
            hidden = hidden + (out if layer.o_bias is None else out + layer.o_bias)
            hidden = hidden + self._mlp(layer, rms_norm(hidden, layer.post_norm, eps))
        return rms_norm(hidden, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the real vocabulary (vocab-parallel shards gathered, padding dropped)."""
        local = F.linear(hidden, self.lm_head).to(torch.float32)
        full = self.tp.all_gather(local, dim=-1) if self.tp.size > 1 else local
        return full[..., : self.config.vocab_size]
