"""`wcache diff`: explain why two checkpoints or saved keys do (or do not) share a key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from wcache.errors import EXIT_DIFFERENCE

from wcache_cli import choices
from wcache_cli.completers import daemon_ids_or_paths
from wcache_cli.output import out
from wcache_cli.params import JsonOpt, RankOpt, RunDirOpt, TpOpt

OperandArg = Annotated[
    Path,
    typer.Argument(help="Checkpoint directory, .safetensors file, saved key file, or daemon id.", show_default=False,
                   readable=False, autocompletion=daemon_ids_or_paths),
]


def diff(
    a: OperandArg,
    b: OperandArg,
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: choices.DtypeOpt = choices.DEFAULT_DTYPE,
    quantization: choices.QuantizationOpt = choices.DEFAULT_QUANTIZATION,
    plan: choices.PlanOpt = choices.DEFAULT_LAYOUT,
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Compare two keys field by field and name every changed, added or removed tensor.

    Plan options apply to checkpoint operands; a key file carries its own plan. Exits 1 when the keys differ.
    """
    # Imported here so that building the help (every command's signature) never loads the key machinery.
    from wcache.key.diff import diff_keys

    from wcache_cli.operands import key_of_operand
    from wcache_cli.render import diff_json, diff_renderable

    spec = choices.plan_from_options(tp, rank, dtype, quantization, plan)
    key_a, key_b = key_of_operand(a, spec, run_dir), key_of_operand(b, spec, run_dir)
    result = diff_keys(key_a, key_b)
    if json:
        out.json(diff_json(result, key_a, key_b))
    else:
        out.print(diff_renderable(result, key_a, key_b))
    if not result.identical:
        raise typer.Exit(EXIT_DIFFERENCE)
