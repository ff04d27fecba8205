"""`wcache status` and `wcache stop`: what the run dir's daemons hold, and stopping them."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from wcache.client import DaemonError, request_once
from wcache.daemons import stop_daemon
from wcache.errors import BadInputError, UnavailableError
from wcache.rundir import DaemonDescriptor, census, matches

from wcache_cli.output import out, printable
from wcache_cli.params import JsonOpt, RunDirOpt, run_dir_or_default
from wcache_cli.render import human_bytes

HEALTH_TIMEOUT_S = 2.0


def _health(url: str | None) -> int | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def _row(descriptor: DaemonDescriptor) -> dict[str, Any]:
    try:
        stats: dict[str, Any] = request_once(descriptor.socket, "stats").fields
    except DaemonError as exc:
        stats = {"state": "unreachable", "error": str(exc)}
    return {
        "name": descriptor.name, "pid": descriptor.pid, "device": descriptor.device,
        "tp_size": descriptor.tp_size, "tp_rank": descriptor.tp_rank, "source": descriptor.source,
        "key_id": descriptor.key_id, "state": stats.get("state"),
        "weights_bytes": stats.get("weights_bytes", 0), "leases": stats.get("leases", 0),
        "uptime_s": stats.get("uptime_s"), "health_url": descriptor.health_url,
        "health_status": _health(descriptor.health_url), "counters": stats.get("counters", {}),
    }


def status(run_dir: RunDirOpt = None, json: JsonOpt = False) -> None:
    """List the daemons in the run dir: device, model, key, state, memory, leases, uptime and health.

    Descriptors left by daemons that died are reported and removed.
    """
    where = run_dir_or_default(run_dir)
    found = census(where) if where.exists() else None
    rows = [_row(d) for d in found.live] if found else []
    stale = [{"name": d.name, "pid": d.pid, "source": d.source} for d in found.stale] if found else []
    if json:
        out.json({"run_dir": str(where), "daemons": rows, "stale_removed": stale})
        return
    for gone in stale:
        out.warning(f"daemon {gone['name']} (pid {gone['pid']}) is gone; removed its descriptor and socket.")
    if not rows:
        out.print(f"No daemons in {where}.")
        return
    table = Table(title=f"daemons in {where}", title_justify="left")
    for column in ("daemon", "device", "rank", "model", "key", "state", "memory", "leases", "uptime", "health"):
        table.add_column(column)
    for r in rows:
        uptime = f"{r['uptime_s']:.0f} s" if isinstance(r["uptime_s"], int | float) else "?"
        health = str(r["health_status"]) if r["health_status"] is not None else "off"
        model = escape(printable(Path(r["source"]).name))  # a directory name may hold brackets or escapes
        table.add_row(escape(printable(r["name"])), r["device"], f"{r['tp_rank']}/{r['tp_size']}", model,
                      r["key_id"], str(r["state"]), human_bytes(int(r["weights_bytes"] or 0)), str(r["leases"]),
                      uptime, health)
    out.print(table)


def stop(
    ident: Annotated[str | None, typer.Argument(help="Daemon name or key id prefix.", show_default=False)] = None,
    all_daemons: Annotated[bool, typer.Option("--all", help="Stop every daemon in the run dir.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop even while engines hold zero-copy leases.")] = False,
    run_dir: RunDirOpt = None,
) -> None:
    """Stop daemons; refuses while zero-copy engines hold leases unless --force."""
    if (ident is None) == (not all_daemons):
        raise BadInputError("name one daemon to stop, or pass --all (not both).")
    where = run_dir_or_default(run_dir)
    live = census(where).live if where.exists() else ()
    targets = list(live) if all_daemons else [d for d in live if matches(d, ident or "")]
    if not targets:
        if all_daemons:
            out.print(f"No daemons in {where}.")
            return
        raise UnavailableError(f"no running daemon matches {ident!r} in {where}; `wcache status` lists them.")
    refused = [f"{d.name} ({leases} lease(s))" for d in targets if (leases := stop_daemon(d, force=force))]
    for descriptor in targets:
        if not any(r.startswith(descriptor.name + " ") for r in refused):
            out.print(f"stopped {descriptor.name}")
    if refused:
        raise BadInputError(
            f"engines still hold leases on {', '.join(refused)}; detach them first or use --force."
        )
