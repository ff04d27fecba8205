"""Options shared by several commands, declared once."""

from __future__ import annotations

from typing import Annotated

import typer
from wcache.plan import PlanSpec

TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size.", min=1)]
RankOpt = Annotated[int, typer.Option("--rank", help="Tensor-parallel rank (0 ≤ rank < tp).", min=0)]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="Processed dtype: auto, float32, float16 or bfloat16.")
]
QuantizationOpt = Annotated[
    str, typer.Option("--quantization", help="Weight-only quantization: none, int8 or fp8.")
]
PlanOpt = Annotated[str, typer.Option("--plan", help="Tensor layout: fused (qkv, gate_up) or identity.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]


def plan_from_options(tp: int, rank: int, dtype: str, quantization: str, layout: str) -> PlanSpec:
    """A validated plan; bad combinations raise BadInputError with the flag to fix."""
    return PlanSpec(tp_size=tp, tp_rank=rank, dtype=dtype, quantization=quantization, layout=layout)
