"""`wcache delta`: write the sparse delta between two checkpoints, or materialize the checkpoint a delta makes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from wcache.errors import BadInputError

from wcache_cli.output import out, printable
from wcache_cli.params import JsonOpt

CheckpointArg = Annotated[
    Path, typer.Argument(help="Checkpoint directory or .safetensors file.", show_default=False, readable=False)
]


def delta(
    old: CheckpointArg,
    new: Annotated[
        Path, typer.Argument(help="The new checkpoint; with --apply, the delta file.", show_default=False,
                             readable=False)
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The delta file to write; with --apply, the new checkpoint's "
                           "directory (new or empty).", show_default=False)
    ],
    apply: Annotated[
        bool, typer.Option("--apply", help="Apply the delta NEW to OLD and write the checkpoint it makes to -o.")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Write the sparse delta that turns checkpoint OLD into NEW, or (--apply) the checkpoint a delta makes.

    A delta is one safetensors file: for each changed tensor its sorted flat element indices (int64) and new
    values, or a whole replacement, and in its metadata the parent's checkpoint digest, so it is only ever
    applied to OLD. `wcache preload --from DAEMON --delta FILE` builds the next version from a running daemon.
    """
    from wcache.key.digest_store import DigestStore

    if not apply and output.exists() and output.is_dir():
        raise BadInputError(f"-o {output} is a directory; the delta is one file.")
    with DigestStore.open() as store:
        if apply:
            from wcache.delta.make import apply_to_disk

            key_file = apply_to_disk(old, new, output, store)
            if json:
                out.json({"checkpoint": str(output), "key_id": key_file.key.short_id,
                          "key": key_file.key.to_json()})
            else:
                out.print(f"wrote {printable(str(output))}: checkpoint {key_file.key.checkpoint[:12]}, key "
                          f"{key_file.key.short_id}")
            return
        from wcache.delta.make import make_delta

        summary = make_delta(old, new, output, store)
    if json:
        out.json({"delta": str(summary.path), "bytes": summary.file_bytes, "parent": summary.parent,
                  "checkpoint": summary.checkpoint, "tensors_changed": summary.tensors_changed,
                  "tensors_whole": summary.tensors_whole, "elements_changed": summary.elements_changed,
                  "elements_total": summary.elements_total})
        return
    share = summary.elements_changed / summary.elements_total if summary.elements_total else 0.0
    out.print(f"wrote {printable(str(summary.path))}: {summary.file_bytes} bytes, {summary.tensors_changed} "
              f"tensor(s) changed ({summary.tensors_whole} whole), {summary.elements_changed} of "
              f"{summary.elements_total} elements ({share:.2%}); parent {summary.parent[:12]} → "
              f"{summary.checkpoint[:12]}")
