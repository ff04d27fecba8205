"""`wcache key`: show a checkpoint's content fingerprint and the key a daemon would hold for it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wcache_cli import choices
from wcache_cli.completers import daemon_ids_or_paths
from wcache_cli.output import out
from wcache_cli.params import ExpectedOpt, JsonOpt, RankOpt, RunDirOpt, TpOpt


def key(
    path: Annotated[
        # readable=False: Click's os.access check refuses a directory that is traversable but not listable,
        # though every file in it opens by name; the checkpoint reader says precisely what it cannot read.
        Path, typer.Argument(help="Model directory, .safetensors file, or running daemon id.", show_default=False,
                             readable=False, autocompletion=daemon_ids_or_paths)
    ],
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: choices.DtypeOpt = choices.DEFAULT_DTYPE,
    quantization: choices.QuantizationOpt = choices.DEFAULT_QUANTIZATION,
    plan: choices.PlanOpt = choices.DEFAULT_LAYOUT,
    tensors: Annotated[bool, typer.Option("--tensors", help="Also list every tensor and its digest.")] = False,
    rehash: Annotated[
        bool, typer.Option("--rehash", help="Hash every byte again instead of trusting the digest store.")
    ] = False,
    expected: ExpectedOpt = None,
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Show the content fingerprint (WeightCacheKey) of a checkpoint.

    `wcache key MODEL --json > model.key` saves a key file that `wcache diff model.key MODEL` can later
    compare against the checkpoint. MODEL may be a Hugging Face repo id (Org/Name[@revision]) in the local
    cache. Each shard's SHA-256 (computed in the same read) is judged against what the cache says the Hub
    published: matches, differs, or unknown (not from the cache, a non-LFS file); --expected gives the digests
    for a plain directory.
    """
    # Imported here so that building the help (every command's signature) never loads the key machinery.
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.checkpoint.provenance import report
    from wcache.key.provenance import verdicts_of

    from wcache_cli.operands import daemon_named, key_of_checkpoint, key_of_daemon
    from wcache_cli.render import key_table, provenance_table, tensors_table

    spec = choices.plan_from_options(tp, rank, dtype, quantization, plan)
    daemon = daemon_named(path, run_dir)
    if daemon is not None:
        key_file, source = key_of_daemon(daemon), daemon.source
    else:
        key_file = key_of_checkpoint(resolve_model_path(path), spec, rehash=rehash)
        source = key_file.source
    provenance = report(verdicts_of(source, key_file.files, expected))
    if json:
        out.json({**key_file.to_json(), "provenance": provenance})
        return
    out.print(key_table(key_file))
    out.print(provenance_table(provenance))
    if tensors:
        out.print(tensors_table(key_file.manifest, f"{len(key_file.manifest)} tensors"))
