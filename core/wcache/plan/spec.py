"""The processing plan's description: what turns checkpoint tensors into one rank's engine tensors."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import msgspec

from wcache.canonical import digest_of
from wcache.checkpoint.dtypes import PLAN_DTYPES
from wcache.errors import BadInputError, option
from wcache.schema import Schema


class PlanError(BadInputError, ValueError):
    """A plan field out of range; a ValueError too, so a plan read from the wire is refused with its path."""


LAYOUTS = ("fused", "identity")
QUANTIZATIONS = ("none", "int8", "fp8")
DTYPES = ("auto", *PLAN_DTYPES)
class PlanSpec(Schema, frozen=True):
    """Everything about processing that changes the bytes a rank holds.

    `dtype` may be "auto" here; `resolve()` replaces it with the checkpoint's dtype before it is digested,
    so "auto" and the dtype it stands for give the same key. DP size is deliberately absent: a dense
    model's processed bytes do not depend on it.
    """

    tp_size: int = 1
    tp_rank: int = 0
    dtype: str = "auto"
    quantization: str = "none"  # load-time quantization (`load_time_quantization`), not a pre-quantized checkpoint
    # Always {}: nothing sets or reads it (a pre-quantized checkpoint's quantization_config is read from its
    # config.json); kept because renaming or dropping it would change every key's plan digest.
    quantization_config: dict[str, Any] = msgspec.field(default_factory=dict)
    layout: str = "fused"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise PlanError(f"{option('tp_size')} must be at least 1, not {self.tp_size}.")
        if not 0 <= self.tp_rank < self.tp_size:
            raise PlanError(f"{option('tp_rank')} must be between 0 and {self.tp_size - 1} for "
                                f"{option('tp_size', self.tp_size)}.")
        if self.dtype not in DTYPES:
            raise PlanError(f"{option('dtype')} must be one of {', '.join(DTYPES)}, not {self.dtype!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise PlanError(
                f"{option('quantization')} must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}."
            )
        if self.layout not in LAYOUTS:
            raise PlanError(f"{option('layout')} must be one of {', '.join(LAYOUTS)}, not {self.layout!r}.")

    def resolve(self, checkpoint_dtype: str) -> PlanSpec:
        """This plan with "auto" replaced by `checkpoint_dtype` (a plan dtype name)."""
        if self.dtype != "auto":
            return self
        return PlanSpec(self.tp_size, self.tp_rank, checkpoint_dtype, self.quantization,
                        dict(self.quantization_config), self.layout)

    def for_rank(self, rank: int) -> PlanSpec:
        """This plan as tensor-parallel rank `rank` holds it (checked against `tp_size` like any plan)."""
        return msgspec.structs.replace(self, tp_rank=rank)

    def to_json(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanSpec:
        return cls(**data)

    def digest(self) -> str:
        if self.dtype == "auto":
            raise ValueError("resolve() the plan's dtype before digesting it")
        return digest_of(self.to_json())


def preload_command(model: Path | str, plan: PlanSpec) -> str:
    """The `wcache preload` command line that starts daemons holding `plan` for `model` (every rank of its TP).

    For the engine user who reads a miss: the command to run, not the names of options to look up.
    """
    words = ["wcache", "preload", shlex.quote(str(model))]
    if plan.tp_size > 1:
        words += ["--tp", str(plan.tp_size)]
    if plan.dtype != "auto":
        words += ["--dtype", plan.dtype]
    if plan.quantization != "none":
        words += ["--quantization", plan.quantization]
    if plan.layout != "fused":
        words += ["--plan", plan.layout]
    return " ".join(words)


def plan_summary(plan: PlanSpec) -> str:
    """The plan in a table cell (`status`, `top`): dtype, TP size, quantization where there is one, and a layout
    other than the fused one; two daemons of one model differ here when they serve different engines."""
    parts = [plan.dtype, f"tp{plan.tp_size}"]
    if plan.quantization != "none":
        parts.append(plan.quantization)
    if plan.layout != "fused":
        parts.append(plan.layout)
    return " ".join(parts)
