"""The processing plan in action: which engine tensors one rank holds, and how each is made from checkpoint tensors.

`build_plan` turns a resolved `PlanSpec`, config.json and the checkpoint's manifest into a `ProcessingPlan`: a
fixed, ordered list of `OutputSpec`s and, for each, a recipe of checkpoint slices. `ProcessingPlan.produce`
runs one recipe. The daemon and the engine's disk path both call it, so their processed bytes are equal.

Building a plan needs no torch: only running a recipe imports it, so a daemon whose outputs are all checkpoint
bytes unchanged never waits for `import torch`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wcache.checkpoint import hf_names
from wcache.checkpoint.dtypes import CASTABLE, TORCH_ITEMSIZE, TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest
from wcache.errors import BadInputError, CheckpointError
from wcache.plan.quantize import QUANTIZED_DTYPES, channel_scales, is_linear_weight, quantize_rows, scale_name
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    import torch

_ROTARY_BUFFER = ".rotary_emb.inv_freq"
# vLLM's DEFAULT_VOCAB_PADDING_SIZE: it pads the vocabulary to a multiple of it before splitting it across ranks.
VOCAB_PADDING = 64

Source = Callable[[str], "torch.Tensor"]


class UnsupportedPlanError(BadInputError):
    """The plan cannot be applied to this checkpoint (its layout, its config, or the TP size)."""


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One engine tensor this rank holds."""

    name: str  # engine name
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16", "int8", "float8_e4m3fn"
    shape: tuple[int, ...]
    sources: tuple[str, ...]  # checkpoint tensor names it is made from

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Piece:
    """A slice of one checkpoint tensor: `length` indices from `start` along `dim`, or all of it if `dim` is None."""

    source: str
    dim: int | None
    start: int
    length: int
    source_shape: tuple[int, ...]
    source_dtype: str  # torch dtype name, checked against what `source()` returns


@dataclass(frozen=True, slots=True)
class Recipe:
    """How one output is made: pieces stacked along dim 0 into `shape`, rows past them zero (vocab padding).

    `kind` is "tensor" (cast into the output dtype), "quantized" (the stacked float32 weight, quantized) or
    "scale" (that weight's per-row scales).
    """

    kind: str
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ProcessingPlan:
    """One rank's engine tensors in a fixed order, and the recipe for each. Build it with `build_plan`."""

    spec: PlanSpec
    outputs: tuple[OutputSpec, ...]
    recipes: Mapping[str, Recipe] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of all outputs together (before any arena alignment)."""
        return sum(o.nbytes for o in self.outputs)

    def produce(self, output: OutputSpec, source: Source, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Make one output from checkpoint tensors; `source(name)` returns one (never written to).

        Returns a new contiguous CPU tensor with exactly `output.dtype` and `output.shape`, or, when `out` is
        given (a contiguous tensor of that dtype and shape, e.g. a slot in an arena), fills and returns `out`,
        so the daemon writes each output once instead of copying it again.
        """
        import torch

        recipe = self.recipes.get(output.name)
        if recipe is None or output.shape != (recipe.shape[:1] if recipe.kind == "scale" else recipe.shape):
            raise KeyError(f"{output.name!r} with shape {output.shape} is not an output of this plan")
        dtype = getattr(torch, output.dtype)
        if out is not None and (out.dtype != dtype or tuple(out.shape) != output.shape or not out.is_contiguous()):
            raise ValueError(f"out for {output.name!r} must be a contiguous {output.dtype} tensor of shape "
                             f"{output.shape}, not {out.dtype} {tuple(out.shape)}")
        if recipe.kind == "tensor":
            return _assemble(recipe, source, dtype, out)
        # Quantization works on the stacked weight in float32 on the CPU: an exact upcast of any floating source,
        # and CPU float32 arithmetic that gives the same bits on every call and in every process.
        weight = _assemble(recipe, source, torch.float32, None)
        method = self.spec.quantization
        scales = channel_scales(weight, method)
        result = scales if recipe.kind == "scale" else quantize_rows(weight, scales, method)
        if out is None:
            return result
        return out.copy_(result)


    def checkpoint_views(
        self, tensors: Mapping[str, torch.Tensor], outputs: Collection[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Checkpoint-named views of processed tensors: every source an output holds whole, as its rows.

        With TP 1 every unquantized source is held whole (q, k and v are consecutive row ranges of qkv_proj,
        gate and up of gate_up_proj), so an engine that loads Hugging Face names can take views instead of
        reading the checkpoint. Sources held only as a TP shard, or quantized, are absent. `outputs` limits
        the views to the sources of those outputs.
        """
        views: dict[str, torch.Tensor] = {}
        for output in self.outputs:
            recipe = self.recipes[output.name]
            wanted = outputs is None or output.name in outputs
            if recipe.kind != "tensor" or output.name not in tensors or not wanted:
                continue
            processed = tensors[output.name]
            row = 0
            for piece in recipe.pieces:
                if piece.dim is None:
                    views[piece.source] = processed
                    break
                rows = piece.length if piece.dim == 0 else piece.source_shape[0]
                if piece.start == 0 and piece.length == piece.source_shape[piece.dim]:
                    views[piece.source] = processed.narrow(0, row, rows)
                row += rows
        return views


def process_all(plan: ProcessingPlan, source: Source) -> dict[str, torch.Tensor]:
    """Every output of the plan, by engine name, in the plan's order."""
    return {o.name: plan.produce(o, source) for o in plan.outputs}


def _assemble(recipe: Recipe, source: Source, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    # Pieces are views of the source (narrow never copies), and copy_ casts while it writes into the result, so
    # the only full-size buffer is the output itself: no checkpoint tensor is ever materialized first.
    import torch

    target = out if out is not None else torch.empty(recipe.shape, dtype=dtype)
    fetched: dict[str, torch.Tensor] = {}
    row = 0
    for piece in recipe.pieces:
        tensor = fetched.get(piece.source)
        if tensor is None:
            tensor = fetched[piece.source] = _fetch(source, piece)
        if piece.dim is None:
            target.copy_(tensor)
            return target
        view = tensor.narrow(piece.dim, piece.start, piece.length)
        target.narrow(0, row, view.shape[0]).copy_(view)
        row += view.shape[0]
    if row < recipe.shape[0]:
        target.narrow(0, row, recipe.shape[0] - row).zero_()
    return target


def _fetch(source: Source, piece: Piece) -> torch.Tensor:
    import torch

    tensor = source(piece.source)
    if tuple(tensor.shape) != piece.source_shape or tensor.dtype != getattr(torch, piece.source_dtype):
        raise CheckpointError(
            f"tensor {piece.source!r} reads as {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)} "
            f"but its header says {piece.source_dtype} {piece.source_shape}."
        )
    return tensor


class _Builder:
    """Collects outputs and recipes in order, choosing each output's dtype and adding quantization scales."""

    def __init__(self, spec: PlanSpec, manifest: Mapping[str, TensorDigest]) -> None:
        self.spec = spec
        self.manifest = manifest
        self.outputs: list[OutputSpec] = []
        self.recipes: dict[str, Recipe] = {}

    def piece(self, name: str, dim: int | None = None, start: int = 0, length: int = 0) -> Piece:
        entry = self.manifest[name]
        return Piece(name, dim, start, length, tuple(entry.shape), _torch_name(entry))

    def whole(self, name: str) -> None:
        """An output that is a checkpoint tensor unchanged but for its dtype."""
        self.add(name, (self.piece(name),), tuple(self.manifest[name].shape))

    def add(self, name: str, pieces: tuple[Piece, ...], shape: tuple[int, ...], sources: tuple[str, ...] = ()) -> None:
        sources = sources or tuple(dict.fromkeys(p.source for p in pieces))
        entries = [self.manifest[s] for s in sources]
        castable = all(e.dtype in CASTABLE for e in entries)
        method = self.spec.quantization
        if method != "none" and is_linear_weight(name, shape):
            if not castable:
                raise UnsupportedPlanError(
                    f"tensor {sources[0]!r} is stored as {entries[0].dtype}; quantizing an already quantized "
                    "checkpoint is not supported."
                )
            self._emit(OutputSpec(name, QUANTIZED_DTYPES[method], shape, sources), Recipe("quantized", pieces, shape))
            self._emit(OutputSpec(scale_name(name), "float32", shape[:1], sources), Recipe("scale", pieces, shape))
            return
        if castable:
            dtype = self.spec.dtype
        elif self.spec.layout == "identity":
            dtype = _torch_name(entries[0])  # identity keeps non-floating and float8 tensors exactly as stored
        else:
            raise UnsupportedPlanError(
                f"tensor {sources[0]!r} is stored as {entries[0].dtype}, which the fused plan cannot shard or cast; "
                "use --plan identity."
            )
        self._emit(OutputSpec(name, dtype, shape, sources), Recipe("tensor", pieces, shape))

    def _emit(self, output: OutputSpec, recipe: Recipe) -> None:
        if output.name in self.recipes:
            # Only possible when a checkpoint already holds `x.weight_scale` next to a weight being quantized.
            raise UnsupportedPlanError(
                f"tensor {output.name!r} would be made twice because the checkpoint already holds quantization "
                "scales; quantizing it again is not supported."
            )
        self.outputs.append(output)
        self.recipes[output.name] = recipe

    def plan(self) -> ProcessingPlan:
        return ProcessingPlan(self.spec, tuple(self.outputs), dict(self.recipes))


def build_plan(spec: PlanSpec, config: Mapping[str, Any] | None, tensors: Sequence[TensorDigest]) -> ProcessingPlan:
    """The plan for one rank of `spec` over a checkpoint with this config and manifest.

    Raises `UnsupportedPlanError` (exit code 2) with one sentence for anything it cannot do.
    """
    if spec.dtype == "auto":
        raise ValueError("resolve() the plan's dtype before building a processing plan")
    manifest: dict[str, TensorDigest] = {}
    for entry in tensors:
        if entry.name in manifest:
            raise CheckpointError(f"tensor {entry.name!r} appears twice in the checkpoint.")
        _torch_name(entry)
        manifest[entry.name] = entry
    builder = _Builder(spec, manifest)
    if spec.layout == "identity":
        check_tp_split(spec, config)
        # Sorted, so the order does not depend on how the manifest was listed (by shard, by name).
        for name in sorted(manifest):
            builder.whole(name)
        return builder.plan()
    _build_fused(builder, _Dims.from_config(config), manifest)
    return builder.plan()


def check_tp_split(spec: PlanSpec, config: Mapping[str, Any] | None) -> None:
    """UnsupportedPlanError unless `spec`'s --tp splits a model with this config; reads no tensors, so a TP
    launcher can refuse before starting a process per rank."""
    if spec.layout == "identity":
        if spec.tp_size != 1:
            raise UnsupportedPlanError("the identity plan holds unsharded weights; use --tp 1 or --plan fused.")
        return
    _check_split(spec.tp_size, _Dims.from_config(config))


def _torch_name(entry: TensorDigest) -> str:
    name = TORCH_NAMES.get(entry.dtype)
    # Checked against torch where it is loaded (an engine); a daemon that has not imported it serves the bytes,
    # and an engine on an older torch refuses them when it attaches.
    torch = sys.modules.get("torch")
    if name is None or (torch is not None and not hasattr(torch, name)):
        raise UnsupportedPlanError(f"tensor {entry.name!r} has dtype {entry.dtype}, which this torch cannot hold.")
    return name


@dataclass(frozen=True, slots=True)
class _Dims:
    """The config fields that shape a Llama/Qwen2/Qwen3/Mistral checkpoint."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tie: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> _Dims:
        if config is None:
            raise UnsupportedPlanError(
                "the fused plan needs the model's config.json to split heads; add it or use --plan identity."
            )

        def number(key: str, default: int | None = None) -> int:
            value = config.get(key)
            if value is None:
                if default is None:
                    raise UnsupportedPlanError(f"config.json has no {key}, which the fused plan needs.")
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedPlanError(
                    f"config.json has {key} = {value!r}; the fused plan needs a positive integer."
                )
            return value

        hidden, heads = number("hidden_size"), number("num_attention_heads")
        # Hugging Face's defaults: no num_key_value_heads means multi-head attention, no head_dim means
        # hidden_size split evenly across heads.
        kv_heads = number("num_key_value_heads", heads)
        if config.get("head_dim") is None and hidden % heads:
            raise UnsupportedPlanError(
                f"config.json has no head_dim and hidden_size {hidden} is not a multiple of {heads} heads."
            )
        head_dim = number("head_dim", hidden // heads)
        tie = config.get("tie_word_embeddings", False)
        return cls(hidden, heads, kv_heads, head_dim, number("intermediate_size"), number("vocab_size"),
                   number("num_hidden_layers"), bool(tie))


def _check_split(tp: int, d: _Dims) -> None:
    if d.heads % tp:
        raise UnsupportedPlanError(f"{d.heads} attention heads cannot be split evenly across --tp {tp}.")
    if d.kv_heads % tp and tp % d.kv_heads:
        raise UnsupportedPlanError(
            f"{d.kv_heads} key/value heads can be neither split nor replicated evenly across --tp {tp}."
        )
    if d.intermediate % tp:
        raise UnsupportedPlanError(f"intermediate_size {d.intermediate} cannot be split evenly across --tp {tp}.")


def _build_fused(b: _Builder, d: _Dims, manifest: Mapping[str, TensorDigest]) -> None:
    tp, rank = b.spec.tp_size, b.spec.tp_rank
    _check_split(tp, d)
    expected, required = _expected_shapes(d)
    unknown = sorted(n for n in manifest if n not in expected and not n.endswith(_ROTARY_BUFFER))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedPlanError(
            f"the fused plan does not know tensor {unknown[0]!r}{more}; use --plan identity to load it by name."
        )
    missing = [n for n in required if n not in manifest]
    if missing:
        raise UnsupportedPlanError(f"the checkpoint lacks {missing[0]!r}, which the fused plan needs.")
    for name, entry in manifest.items():
        shape = expected.get(name)
        if shape is not None and tuple(entry.shape) != shape:
            raise UnsupportedPlanError(
                f"tensor {name!r} has shape {tuple(entry.shape)} but config.json implies {shape}."
            )

    # Column-parallel attention: rank r holds a contiguous block of query heads and the key/value heads they
    # read. With fewer kv heads than ranks each kv head is replicated, and rank r holds head r*kv//tp (vLLM's rule).
    q_rows = d.heads // tp * d.head_dim
    kv_per_rank = max(d.kv_heads // tp, 1)
    kv_start = rank * d.kv_heads // tp * d.head_dim
    kv_rows = kv_per_rank * d.head_dim
    inter = d.intermediate // tp

    def rows(name: str, start: int, length: int) -> Piece:
        return b.piece(name, 0, start, length)

    def cols(name: str, start: int, length: int) -> Piece:
        return b.piece(name, 1, start, length)

    _vocab_parallel(b, hf_names.EMBED, d)
    for i in range(d.layers):
        p, a, m = hf_names.layer(i), hf_names.attention(i), hf_names.mlp(i)
        b.whole(f"{p}.input_layernorm.weight")
        qkv = (rows(f"{a}.q_proj.weight", rank * q_rows, q_rows), rows(f"{a}.k_proj.weight", kv_start, kv_rows),
               rows(f"{a}.v_proj.weight", kv_start, kv_rows))
        b.add(f"{a}.qkv_proj.weight", qkv, (q_rows + 2 * kv_rows, d.hidden))
        present = [n for n in (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias") if n in manifest]
        if 0 < len(present) < 3:
            raise UnsupportedPlanError(
                f"layer {i} has a bias for only some of q, k and v, so qkv_proj cannot be fused."
            )
        if present:
            biases = (rows(f"{a}.q_proj.bias", rank * q_rows, q_rows), rows(f"{a}.k_proj.bias", kv_start, kv_rows),
                      rows(f"{a}.v_proj.bias", kv_start, kv_rows))
            b.add(f"{a}.qkv_proj.bias", biases, (q_rows + 2 * kv_rows,))
        b.add(f"{a}.o_proj.weight", (cols(f"{a}.o_proj.weight", rank * q_rows, q_rows),), (d.hidden, q_rows))
        # A row-parallel bias is added once after the all-reduce, so every rank keeps all of it.
        for optional in (f"{a}.o_proj.bias", f"{a}.q_norm.weight", f"{a}.k_norm.weight"):
            if optional in manifest:
                b.whole(optional)
        b.whole(f"{p}.post_attention_layernorm.weight")
        gate_up = (rows(f"{m}.gate_proj.weight", rank * inter, inter), rows(f"{m}.up_proj.weight", rank * inter, inter))
        b.add(f"{m}.gate_up_proj.weight", gate_up, (2 * inter, d.hidden))
        b.add(f"{m}.down_proj.weight", (cols(f"{m}.down_proj.weight", rank * inter, inter),), (d.hidden, inter))
    b.whole(hf_names.FINAL_NORM)
    # Tied embeddings: the engine reuses embed_tokens, so lm_head exists only if the checkpoint stores one
    # (Qwen3-0.6B does, tied or not); the engine then uses the stored bytes, exactly as transformers does.
    if hf_names.LM_HEAD in manifest:
        _vocab_parallel(b, hf_names.LM_HEAD, d)


def vocab_rows_per_rank(vocab: int, tp: int) -> int:
    """Rows of a vocab-parallel tensor (embed_tokens, lm_head) on each of `tp` ranks.

    TP 1 keeps the checkpoint's shape (what transformers and the reference engine load). Split, the vocab is
    first padded with zero rows to a multiple of VOCAB_PADDING, as vLLM pads it, so that each rank's shard is
    exactly vLLM's parameter; every rank's shard has one shape, and engines mask logits past vocab_size.
    """
    if tp == 1:
        return vocab
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def _vocab_parallel(b: _Builder, name: str, d: _Dims) -> None:
    tp, rank = b.spec.tp_size, b.spec.tp_rank
    per_rank = vocab_rows_per_rank(d.vocab, tp)
    start = rank * per_rank
    real = max(0, min(per_rank, d.vocab - start))
    pieces = (b.piece(name, 0, start, real),) if real else ()
    b.add(name, pieces, (per_rank, d.hidden), sources=(name,))


def _expected_shapes(d: _Dims) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every tensor name the fused plan understands with its shape, and those it cannot do without."""
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    expected: dict[str, tuple[int, ...]] = {
        hf_names.EMBED: (d.vocab, d.hidden),
        hf_names.FINAL_NORM: (d.hidden,),
        hf_names.LM_HEAD: (d.vocab, d.hidden),
    }
    required = [hf_names.EMBED, hf_names.FINAL_NORM]
    if not d.tie:
        required.append(hf_names.LM_HEAD)
    for i in range(d.layers):
        p, a, m = hf_names.layer(i), hf_names.attention(i), hf_names.mlp(i)
        layer = {
            f"{p}.input_layernorm.weight": (d.hidden,),
            f"{a}.q_proj.weight": (q_out, d.hidden),
            f"{a}.k_proj.weight": (kv_out, d.hidden),
            f"{a}.v_proj.weight": (kv_out, d.hidden),
            f"{a}.o_proj.weight": (d.hidden, q_out),
            f"{p}.post_attention_layernorm.weight": (d.hidden,),
            f"{m}.gate_proj.weight": (d.intermediate, d.hidden),
            f"{m}.up_proj.weight": (d.intermediate, d.hidden),
            f"{m}.down_proj.weight": (d.hidden, d.intermediate),
        }
        required.extend(layer)
        expected.update(layer)
        expected.update({
            f"{a}.q_norm.weight": (d.head_dim,),
            f"{a}.k_norm.weight": (d.head_dim,),
            f"{a}.q_proj.bias": (q_out,),
            f"{a}.k_proj.bias": (kv_out,),
            f"{a}.v_proj.bias": (kv_out,),
            f"{a}.o_proj.bias": (d.hidden,),
        })
    return expected, required
