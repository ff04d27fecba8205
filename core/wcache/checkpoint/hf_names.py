"""Hugging Face tensor names of the Llama family (Llama, Mistral, Qwen2, Qwen3): one owner for every module
that builds, reads or writes them (the fused plan, the reference engine, the test checkpoint writers)."""

from __future__ import annotations

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer(i: int) -> str:
    """The prefix of decoder layer `i`'s tensors."""
    return f"model.layers.{i}"


def attention(i: int) -> str:
    """The prefix of layer `i`'s attention projections and norms (q_proj, …, q_norm)."""
    return f"{layer(i)}.self_attn"


def mlp(i: int) -> str:
    """The prefix of layer `i`'s MLP projections (gate_proj, up_proj, down_proj)."""
    return f"{layer(i)}.mlp"
