"""`wcache demo`: build the tiny checkpoint and walk through what wcache's fingerprint catches."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from wcache.errors import EXIT_DIFFERENCE, BadInputError

from wcache_cli.output import out
from wcache_cli.params import RunDirOpt, run_dir_or_default

if TYPE_CHECKING:
    from wcache.daemon.launch import DaemonGroup

# A demo directory holds this marker, so a rerun only ever deletes what an earlier demo wrote.
MARKER = ".wcache-demo"
KEEP_BYTES = 1024
# A phrase of the trained checkpoint's corpus: the original continues it with the corpus's next words.
PROMPT = "the weights cache daemon keeps"
NEW_TOKENS = 50


def _fresh_dir(directory: Path) -> None:
    # The demo's machinery (daemons, psutil, rich tables) is imported where it is used, so `--help` stays light.
    from wcache_cli.demo_serving import stop_serving

    if directory.exists():
        if not (directory / MARKER).exists():
            raise BadInputError(f"{directory} exists and was not made by wcache demo; pass another --dir.")
        stop_serving(directory)  # a previous run's daemon and engine must not outlive their files
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / MARKER).write_text("made by wcache demo; safe to delete\n")


def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where to write the demo checkpoints [default: <cache dir>/demo].",
                     show_default=False),
    ] = None,
    serve: Annotated[
        bool, typer.Option("--serve/--no-serve", help="Leave a daemon and a served engine running for wcache top.")
    ] = True,
    stop: Annotated[bool, typer.Option("--stop", help="Stop what an earlier demo left running, then exit.")] = False,
    run_dir: RunDirOpt = None,
) -> None:
    """Build a tiny checkpoint, show that wcache catches a change header-only keys miss, then serve and attach it.

    At the end a daemon and a served engine keep running (unless --no-serve) so `wcache top` has something to
    show; `wcache demo --stop` stops them.
    """
    import tempfile

    from rich.table import Table
    from wcache.key.diff import diff_keys
    from wcache.key.digest_store import default_store_dir
    from wcache.plan.spec import PlanSpec
    from wcache_dev import synth, vllm_compat

    from wcache_cli.demo_serving import leave_serving, stop_serving
    from wcache_cli.operands import key_of_checkpoint
    from wcache_cli.render import diff_renderable, key_table

    workdir = directory or default_store_dir() / "demo"
    if stop:
        out.print("stopped the demo's daemon and engine" if stop_serving(workdir) else "nothing was left running")
        return
    _fresh_dir(workdir)
    original, modified = workdir / "tiny", workdir / "tiny-zeroed"

    out.print(f"[bold]1.[/] Writing the [cyan]tiny-trained[/] checkpoint (the tiny Qwen3 architecture, byte "
              f"vocabulary, trained on a few paragraphs of English by benchmarks/train_tiny.py) to {original}")
    synth.write_checkpoint(synth.TRAINED_PRESET, original)
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

    # Steps 4–8 use a scratch run dir of their own, so nothing they start can meet the user's daemons.
    scratch = Path(tempfile.mkdtemp(prefix="wcache-demo-", dir="/tmp"))
    groups: list[DaemonGroup] = []
    try:
        served_ok = _serve_attach_verify(original, modified, victim.name, scratch, groups)
    finally:
        for group in groups:
            group.stop(force=True)  # every rank, then its supervisor
        shutil.rmtree(scratch, ignore_errors=True)
    if not served_ok:
        raise typer.Exit(EXIT_DIFFERENCE)
    if serve:
        where = run_dir_or_default(run_dir)
        out.print(f"\n[bold]9.[/] Leaving a daemon and a served engine running (run dir {where})")
        leave_serving(original, modified, workdir, where)
        top = "wcache top" if run_dir is None else f"wcache top --run-dir {where}"
        stop_command = "wcache demo --stop" + ("" if directory is None else f" --dir {workdir}")
        out.print(f"Watch them with [bold]{top}[/]; stop everything with [bold]{stop_command}[/].")
    out.print(f"\nDone. Try: [bold]wcache key {original} --tensors[/], "
              f"[bold]wcache diff {original} {modified} --json[/], and "
              f"[bold]wcache preload {original} --tp 2[/] in one terminal with "
              f"[bold]wcache attach {original} --tp 2 --prompt '{PROMPT}'[/] in another.")


def _preload(model: Path, run_dir: Path, groups: list[DaemonGroup]) -> str:
    from wcache.daemon.launch import start_daemons

    group = start_daemons(model, run_dir=run_dir)
    groups.append(group)
    ready = group.ready
    key_id = ready.by_rank()[0].key_id
    out.print(f"READY in {ready.seconds:.2f} s: key {key_id}; health {ready.health_url}/health")
    return str(key_id)


def _serve_attach_verify(
    original: Path, modified: Path, victim: str, run_dir: Path, groups: list[DaemonGroup]
) -> bool:
    """Steps 4–9: preload, a hit that generates, a miss that falls back, and verify passing then failing."""
    from rich.markup import escape
    from wcache.attach_options import AttachOptions
    from wcache.engine import Engine
    from wcache.ipc.run_dir.paths import RunPaths
    from wcache.key.digest_store import DigestStore
    from wcache.monitor.events import read_events
    from wcache.plan.spec import PlanSpec
    from wcache.verify import default_prompts, verify_content, verify_greedy

    from wcache_cli.verify_report import print_content, print_greedy

    out.print(f"\n[bold]4.[/] wcache preload {original} (a daemon holding the processed weights; run dir {run_dir})")
    _preload(original, run_dir, groups)

    out.print(f"\n[bold]5.[/] An engine attaches {original} (zero-copy) and generates")
    engine = Engine.from_attach(original, PlanSpec(), options=AttachOptions(run_dir=str(run_dir)))
    try:
        hit = engine.attach_report
        timings = ", ".join(f"{k} {v:.1f} ms" for k, v in hit.timings_ms.items())
        out.print(f"[green]HIT[/] {hit.daemon}: {hit.num_tensors} tensors mapped; {timings}")
        spoken, generation = engine.complete(PROMPT, NEW_TOKENS)
        out.print(f"generated {len(generation.token_ids)} tokens from {PROMPT!r}: [green]{escape(repr(spoken))}[/]")
    finally:
        engine.close()

    out.print(f"\n[bold]6.[/] An engine attaches the zeroed copy {modified}")
    from wcache.attach import attach

    with DigestStore.open() as store, attach(modified, PlanSpec(), run_dir=run_dir, store=store) as miss:
        out.print(f"[red]MISS[/] {miss.report.reason}")
        out.print(f"[yellow]FALLBACK[/] loaded {miss.report.num_tensors} tensors from disk with the same plan "
                  f"in {miss.report.timings_ms.get('disk_load', 0):.1f} ms; the daemon's weights were not used.")
        broken, _ = Engine.from_weights(modified, miss.tensors).complete(PROMPT, NEW_TOKENS)
        out.print(f"the zeroed copy's own weights, from {PROMPT!r}: [red]{escape(repr(broken))}[/]")
        out.print(f"A header-only key (vLLM 0.31's, or #59648's sampled one) matches the daemon holding the original, "
                  f"so this copy would have been served the original's {escape(repr(spoken))} instead (vLLM #59647).")
    missed_right = miss.report.diff is not None and [c.name for c in miss.report.diff.changed] == [victim]

    prompts = default_prompts(3)
    out.print(f"\n[bold]7.[/] wcache verify {original} --greedy")
    passing = verify_greedy(original, PlanSpec(), prompts, 12, options=AttachOptions(run_dir=str(run_dir))).to_json()
    print_greedy(passing)

    out.print(f"\n[bold]8.[/] wcache preload {modified}, then verify {original} through it with --trust-daemon")
    copy_key = _preload(modified, run_dir, groups)
    trusting = AttachOptions(run_dir=str(run_dir), trust_daemon=True, daemon=copy_key)
    failing = verify_greedy(original, PlanSpec(), prompts, 12, options=trusting).to_json()
    print_greedy(failing)
    content = verify_content(original, PlanSpec(), run_dir, daemon=copy_key).to_json()
    print_content(content)

    ok = (hit.outcome == "hit" and miss.report.outcome == "fallback" and missed_right and passing["all_match"]
          and not failing["all_match"] and content["source"]["changed"] == [victim])
    if not ok:
        out.error("the demo expected a hit, a miss naming the zeroed tensor, a passing verify and a failing one.")
    events = [e["kind"] for e in read_events(run_dir)]
    # The scratch run dir goes when the demo ends: its events are kept beside the demo's checkpoints.
    kept = original.parent / RunPaths(run_dir).events.name
    shutil.copyfile(RunPaths(run_dir).events, kept)
    out.print(f"\nEvents written (kept in {kept}): {', '.join(events)}")
    return ok
