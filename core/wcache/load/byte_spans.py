"""Outputs that are checkpoint bytes unchanged, as runs of those bytes: what can be copied instead of computed.

A tensor whole, a run of its rows, or such runs stacked (all of a TP 1 fused plan that casts nothing) need no
torch: their bytes go from the read buffer to their place in the arena as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wcache.checkpoint.dtypes import TORCH_ITEMSIZE
from wcache.plan.processing import OutputSpec, ProcessingPlan


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [start, start + nbytes) of one checkpoint tensor are bytes [at, at + nbytes) of `output`."""

    output: str
    start: int
    nbytes: int
    at: int


def byte_spans(plan: ProcessingPlan, output: OutputSpec) -> list[tuple[str, Span]] | None:
    """`output` as runs of its sources' bytes, (source, span) in output order, when it is their bytes unchanged:
    no cast, whole tensors or runs of rows stacked along dim 0, no padding. None when it must be computed."""
    recipe = plan.recipes[output.name]
    if recipe.kind != "tensor" or not recipe.pieces:
        return None
    itemsize = TORCH_ITEMSIZE[output.dtype]
    spans: list[tuple[str, Span]] = []
    rows = at = 0
    for piece in recipe.pieces:
        if piece.source_dtype != output.dtype:
            return None
        if piece.dim is None:
            if len(recipe.pieces) != 1 or tuple(recipe.shape) != tuple(piece.source_shape):
                return None
            return [(piece.source, Span(output.name, 0, output.nbytes, 0))]
        if piece.start == 0 and piece.length == piece.source_shape[piece.dim]:
            first, count = 0, piece.source_shape[0]  # all of the source, whichever dim it is cut along
        elif piece.dim == 0:
            first, count = piece.start, piece.length
        else:
            return None  # a slice across rows is not one run of bytes
        if tuple(piece.source_shape[1:]) != tuple(recipe.shape[1:]):
            return None
        row_bytes = math.prod(piece.source_shape[1:]) * itemsize
        spans.append((piece.source, Span(output.name, first * row_bytes, count * row_bytes, at)))
        at += count * row_bytes
        rows += count
    return spans if rows == recipe.shape[0] else None


def copied_source(plan: ProcessingPlan, output: OutputSpec) -> str | None:
    """The checkpoint tensor whose bytes `output` is, unchanged (no cast, slice, fusion or padding), or None."""
    spans = byte_spans(plan, output)
    if spans is None or len(spans) != 1:
        return None
    source, span = spans[0]
    piece = plan.recipes[output.name].pieces[0]
    whole = span.start == 0 and span.nbytes == math.prod(piece.source_shape) * TORCH_ITEMSIZE[output.dtype]
    return source if whole else None

