"""`wcache verify --greedy --engine transformers`: `from_pretrained` through wcache against transformers' own
(TP 1, the checkpoint's own plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wcache.attach_options import AttachOptions
from wcache.integrations.registry import GreedyAttach, GreedyTokens
from wcache.plan.spec import PlanSpec


def run_greedy(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int, options: AttachOptions,
               device: str) -> GreedyTokens:
    """Both sides' greedy tokens; transformers picks its own device."""
    import torch
    from transformers import AutoModelForCausalLM

    from wcache.engine.tokenizer import load_tokenizer
    from wcache.integrations.transformers.attach import from_pretrained

    dtype = {} if plan.dtype == "auto" else {"dtype": getattr(torch, plan.dtype)}
    cached_model = from_pretrained(model, **dtype, **options.to_mapping())
    disk_model = AutoModelForCausalLM.from_pretrained(model, **dtype).eval()
    tokenizer = load_tokenizer(model)

    def generate(engine: Any, prompt: str) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.int64)
        with torch.inference_mode():
            output = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=engine.config.eos_token_id)
        return [int(t) for t in output[0, ids.shape[1]:]]

    cached = [generate(cached_model, p) for p in prompts]
    disk = [generate(disk_model, p) for p in prompts]
    report = cached_model.wcache_report.summary()
    cached_model._wcache_weights.close()
    return GreedyTokens(cached, disk, GreedyAttach.of_report("transformers", report))
