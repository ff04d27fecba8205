"""`wcache status` and `wcache stop`: what the run dir's daemons hold (or are loading), and stopping them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from wcache.errors import BadInputError, UnavailableError

from wcache_cli.completers import daemon_ids
from wcache_cli.output import literal, out
from wcache_cli.params import JsonOpt, RunDirOpt, run_dir_or_default

if TYPE_CHECKING:
    import msgspec
    from rich.console import RenderableType
    from rich.table import Table
    from wcache.monitor.daemon_status import DaemonStatus
    from wcache.monitor.snapshot import EngineRow, ServerRow, Snapshot
    from wcache.monitor.status_row import StatusRow

HEALTH_TIMEOUT_S = 2.0


def _health(url: str | None) -> int | None:
    if not url:
        return None
    # Imported per use: the help and a run dir without daemons must not pay for http.client, sockets or psutil.
    from wcache.ipc.http.client import health_status

    return health_status(f"{url}/health", HEALTH_TIMEOUT_S)


def _ask(sockets: list[str]) -> list[DaemonStatus]:
    """Each daemon's answer to a status request, in order; with no daemon, the wire client is never imported."""
    if not sockets:
        return []
    from wcache.monitor.daemon_status import collect

    return collect(sockets)


def _unhealthy(row: StatusRow) -> str | None:
    """Why a daemon is not ready to serve, or None when it is."""
    name = row.name or f"pid {row.pid}"
    if row.state == "loading":
        total = int(row.total_bytes or 0)
        progress = f", {int(row.done_bytes or 0) * 100 // total}% read" if total else ""
        return f"daemon {name} is still loading ({row.phase or ''}{progress})"
    if row.state == "unreachable":
        return f"daemon {name} does not answer"
    if row.state == "released" or not row.holds_weights:
        return f"daemon {name} no longer holds weights (state {row.state})"
    if row.corrupt:
        return f"daemon {name} found its weights changed in memory: {row.corrupt[0]}"
    if row.health_status not in (None, 200):
        return f"the health server of daemon {name} answers {row.health_status}"
    return None


def status(
    run_dir: RunDirOpt = None,
    json: JsonOpt = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Exit 3 unless there are daemons and every one is ready (an exec probe)."),
    ] = False,
) -> None:
    """List the daemons in the run dir: device, model, key, state, origin, memory, leases, uptime, health and
    plan; then the engines attached to them (vLLM ranks and wcache's servers): hit or fallback and why; then the
    vLLM servers `wcache serve` supervises: address, state, pid, restarts, the last start's time until /health
    answered, and why the last one died.

    origin is the checkpoint's files against what the Hub published, judged when the daemon loaded them:
    "✓ hub" all match, "✗ DIFFERS" one does not (wcache verify --provenance names it), "?" not known.

    Daemons still loading are listed with their progress. Descriptors left by daemons that died are reported
    and removed. With --check, exit 0 only when at least one daemon runs and every daemon holds its weights.
    """
    from wcache.ipc.run_dir.directory import census
    from wcache.ipc.run_dir.loading import read_loading
    from wcache.monitor.status_row import StaleDaemon, StatusRow

    where = run_dir_or_default(run_dir)
    found = census(where) if where.exists() else None
    live = found.live if found else ()
    rows = [StatusRow.of(d, answer, _health(d.health_url))
            for d, answer in zip(live, _ask([d.socket for d in live]), strict=True)]
    rows += [StatusRow.loading(r) for r in read_loading(where)] if where.exists() else []
    stale = [StaleDaemon(d.name, d.pid, d.source) for d in found.stale] if found else []
    problems = [p for p in map(_unhealthy, rows) if p is not None]
    engines = _engines(where) if where.exists() and not check else ()
    servers = _servers(where) if not check else ()
    if json:
        from wcache.monitor.status_output import StatusOutput

        out.json(StatusOutput(run_dir=str(where), daemons=rows, stale_removed=stale,
                              ready=bool(rows) and not problems, engines=[_plain(e) for e in engines],
                              servers=list(servers)))
    else:
        for gone in stale:
            out.warning(f"daemon {gone.name} (pid {gone.pid}) is gone; removed its descriptor and socket.")
        if not rows and not check:
            out.print(f"No daemons in {where}.")
        elif rows and not check:
            out.print(_table(where, rows, out.stdout.width))
        if engines:
            out.print(_engine_table(engines, out.stdout.width))
        if servers:
            out.print(_panel("servers", _snapshot(servers=servers), out.stdout.width))
    if check:
        if not rows:
            raise UnavailableError(f"no daemons in {where}.")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UnavailableError(f"{problems[0]}{more}.")
        if not json:
            out.print(f"ready: {len(rows)} daemon(s) in {where}")


def _engines(where: Path) -> tuple[EngineRow, ...]:
    """The engines announced in the run dir (vLLM ranks and reference servers), as `top` shows them."""
    from wcache.ipc.run_dir.paths import RunPaths

    if not any(RunPaths(where).engines.glob(f"*{RunPaths.DESCRIPTOR_SUFFIX}")):
        return ()  # nothing announced: no scraping machinery to import
    from wcache.monitor.collector import Collector

    collector = Collector(where)
    try:
        return collector.engines()
    finally:
        collector.close()


def _servers(where: Path) -> tuple[ServerRow, ...]:
    """The vLLM servers `wcache serve` launchers supervise here, as `top` shows them."""
    from wcache.ipc.run_dir.paths import RunPaths

    if not where.exists() or not RunPaths.server_files(RunPaths(where).servers):
        return ()
    from wcache.monitor.collector import server_rows

    return server_rows(where)


def _plain(row: EngineRow) -> msgspec.Struct:
    from wcache.monitor.status_output import StatusEngine

    return StatusEngine(**{name: getattr(row, name) for name in StatusEngine.__struct_fields__})


def _snapshot(engines: tuple[EngineRow, ...] = (), servers: tuple[ServerRow, ...] = ()) -> Snapshot:
    import time

    from wcache.monitor.snapshot import Snapshot

    return Snapshot(taken_at=time.time(), interval_s=0.0, rates="cumulative", run_dir="", daemons=(),
                    engines=engines, events=(), servers=servers)


def _panel(panel: str, snapshot: Snapshot, width: int | None) -> RenderableType:
    """One of `top`'s panels, once: the same columns and cells."""
    import time

    from wcache_cli.top.once import panel_table
    from wcache_cli.top.view import PANEL_BY_ID

    return panel_table(PANEL_BY_ID[panel], snapshot, time.time(), width=width)


def _engine_table(engines: tuple[EngineRow, ...], width: int | None) -> RenderableType:
    """`top`'s engines panel, once: the same columns and cells (a fallback in red, with its reason)."""
    return _panel("engines", _snapshot(engines=engines), width)


# The table's columns and, for a narrow terminal, which go first (highest first; 0: never). The daemon's name
# is what `stop` takes and holds its device and key id, so those columns go early.
STATUS_COLUMNS = (("daemon", 0), ("device", 6), ("rank", 5), ("model", 2), ("key", 8), ("state", 1), ("origin", 1),
                  ("memory", 3), ("leases", 4), ("uptime", 7), ("health", 4), ("plan", 5))


def _table(where: Path, rows: list[StatusRow], width: int | None = None) -> Table:
    from rich.table import Table
    from rich.text import Text

    from wcache_cli.fit import visible_columns

    cells = [[Text.from_markup(c) for c in _cells(r)] for r in rows]
    labels = [label for label, _ in STATUS_COLUMNS]
    widths = [max([len(label), *(row[i].cell_len for row in cells)]) for i, label in enumerate(labels)]
    shown = (visible_columns(widths, [drop for _, drop in STATUS_COLUMNS], width) if width is not None
             else list(range(len(labels))))
    table = Table(title=f"daemons in {where}", title_justify="left")
    for i in shown:  # no cell is cut or wrapped: a column that does not fit is left out whole
        table.add_column(labels[i], no_wrap=True)
    for row in cells:
        table.add_row(*(row[i] for i in shown))
    return table


def _cells(r: StatusRow) -> list[str]:
    """One daemon's cells, as markup. Every string here comes from a file in the run dir, which anything
    running as this user may forge: shown through `literal`."""
    from wcache.checkpoint.display_name import display_name

    from wcache_cli.cells import PROVENANCE_MARK, human_bytes

    uptime = f"{r.uptime_s:.0f} s" if isinstance(r.uptime_s, int | float) else "?"
    health = str(r.health_status) if r.health_status is not None else "off"
    model = literal(r.model if isinstance(r.model, str) else display_name(r.source))  # may hold brackets
    state = str(r.state)
    if state == "loading":
        total = int(r.total_bytes or 0)
        state = (f"loading {human_bytes(int(r.done_bytes or 0))}/{human_bytes(total)}" if total
                 else f"loading ({literal(r.phase or '')})")
    elif not r.holds_weights and state == "ready":
        state = "ready, no weights"
    if r.corrupt:
        state = "CORRUPT: " + "; ".join(literal(c) for c in r.corrupt)
    if unverified := int((r.counters or {}).get("hits_unverified", 0)):
        state += f", {unverified} unverified hit(s)"  # --trust-daemon engines never compared checkpoints
    name = literal(r.name) if r.name else f"(pid {r.pid})"
    key = literal(f"{r.parent_key_id} → {r.key_id}" if r.parent_key_id else (r.key_id or "-"))
    mark, style = PROVENANCE_MARK.get(r.provenance or "", ("-", "dim"))
    return [name, literal(r.device), f"{r.tp_rank}/{r.tp_size}", model, key,
            state, f"[{style}]{mark}[/]", human_bytes(int(r.weights_bytes or 0)), str(r.leases),
            uptime, health, literal(r.plan or "-")]


def stop(
    ident: Annotated[
        str | None, typer.Argument(help="Daemon name or key id prefix.", show_default=False, autocompletion=daemon_ids)
    ] = None,
    all_daemons: Annotated[bool, typer.Option("--all", help="Stop every daemon in the run dir.")] = False,
    group: Annotated[
        bool, typer.Option("--group", help="Stop every rank of the tensor-parallel group the daemon belongs to.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop even while engines hold zero-copy leases.")] = False,
    run_dir: RunDirOpt = None,
) -> None:
    """Stop daemons; refuses while zero-copy engines hold leases unless --force.

    One rank of a tensor-parallel group is never stopped alone (the rest could not serve): name the group
    with --group.
    """
    if (ident is None) == (not all_daemons):
        raise BadInputError("name one daemon to stop, or pass --all (not both).")
    from wcache.daemon.groups import stop_targets
    from wcache.daemon.stopping import stop_daemons, stop_loading
    from wcache.ipc.run_dir.loading import read_loading

    where = run_dir_or_default(run_dir)
    targets = stop_targets(where, None if all_daemons else ident, group=group)
    loading = read_loading(where) if all_daemons and where.exists() else []
    unreachable: list[UnavailableError] = []  # ranks loading in another pid namespace: the rest still stop
    for record in loading:
        try:
            stop_loading(where, record)
        except UnavailableError as exc:
            unreachable.append(exc)
            continue
        out.print(f"stopped {literal(record.name or f'pid {record.pid}')} (it was loading)")
    if targets:
        stop_daemons(targets, force=force, on_stopped=lambda name: out.print(f"stopped {literal(name)}"))
    elif not loading:
        if not all_daemons:
            raise UnavailableError(f"no running daemon matches {ident!r} in {where}; `wcache status` lists them.")
        out.print(f"No daemons in {where}.")
    if unreachable:
        raise unreachable[0]
