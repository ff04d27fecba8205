"""`wcache key`: show a checkpoint's content fingerprint and the key a daemon would hold for it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wcache_cli.operands import key_of_checkpoint
from wcache_cli.output import out
from wcache_cli.params import DtypeOpt, JsonOpt, PlanOpt, QuantizationOpt, RankOpt, TpOpt, plan_from_options
from wcache_cli.render import key_table, tensors_table


def key(
    path: Annotated[Path, typer.Argument(help="Model directory or .safetensors file.", show_default=False)],
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: DtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    plan: PlanOpt = "fused",
    tensors: Annotated[bool, typer.Option("--tensors", help="Also list every tensor and its digest.")] = False,
    rehash: Annotated[
        bool, typer.Option("--rehash", help="Hash every byte again instead of trusting the digest store.")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Show the content fingerprint (WeightCacheKey) of a checkpoint.

    `wcache key MODEL --json > model.key` saves a key file that `wcache diff model.key MODEL` can later
    compare against the checkpoint.
    """
    key_file = key_of_checkpoint(path, plan_from_options(tp, rank, dtype, quantization, plan), rehash=rehash)
    if json:
        out.json(key_file.to_json())
        return
    out.print(key_table(key_file))
    if tensors:
        out.print(tensors_table(key_file.manifest, f"{len(key_file.manifest)} tensors"))
