"""`wcache doctor`: check that this host is right for wcache, one finding per line with what to do."""

from __future__ import annotations

from dataclasses import replace

import typer
from wcache.errors import EXIT_DIFFERENCE

from wcache_cli.output import out, printable
from wcache_cli.params import JsonOpt, RunDirOpt, run_dir_or_default
from wcache_cli.words import cli_text

MARKS = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "fail": ("✗", "bold red")}


def doctor(run_dir: RunDirOpt = None, json: JsonOpt = False) -> None:
    """Check the host: the run dir (owner, mode, filesystem, free space), memfd seals, shared memory and memlock,
    huge pages, cgroup memory against the daemons' arenas, daemon owners, the installed vLLM, CUDA and the
    digest store.

    Each finding is one line: ✓ ok, ! a warning (wcache works, slower or with less safety), ✗ a failure
    (something wcache needs is missing or unsafe), with what to do. Exit 1 when any check fails.
    """
    from rich.markup import escape
    from wcache.doctor import DoctorOutput, run_checks

    findings = run_checks(run_dir_or_default(run_dir))
    failed = any(f.status == "fail" for f in findings)
    if json:
        out.json(DoctorOutput(ok=not failed, findings=[replace(f, message=cli_text(f.message)) for f in findings]))
    else:
        for finding in findings:
            mark, style = MARKS[finding.status]
            # One line per finding however narrow the terminal: a wrapped finding reads as two.
            line = f"[{style}]{mark}[/] {finding.check}: {escape(printable(cli_text(finding.message)))}"
            out.stdout.print(line, soft_wrap=True)
    if failed:
        raise typer.Exit(EXIT_DIFFERENCE)
