"""`wcache attach`: attach to the daemon holding a checkpoint's key, as an engine would, and report how."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from wcache.digest_store import DigestStore

from wcache_cli.output import out
from wcache_cli.params import (
    DeviceOpt,
    Dtype,
    DtypeOpt,
    JsonOpt,
    Layout,
    Mode,
    PlanOpt,
    Quantization,
    QuantizationOpt,
    RankOpt,
    RunDirOpt,
    TpOpt,
    plan_from_options,
    run_dir_or_default,
)
from wcache_cli.render import human_bytes

ModeOpt = Annotated[Mode, typer.Option("--mode", help="zero_copy maps the daemon's memory; copy takes a private copy.")]


def attach(
    model: Annotated[Path, typer.Argument(help="Model directory or .safetensors file.", show_default=False)],
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: DtypeOpt = Dtype.auto,
    quantization: QuantizationOpt = Quantization.none,
    plan: PlanOpt = Layout.fused,
    device: DeviceOpt = "cpu",
    mode: ModeOpt = Mode.zero_copy,
    no_fallback: Annotated[
        bool, typer.Option("--no-fallback", help="Fail (exit 3) on a miss instead of loading from disk.")
    ] = False,
    trust_daemon: Annotated[
        bool, typer.Option("--trust-daemon", help="Skip the checkpoint stat pass; still compare config and plan.")
    ] = False,
    daemon: Annotated[
        str | None, typer.Option("--daemon", help="Use this daemon (name or key id prefix).", show_default=False)
    ] = None,
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Attach to a daemon as an engine would: hit or miss, why, and how long key, connect and map took."""
    from wcache.attach import AttachMissError
    from wcache.attach import attach as attach_weights

    spec = plan_from_options(tp, rank, dtype, quantization, plan)
    try:
        with DigestStore.open() as store:
            weights = attach_weights(
                model, spec, device=device, mode=mode.value, fallback=not no_fallback, trust_daemon=trust_daemon,
                daemon=daemon, run_dir=run_dir_or_default(run_dir), store=store,
            )
    except AttachMissError as miss:
        if json:
            out.json(miss.report.to_json())
        raise
    with weights:
        report = weights.report
        if json:
            out.json(report.to_json())
            return
        if report.outcome == "hit":
            out.print(f"[green]HIT[/] {report.daemon} ({report.mode}): {report.num_tensors} tensors, "
                      f"{human_bytes(report.bytes_mapped)}")
        else:
            out.print(f"[red]MISS[/] {report.reason}")
            out.print(f"[yellow]FALLBACK[/] loaded {report.num_tensors} tensors from disk with the same plan")
        timings = Table(title="timings", title_justify="left")
        timings.add_column("step")
        timings.add_column("ms", justify="right")
        for step, ms in report.timings_ms.items():
            timings.add_row(step, f"{ms:.1f}")
        out.print(timings)
