"""`wcache top`: a live dashboard of daemons, engines, fallbacks and replay hit rates, or the same as tables/JSON.

Everything past option parsing is imported inside the function: Textual only on the interactive path, and
the collector (prometheus-client, sockets) only when `top` actually runs, so other commands stay light.
"""

from __future__ import annotations

import json as jsonlib
import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from wcache.errors import BadInputError

from wcache_cli.output import out
from wcache_cli.params import RunDirOpt, run_dir_or_default

if TYPE_CHECKING:
    from wcache_cli.top.source import Source

MIN_INTERVAL_S = 0.1


def top(
    interval: Annotated[
        float, typer.Option("--interval", metavar="SECONDS", min=MIN_INTERVAL_S,
                            help="Seconds between samples; rates are deltas over one interval.")
    ] = 2.0,
    scrape: Annotated[
        list[str] | None,
        typer.Option("--scrape", metavar="URL", show_default=False,
                     help="Also scrape this engine's Prometheus /metrics (a vLLM server, say); repeatable."),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Sample twice, one interval apart, print tables (or --json) and exit.")
    ] = False,
    count: Annotated[
        int | None,
        typer.Option("--count", metavar="N", min=1, show_default=False,
                     help="With --json (without --once): print N lines, one per interval, then exit."),
    ] = None,
    run_dir: RunDirOpt = None,
    json: Annotated[
        bool, typer.Option("--json", help="JSON (schema wcache.top/1): one object with --once, else one line per "
                                          "interval, flushed.")
    ] = False,
) -> None:
    """Watch daemons, engines, attach misses and fallbacks, and prefix-cache and replay hit rates live.

    Keys: q quit, ? help, p pause, / filter (regex, ! inverts), s/S sort, r refresh, e export JSON.
    With --once, print the same as tables (or one JSON object with --json) after waiting one interval so
    rates are real; with --json alone, print one JSON line per interval (--count N to stop).
    """
    if count is not None and (once or not json):
        raise BadInputError("--count goes with --json and without --once (it counts the lines streamed).")
    if not (once or json) and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise BadInputError("wcache top needs a terminal; use --once or --json to script it.")
    from wcache.ipc.run_dir.directory import check_run_dir

    from wcache_cli.top.source import open_source

    where = run_dir_or_default(run_dir)
    if where.exists():
        check_run_dir(where)  # a run dir open to others is refused up front, not on every poll
    source = open_source(where, list(scrape or []), interval)
    try:
        if once:
            _once(source, interval, json)
        elif json:
            _stream(source, interval, count)
        else:
            from wcache_cli.top.app import TopApp

            TopApp(source, interval_s=interval, run_dir=str(where)).run()
    finally:
        source.close()


def _once(source: Source, interval: float, json: bool) -> None:
    import time

    from wcache_cli.top.source import two_samples

    if not json and out.stderr.is_terminal:
        out.hint(f"sampling twice, {interval:g} s apart, so rates are over a real interval…")
    snapshot = two_samples(source, interval)
    if json:
        out.json(snapshot.to_json())
        return
    from wcache_cli.top.once import once_renderable

    out.print(once_renderable(snapshot, time.time(), interval, out.stdout.width))


def _stream(source: Source, interval: float, count: int | None) -> None:
    from wcache_cli.top.source import every_interval

    try:
        for snapshot in every_interval(source, interval, count):
            sys.stdout.write(jsonlib.dumps(snapshot.to_json(), ensure_ascii=False) + "\n")
            sys.stdout.flush()  # a pipe must see each sample as it is taken
    except BrokenPipeError:
        # The reader went away (`| head -1`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
