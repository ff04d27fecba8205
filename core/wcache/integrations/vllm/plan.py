"""The plan a vLLM engine will ask its daemons for, resolved by vLLM itself before any daemon starts.

`wcache preload MODEL --engine vllm` uses it, so the daemons it starts hold what the load format `wcache` asks
for: vLLM's dtype (its `auto` rule for this platform: bfloat16 for a float32 checkpoint on CPU), the layout its
model class fuses, and a refusal naming a quantization the daemon's tensors cannot serve. Importing this module
imports vLLM (behind `api`'s version check).
"""

from __future__ import annotations

from wcache.checkpoint.files import locate
from wcache.checkpoint.model_path import resolve_model_path
from wcache.integrations.vllm import formats
from wcache.integrations.vllm.api import ModelConfig, resolved_model_config
from wcache.plan.spec import PlanSpec


def vllm_plan(model: str, tensor_parallel_size: int = 1, dtype: str = "auto") -> PlanSpec:
    """Rank 0's plan of a vLLM engine of `model` at `tensor_parallel_size` with vLLM's `dtype` argument: what
    `loader.plan_for` computes inside that engine."""
    return plan_of(resolved_model_config(str(model), dtype), tensor_parallel_size, 0)


def plan_of(model_config: ModelConfig, tp_size: int, tp_rank: int) -> PlanSpec:
    """The plan of one rank of an engine with vLLM's `model_config` (the one rule, inside an engine and before)."""
    formats.check_quantization(model_config)
    config = locate(resolve_model_path(model_config.model, model_config.revision)).config
    return PlanSpec(tp_size=tp_size, tp_rank=tp_rank, dtype=str(model_config.dtype).removeprefix("torch."),
                    layout=formats.layout_for_vllm(model_config, config))
