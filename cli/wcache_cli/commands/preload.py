"""`wcache preload`: start one daemon per rank holding processed weights, and wait until all are ready."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypedDict

import typer
from wcache.errors import EXIT_INTERRUPTED, BadInputError, UnavailableError

from wcache_cli.choices import (
    DEFAULT_DTYPE,
    DEFAULT_FORMAT,
    DEFAULT_LAYOUT,
    DEFAULT_LEVEL,
    DEFAULT_QUANTIZATION,
    Dtype,
    DtypeOpt,
    Layout,
    LogFormat,
    LogLevel,
    PlanOpt,
    Quantization,
    QuantizationOpt,
)
from wcache_cli.completers import daemon_ids
from wcache_cli.output import out, printable
from wcache_cli.params import (
    DeviceOpt,
    ExpectedOpt,
    JsonOpt,
    OptionalModelArg,
    RunDirOpt,
    TpOpt,
    VersionPoolOpt,
    run_dir_or_default,
    warn_if_exposed,
)
from wcache_cli.stop_signals import StopSignal, raise_stop
from wcache_cli.words import cli_message

if TYPE_CHECKING:
    from wcache.daemon.launch import DaemonGroup
    from wcache.ipc.wire.status_pipe import GroupReady


class DaemonRunOptions(TypedDict):
    """How every daemon a preload starts runs, whether from a checkpoint or --from: built once from the
    command line, and passed to `start_daemons` and `start_next_version` as their keyword arguments."""

    run_dir: Path
    health_host: str
    health_port: int
    log_level: str
    log_format: str
    share_stderr: bool
    scrub_interval: float
    version_pool: int


def _launch(
    model: Path, device: str, tp: int, dtype: Dtype, quantization: Quantization, plan: Layout,
    running: DaemonRunOptions, require_provenance: str, expected: Path | None,
) -> DaemonGroup:
    """Start the daemons with a progress bar on a terminal; raise with the failing rank's reason otherwise."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from wcache.daemon.launch import start_daemons

    bar = Progress(TextColumn("loading, hashing, processing"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=out.stderr, transient=True,
                   disable=not out.stderr.is_terminal)
    with bar:
        task = bar.add_task("load", total=None)
        return start_daemons(
            model, device=device, tp=tp, dtype=dtype.value, quantization=quantization.value, layout=plan.value,
            require_provenance=require_provenance, expected=expected,
            on_progress=lambda done, total: bar.update(task, completed=done, total=total or None), **running,
        )


# What a version built with --from takes from its parent group (devices, TP size, plan) or does not do (judge
# provenance: it reads no checkpoint file but the delta).
_NOT_WITH_FROM = ("device", "tp", "dtype", "quantization", "plan", "require_provenance", "refuse_unknown", "expected")


def _refuse_plan_flags(ctx: typer.Context) -> None:
    """A flag --from would ignore is refused by name, never silently replaced by the parent's value."""
    # By the source's name: Typer's Context is its own copy of click's, with its own enum.
    given = [p for p in ctx.command.params if p.name in _NOT_WITH_FROM
             and getattr(ctx.get_parameter_source(p.name), "name", None) in ("COMMANDLINE", "ENVIRONMENT")]
    if given:
        flag = given[0].opts[0]
        raise BadInputError(f"{flag} does not apply with --from: the new version keeps its parent's devices, "
                            "TP size and plan, and reads no checkpoint file but the delta.")


def preload(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    device: DeviceOpt = "cpu",
    tp: TpOpt = 1,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    quantization: QuantizationOpt = DEFAULT_QUANTIZATION,
    plan: PlanOpt = DEFAULT_LAYOUT,
    run_dir: RunDirOpt = None,
    health_port: Annotated[
        int, typer.Option("--health-port", help="Port for /health, /metrics and /stats (0 picks a free one).")
    ] = 0,
    health_host: Annotated[str, typer.Option("--health-host", help="Address the health server binds.")] = "127.0.0.1",
    detach: Annotated[bool, typer.Option("--detach", help="Return once ready and leave the daemons running.")] = False,
    replace: Annotated[
        bool, typer.Option("--replace", help="First stop the daemons of this checkpoint on these devices.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --replace: stop them even while engines hold zero-copy leases.")
    ] = False,
    log_level: Annotated[
        LogLevel, typer.Option("--log-level", help="Lowest level the supervisor and daemons log.")
    ] = DEFAULT_LEVEL,
    log_format: Annotated[
        LogFormat, typer.Option("--log-format", help="Log lines as text or as one JSON object each.")
    ] = DEFAULT_FORMAT,
    require_provenance: Annotated[
        bool, typer.Option("--require-provenance", help="Refuse a checkpoint with any file whose SHA-256 differs "
                           "from what the Hugging Face cache (or --expected) says was published; default: a warning.")
    ] = False,
    refuse_unknown: Annotated[
        bool, typer.Option("--refuse-unknown", help="With --require-provenance: also refuse a file whose provenance "
                           "is unknown (not from the cache, a non-LFS file).")
    ] = False,
    expected: ExpectedOpt = None,
    parent: Annotated[
        str | None, typer.Option("--from", help="Build the next version from this running daemon (name or key id "
                                 "prefix) and --delta, instead of from MODEL.", show_default=False,
                                 autocompletion=daemon_ids)
    ] = None,
    delta: Annotated[
        Path | None, typer.Option("--delta", help="With --from: the delta file (wcache delta) to apply.",
                                  show_default=False)
    ] = None,
    scrub_interval: Annotated[
        float | None, typer.Option("--scrub-interval", show_default=False,
                                   help="Seconds between background re-hashes of each arena (at most 5% of one core "
                                   "while one runs), up to a year; 0 turns them off [default: the daemons' own, 600].")
    ] = None,
    version_pool: VersionPoolOpt = "0",
    engine: Annotated[
        str | None, typer.Option("--engine", help="Resolve the plan as this engine will ask for it: vllm (its "
                                 "dtype rule for this platform, e.g. bfloat16 for a float32 checkpoint on CPU, "
                                 "and its model's layout; --dtype is passed to vLLM as its own --dtype).",
                                 show_default=False)
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Start one daemon per TP rank holding the checkpoint's processed weights.

    Each daemon reads every shard once (hashing as it reads), runs the processing plan, fills its arena and
    then publishes its socket. A key already served on the device is not loaded twice: preload says which
    daemon holds it and exits 0 (while another preload is still loading it, preload waits for that one's
    outcome, and loads the key itself if it failed); --replace stops that daemon first. Without --detach, preload
    stays in the foreground (SIGTERM, SIGHUP and Ctrl-C stop the daemons) and, when stderr is not a
    terminal, the daemons' log lines go to it as well as to the run dir's logs/. Each shard's SHA-256 is
    computed in the same read and judged against the Hugging Face cache (a warning names a file that differs);
    --require-provenance refuses to serve such a checkpoint, naming the file, and exits 1.

    With --from DAEMON --delta FILE (and no MODEL), a new group on the same devices with the same TP size and
    plan starts from that daemon's arena with the delta applied, reading nothing of the checkpoint but the
    delta; its key is the new checkpoint's content key, and the parent keeps serving its engines. The device,
    TP, plan and provenance flags are refused with --from.
    """
    if force and not replace:
        raise BadInputError("--force only applies with --replace.")
    if refuse_unknown and not require_provenance:
        raise BadInputError("--refuse-unknown only applies with --require-provenance.")
    requirement = ("unknown" if refuse_unknown else "differs") if require_provenance else "warn"
    from wcache.daemon.argv import LoadArgs
    from wcache.daemon.scrub import checked_interval

    from wcache_cli.byte_size import parse_byte_size

    scrub = checked_interval(LoadArgs.scrub_interval if scrub_interval is None else scrub_interval)
    pool_bytes = parse_byte_size(version_pool, "--version-pool")
    if (parent is None) != (delta is None):
        raise BadInputError("--from and --delta go together: --from DAEMON --delta FILE.")
    if parent is not None and (model is not None or replace):
        raise BadInputError("--from builds from a running daemon: give no MODEL (and no --replace) with it.")
    if parent is not None:
        _refuse_plan_flags(ctx)
    if parent is None and model is None:
        raise BadInputError("give a MODEL to preload, or --from DAEMON --delta FILE.")
    # Imported here so that building the help (every command's signature) loads no daemon machinery.
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.daemon.replace import replace_daemons, replacing
    from wcache.daemon.sd_notify import Notifier
    from wcache.daemon.supervisor import rank_devices
    from wcache.ipc.run_dir.directory import DaemonExistsError, ensure_daemon_run_dir

    where = ensure_daemon_run_dir(run_dir_or_default(run_dir))
    warn_if_exposed(health_host, "--health-host", "/health, /metrics and /stats")
    running = DaemonRunOptions(run_dir=where, health_host=health_host, health_port=health_port,
                               log_level=log_level.value, log_format=log_format.value,
                               share_stderr=not detach and not out.stderr.is_terminal, scrub_interval=scrub,
                               version_pool=pool_bytes)
    if delta is not None:
        model = delta  # what the new version is made from, in its READY line
    else:
        assert model is not None
        model = resolve_model_path(model)
    if engine is not None:
        dtype, plan = _engine_plan(engine, model if delta is None else None, tp, dtype, quantization, plan)
    # Held from stopping the old group until the new one is ready: concurrent replaces take turns.
    serial = contextlib.ExitStack()
    if replace:
        serial.enter_context(replacing(where))
        try:
            replaced = replace_daemons(model, rank_devices(device, tp), where, force=force)
        except BaseException:
            serial.close()
            raise
        for name in replaced:
            out.hint(f"stopped {printable(name)} to replace it")
    notifier = Notifier.take_from_environment()  # systemd's Type=notify; taken before any child inherits it
    # SIGTERM and SIGHUP (systemd, supervisord, `timeout`, `docker stop`, a closed terminal) stop every rank we
    # started, as Ctrl-C does: the supervisor runs in a session of its own, so only we can pass the stop on.
    previous = {signum: signal.signal(signum, raise_stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    group: DaemonGroup | None = None  # once set (ready), a stop must reach its supervisor
    try:
        try:
            if parent is not None and delta is not None:
                from wcache.daemon.launch import start_next_version

                group = start_next_version(parent, delta, **running)
                device = group.descriptors()[0].device if group.descriptors() else device
            else:
                group = _launch(model, device, tp, dtype, quantization, plan, running,
                                require_provenance=requirement, expected=expected)
        except DaemonExistsError as exc:
            if json_output:
                out.json({"event": "exists", "reason": cli_message(exc)})
            else:
                out.print(cli_message(exc))
            return
        finally:
            serial.close()  # ready or failed: the next replace may go ahead
        _print_ready(group.ready, model, device, json_output)
        _warn_provenance(group.ready, where, expected)
        if detach:
            group.detach()
            group = None
            out.hint(f"Daemons keep running; stop them with: wcache stop --all --run-dir {where}")
            return
        notifier.ready(f"{len(group.ready.ranks)} rank(s) of {printable(str(model))} ready on {device}; "
                       f"health {group.ready.health_url}")
        out.hint("Serving; press Ctrl-C to stop the daemons.")
        code = group.wait()
        notifier.stopping("every rank has exited")
        if code != 0:
            raise UnavailableError(f"a daemon of {model} exited on its own (its supervisor exited with code {code}); "
                                   f"see {where / 'logs'}.")
    except (KeyboardInterrupt, StopSignal) as stop:
        # Further stops wait: the ranks' files must be removed, not abandoned half-way.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if group is not None:
            notifier.stopping()
            group.terminate()
            out.hint("Stopped.")
        if isinstance(stop, KeyboardInterrupt):
            raise typer.Exit(EXIT_INTERRUPTED) from None
        # Die of the signal itself once everything is stopped: what service managers count as a clean stop.
        signal.signal(stop.signum, signal.SIG_DFL)
        os.kill(os.getpid(), stop.signum)
    finally:
        serial.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)

def _engine_plan(engine: str, model: Path | None, tp: int, dtype: Dtype, quantization: Quantization,
                 plan: Layout) -> tuple[Dtype, Layout]:
    """The dtype and layout `engine` will ask its daemons for (vLLM resolves them itself, in this process)."""
    if engine != "vllm":
        raise BadInputError(f"--engine takes vllm (the engine whose plan preload resolves), not {engine!r}.")
    if model is None:
        raise BadInputError("--engine resolves a MODEL's plan; it does not apply with --from.")
    if quantization != DEFAULT_QUANTIZATION or plan != DEFAULT_LAYOUT:
        raise BadInputError("--engine vllm takes its plan from vLLM; drop --quantization and --plan.")
    from wcache.integrations.vllm.plan import vllm_plan

    resolved = vllm_plan(str(model), tensor_parallel_size=tp, dtype=dtype.value)
    return Dtype(resolved.dtype), Layout(resolved.layout)


def _warn_provenance(ready: GroupReady, run_dir: Path, expected: Path | None) -> None:
    """A warning for each file of the loaded checkpoint that differs from what was published."""
    from wcache.ipc.run_dir.directory import census
    from wcache.key.provenance import verdicts_of

    names = {r.name for r in ready.ranks}
    served = [d for d in census(run_dir).live if d.name in names][:1]  # every rank read the same files
    for descriptor in served:
        if descriptor.provenance is None and any(f.sha256 is None for f in descriptor.files):
            out.hint("Provenance: each file's SHA-256 is computed after READY; `wcache status` shows the verdict, "
                     "and the daemon's log names any file that differs.")
            continue
        for verdict in verdicts_of(descriptor.source, descriptor.files, expected):
            if verdict.verdict == "differs":
                out.warning(verdict.sentence() + "; --require-provenance would refuse it.")


def _print_ready(ready: GroupReady, model: Path, device: str, json_output: bool) -> None:
    from rich.markup import escape

    from wcache_cli.cells import human_bytes

    ranks = ready.ranks
    if json_output:
        out.json(ready.to_json())
        return
    total = sum(r.weights_bytes for r in ranks)
    keys = " ".join(r.key_id for r in ranks)
    from wcache.checkpoint.display_name import described

    shown = escape(printable(described(str(model))))  # a path may hold brackets (markup) or escape sequences
    out.print(
        f"READY: {len(ranks)} rank(s) of {shown} on {device}, key(s) {keys}, {human_bytes(total)} "
        f"in {ready.seconds:.2f} s; health {ready.health_url}/health"
    )
