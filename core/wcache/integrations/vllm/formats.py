"""Which of vLLM's models and checkpoint formats a daemon's tensors can serve, and in what layout.

The layout comes from the model class vLLM builds: its `packed_modules_mapping` (fused module → checkpoint
modules) must be the one the family's fused plan makes, or the plan would hold tensors vLLM has no parameter
for. A pre-quantized checkpoint is served when its tensors are a projection's `weight` with per-channel or
per-tensor companions (compressed-tensors W8A8 int8 and fp8, and vLLM's own `fp8`): the daemon holds the
codes and scales as stored, stacked where vLLM fuses them, and vLLM's `process_weights_after_loading` runs
after, as it does from disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from wcache.integrations.vllm.api import ModelConfig, get_model_architecture
from wcache.plan import family
from wcache.plan.family import ModelDims, UnsupportedPlanError

# quant_method → why wcache does not serve it: their tensors (packed int4 words, group scales, permutations)
# are neither a projection's weight nor its per-channel or per-tensor companions.
UNSERVED_QUANTIZATIONS: dict[str, str] = {
    method: "packs 4-bit codes into int32 qweight/qzeros words the fused plan does not stack"
    for method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "marlin", "bitsandbytes", "gguf")
}
SERVED_QUANTIZATIONS = frozenset({"compressed-tensors", "fp8"})


def check_quantization(model_config: ModelConfig) -> None:
    """UnsupportedPlanError, naming the format, for a quantization the daemon's tensors cannot serve."""
    method = model_config.quantization
    if not method or method in SERVED_QUANTIZATIONS:
        return
    why = UNSERVED_QUANTIZATIONS.get(method, "is not one whose tensors the fused plan knows")
    raise UnsupportedPlanError(f"wcache does not serve {method} checkpoints to vLLM ({method} {why}).")


def layout_for_vllm(model_config: ModelConfig, config: Mapping[str, Any] | None) -> str:
    """"fused" when vLLM's model class fuses exactly as the family's plan does, "identity" when it fuses none
    of it; UnsupportedPlanError, with the reason, when the class and the plan disagree."""
    model_class, _ = get_model_architecture(model_config)
    packed: Mapping[str, list[str]] = getattr(model_class, "packed_modules_mapping", {}) or {}
    if not family.fuses_like_family(packed):
        return "identity"
    family.check_engine_fusions(packed, ModelDims.from_config(config), model_class.__name__)
    return "fused"


def daemon_name(parameter: str) -> str:
    """The daemon's name for a vLLM parameter: its own, but for stacked experts, which vLLM 0.32 keeps one module
    deeper (`mlp.experts.routed_experts.w13_weight`) than the plan names them (`mlp.experts.w13_weight`)."""
    head, dot, leaf = parameter.rpartition(".")
    if leaf not in family.EXPERT_STACK_LEAVES or ".experts." not in f"{head}.":
        return parameter
    return f"{head.split('.experts', 1)[0]}.experts{dot}{leaf}"


def expert_note(model: nn.Module, assigned: Iterable[str]) -> str:
    """"; E of S stacked expert parameters took the daemon's tensors" for a mixture of experts, else "".

    Asked before vLLM's post-processing, which may repack the experts into parameters of its own.
    """
    stacks = [name for name, _ in model.named_parameters()
              if name.rsplit(".", 1)[-1] in family.EXPERT_STACKS and ".experts." in name]
    if not stacks:
        return ""
    taken = set(assigned)
    took = sum(name in taken for name in stacks)
    return f"; {took} of {len(stacks)} stacked expert parameters took the daemon's tensors"
