"""`wcache verify --greedy --engine reference`: wcache's own engine attached to a daemon against the same
engine loading the checkpoint from disk; a TP plan runs every rank (gloo), each attaching its own shard."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wcache.attach_options import AttachOptions
from wcache.errors import BadInputError
from wcache.integrations.registry import GreedyAttach, GreedyTokens
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    from wcache.engine.parallel import TensorParallel


def run_greedy(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int, options: AttachOptions,
               device: str) -> GreedyTokens:
    """Both sides' greedy tokens; `device` is the attached engine's."""
    from wcache.tp_launch import run_tensor_parallel

    # Every rank must attach its own shard; each runs the same prompts and rank 0's answer is the report.
    # No timeout: loading a large model on every rank may take long; Ctrl-C stops every rank.
    return run_tensor_parallel(_run_prompts, plan.tp_size, model, plan, prompts, max_new_tokens, options,
                               device)[0]


def _run_prompts(tp: TensorParallel, model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int,
                 options: AttachOptions, device: str) -> GreedyTokens:
    from wcache.engine import Engine, EngineConfig

    spec = plan.for_rank(tp.rank)
    # No prefix caching: each prompt must exercise the weights, not a cache shared between prompts.
    engine_config = EngineConfig(enable_prefix_caching=False)
    cached = Engine.from_attach(model, spec, engine_config, tp, options=options, device=device)
    try:
        disk = Engine.from_disk(model, spec, engine_config, tp)
        if cached.tokenizer is None:
            raise BadInputError(f"{model} has no tokenizer to encode the prompts.")
        encoded = [cached.tokenizer.encode(prompt) for prompt in prompts]
        from_cache = [cached.generate(ids, max_new_tokens).token_ids for ids in encoded]
        from_disk = [disk.generate(ids, max_new_tokens).token_ids for ids in encoded]
        report = cached.attach_report
        attach = (GreedyAttach.of_report("reference", report.summary()) if report is not None
                  else GreedyAttach("reference", "unknown"))
        return GreedyTokens(from_cache, from_disk, attach)
    finally:
        cached.close()
