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

from wcache.checkpoint.dtypes import CASTABLE, TORCH_ITEMSIZE, TORCH_NAMES
from wcache.checkpoint.manifest import TensorDigest
from wcache.errors import CheckpointError, option
from wcache.plan import family
from wcache.plan.family import ModelDims, UnsupportedPlanError
from wcache.plan.quantize import QUANTIZED_DTYPES, channel_scales, is_linear_weight, quantize_rows, scale_name
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    import torch

_ROTARY_BUFFER = ".rotary_emb.inv_freq"
# vLLM's DEFAULT_VOCAB_PADDING_SIZE: it pads the vocabulary to a multiple of it before splitting it across ranks.
VOCAB_PADDING = 64

Source = Callable[[str], "torch.Tensor"]

__all__ = ["OutputSpec", "Piece", "ProcessingPlan", "Recipe", "UnsupportedPlanError", "build_plan", "check_tp_split",
           "process_all"]


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

    A 3-D shape (a mixture of experts' stacked projections) is filled as its first two dimensions flattened:
    expert after expert, each expert's pieces in turn.

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
            processed = _rows(tensors[output.name])
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

    result = out if out is not None else torch.empty(recipe.shape, dtype=dtype)
    target = _rows(result)
    fetched: dict[str, torch.Tensor] = {}
    row = 0
    for piece in recipe.pieces:
        tensor = fetched.get(piece.source)
        if tensor is None:
            tensor = fetched[piece.source] = _fetch(source, piece)
        if piece.dim is None:
            target.copy_(tensor.reshape(target.shape))
            return result
        view = tensor.narrow(piece.dim, piece.start, piece.length)
        target.narrow(0, row, view.shape[0]).copy_(view)
        row += view.shape[0]
    if row < target.shape[0]:
        target.narrow(0, row, target.shape[0] - row).zero_()
    return result


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A stacked experts tensor [experts, rows, cols] as [experts × rows, cols] (a view); others as they are."""
    return tensor.flatten(0, 1) if tensor.dim() == 3 else tensor


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

    def __init__(self, spec: PlanSpec, manifest: Mapping[str, TensorDigest], prequantized: bool = False) -> None:
        self.spec = spec
        self.manifest = manifest
        # config.json declares a quantization_config: its codes are stacked and sharded as stored, never cast.
        self.prequantized = prequantized
        self.outputs: list[OutputSpec] = []
        self.recipes: dict[str, Recipe] = {}

    def piece(self, name: str, dim: int | None = None, start: int = 0, length: int = 0) -> Piece:
        entry = self.manifest[name]
        return Piece(name, dim, start, length, tuple(entry.shape), _torch_name(entry))

    def whole(self, name: str) -> None:
        """An output that is a checkpoint tensor unchanged but for its dtype."""
        self.add(name, (self.piece(name),), tuple(self.manifest[name].shape))

    def add(self, name: str, pieces: tuple[Piece, ...], shape: tuple[int, ...], sources: tuple[str, ...] = (),
            dtype: str | None = None) -> None:
        """An output stacked from `pieces`; `dtype` overrides the plan's for floating sources (scales)."""
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
            dtype = dtype or self.spec.dtype
        elif self.spec.layout == "identity" or (self.prequantized and len({e.dtype for e in entries}) == 1):
            # Kept exactly as stored: identity's non-floating tensors, and a pre-quantized checkpoint's codes.
            dtype = _torch_name(entries[0])
        else:
            raise UnsupportedPlanError(
                f"tensor {sources[0]!r} is stored as {entries[0].dtype}, which the fused plan cannot shard or cast "
                f"without a quantization_config in config.json; use {option('layout', 'identity')}."
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
    builder = _Builder(spec, manifest, family.quantization_method(config) is not None)
    if spec.layout == "identity":
        check_tp_split(spec, config)
        # Sorted, so the order does not depend on how the manifest was listed (by shard, by name).
        for name in sorted(manifest):
            builder.whole(name)
        return builder.plan()
    _build_fused(builder, ModelDims.from_config(config), manifest)
    return builder.plan()


def check_tp_split(spec: PlanSpec, config: Mapping[str, Any] | None) -> None:
    """UnsupportedPlanError unless `spec`'s TP size splits a model with this config; reads no tensors, so a TP
    launcher can refuse before starting a process per rank."""
    if spec.layout == "identity":
        if spec.tp_size != 1:
            raise UnsupportedPlanError(f"the identity plan holds unsharded weights; use {option('tp_size', 1)} or "
                                       f"{option('layout', 'fused')}.")
        return
    _check_split(spec.tp_size, ModelDims.from_config(config))


def _torch_name(entry: TensorDigest) -> str:
    name = TORCH_NAMES.get(entry.dtype)
    # Checked against torch where it is loaded (an engine); a daemon that has not imported it serves the bytes,
    # and an engine on an older torch refuses them when it attaches.
    torch = sys.modules.get("torch")
    if name is None or (torch is not None and not hasattr(torch, name)):
        raise UnsupportedPlanError(f"tensor {entry.name!r} has dtype {entry.dtype}, which this torch cannot hold.")
    return name


def _check_split(tp: int, d: ModelDims) -> None:
    if d.heads % tp:
        raise UnsupportedPlanError(f"{d.heads} attention heads cannot be split evenly across {option('tp_size', tp)}.")
    if d.kv_heads % tp and tp % d.kv_heads:
        raise UnsupportedPlanError(
            f"{d.kv_heads} key/value heads can be neither split nor replicated evenly across {option('tp_size', tp)}."
        )
    if len(d.sparse_layers) < d.layers and d.intermediate % tp:
        raise UnsupportedPlanError(f"intermediate_size {d.intermediate} cannot be split evenly across "
                                   f"{option('tp_size', tp)}.")
    if d.is_moe and d.expert_intermediate % tp:
        raise UnsupportedPlanError(
            f"moe_intermediate_size {d.expert_intermediate} cannot be split evenly across {option('tp_size', tp)}."
        )


class _Shards:
    """How one rank slices the family's projections, and the fusions it makes of them."""

    def __init__(self, b: _Builder, d: ModelDims) -> None:
        self.b, self.d = b, d
        tp, rank = b.spec.tp_size, b.spec.tp_rank
        self.tp, self.rank = tp, rank
        # Column-parallel attention: rank r holds a contiguous block of query heads and the key/value heads they
        # read. With fewer kv heads than ranks each kv head is replicated, and rank r holds head r*kv//tp
        # (vLLM's rule).
        self.q_rows = d.heads // tp * d.head_dim
        self.kv_start = rank * d.kv_heads // tp * d.head_dim
        self.kv_rows = max(d.kv_heads // tp, 1) * d.head_dim

    def rows(self, name: str, start: int, length: int) -> Piece:
        return self.b.piece(name, 0, start, length)

    def cols(self, name: str, start: int, length: int) -> Piece:
        return self.b.piece(name, 1, start, length)

    def column_parallel(self, fused: str, parts: list[tuple[str, int, int]], cols: int) -> None:
        """`fused.weight` from rows [start, start+length) of each part's weight, and each companion alike.

        Per-channel companions (scales, zero points: one row per output row) are sliced and stacked with the
        weight's rows; the others (per-tensor) are held whole for the engine's own loader.
        """
        pieces = tuple(self.rows(f"{part}.weight", start, length) for part, start, length in parts)
        self.b.add(f"{fused}.weight", pieces, (sum(length for _, _, length in parts), cols))
        for suffix in family.QUANTIZED_SUFFIXES:
            names = [f"{part}.{suffix}" for part, _, _ in parts]
            present = [n for n in names if n in self.b.manifest]
            if not present:
                continue
            if len(present) < len(names):
                raise UnsupportedPlanError(f"{names[len(present)]!r} is missing beside {present[0]!r}, so "
                                           f"{fused}.{suffix} cannot be fused.")
            shapes = [(tuple(self.b.manifest[n].shape), self.b.manifest[f"{part}.weight"].shape[0])
                      for n, (part, _, _) in zip(names, parts, strict=True)]
            if not all(len(shape) in (1, 2) and shape[0] == rows for shape, rows in shapes):
                for name in names:
                    self._companion_whole(name)
                continue
            trailing = tuple(self.b.manifest[names[0]].shape[1:])
            stacked = tuple(self.rows(n, start, length) for n, (_, start, length) in zip(names, parts, strict=True))
            self.b.add(f"{fused}.{suffix}", stacked, (sum(length for _, _, length in parts), *trailing),
                       dtype=family.SCALE_DTYPE)

    def row_parallel(self, module: str, start: int, length: int, rows: int) -> None:
        """`module.weight` from columns [start, start+length); its companions (per output row) whole."""
        self.b.add(f"{module}.weight", (self.cols(f"{module}.weight", start, length),), (rows, length))
        for suffix in family.QUANTIZED_SUFFIXES:
            name = f"{module}.{suffix}"
            if name in self.b.manifest:
                self._companion_whole(name)

    def _companion_whole(self, name: str) -> None:
        entry = self.b.manifest[name]
        self.b.add(name, (self.b.piece(name),), tuple(entry.shape), dtype=family.SCALE_DTYPE)

    def experts(self, i: int) -> None:
        """The router whole, and every expert's projections stacked as the engine holds them (vLLM's FusedMoE)."""
        d, b = self.d, self.b
        b.whole(f"{family.mlp(i)}.{family.ROUTER}.weight")
        inter = d.expert_intermediate // self.tp
        start = self.rank * inter
        w13: list[Piece] = []
        w2: list[Piece] = []
        for e in range(d.experts):
            prefix = family.expert(i, e)
            w13 += [self.rows(f"{prefix}.{part}.weight", start, inter) for part in family.EXPERT_STACKS["w13_weight"]]
            w2 += [self.cols(f"{prefix}.{part}.weight", start, inter) for part in family.EXPERT_STACKS["w2_weight"]]
        b.add(family.expert_stack(i, "w13_weight"), tuple(w13), (d.experts, 2 * inter, d.hidden))
        b.add(family.expert_stack(i, "w2_weight"), tuple(w2), (d.experts, d.hidden, inter))


def _build_fused(b: _Builder, d: ModelDims, manifest: Mapping[str, TensorDigest]) -> None:
    _check_split(b.spec.tp_size, d)
    expected, required = _expected_shapes(d)
    known = [n for n in manifest if n in expected or n.endswith(_ROTARY_BUFFER)
             or (b.prequantized and _is_companion(n, expected))]
    unknown = sorted(set(manifest) - set(known))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedPlanError(
            f"the fused plan does not know tensor {unknown[0]!r}{more}; use {option('layout', 'identity')} to load "
            "it by name."
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

    s = _Shards(b, d)
    q_rows, kv_start, kv_rows, rank = s.q_rows, s.kv_start, s.kv_rows, s.rank
    inter = d.intermediate // s.tp
    _vocab_parallel(b, family.EMBED, d)
    for i in range(d.layers):
        p, a, m = family.layer(i), family.attention(i), family.mlp(i)
        b.whole(f"{p}.input_layernorm.weight")
        qkv = [(f"{a}.q_proj", rank * q_rows, q_rows), (f"{a}.k_proj", kv_start, kv_rows),
               (f"{a}.v_proj", kv_start, kv_rows)]
        s.column_parallel(f"{a}.{family.QKV}", qkv, d.hidden)
        present = [n for n in (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias") if n in manifest]
        if 0 < len(present) < 3:
            raise UnsupportedPlanError(
                f"layer {i} has a bias for only some of q, k and v, so qkv_proj cannot be fused."
            )
        if present:
            biases = (s.rows(f"{a}.q_proj.bias", rank * q_rows, q_rows),
                      s.rows(f"{a}.k_proj.bias", kv_start, kv_rows), s.rows(f"{a}.v_proj.bias", kv_start, kv_rows))
            b.add(f"{a}.qkv_proj.bias", biases, (q_rows + 2 * kv_rows,))
        s.row_parallel(f"{a}.o_proj", rank * q_rows, q_rows, d.hidden)
        # A row-parallel bias is added once after the all-reduce, so every rank keeps all of it.
        for optional in (f"{a}.o_proj.bias", f"{a}.q_norm.weight", f"{a}.k_norm.weight"):
            if optional in manifest:
                b.whole(optional)
        b.whole(f"{p}.post_attention_layernorm.weight")
        if i in d.sparse_layers:
            s.experts(i)
            continue
        s.column_parallel(f"{m}.{family.GATE_UP}", [(f"{m}.gate_proj", rank * inter, inter),
                                                    (f"{m}.up_proj", rank * inter, inter)], d.hidden)
        s.row_parallel(f"{m}.down_proj", rank * inter, inter, d.hidden)
    b.whole(family.FINAL_NORM)
    # Tied embeddings: the engine reuses embed_tokens, so lm_head exists only if the checkpoint stores one
    # (Qwen3-0.6B does, tied or not); the engine then uses the stored bytes, exactly as transformers does.
    if family.LM_HEAD in manifest:
        _vocab_parallel(b, family.LM_HEAD, d)


def _is_companion(name: str, expected: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether `name` is a pre-quantized projection's scale or zero point (`x.weight_scale` beside `x.weight`)."""
    module, _, suffix = name.rpartition(".")
    return suffix in family.QUANTIZED_SUFFIXES and family.is_projection(f"{module}.weight") and (
        f"{module}.weight" in expected)


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


def _vocab_parallel(b: _Builder, name: str, d: ModelDims) -> None:
    tp, rank = b.spec.tp_size, b.spec.tp_rank
    per_rank = vocab_rows_per_rank(d.vocab, tp)
    start = rank * per_rank
    real = max(0, min(per_rank, d.vocab - start))
    pieces = (b.piece(name, 0, start, real),) if real else ()
    b.add(name, pieces, (per_rank, d.hidden), sources=(name,))


def _expected_shapes(d: ModelDims) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every tensor name the fused plan understands with its shape, and those it cannot do without."""
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    expected: dict[str, tuple[int, ...]] = {
        family.EMBED: (d.vocab, d.hidden),
        family.FINAL_NORM: (d.hidden,),
        family.LM_HEAD: (d.vocab, d.hidden),
    }
    required = [family.EMBED, family.FINAL_NORM]
    if not d.tie:
        required.append(family.LM_HEAD)
    for i in range(d.layers):
        a = family.attention(i)
        layer = {leaf.name: leaf.shape for leaf in family.layer_leaves(d, i, qk_norm=False)}
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
