"""`wcache key`: show a checkpoint's content fingerprint and the key a daemon would hold for it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wcache_cli.completers import daemon_ids_or_paths
from wcache_cli.output import out
from wcache_cli.params import (
    DEFAULT_DTYPE,
    DEFAULT_LAYOUT,
    DEFAULT_QUANTIZATION,
    DtypeOpt,
    JsonOpt,
    PlanOpt,
    QuantizationOpt,
    RankOpt,
    RunDirOpt,
    TpOpt,
    plan_from_options,
)


def key(
    path: Annotated[
        # readable=False: Click's os.access check refuses a directory that is traversable but not listable,
        # though every file in it opens by name; the checkpoint reader says precisely what it cannot read.
        Path, typer.Argument(help="Model directory, .safetensors file, or running daemon id.", show_default=False,
                             readable=False, autocompletion=daemon_ids_or_paths)
    ],
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    quantization: QuantizationOpt = DEFAULT_QUANTIZATION,
    plan: PlanOpt = DEFAULT_LAYOUT,
    tensors: Annotated[bool, typer.Option("--tensors", help="Also list every tensor and its digest.")] = False,
    rehash: Annotated[
        bool, typer.Option("--rehash", help="Hash every byte again instead of trusting the digest store.")
    ] = False,
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Show the content fingerprint (WeightCacheKey) of a checkpoint.

    `wcache key MODEL --json > model.key` saves a key file that `wcache diff model.key MODEL` can later
    compare against the checkpoint.
    """
    # Imported here so that building the help (every command's signature) never loads the key machinery.
    from wcache_cli.operands import daemon_named, key_of_checkpoint, key_of_daemon
    from wcache_cli.render import key_table, tensors_table

    spec = plan_from_options(tp, rank, dtype, quantization, plan)
    daemon = daemon_named(path, run_dir)
    key_file = key_of_daemon(daemon) if daemon is not None else key_of_checkpoint(path, spec, rehash=rehash)
    if json:
        out.json(key_file.to_json())
        return
    out.print(key_table(key_file))
    if tensors:
        out.print(tensors_table(key_file.manifest, f"{len(key_file.manifest)} tensors"))
