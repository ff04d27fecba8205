"""Typer choices built from core's vocabulary (and its defaults), never restated here, and the options that take
them. Apart from `params` because they import the plan and the attach options, which the commands that only look
at the run dir (`status`, `stop`, `doctor`) would load for nothing."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from wcache.attach_options import MODES, AttachOptions
from wcache.monitor.logs import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from wcache.plan.spec import DTYPES, LAYOUTS, QUANTIZATIONS, PlanSpec

Dtype = StrEnum("Dtype", {name: name for name in DTYPES})  # type: ignore[misc]
Quantization = StrEnum("Quantization", {name: name for name in QUANTIZATIONS})  # type: ignore[misc]
Layout = StrEnum("Layout", {name: name for name in LAYOUTS})  # type: ignore[misc]
LogLevel = StrEnum("LogLevel", {name: name for name in LOG_LEVELS})  # type: ignore[misc]
LogFormat = StrEnum("LogFormat", {name: name for name in LOG_FORMATS})  # type: ignore[misc]
Mode = StrEnum("Mode", {name: name for name in MODES})  # type: ignore[misc]
_PLAN = PlanSpec()
DEFAULT_DTYPE = Dtype(_PLAN.dtype)
DEFAULT_QUANTIZATION = Quantization(_PLAN.quantization)
DEFAULT_LAYOUT = Layout(_PLAN.layout)
DEFAULT_LEVEL = LogLevel(DEFAULT_LOG_LEVEL)
DEFAULT_FORMAT = LogFormat(DEFAULT_LOG_FORMAT)
DEFAULT_MODE = Mode(AttachOptions().mode)


DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Processed dtype; auto keeps the checkpoint's.")]
QuantizationOpt = Annotated[Quantization, typer.Option("--quantization", help="Weight-only quantization.")]
PlanOpt = Annotated[Layout, typer.Option("--plan", help="Tensor layout: fused (qkv, gate_up) or identity.")]
ModeOpt = Annotated[Mode, typer.Option(
    "--mode", help="zero_copy maps the daemon's memory and holds a lease; copy gives the engine weights of its own "
    "(on CPU a private copy-on-write map, no byte copied) and lets the daemon release them.")]


def plan_from_options(tp: int, rank: int, dtype: Dtype, quantization: Quantization, layout: Layout) -> PlanSpec:
    """A validated plan; bad combinations raise BadInputError with the flag to fix."""
    return PlanSpec(tp_size=tp, tp_rank=rank, dtype=dtype.value, quantization=quantization.value,
                    layout=layout.value)
