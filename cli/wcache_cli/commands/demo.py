"""`wcache demo`: build the tiny checkpoint and walk through what wcache's fingerprint catches."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from wcache.digest_store import default_store_dir
from wcache.errors import EXIT_DIFFERENCE, BadInputError
from wcache.events import read_events
from wcache.key_diff import diff_keys
from wcache.plan import PlanSpec
from wcache.rundir import census

from wcache_cli.commands.preload import launch
from wcache_cli.commands.status import shutdown_daemon
from wcache_cli.operands import key_of_checkpoint
from wcache_cli.output import out
from wcache_cli.params import Dtype, Layout, Quantization
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
    """Build a tiny checkpoint, show that wcache catches a change header-only keys miss, then serve and attach it."""
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

    run_dir = Path(tempfile.mkdtemp(prefix="wcache-demo-", dir="/tmp"))
    supervisor: subprocess.Popen[str] | None = None
    try:
        out.print(f"\n[bold]4.[/] wcache preload {original} --tp 2 (one daemon per rank, run dir {run_dir})")
        supervisor, ready = launch(original, "cpu", 2, Dtype.auto, Quantization.none, Layout.fused, run_dir)
        keys = ", ".join(r["key_id"] for r in ready["ranks"])
        out.print(f"READY in {ready['seconds']:.2f} s: rank keys {keys}; health {ready['health_url']}/health")
        served_ok = _attach_both(original, modified, victim.name, run_dir)
    finally:
        for descriptor in census(run_dir).live:
            shutdown_daemon(descriptor, force=True)
        if supervisor is not None:
            supervisor.wait(timeout=30)  # it exits once its ranks have
        shutil.rmtree(run_dir, ignore_errors=True)
    if not served_ok:
        raise typer.Exit(EXIT_DIFFERENCE)
    out.print(f"\nDone. Try: [bold]wcache key {original} --tensors[/], "
              f"[bold]wcache diff {original} {modified} --json[/], and "
              f"[bold]wcache preload {original} --tp 2[/] in one terminal with "
              f"[bold]wcache attach {original} --tp 2 --rank 1[/] in another.")


def _attach_both(original: Path, modified: Path, victim: str, run_dir: Path) -> bool:
    """Steps 5–6: attach the original (a hit), then the zeroed copy (a miss naming the tensor, then disk)."""
    from wcache.attach import attach
    from wcache.digest_store import DigestStore

    with DigestStore.open() as store:
        out.print(f"\n[bold]5.[/] An engine for rank 0 attaches {original} (zero-copy)")
        with attach(original, PlanSpec(tp_size=2, tp_rank=0), run_dir=run_dir, store=store) as hit:
            timings = ", ".join(f"{k} {v:.1f} ms" for k, v in hit.report.timings_ms.items())
            out.print(f"[green]HIT[/] {hit.report.daemon}: {hit.report.num_tensors} tensors mapped; {timings}")

        out.print(f"\n[bold]6.[/] An engine for rank 0 attaches the zeroed copy {modified}")
        with attach(modified, PlanSpec(tp_size=2, tp_rank=0), run_dir=run_dir, store=store) as miss:
            out.print(f"[red]MISS[/] {miss.report.reason}")
            out.print(f"[yellow]FALLBACK[/] loaded {miss.report.num_tensors} tensors from disk with the same plan "
                      f"in {miss.report.timings_ms.get('disk_load', 0):.1f} ms; the daemon's weights were not used.")
    ok = hit.report.outcome == "hit" and miss.report.outcome == "fallback" and miss.report.diff is not None and [
        c.name for c in miss.report.diff.changed
    ] == [victim]
    if not ok:
        out.error("the demo expected a hit for the original and a miss naming the zeroed tensor for the copy.")
    events = [e["kind"] for e in read_events(run_dir)]
    out.print(f"Events written to {run_dir}/events.jsonl: {', '.join(events)}")
    return ok
