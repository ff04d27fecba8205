"""Greedy decode speed of the reference engine against Hugging Face transformers, and engine construction time.

For each checkpoint (written for the run with deterministic random weights and no EOS, so both sides decode
every token) and each torch thread count, one run measures side by side, interleaved, median of ``--repeat``:

* the reference engine: ``generate`` of ``--new-tokens`` after a ``--prompt``-token prompt; decode time is
  every forward pass after the prefill (the benchmark wraps the model's ``forward``), per token;
* transformers (``AutoModelForCausalLM``, its default sdpa attention, its ``DynamicCache``): one prefill
  call, then one call per token with the cache, argmax in between; decode time likewise per token;
* the ratio wcache / transformers of the two (below 1 means the engine is faster).

The thread count is set with ``torch.set_num_threads`` before both sides run; the engine's decode steps may
run on fewer (``wcache.engine.threads``), which the table shows. The construction table times ``Engine(...)`` with
the default ``EngineConfig`` on weights already loaded, against zeroing a KV pool of that default size
(what construction cost before the pool was allocated on demand).

Run::

    .venv/bin/python benchmarks/decode_speed.py                               # tiny, small, mid; 1 and 2 threads
    .venv/bin/python benchmarks/decode_speed.py --presets qwen3-0.6b --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_common import fmt_seconds, workspace
from rich.console import Console
from rich.table import Table
from wcache.engine.config import EngineConfig, ModelConfig
from wcache.engine.engine import Engine
from wcache.engine.threads import step_threads
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, Preset, make_tensors, write_tensors

# qwen3-0.6b's layer shapes (GQA 16/8, head_dim 128) with 8 layers and a 32k vocabulary: a third of its
# per-token work, in a checkpoint that is quick to write.
MID = Preset(
    config={**PRESETS["qwen3-0.6b"].config, "num_hidden_layers": 8, "layer_types": ["full_attention"] * 8,
            "vocab_size": 32768, "bos_token_id": 32000, "eos_token_id": 32001},
    num_shards=1,
    write_lm_head=True,
)
CHOICES: dict[str, Preset] = {**PRESETS, "mid": MID}


def write_model(name: str, root: Path) -> Path:
    """The preset as one shard without an EOS token (reused when the work directory already has it)."""
    dest = root / name
    if (dest / "config.json").exists():
        return dest
    preset = CHOICES[name]
    config = {k: v for k, v in preset.config.items() if k != "eos_token_id"}
    return write_tensors(make_tensors(preset), config, dest, 1)


def prompt_tokens(length: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(vocab, 256)) for _ in range(length)]


@dataclass
class Side:
    """One implementation's per-repeat decode times (seconds per token) and its greedy tokens."""

    per_token: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.per_token)


def engine_decode(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Seconds per decoded token (forward passes after the prefill) and the greedy tokens."""
    marks: list[float] = []
    forward: Callable[..., torch.Tensor] = engine.model.forward

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = forward(*args, **kwargs)
        marks.append(time.perf_counter())
        return hidden

    engine.model.forward = timed  # type: ignore[method-assign]
    try:
        tokens = engine.generate(prompt, new_tokens).token_ids
    finally:
        engine.model.forward = forward  # type: ignore[method-assign]
    # marks[0] ends the prefill; each later mark ends one decode step (logits and argmax fall between).
    return (marks[-1] - marks[0]) / (len(marks) - 1), tokens


def hf_decode(model: Any, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens, start = [token], time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
        return (time.perf_counter() - start) / (new_tokens - 1), tokens


def construction(model_config: ModelConfig, weights: Any, repeat: int) -> tuple[float, float, int]:
    """Median seconds of Engine(...) with the default config and of zeroing a pool of its size; the pool's bytes."""
    built, zeroed, pool_bytes = [], [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        engine = Engine(model_config, weights, EngineConfig())
        built.append(time.perf_counter() - start)
        pools = [*engine.kv.k.values(), *engine.kv.v.values()]
        start = time.perf_counter()
        for pool in pools:
            pool.zero_()
        zeroed.append(time.perf_counter() - start)
        pool_bytes = sum(pool.numel() * pool.element_size() for pool in pools)
        del engine, pools
    return statistics.median(built), statistics.median(zeroed), pool_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small,mid", help=f"comma-separated, of {', '.join(CHOICES)}")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request (default 32)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (default 1,2)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; medians are shown (default 3)")
    parser.add_argument("--workdir", type=Path, help="keep checkpoints here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in CHOICES]
    if unknown or args.new_tokens < 2 or args.repeat < 1:
        print(f"choose presets from {', '.join(CHOICES)}, --new-tokens ≥ 2, --repeat ≥ 1", file=sys.stderr)
        return 2
    thread_counts = [int(t) for t in args.threads.split(",")]
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    console = Console(width=120)
    decode = Table(title=f"Greedy decode after a {args.prompt}-token prompt, {args.new_tokens} tokens, "
                         f"median of {args.repeat}")
    for column in ("checkpoint", "threads", "engine threads", "wcache /token", "transformers /token",
                   "wcache / transformers", "same tokens"):
        decode.add_column(column, justify="left" if column == "checkpoint" else "right")
    build = Table(title=f"Engine construction, default EngineConfig, median of {args.repeat}")
    for column in ("checkpoint", "Engine(...)", "zeroing the pool", "pool size"):
        build.add_column(column, justify="left" if column == "checkpoint" else "right")
    results: dict[str, Any] = {}
    initial_threads = torch.get_num_threads()
    with workspace(args.workdir) as root:
        os.environ["WCACHE_CACHE_DIR"] = str(root / "store")  # nothing may touch the user's own store
        for name in presets:
            model_dir = write_model(name, root)
            config = json.loads((model_dir / "config.json").read_text())
            prompt = prompt_tokens(args.prompt, config["vocab_size"])
            engine = Engine.from_disk(model_dir, PlanSpec(), EngineConfig(enable_prefix_caching=False))
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, config["torch_dtype"]))
            hf.eval()
            for threads in thread_counts:
                torch.set_num_threads(threads)
                ours, theirs = Side(), Side()
                engine_decode(engine, prompt, 3)  # warm-up: first-call allocations and thread pools
                hf_decode(hf, prompt, 3)
                for _ in range(args.repeat):
                    seconds, ours.tokens = engine_decode(engine, prompt, args.new_tokens)
                    ours.per_token.append(seconds)
                    seconds, theirs.tokens = hf_decode(hf, prompt, args.new_tokens)
                    theirs.per_token.append(seconds)
                same = sum(a == b for a, b in zip(ours.tokens, theirs.tokens, strict=False))
                used = step_threads(threads, 1, engine.model.layer_macs)
                ratio = ours.median / theirs.median
                decode.add_row(name, str(threads), str(used), fmt_seconds(ours.median), fmt_seconds(theirs.median),
                               f"{ratio:.2f}×", f"{same}/{args.new_tokens}")
                results.setdefault(name, {})[f"threads={threads}"] = {
                    "engine_s_per_token": ours.per_token, "hf_s_per_token": theirs.per_token, "ratio": ratio,
                    "engine_threads": used, "same_tokens": same}
            torch.set_num_threads(initial_threads)
            built, zeroed, pool_bytes = construction(engine.model_config, engine.model.weights, args.repeat)
            build.add_row(name, fmt_seconds(built), fmt_seconds(zeroed), f"{pool_bytes / 2**30:.2f} GiB")
            results.setdefault(name, {})["construction"] = {"engine_s": built, "zero_pool_s": zeroed,
                                                            "pool_bytes": pool_bytes}
            engine.close()
            del engine, hf
    console.print(decode)
    console.print(build)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
