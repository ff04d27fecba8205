"""`wcache serve MODEL -- VLLM ARGS`: a supervised vLLM server over the daemons of its plan; `wcache restart`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from wcache.errors import EXIT_INTERRUPTED, BadInputError, UnavailableError

from wcache_cli.output import out, printable
from wcache_cli.params import DeviceOpt, ModelArg, RunDirOpt, VersionPoolOpt, run_dir_or_default
from wcache_cli.stop_signals import StopSignal, raise_stop

if TYPE_CHECKING:
    from wcache.daemon.sd_notify import Notifier
    from wcache.ipc.run_dir.paths import RunPaths
    from wcache.serve.daemons import ServedDaemons
    from wcache.serve.option_table import OptionTable
    from wcache.serve.server_args import ServerArgs
    from wcache.serve.starter import ServerStarter

VllmArgs = Annotated[
    list[str] | None,
    typer.Argument(help="vLLM server arguments, after --, e.g. -- --port 8000 --max-model-len 4096.",
                   show_default=False, metavar="-- VLLM_ARGS"),
]


def _option_table() -> OptionTable:
    from wcache.key.digest_store import default_store_dir
    from wcache.serve.option_table import load_table

    return load_table(default_store_dir(), on_build=lambda: out.hint(
        "Reading vLLM's server options once for this vLLM (it imports vLLM: about 15 s); later checks take "
        "milliseconds."))


def _checked(argv: Sequence[str], table: OptionTable) -> ServerArgs:
    from wcache.serve.server_args import EXTRA_CONFIG, check_server_args

    args = check_server_args(argv, table)
    extra = args.value(EXTRA_CONFIG)
    if isinstance(extra, dict) and "run_dir" in extra:
        raise BadInputError("give the run dir as wcache serve's --run-dir, not in --model-loader-extra-config.")
    return args


def _url(user_argv: Sequence[str]) -> str:
    """Where the server will answer, as its engines announce it (vLLM's defaults: every interface, port 8000)."""
    from wcache.integrations.vllm.announce import server_url_from_argv
    from wcache.serve.starter import SERVER_MODULE

    url = server_url_from_argv(["python", "-m", SERVER_MODULE, *user_argv])
    if url is None:
        raise BadInputError("wcache serve checks the server's /health over TCP: give --host and --port, not --uds.")
    return url


def serve(
    model: ModelArg,
    vllm_args: VllmArgs = None,
    device: DeviceOpt = "cpu",
    run_dir: RunDirOpt = None,
    ready_timeout: Annotated[
        float, typer.Option("--ready-timeout", help="Seconds a start may take until /health answers 200; a server "
                            "slower than that is stopped and started again.", min=1)
    ] = 900.0,
    stop_grace: Annotated[
        float, typer.Option("--stop-grace", help="Seconds a stopping server (and its engine core and workers) gets "
                            "after SIGTERM before SIGKILL.", min=0)
    ] = 20.0,
    cold: Annotated[
        bool, typer.Option("--cold", help="Start each server in a fresh interpreter that imports vLLM anew, "
                           "instead of forking it from processes that imported vLLM once (slower restarts, "
                           "nothing kept resident).")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", help="Reload the server in place with each new version built from the "
                           "weights it serves (publish, preload --from) as soon as its daemon (every rank's, at "
                           "TP > 1) is ready; on a loopback --host only (it runs vLLM's development endpoints).")
    ] = False,
    version_pool: VersionPoolOpt = "0",
) -> None:
    """Run vLLM's OpenAI server over wcache's daemons, restarting it when it dies.

    The vLLM arguments after -- are checked against vLLM's own options first (a typo is one sentence within
    two seconds, before anything starts; the table of options is built once per installed vLLM). vLLM then
    resolves the plan it will ask for (dtype, TP size, layout), and a daemon group serving exactly that plan is
    reused, or started and kept for as long as this command runs. The server runs with --load-format wcache
    and its output goes to the run dir's logs/serve-<pid>.log. When it dies, one line says why, and it starts
    again after a backoff (1, 2, 4 … 30 s; reset once it has served a minute). SIGHUP or `wcache restart`
    restarts it at once (`wcache restart -- ARGS` with new vLLM arguments); SIGTERM and Ctrl-C stop it, its
    engine core and workers, and the daemons this command started. Restarts are warm: the server, its engine
    core and workers are forked from processes that imported vLLM once, when this command started (--cold
    starts each in a fresh interpreter). Under systemd (Type=notify) it reports
    READY=1 once /health answers 200. With --follow, a version published from the served weights is served from
    the next request on: vLLM pauses, reloads in place from the new version's daemon, resets its prefix cache and
    resumes, so no request sees two versions; --version-pool lets the daemons it starts build those versions in
    retired versions' arenas.
    """
    from wcache.daemon.sd_notify import Notifier

    notifier = Notifier.take_from_environment()  # before any child inherits it: only we are the service
    from wcache_cli.byte_size import parse_byte_size

    pool_bytes = parse_byte_size(version_pool, "--version-pool")
    table = _option_table()
    user_argv = list(vllm_args or [])
    first = _checked(user_argv, table)
    _url(user_argv)  # a server without a TCP address is refused before anything starts
    from wcache.serve.server_args import check_port_free

    check_port_free(first)
    if follow:
        from wcache.serve.follow import check_follow

        host = first.value("host")
        check_follow(str(host) if host is not None else None)
    from wcache.ipc.run_dir.directory import ensure_daemon_run_dir

    where = ensure_daemon_run_dir(run_dir_or_default(run_dir))
    previous = {signum: signal.signal(signum, raise_stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    daemons = None
    try:
        try:
            daemons = _daemons(model, first, device, where, pool_bytes)
            code = _supervise(model, user_argv, first, table, daemons, where, notifier, ready_timeout, stop_grace,
                              cold, follow)
        finally:
            if daemons is not None:
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_IGN)  # the daemons' files must be removed, not abandoned
                daemons.stop()
    except (KeyboardInterrupt, StopSignal) as stop:
        code = stop.signum if isinstance(stop, StopSignal) else signal.SIGINT
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    out.hint("Stopped.")
    if code == signal.SIGINT:
        raise typer.Exit(EXIT_INTERRUPTED)
    # Die of the signal itself once everything is stopped: what service managers count as a clean stop.
    signal.signal(code, signal.SIG_DFL)
    os.kill(os.getpid(), code)


def _daemons(model: Path, first: ServerArgs, device: str, where: Path, pool_bytes: int) -> ServedDaemons:
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.serve.daemons import ensure_daemons
    from wcache.serve.plan_child import resolved_plan

    path = resolve_model_path(model)
    tp = first.value("tensor_parallel_size", 1)
    dtype = first.value("dtype", "auto")
    began = time.monotonic()
    plan = resolved_plan(path, int(str(tp)), str(dtype), os.environ)
    out.hint(f"vLLM asks for {plan.dtype}, TP {plan.tp_size}, layout {plan.layout} "
             f"(resolved in {time.monotonic() - began:.1f} s).")
    daemons = ensure_daemons(path, plan, device, where, version_pool=pool_bytes)
    try:
        daemons.hold_leases()
    except BaseException:
        daemons.stop()  # a group started here must not outlive a launcher that never ran
        raise
    how = "started" if daemons.started is not None else "reusing"
    out.hint(f"Daemons: {how} {', '.join(daemons.names)}.")
    return daemons


def _supervise(model: Path, user_argv: list[str], first: ServerArgs, table: OptionTable, daemons: ServedDaemons,
               where: Path, notifier: Notifier, ready_timeout: float, stop_grace: float, cold: bool,
               follow: bool) -> int:
    from wcache.checkpoint.model_path import resolve_model_path
    from wcache.integrations.vllm.announce import URL_VARIABLE
    from wcache.integrations.vllm.dev_guard import MIDDLEWARE
    from wcache.ipc.run_dir.paths import RunPaths
    from wcache.serve.cache_roots import with_keyed_cache
    from wcache.serve.launcher import Launcher, LaunchSpec
    from wcache.serve.server_args import EXTRA_CONFIG, LOAD_FORMAT, check_restart, pinned_restart

    path = resolve_model_path(model)
    guard = ["--middleware", MIDDLEWARE] if follow else []
    started_on = daemons.names

    def server_argv(argv: Sequence[str]) -> list[str]:
        args = _checked(argv, table)
        check_restart(first, args)
        named = [] if args.flags_of("served_model_name") else ["--served-model-name", str(model)]
        # A following server moved to another version comes back on it: the launcher leases that one now.
        pinned = pinned_restart(args.value(EXTRA_CONFIG), daemons.names[0]) if daemons.names != started_on else []
        return ["--model", str(path), "--load-format", LOAD_FORMAT, *named, *guard, *argv, *pinned]

    paths = RunPaths(where)
    paths.logs.mkdir(mode=0o700, exist_ok=True)
    url = _url(user_argv)

    def say(line: str) -> None:
        out.hint(printable(line))

    # The run dir the load format attaches through, and the URL its engines announce for `status` and `top`.
    env = {**with_keyed_cache(os.environ, daemons.key_id), "WCACHE_RUN_DIR": str(where), URL_VARIABLE: url}
    spec = LaunchSpec(model=str(model), user_argv=user_argv, server_argv=server_argv, env=env, url=url,
                      run_dir=where, log=paths.serve_log(os.getpid()), daemons=daemons.names,
                      ready_timeout_s=ready_timeout, stop_grace_s=stop_grace)
    made_token: Path | None = None
    if follow:
        from wcache.ipc.run_dir.engine_token import TOKEN_FILE_ENV, new_token, write_engine_token
        from wcache.serve.follow import FOLLOW_ENV, server_follower

        if not os.environ.get(TOKEN_FILE_ENV):
            # The development routes take this launcher's token (its switches carry it): not other local users.
            made_token = write_engine_token(where, os.getpid(), new_token())
            os.environ[TOKEN_FILE_ENV] = str(made_token)
        spec.env.update({**FOLLOW_ENV, TOKEN_FILE_ENV: os.environ[TOKEN_FILE_ENV]})
        device = daemons.descriptors[0].device
        spec.watcher = lambda: server_follower(url, where, device, daemons, say,
                                               lambda: launcher.serving_from(daemons.names),
                                               lambda: launcher.request_restart())
    launcher = Launcher(_starter(cold, paths), spec, notifier, say=say)
    how = "" if cold else " (importing vLLM once first, for warm restarts)"
    out.hint(f"Starting vLLM's server for {printable(str(model))} at {spec.url}{how}; its log is {spec.log}.")
    launcher.install_signals()
    try:
        return launcher.run()
    finally:
        if made_token is not None:
            made_token.unlink(missing_ok=True)


def _starter(cold: bool, paths: RunPaths) -> ServerStarter:
    """The warm starter (a pre-imported zygote and forkserver), or the cold one (a fresh interpreter a start)."""
    if cold:
        from wcache.serve.starter import ColdStarter

        return ColdStarter()
    from wcache.integrations.vllm.warm import WarmStarter

    return WarmStarter(zygote_log=paths.serve_starter_log(os.getpid()))


def restart(
    vllm_args: VllmArgs = None,
    pid: Annotated[
        int | None, typer.Option("--pid", help="The launcher to restart (its pid, as `wcache status` shows it); "
                                 "default: the only one in the run dir.", show_default=False, min=1)
    ] = None,
    run_dir: RunDirOpt = None,
) -> None:
    """Restart the vLLM server of a running `wcache serve` now, with new vLLM arguments after -- if given.

    The new arguments replace the old ones and are checked first (one sentence, nothing restarted, when one is
    wrong); those that decide the daemons' plan (dtype, TP size, quantization) or the address cannot change.
    The daemons keep serving; the launcher stops the old server and starts the new one at once.
    """
    from wcache.ipc.run_dir.servers import RestartRequest, live_server_records, write_restart_request

    where = run_dir_or_default(run_dir)
    records = live_server_records(where) if where.exists() else []
    chosen = [r for r in records if pid is None or r.launcher_pid == pid]
    if not chosen:
        raise UnavailableError(f"no wcache serve is running in {where}" + (f" with pid {pid}." if pid else "."))
    if len(chosen) > 1:
        raise BadInputError(f"{len(chosen)} wcache serve launchers run in {where} (pids "
                            f"{', '.join(str(r.launcher_pid) for r in chosen)}); name one with --pid.")
    record = chosen[0]
    if vllm_args is not None:
        from wcache.serve.server_args import check_restart

        table = _option_table()
        check_restart(_checked(record.argv, table), _checked(vllm_args, table))
    write_restart_request(where, record.launcher_pid, RestartRequest(tuple(vllm_args) if vllm_args else None))
    try:
        os.kill(record.launcher_pid, signal.SIGHUP)
    except ProcessLookupError:
        raise UnavailableError(f"wcache serve (pid {record.launcher_pid}) has just exited.") from None
    out.print(f"asked wcache serve (pid {record.launcher_pid}) to restart {printable(record.url)}"
              + (" with new arguments." if vllm_args else "."))

