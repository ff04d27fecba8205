"""The processing plan in action: which engine tensors one rank holds, and how each is made from checkpoint tensors.

`build_plan` turns a resolved `PlanSpec`, config.json and the checkpoint's manifest into a `ProcessingPlan`: a
fixed, ordered list of `OutputSpec`s and, for each, a recipe of checkpoint slices. The layout says which slices
make each output (the identity layout: every tensor whole, here; the fused one: `fused_layout`); the builder
here chooses each output's dtype and adds load-time quantization's codes and scales (`load_time_quantization`).
`ProcessingPlan.produce` runs one recipe. The daemon and the engine's disk path both call it, so their processed
bytes are equal.

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
from wcache.plan import family, fused_layout
from wcache.plan.family import ModelDims, UnsupportedPlanError
from wcache.plan.load_time_quantization import (
    CODE_DTYPES,
    channel_scales,
    quantize_rows,
    quantized_at_load,
    scale_name,
)
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    import torch

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
    """Collects outputs and recipes in order, choosing each output's dtype and adding load-time quantization's
    scales."""

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
        if method != "none" and quantized_at_load(name, shape):
            if not castable:
                raise UnsupportedPlanError(
                    f"tensor {sources[0]!r} is stored as {entries[0].dtype}; quantizing an already quantized "
                    "checkpoint is not supported."
                )
            self._emit(OutputSpec(name, CODE_DTYPES[method], shape, sources), Recipe("quantized", pieces, shape))
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
    builder = _Builder(spec, manifest, family.prequantized_method(config) is not None)
    if spec.layout == "identity":
        check_tp_split(spec, config)
        # Sorted, so the order does not depend on how the manifest was listed (by shard, by name).
        for name in sorted(manifest):
            builder.whole(name)
        return builder.plan()
    fused_layout.build(builder, ModelDims.from_config(config))
    return builder.plan()


def check_tp_split(spec: PlanSpec, config: Mapping[str, Any] | None) -> None:
    """UnsupportedPlanError unless `spec`'s TP size splits a model with this config; reads no tensors, so a TP
    launcher can refuse before starting a process per rank."""
    if spec.layout == "identity":
        if spec.tp_size != 1:
            raise UnsupportedPlanError(f"the identity plan holds unsharded weights; use {option('tp_size', 1)} or "
                                       f"{option('layout', 'fused')}.")
        return
    fused_layout.check_split(spec.tp_size, ModelDims.from_config(config))


def _torch_name(entry: TensorDigest) -> str:
    name = TORCH_NAMES.get(entry.dtype)
    # Checked against torch where it is loaded (an engine); a daemon that has not imported it serves the bytes,
    # and an engine on an older torch refuses them when it attaches.
    torch = sys.modules.get("torch")
    if name is None or (torch is not None and not hasattr(torch, name)):
        raise UnsupportedPlanError(f"tensor {entry.name!r} has dtype {entry.dtype}, which this torch cannot hold.")
    return name
