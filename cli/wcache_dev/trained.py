"""A tiny checkpoint that speaks: the "tiny" preset's architecture trained on a few paragraphs of English.

The random weights of "tiny" decode to mojibake, so a demo cannot show what a wrong checkpoint does to the
text. This module trains the same architecture (same config.json, same tensor names and shapes, float32) at
the byte level on CORPUS for a fixed number of steps, with fixed seeds, one thread and deterministic
algorithms, in a few seconds of CPU. The result memorises the corpus well enough that greedy decoding from a
phrase of it continues with its words. Nothing is cached: every call trains from scratch, and two calls on
the same machine write byte-identical files. (Float rounding may differ on a CPU with other vector units.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.plan import family

from wcache_dev.synth import PRESETS, make_tensors, tensor_shapes, write_tensors

if TYPE_CHECKING:
    import torch

BASE_PRESET = "tiny"
SEED = 0
SEQ_LEN = 64  # twice the sliding window, so the sliding layers see their window close
BATCH = 8  # small batches, many steps: at this size a step costs its overheads, not its tokens
STEPS = 600
PEAK_LR = 1e-2
WARMUP_STEPS = 30

CORPUS = """\
the weights cache daemon keeps the processed weights of a model in shared memory, so that an engine which \
starts can map them instead of reading every shard from disk again. the daemon keeps one copy of the weights \
for every engine on the machine, and it keeps them until the last engine lets them go.

when an engine asks for a checkpoint, the daemon compares keys. a key is a digest of every tensor byte, of \
the plan that processed them, and of the rank that holds them. if the keys match, the engine maps the weights \
and starts at once. if the keys differ, the engine reads the checkpoint from disk, as it would without the \
cache, and the weights of the daemon are not used.

a header only key looks at the names, the shapes and the types of the tensors, but never at their bytes. two \
checkpoints with the same header and different weights get the same key, and a cache that trusts such a key \
serves the wrong weights without a word. this is why the cache hashes every byte. hashing is fast, and the \
digests are kept in a store, so a warm key costs one stat for each shard and reads nothing.

the engine is small. it runs a decoder with paged attention, a prefix cache and a sliding window. each layer \
reads the keys and values of the tokens before it, and the sliding layers read only the last few. when a \
prompt shares a prefix with an earlier one, the engine finds its blocks in the cache and computes only the \
rest of the prompt. the engine writes a line to the events file for every hit and every miss.

the weights are the model. the cache only moves them, and the key says which weights they are. a model with \
the right weights writes the same words from the same prompt, every time. a model with broken weights writes \
nothing that makes sense, and a good key is what keeps it from being served in place of the right one.

to start, run the daemon with the checkpoint. it hashes the shards, processes the weights with the plan, and \
says that it is ready. then start an engine, and it attaches the weights of the daemon in a few milliseconds. \
stop the daemon when no engine needs its weights, and the memory goes back to the machine.
"""


@contextmanager
def _deterministic() -> Iterator[None]:
    """One thread and deterministic kernels while training; the caller's settings come back afterwards."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _rope_tables(config: Mapping[str, object], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    from wcache.engine.config import ModelConfig

    inv_freq = torch.tensor(ModelConfig.from_hf(config).inv_freq(), dtype=torch.float32)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]  # [1, T, 1, d]


def _masks(config: Mapping[str, object], length: int) -> list[torch.Tensor]:
    """Per layer, which keys each query may see: causal, and within the window on sliding layers."""
    import torch
    from wcache.engine.config import SLIDING, ModelConfig

    model = ModelConfig.from_hf(config)
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = key <= query
    window = causal & (key > query - (model.sliding_window or length))
    return [window if kind == SLIDING else causal for kind in model.layer_types]


def forward(params: Mapping[str, torch.Tensor], config: Mapping[str, object], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] of a Qwen3 decoder over Hugging Face-named weights: the engine's math, batched."""
    import torch.nn.functional as F
    from wcache.engine.config import ModelConfig
    from wcache.engine.model import rms_norm, rotate_half

    model = ModelConfig.from_hf(config)
    eps, heads, kv_heads, head_dim = model.rms_norm_eps, model.num_heads, model.num_kv_heads, model.head_dim
    batch, length = tokens.shape
    cos, sin = _rope_tables(config, length)
    masks = _masks(config, length)
    hidden = F.embedding(tokens, params[family.EMBED])
    for i, mask in enumerate(masks):
        p = family.layer(i)
        x = rms_norm(hidden, params[f"{p}.input_layernorm.weight"], eps)
        q = F.linear(x, params[f"{p}.self_attn.q_proj.weight"]).reshape(batch, length, heads, head_dim)
        k = F.linear(x, params[f"{p}.self_attn.k_proj.weight"]).reshape(batch, length, kv_heads, head_dim)
        v = F.linear(x, params[f"{p}.self_attn.v_proj.weight"]).reshape(batch, length, kv_heads, head_dim)
        q = rms_norm(q, params[f"{p}.self_attn.q_norm.weight"], eps)
        k = rms_norm(k, params[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask[None, None])
        attn = attn.transpose(1, 2).reshape(batch, length, heads * head_dim)
        hidden = hidden + F.linear(attn, params[f"{p}.self_attn.o_proj.weight"])
        x = rms_norm(hidden, params[f"{p}.post_attention_layernorm.weight"], eps)
        gate = F.linear(x, params[f"{p}.mlp.gate_proj.weight"])
        up = F.linear(x, params[f"{p}.mlp.up_proj.weight"])
        hidden = hidden + F.linear(F.silu(gate) * up, params[f"{p}.mlp.down_proj.weight"])
    return F.linear(rms_norm(hidden, params[family.FINAL_NORM], eps), params[family.LM_HEAD])


def train_tensors(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Train the "tiny" architecture on CORPUS; float32 tensors in the order synth.tensor_shapes gives."""
    import torch
    import torch.nn.functional as F

    preset = PRESETS[BASE_PRESET]
    config = preset.config
    names = [name for name, _ in tensor_shapes(config, preset.write_lm_head)]
    data = torch.tensor(list(CORPUS.encode("utf-8")), dtype=torch.int64)
    with _deterministic():
        # Start from the preset's own deterministic random weights (norms near 1, matrices N(0, 0.02)).
        initial = make_tensors(preset, SEED)
        params = {name: initial[name].to(torch.float32).clone().requires_grad_(True) for name in names}
        optimizer = torch.optim.AdamW(list(params.values()), lr=PEAK_LR, betas=(0.9, 0.98), weight_decay=0.0,
                                      foreach=False)
        generator = torch.Generator().manual_seed(SEED)
        offsets = torch.arange(SEQ_LEN + 1)
        for step in range(steps):
            # Linear warmup, then linear decay to zero: the last steps polish what the first ones found.
            scale = (step + 1) / WARMUP_STEPS if step < WARMUP_STEPS else (steps - step) / (steps - WARMUP_STEPS)
            for group in optimizer.param_groups:
                group["lr"] = PEAK_LR * scale
            starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (BATCH,), generator=generator)
            window = data[starts[:, None] + offsets[None, :]]
            logits = forward(params, config, window[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return {name: params[name].detach().contiguous() for name in names}


def write_trained_checkpoint(dest: Path, *, num_shards: int | None = None) -> Path:
    """Train and write to the new directory `dest`, laid out as synth.write_checkpoint("tiny") lays it out."""
    preset = PRESETS[BASE_PRESET]
    return write_tensors(train_tensors(), preset.config, dest, num_shards or preset.num_shards)
