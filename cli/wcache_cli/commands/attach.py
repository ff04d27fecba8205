"""`wcache attach`: attach as an engine would, and optionally generate or serve an OpenAI-style API."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from wcache.attach_options import AttachOptions
from wcache.errors import BadInputError

from wcache_cli.choices import (
    DEFAULT_DTYPE,
    DEFAULT_LAYOUT,
    DEFAULT_MODE,
    DEFAULT_QUANTIZATION,
    DtypeOpt,
    ModeOpt,
    PlanOpt,
    QuantizationOpt,
    plan_from_options,
)
from wcache_cli.output import out
from wcache_cli.params import (
    DaemonOpt,
    DeviceOpt,
    JsonOpt,
    MaxNewTokensOpt,
    ModelArg,
    RankOpt,
    RunDirOpt,
    TpOpt,
    TrustDaemonOpt,
    run_dir_or_default,
    warn_if_exposed,
)

if TYPE_CHECKING:
    from wcache.plan.spec import PlanSpec


def attach(
    model: ModelArg,
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    quantization: QuantizationOpt = DEFAULT_QUANTIZATION,
    plan: PlanOpt = DEFAULT_LAYOUT,
    device: DeviceOpt = "cpu",
    mode: ModeOpt = DEFAULT_MODE,
    no_fallback: Annotated[
        bool, typer.Option("--no-fallback", help="Fail (exit 3) on a miss instead of loading from disk.")
    ] = False,
    trust_daemon: TrustDaemonOpt = False,
    daemon: DaemonOpt = None,
    wait: Annotated[
        float, typer.Option("--wait", help="Seconds to keep looking for a daemon with this key (one still "
                            "loading) before missing.", min=0)
    ] = 0.0,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="Generate from this prompt (greedy) and print the text.",
                                 show_default=False)
    ] = None,
    max_new_tokens: MaxNewTokensOpt = 32,
    serve: Annotated[bool, typer.Option("--serve", help="Serve POST /v1/completions, /health and /metrics.")] = False,
    port: Annotated[int, typer.Option("--port", help="Port for --serve (0 picks a free one).")] = 8000,
    host: Annotated[str, typer.Option("--host", help="Address for --serve.")] = "127.0.0.1",
    follow: Annotated[
        bool, typer.Option("--follow", help="With --serve: switch to each new version built from the weights "
                           "served (preload --from, publish) as soon as its daemon is ready.")
    ] = False,
    no_swa_bounded_replay: Annotated[
        bool, typer.Option("--no-swa-bounded-replay", help="Keep sliding-window KV in the prefix cache instead.")
    ] = False,
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Attach to a daemon as an engine would: hit or miss, why, and how long key, connect and map took.

    With --prompt, run the reference engine on the attached weights; with --serve, keep it up behind an
    OpenAI-compatible API. With --tp N, those two run every rank (gloo) and --rank is ignored.
    """
    if prompt is not None and serve:
        raise BadInputError("use --prompt or --serve, not both.")
    if follow and not serve:
        raise BadInputError("--follow moves a served engine to new versions; add --serve.")
    # Imported here so that building the help (every command's signature) loads no attach machinery.
    from wcache.checkpoint.model_path import resolve_model_path

    model = resolve_model_path(model)
    where = run_dir_or_default(run_dir)
    options = AttachOptions(mode=mode.value, fallback=not no_fallback, trust_daemon=trust_daemon, daemon=daemon,
                            run_dir=str(where), wait_s=wait)
    if prompt is not None or serve:
        from wcache.engine import EngineConfig

        from wcache_cli.operands import check_tp_fits

        engine_config = EngineConfig(swa_bounded_replay=not no_swa_bounded_replay)
        spec = plan_from_options(tp, 0, dtype, quantization, plan)
        check_tp_fits(model, spec)
        if serve:
            warn_if_exposed(host, "--host", "completions, metrics and weight switches")
            _serve(model, spec, engine_config, options, device, host, port, where, follow)
        else:
            _generate(model, spec, engine_config, options, device, prompt or "", max_new_tokens, json)
        return
    _report_only(model, plan_from_options(tp, rank, dtype, quantization, plan), options, device, json)


def _report_only(model: Path, spec: Any, options: AttachOptions, device: str, json: bool) -> None:
    from wcache.attach import AttachMissError, attach_with
    from wcache.key.digest_store import DigestStore

    try:
        with DigestStore.open() as store:
            # Only the report is wanted: no tensors, so no torch (a disk fallback still loads them).
            weights = attach_with(model, spec, options, device=device, store=store, views=False)
    except AttachMissError as miss:
        if json:
            out.json(miss.report.summary().to_wire())
        raise
    with weights:
        if json:
            out.json(weights.report.summary().to_wire())
        else:
            _print_report(weights.report)


def _print_report(report: Any) -> None:
    from rich.table import Table

    from wcache_cli.render import human_bytes

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


def generate_rank(tp: Any, model: Path, plan: PlanSpec, engine_config: Any, options: AttachOptions,
                  device: str, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """One rank of `--prompt`: attach, generate, and describe what happened (rank 0's answer is shown)."""
    import time

    from wcache.engine import Engine

    spec = plan.for_rank(tp.rank)
    engine = Engine.from_attach(model, spec, engine_config, tp, options=options, device=device)
    try:
        began = time.perf_counter()
        text, generation = engine.complete(prompt, max_new_tokens)
        seconds = time.perf_counter() - began
        report = engine.attach_report
        return {"text": text, "token_ids": generation.token_ids, "prompt_tokens": generation.prompt_tokens,
                "generate_ms": round(seconds * 1000, 3), "attach": report.summary().to_wire() if report else None}
    finally:
        engine.close()


def _generate(model: Path, plan: PlanSpec, engine_config: Any, options: AttachOptions, device: str,
              prompt: str, max_new_tokens: int, json: bool) -> None:
    from wcache.tp_launch import run_tensor_parallel

    # No timeout, as for one rank: loading a large model on every rank may take long; Ctrl-C stops every rank.
    result = run_tensor_parallel(generate_rank, plan.tp_size, model, plan, engine_config, options, device, prompt,
                                 max_new_tokens)[0]
    if json:
        out.json(result)
        return
    attach_report = result["attach"] or {}
    timings = ", ".join(f"{k} {v:.1f} ms" for k, v in attach_report.get("timings_ms", {}).items())
    out.print(f"[dim]weights: {attach_report.get('outcome')} ({timings})[/]")
    out.print(result["text"])
    out.print(f"[dim]{len(result['token_ids'])} tokens from a {result['prompt_tokens']}-token prompt in "
              f"{result['generate_ms']:.0f} ms[/]")


def announce(url: str, engine: Any) -> None:
    """Printed by the serving rank once it listens (module level, so a spawned rank can call it)."""
    report = engine.attach_report
    outcome = report.outcome if report is not None else "disk"
    out.print(f"SERVING {url}/v1/completions (weights: {outcome}); /health and /metrics beside it. Ctrl-C stops.")


def _serve(model: Path, plan: PlanSpec, engine_config: Any, options: AttachOptions, device: str, host: str,
           port: int, where: Path, follow: bool) -> None:
    from wcache.serving.follow import check_followable
    from wcache.serving.ranks import corrupt_channel, serve_rank
    from wcache.tp_launch import run_tensor_parallel

    if follow:
        check_followable(plan.tp_size)
    # Rank 0 serves in this process (its pid announces the engine; SIGTERM stops it gracefully); the others
    # follow it. Only they report corruption to it, over a channel made before they start.
    corrupt = corrupt_channel() if plan.tp_size > 1 else None
    run_tensor_parallel(serve_rank, plan.tp_size, model, plan, engine_config, options, device, host, port, where,
                        announce, corrupt, follow)
