"""`wcache demo`: build the tiny checkpoint and walk through what wcache's fingerprint catches."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from wcache.digest_store import default_store_dir
from wcache.errors import EXIT_DIFFERENCE, BadInputError
from wcache.key_diff import diff_keys
from wcache.plan import PlanSpec

from wcache_cli.operands import key_of_checkpoint
from wcache_cli.output import out
from wcache_cli.render import diff_renderable, key_table

# A demo directory holds this marker, so a rerun only ever deletes what an earlier demo wrote.
MARKER = ".wcache-demo"
KEEP_BYTES = 1024


def _fresh_dir(directory: Path) -> None:
    if directory.exists():
        if not (directory / MARKER).exists():
            raise BadInputError(f"{directory} exists and was not made by wcache demo; pass another --dir.")
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / MARKER).write_text("made by wcache demo; safe to delete\n")


def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where to write the demo checkpoints [default: <cache dir>/demo].",
                     show_default=False),
    ] = None,
) -> None:
    """Build a tiny checkpoint, fingerprint it, and show that wcache catches a change header-only keys miss."""
    from wcache import synth, vllm_compat

    workdir = directory or default_store_dir() / "demo"
    _fresh_dir(workdir)
    original, modified = workdir / "tiny", workdir / "tiny-zeroed"

    out.print(f"[bold]1.[/] Writing the [cyan]tiny[/] test checkpoint to {original}")
    synth.write_checkpoint("tiny", original)
    plan = PlanSpec()
    key_a = key_of_checkpoint(original, plan)
    out.print(key_table(key_a))

    victim = max(key_a.manifest, key=lambda e: (e.nbytes, e.name))
    out.print(
        f"\n[bold]2.[/] Copying it to {modified} and zeroing [cyan]{victim.name}[/] past its first "
        f"{KEEP_BYTES} bytes ({victim.nbytes - KEEP_BYTES:,} bytes); the header stays as it was."
    )
    shutil.copytree(original, modified, ignore=shutil.ignore_patterns(MARKER))
    synth.overwrite_tensor_bytes(modified, victim.name, KEEP_BYTES, bytes(victim.nbytes - KEEP_BYTES))
    key_b = key_of_checkpoint(modified, plan)

    header_same = vllm_compat.header_fingerprint(original) == vllm_compat.header_fingerprint(modified)
    sampled_same = vllm_compat.sampled_fingerprint(original) == vllm_compat.sampled_fingerprint(modified)
    wcache_same = key_a.key == key_b.key
    verdicts = Table(title="Does the fingerprint notice?", title_justify="left")
    verdicts.add_column("method")
    verdicts.add_column("original vs zeroed copy")
    for method, same in (
        ("vLLM 0.31 header-only fingerprint", header_same),
        ("#59648 proposal: + first 1 KiB of each tensor", sampled_same),
        ("wcache: BLAKE3 of every tensor byte", wcache_same),
    ):
        verdicts.add_row(method, "[red]same key: would serve the wrong weights[/]" if same else "[green]differs[/]")
    out.print()
    out.print(verdicts)

    out.print(f"\n[bold]3.[/] wcache diff {original} {modified}")
    result = diff_keys(key_a, key_b)
    out.print(diff_renderable(result, key_a, key_b))
    named = [c.name for c in result.changed] == [victim.name]
    if wcache_same or not named:
        out.error("the demo expected wcache to name exactly the zeroed tensor, and it did not.")
        raise typer.Exit(EXIT_DIFFERENCE)
    out.print(f"\nDone. Try: [bold]wcache key {original} --tensors[/] and "
              f"[bold]wcache diff {original} {modified} --json[/]")
