"""`wcache top --once`: the dashboard's panels as rich tables, printed once (no Textual)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from wcache.monitor.snapshot import Snapshot

from wcache_cli.output import printable
from wcache_cli.top.view import (
    FEED_LIMIT,
    PANEL_BY_ID,
    PANELS,
    SEVERITY_STYLE,
    Panel,
    counts_line,
    default_sort,
    diff_lines,
    fitted_columns,
    render_rows,
)


def panel_table(panel: Panel[object], snapshot: Snapshot, now: float, limit: int | None = None,
                width: int | None = None) -> Table:
    rows = render_rows(panel, snapshot, default_sort(panel), None, now)
    shown = rows[:limit] if limit is not None else rows
    title = panel.title if len(shown) == len(rows) else f"{panel.title} (latest {len(shown)} of {len(rows)})"
    table = Table(title=title, title_justify="left", title_style="bold")
    # Columns that do not fit are left out whole, and those shown are never cut or wrapped (but a summary).
    columns = fitted_columns(panel, [c.label for c in panel.columns], shown, width)
    for i in columns:
        column = panel.columns[i]
        table.add_column(column.label, justify=column.justify, no_wrap=not column.flexible)
    for row in shown:
        table.add_row(*(row.cells[i] for i in columns))
    if not rows:
        table.add_row(Text("none", style="dim"), *[""] * (len(columns) - 1))
    return table


def _why(snapshot: Snapshot, now: float) -> RenderableType | None:
    """Reasons and key diffs of the latest misses, fallbacks and errors (the TUI shows them on selection)."""
    notable = [e for e in snapshot.events if e.severity != "info"][-5:]
    if not notable:
        return None
    text = Text()
    for event in reversed(notable):
        text.append(f"{event.kind}: ", style=SEVERITY_STYLE.get(event.severity, ""))
        text.append(f"{printable(event.summary)}\n")
        diff = event.detail.get("diff")
        if isinstance(diff, dict):
            for line in diff_lines(diff):
                text.append(f"    {line}\n", style="dim")
    text.rstrip()
    return Group(Text("Why (latest warnings and errors)", style="bold"), text)


def once_renderable(snapshot: Snapshot, now: float, waited_s: float, width: int | None = None) -> RenderableType:
    """The panels as tables; with `width`, each shows the columns that fit it (see view.fitted_columns)."""
    parts: list[RenderableType] = [
        Text(f"wcache top · {printable(snapshot.run_dir)} · {counts_line(snapshot)}", style="bold"),
        *(Text(printable(alert), style="bold red") for alert in snapshot.alerts),
    ]
    for panel in PANELS:
        limit = FEED_LIMIT if panel is PANEL_BY_ID["events"] else None
        parts.append(panel_table(panel, snapshot, now, limit, width))
    why = _why(snapshot, now)
    if why is not None:
        parts.append(why)
    parts.append(Text(
        f"Hit rates \"(interval)\" are over the {waited_s:g} s this command waited between two samples; "
        "totals and \"(overall)\" are cumulative since each engine started; \"off\" means the engine does not "
        "export that series.",
        style="dim",
    ))
    return Group(*parts)
