"""`wcache preload`: start one daemon per rank holding processed weights, and wait until all are ready."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from wcache.daemon.status_pipe import parse_line
from wcache.errors import EXIT_UNAVAILABLE, WcacheError
from wcache.rundir import ensure_run_dir

from wcache_cli.output import out
from wcache_cli.params import (
    DeviceOpt,
    Dtype,
    DtypeOpt,
    JsonOpt,
    Layout,
    PlanOpt,
    Quantization,
    QuantizationOpt,
    RunDirOpt,
    TpOpt,
    run_dir_or_default,
)
from wcache_cli.render import human_bytes


class PreloadFailedError(WcacheError):
    """A rank failed to load; the others were stopped."""


def _supervisor_command(
    model: Path, device: str, tp: int, dtype: Dtype, quantization: Quantization, plan: Layout, run_dir: Path,
    health_host: str, health_port: int,
) -> list[str]:
    return [
        sys.executable, "-m", "wcache.daemon.supervisor", "--model", str(model.absolute()), "--device", device,
        "--tp", str(tp), "--dtype", dtype.value, "--quantization", quantization.value, "--plan", plan.value,
        "--run-dir", str(run_dir), "--health-host", health_host, "--health-port", str(health_port),
    ]


def _follow(stream: IO[str]) -> dict[str, Any] | None:
    """Show progress until the supervisor says ready or failed; None if it exits saying neither."""
    bar = Progress(TextColumn("loading, hashing, processing"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=out.stderr, transient=True,
                   disable=not out.stderr.is_terminal)
    with bar:
        task = bar.add_task("load", total=None)
        for line in stream:
            message = parse_line(line)
            if message is None:
                continue
            if message["event"] == "progress":
                bar.update(task, completed=message.get("done", 0), total=message.get("total") or None)
            elif message["event"] in ("ready", "failed"):
                return message
    return None


def launch(
    model: Path, device: str, tp: int, dtype: Dtype, quantization: Quantization, plan: Layout, run_dir: Path,
    health_host: str = "127.0.0.1", health_port: int = 0,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a supervisor and follow its progress until every rank is ready; raise with the reason otherwise."""
    logs = run_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    log_path = logs / f"supervisor-{os.getpid()}.log"
    command = _supervisor_command(model, device, tp, dtype, quantization, plan, run_dir, health_host, health_port)
    with log_path.open("a") as log_file:
        # A session of its own: Ctrl-C here reaches the supervisor only through us, so it can stop cleanly.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                   text=True, bufsize=1, start_new_session=True)
    assert process.stdout is not None
    try:
        outcome = _follow(process.stdout)
    except KeyboardInterrupt:
        process.send_signal(signal.SIGTERM)
        process.wait()
        raise PreloadFailedError("preload was interrupted; the daemons were stopped.") from None
    if outcome is None or outcome["event"] == "failed":
        code = process.wait()
        reason = outcome.get("reason") if outcome else f"the supervisor exited with code {code}; see {log_path}"
        error = PreloadFailedError(str(reason).rstrip(".") + ".")
        error.exit_code = int(outcome.get("exit_code", 1)) if outcome else EXIT_UNAVAILABLE
        raise error
    return process, outcome


def preload(
    model: Annotated[Path, typer.Argument(help="Model directory or .safetensors file.", show_default=False)],
    device: DeviceOpt = "cpu",
    tp: TpOpt = 1,
    dtype: DtypeOpt = Dtype.auto,
    quantization: QuantizationOpt = Quantization.none,
    plan: PlanOpt = Layout.fused,
    run_dir: RunDirOpt = None,
    health_port: Annotated[
        int, typer.Option("--health-port", help="Port for /health, /metrics and /stats (0 picks a free one).")
    ] = 0,
    health_host: Annotated[str, typer.Option("--health-host", help="Address the health server binds.")] = "127.0.0.1",
    detach: Annotated[bool, typer.Option("--detach", help="Return once ready and leave the daemons running.")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Start one daemon per TP rank holding the checkpoint's processed weights.

    Each daemon reads every shard once (hashing as it reads), runs the processing plan, fills its arena and
    then publishes its socket. Without --detach, preload stays in the foreground; Ctrl-C stops the daemons.
    """
    where = ensure_run_dir(run_dir_or_default(run_dir))
    process, outcome = launch(model, device, tp, dtype, quantization, plan, where, health_host, health_port)
    _print_ready(outcome, model, device, json_output)
    if detach:
        assert process.stdout is not None
        process.stdout.close()
        out.hint(f"Daemons keep running; stop them with: wcache stop --all --run-dir {where}")
        return
    out.hint("Serving; press Ctrl-C to stop the daemons.")
    try:
        process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGTERM)
        process.wait()
        out.hint("Stopped.")


def _print_ready(ready: dict[str, Any], model: Path, device: str, json_output: bool) -> None:
    ranks = ready.get("ranks", [])
    if json_output:
        out.json(ready)
        return
    total = sum(int(r.get("weights_bytes", 0)) for r in ranks)
    keys = " ".join(r.get("key_id", "?") for r in ranks)
    out.print(
        f"READY: {len(ranks)} rank(s) of {model} on {device}, key(s) {keys}, {human_bytes(total)} "
        f"in {ready.get('seconds', 0):.2f} s; health {ready.get('health_url')}/health"
    )
