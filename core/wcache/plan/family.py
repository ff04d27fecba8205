"""The model family wcache processes (Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE): one owner for its facts.

Its Hugging Face tensor names, the fusions engines make of them (in the shape of vLLM's
`packed_modules_mapping`), the suffixes of a pre-quantized checkpoint's tensors, how a mixture of experts is
stacked, and the one strict parser of config.json's dimensions. The plan, the reference engine, the
integrations and the dev checkpoint writers all read them here. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wcache.errors import BadInputError, option

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# Fused module → the checkpoint modules it stacks, row after row: vLLM's packed_modules_mapping.
QKV = "qkv_proj"
GATE_UP = "gate_up_proj"
FUSIONS: dict[str, tuple[str, ...]] = {QKV: ("q_proj", "k_proj", "v_proj"), GATE_UP: ("gate_proj", "up_proj")}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A decoder layer's linear projections by parent module, as checkpoints name them and as the fused layout fuses them.
LAYER_PROJECTIONS: dict[str, tuple[str, ...]] = {"self_attn": (*ATTENTION_PROJECTIONS, QKV),
                                                 "mlp": (*MLP_PROJECTIONS, GATE_UP)}

# A mixture of experts: each expert is an MLP of its own in the checkpoint; engines hold one tensor per
# projection kind, the experts stacked along a new first dimension (vLLM's FusedMoE w13_weight and w2_weight).
ROUTER = "gate"  # mlp.gate.weight: [num_experts, hidden]
EXPERT_STACKS: dict[str, tuple[str, ...]] = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}
# A pre-quantized checkpoint's per-channel expert scales are stacked alike (FusedMoE's w13_weight_scale, w2_…).
EXPERT_STACK_LEAVES = (*EXPERT_STACKS, *(f"{stack}_scale" for stack in EXPERT_STACKS))

# A pre-quantized linear module `x` stores `x.weight` as codes and, beside it, tensors that give them meaning.
# Per output channel ones ([rows, 1] or [rows]) are stacked and sharded with the weight's rows; the others
# (per-tensor scales) are held whole under their checkpoint names for the engine's own loader.
PREQUANTIZED_SUFFIXES = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
# Engines hold scales in float32 (vLLM's compressed-tensors and fp8 parameters); a floating scale is upcast
# to it exactly, so the engine's parameter can be the daemon's tensor.
SCALE_DTYPE = "float32"


class UnsupportedPlanError(BadInputError):
    """The plan cannot be applied to this checkpoint (its layout, its config, or the TP size)."""


def layer(i: int) -> str:
    """The prefix of decoder layer `i`'s tensors."""
    return f"model.layers.{i}"


def attention(i: int) -> str:
    """The prefix of layer `i`'s attention projections and norms (q_proj, …, q_norm)."""
    return f"{layer(i)}.self_attn"


def mlp(i: int) -> str:
    """The prefix of layer `i`'s MLP: its projections (dense), or its router and experts (mixture of experts)."""
    return f"{layer(i)}.mlp"


def expert(i: int, e: int) -> str:
    """The prefix of expert `e` of layer `i` in the checkpoint (its gate_proj, up_proj, down_proj)."""
    return f"{mlp(i)}.experts.{e}"


def expert_stack(i: int, stack: str) -> str:
    """The engine name of layer `i`'s stacked experts for one of EXPERT_STACK_LEAVES."""
    return f"{mlp(i)}.experts.{stack}"


def companion(weight: str, suffix: str) -> str:
    """`x.weight` and one of PREQUANTIZED_SUFFIXES → the name of that tensor of module `x` (`x.weight_scale`)."""
    return f"{weight.removesuffix('.weight')}.{suffix}"


def prequantized_method(config: Mapping[str, Any] | None) -> str | None:
    """How a pre-quantized checkpoint's codes were made: the `quant_method` config.json's quantization_config
    names ("compressed-tensors", "fp8", …), or None for a floating checkpoint. Not load-time quantization (the
    plan's `quantization` field, `load_time_quantization`)."""
    block = (config or {}).get("quantization_config")
    if not isinstance(block, Mapping):
        return None
    method = block.get("quant_method")
    return str(method) if method else "unnamed"


@dataclass(frozen=True, slots=True)
class ModelDims:
    """config.json's dimensions, read strictly: every field the family's shapes depend on."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tie: bool
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> ModelDims:
        """The dimensions, or UnsupportedPlanError naming the field that is missing or not a positive integer."""
        if config is None:
            raise UnsupportedPlanError(
                "the fused plan needs the model's config.json to split heads; add it or use "
                f"{option('layout', 'identity')}."
            )

        def number(key: str, default: int | None = None) -> int:
            value = config.get(key)
            if value is None:
                if default is None:
                    raise UnsupportedPlanError(f"config.json has no {key}, which the model's shapes need.")
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedPlanError(f"config.json has {key} = {value!r}; the model needs a positive integer.")
            return value

        hidden, heads, layers = number("hidden_size"), number("num_attention_heads"), number("num_hidden_layers")
        # Hugging Face's defaults: no num_key_value_heads means multi-head attention, no head_dim means
        # hidden_size split evenly across heads.
        kv_heads = number("num_key_value_heads", heads)
        if config.get("head_dim") is None and hidden % heads:
            raise UnsupportedPlanError(
                f"config.json has no head_dim and hidden_size {hidden} is not a multiple of {heads} heads."
            )
        head_dim = number("head_dim", hidden // heads)
        experts = config.get("num_experts") or 0
        sparse: tuple[int, ...] = ()
        if experts:
            experts = number("num_experts")
            step = number("decoder_sparse_step", 1)
            dense = config.get("mlp_only_layers") or []
            if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
                raise UnsupportedPlanError(f"config.json has mlp_only_layers = {dense!r}; it must list layer numbers.")
            sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        per_token = number("num_experts_per_tok") if experts else 0
        if per_token > experts:
            raise UnsupportedPlanError(f"config.json routes each token to {per_token} of {experts} experts.")
        expert_inter = number("moe_intermediate_size") if experts else 0
        # A dense layer's intermediate_size is needed only where some layer is dense.
        intermediate = number("intermediate_size", None if len(sparse) < layers else 1)
        return cls(hidden, heads, kv_heads, head_dim, intermediate, number("vocab_size"), layers,
                   bool(config.get("tie_word_embeddings", False)), experts, per_token, expert_inter, sparse)

    def fusions(self) -> dict[str, tuple[str, ...]]:
        """The fusions the fused plan makes for this model: qkv always, gate_up where some layer is dense."""
        return {name: parts for name, parts in FUSIONS.items() if name == QKV or len(self.sparse_layers) < self.layers}


def check_engine_fusions(packed: Mapping[str, Sequence[str]], dims: ModelDims, model: str) -> None:
    """UnsupportedPlanError unless the engine's model class fuses exactly what the fused plan fuses.

    `packed` is the class's packed_modules_mapping (fused module → its checkpoint modules); `model` names the
    class in the sentence.
    """
    theirs = {name: tuple(parts) for name, parts in packed.items()}
    ours = dims.fusions()
    for name, parts in theirs.items():
        if ours.get(name) != parts:
            raise UnsupportedPlanError(
                f"{model} fuses {name} from {', '.join(parts)}, which the fused plan does not make; "
                f"preload it with {option('layout', 'identity')}."
            )
    for name in ours:
        if name not in theirs:
            raise UnsupportedPlanError(
                f"{model} does not fuse {name}, which the fused plan makes; preload it with "
                f"{option('layout', 'identity')}."
            )


def fuses_like_family(packed: Mapping[str, Sequence[str]]) -> bool:
    """Whether an engine's packed_modules_mapping makes any of the family's fusions (the fused module from the
    same checkpoint modules): then its model is of the family, and its layout the fused one."""
    return any(FUSIONS.get(name) == tuple(parts) for name, parts in packed.items())


# Hugging Face transformers' classes of the family's dense models, whose modules take views of fused tensors
# by name (transformers has no packed_modules_mapping to ask).
DENSE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def layout_for_architectures(architectures: Sequence[str] | None) -> str:
    """The layout a transformers model asks for: fused for the family's dense classes, else tensors by name."""
    return "fused" if set(architectures or ()) & DENSE_ARCHITECTURES else "identity"


@dataclass(frozen=True, slots=True)
class Leaf:
    """One checkpoint tensor of the family, with its shape."""

    name: str
    shape: tuple[int, ...]


def layer_leaves(dims: ModelDims, i: int, *, qk_norm: bool) -> Iterator[Leaf]:
    """Layer `i`'s checkpoint tensors in module order (unquantized, without optional biases)."""
    p, a, m = layer(i), attention(i), mlp(i)
    q_out, kv_out = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    yield Leaf(f"{p}.input_layernorm.weight", (dims.hidden,))
    yield Leaf(f"{a}.q_proj.weight", (q_out, dims.hidden))
    yield Leaf(f"{a}.k_proj.weight", (kv_out, dims.hidden))
    yield Leaf(f"{a}.v_proj.weight", (kv_out, dims.hidden))
    yield Leaf(f"{a}.o_proj.weight", (dims.hidden, q_out))
    if qk_norm:
        yield Leaf(f"{a}.q_norm.weight", (dims.head_dim,))
        yield Leaf(f"{a}.k_norm.weight", (dims.head_dim,))
    yield Leaf(f"{p}.post_attention_layernorm.weight", (dims.hidden,))
    if i in dims.sparse_layers:
        yield Leaf(f"{m}.{ROUTER}.weight", (dims.experts, dims.hidden))
        for e in range(dims.experts):
            yield from _mlp_leaves(expert(i, e), dims.hidden, dims.expert_intermediate)
    else:
        yield from _mlp_leaves(m, dims.hidden, dims.intermediate)


def _mlp_leaves(prefix: str, hidden: int, inter: int) -> Iterator[Leaf]:
    yield Leaf(f"{prefix}.gate_proj.weight", (inter, hidden))
    yield Leaf(f"{prefix}.up_proj.weight", (inter, hidden))
    yield Leaf(f"{prefix}.down_proj.weight", (hidden, inter))


def is_dense_projection(name: str) -> bool:
    """Whether `name` is the weight of a decoder layer's attention or MLP projection, by its checkpoint name
    (q_proj, …, down_proj) or its fused one (qkv_proj, gate_up_proj); an expert's are not (`is_expert_projection`).

    The layers may sit under any prefix, as in a multimodal checkpoint's `model.language_model.layers`.
    """
    parts = name.split(".")
    return (len(parts) >= 5 and parts[-1] == "weight" and parts[-2] in LAYER_PROJECTIONS.get(parts[-3], ())
            and _is_layer(parts[-5:-3]))


def is_expert_projection(name: str) -> bool:
    """Whether `name` is the weight of one expert's projection in the checkpoint (`….mlp.experts.3.up_proj.weight`)."""
    parts = name.split(".")
    return (len(parts) >= 7 and parts[-1] == "weight" and parts[-2] in MLP_PROJECTIONS and parts[-3].isdecimal()
            and parts[-5:-3] == ["mlp", "experts"] and _is_layer(parts[-7:-5]))


def is_projection(name: str) -> bool:
    """Whether `name` is a decoder layer's linear projection weight: attention, MLP or expert."""
    return is_dense_projection(name) or is_expert_projection(name)


def _is_layer(parts: list[str]) -> bool:
    """Whether two name parts are `layers.<i>`."""
    return parts[0] == "layers" and parts[1].isdecimal()
