"""The `wcache top` dashboard: daemons, engines, replay and prefix caching, and the event feed.

The app renders snapshots; it never collects them itself. A `Source` (see source.py) is polled in a thread
worker every interval and on `r`, and each finished poll is handed back to the UI thread, so a slow daemon
or engine never blocks a key press. Pausing freezes what is shown while polling goes on; unpausing shows
the latest snapshot. Tests pass a fake source and a frozen clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static
from wcache.monitor.snapshot import EventRow, Snapshot

from wcache_cli.output import printable
from wcache_cli.top.source import Source
from wcache_cli.top.view import (
    FLEXIBLE_WIDTH,
    PANEL_BY_ID,
    PANELS,
    FilterError,
    Panel,
    RowFilter,
    Sort,
    column_label,
    counts_line,
    default_sort,
    event_detail,
    fitted_columns,
    natural_widths,
    rates_line,
    render_rows,
)

EXPORT_DIR_ENV = "WCACHE_TOP_EXPORT_DIR"
# A table's width that holds no column: its rounded border (two cells) and its vertical scrollbar (one).
TABLE_CHROME = 3
NO_EVENT = "Select an event (Tab to the feed, then ↑/↓) to see its reason and key diff."

# Longer explanations for the help screen, by action; every binding of TopApp must have one.
HELP: dict[str, str] = {
    "quit": "Quit.",
    "help": "Show this help (Esc, ? or q closes it).",
    "toggle_pause": "Pause the display; collection continues and a banner says so. Press again for the latest.",
    "filter": "Filter rows and events by regex (case-insensitive unless it has a capital); a leading ! inverts.",
    "clear_filter": "Clear the filter (and close the filter prompt).",
    "cycle_sort": "Sort the focused table by its next column (the ▲/▼ in its header marks the sort column).",
    "reverse_sort": "Reverse the focused table's sort order.",
    "refresh": "Poll now instead of waiting for the next interval.",
    "export": f"Write the displayed snapshot as JSON to the current directory (or ${EXPORT_DIR_ENV}).",
}
NAVIGATION: tuple[tuple[str, str], ...] = (
    ("Tab / Shift+Tab", "Move between the daemons, engines, servers, replay and events tables."),
    ("↑ ↓ PgUp PgDn", "Move the cursor in a table; in the events table this selects an event."),
    ("Enter", "Select the event under the cursor: its reason and key diff show beside the feed."),
)


class HelpScreen(ModalScreen[None]):
    """Every binding of the dashboard, with what it does."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close", show=False),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for binding in self.bindings:
            table.add_row(binding.key_display or binding.key, HELP.get(binding.action, binding.description))
        table.add_row("", "")
        for keys, what in NAVIGATION:
            table.add_row(keys, what)
        with VerticalScroll(id="help-body"):
            yield Static(Text("wcache top: keys", style="bold"), id="help-title")
            yield Static(table, id="help-keys")
            yield Static(
                Text("\"off\": the engine does not export that series (vLLM has no replay counters). "
                     "\"–\": the series exists but has no value for this interval yet.", style="dim"),
                id="help-notes",
            )


class TopApp(App[None]):
    """Live view of one run dir's daemons and engines, fed by a polling `Source`."""

    CSS_PATH = "app.tcss"
    TITLE = "wcache top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("escape", "clear_filter", "Clear filter", key_display="Esc", show=False),
        Binding("s", "cycle_sort", "Sort"),
        Binding("S", "reverse_sort", "Reverse", key_display="S"),
        Binding("r", "refresh", "Refresh"),
        Binding("e", "export", "Export"),
        Binding("ctrl+c", "quit", "Quit", key_display="Ctrl+C", show=False, priority=True),
    ]

    def __init__(self, source: Source, *, interval_s: float = 2.0, run_dir: str = "",
                 clock: Callable[[], float] = time.time, export_dir: Path | None = None) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.run_dir = run_dir
        self.clock = clock
        self.export_dir = export_dir
        self.latest: Snapshot | None = None
        """The newest snapshot polled."""
        self.shown: Snapshot | None = None
        """The snapshot on screen: the latest, or the one frozen by pause."""
        self.paused = False
        self.polls = 0
        self.newer_while_paused = 0
        self.poll_error: str | None = None
        self.sorts: dict[str, Sort] = {p.id: default_sort(p) for p in PANELS}
        self.row_filter: RowFilter | None = None
        self.filter_error: str | None = None
        self.sort_target = "daemons"
        self._polling = False
        self._poll_again = False
        self._events: dict[str, EventRow] = {}
        # The detail pane follows the newest event until the user picks one; then it stays on their pick.
        self._event_pinned = False
        self._followed_event: str | None = None
        self._rendering = False
        self._signatures: dict[str, Any] = {}  # what each table last showed
        self._texts: dict[str, tuple[Any, ...]] = {}  # what each Static last showed

    # -- layout ----------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="banner")
        for panel in PANELS:
            if panel.id != "events":  # the feed sits beside its detail, below
                yield DataTable(id=panel.id, cursor_type="row")
        with Horizontal(id="bottom"):
            yield DataTable(id="events", cursor_type="row")
            with VerticalScroll(id="detail-pane"):
                yield Static(Text(NO_EVENT, style="dim"), id="detail")
        yield Input(id="filter", select_on_focus=False,
                    placeholder="regex over rows and events; a leading ! inverts; Enter applies, Esc clears")
        yield Footer()

    def on_mount(self) -> None:
        for panel in PANELS:
            self.query_one(f"#{panel.id}", DataTable).border_title = panel.title
        self.query_one("#detail-pane").border_title = "Event detail"
        self.query_one("#daemons", DataTable).focus()
        self.render_all()
        self.poll_now()
        self.set_interval(self.interval_s, self.poll_now)

    # -- polling ---------------------------------------------------------------------------------------------

    def poll_now(self) -> None:
        """Start a poll in a thread worker; if one is running, run another as soon as it ends."""
        if self._polling:
            self._poll_again = True
            return
        self._polling = True
        self.run_worker(self._poll_in_thread, thread=True, group="poll", exit_on_error=False,
                        description="polling daemons, engines and events")

    def _poll_in_thread(self) -> None:
        try:
            snapshot = self.source.poll()
        except Exception as exc:  # any failure of one poll is shown and the next poll tries again
            with contextlib.suppress(RuntimeError):  # the app may be closing
                self.call_from_thread(self._poll_failed, f"{type(exc).__name__}: {exc}")
            return
        with contextlib.suppress(RuntimeError):
            self.call_from_thread(self._received, snapshot)

    def _poll_done(self) -> None:
        self._polling = False
        if self._poll_again:
            self._poll_again = False
            self.poll_now()

    def _poll_failed(self, message: str) -> None:
        self.poll_error = message
        self.notify(f"poll failed: {message}", severity="error", timeout=5)
        self.render_status()
        self._poll_done()

    def _received(self, snapshot: Snapshot) -> None:
        self.polls += 1
        self.poll_error = None
        self.latest = snapshot
        if self.paused:
            self.newer_while_paused += 1
            self.render_status()
        else:
            self.shown = snapshot
            self.render_all()
        self._poll_done()

    # -- rendering -------------------------------------------------------------------------------------------

    def render_all(self) -> None:
        for panel in PANELS:
            self.render_panel(panel)
        self.render_detail()
        self.render_status()

    def render_status(self) -> None:
        shown = self.shown
        now = self.clock()
        line = Text()
        line.append("wcache top", style="bold")
        line.append(f"  {self.run_dir or (shown.run_dir if shown else '')}  every {self.interval_s:g} s")
        if shown is not None:
            line.append(f"  {counts_line(shown)}\n")
            line.append(rates_line(shown), style="dim")
        else:
            line.append("\nwaiting for the first sample…", style="dim")
        if self.row_filter is not None:
            line.append("  filter: ", style="dim")
            line.append(self.row_filter.text, style="bold magenta")
        if self.filter_error and self.query_one("#filter", Input).display:
            line.append(f"  {self.filter_error}", style="bold red")
        if self.poll_error:
            line.append(f"  last poll failed: {self.poll_error}", style="bold red")
        self._update("#status", line)
        alerts = shown.alerts if shown is not None else ()
        self.query_one("#banner", Static).display = self.paused or bool(alerts)
        banner = Text(printable(" · ".join(alerts)), style="bold") if alerts else Text()
        if self.paused:
            taken = f" from {now - shown.taken_at:.0f} s ago" if shown is not None else ""
            banner = Text(
                f"PAUSED · showing the sample{taken} · collection continues "
                f"({self.newer_while_paused} newer) · p resumes" + ("\n" if alerts else ""),
            ).append_text(banner)
        if self.paused or alerts:
            self._update("#banner", banner)

    def _update(self, selector: str, text: Text) -> None:
        """Static.update repaints even with the same text; skip it when nothing changed."""
        signature = (text.plain, tuple(text.spans), str(text.style))
        if self._texts.get(selector) != signature:
            self._texts[selector] = signature
            self.query_one(selector, Static).update(text)

    def _table_width(self, table: DataTable[Any]) -> int:
        """The table's outer width once laid out, else the screen's (the first render comes before layout)."""
        return table.size.width or self.size.width

    def on_resize(self) -> None:
        # Which columns fit changes with the width: render again once the new layout has sized the tables.
        self._signatures.clear()
        self.call_after_refresh(self.render_all)

    def render_panel(self, panel: Panel[Any]) -> None:
        table = self.query_one(f"#{panel.id}", DataTable)
        sort = self.sorts[panel.id]
        rows = render_rows(panel, self.shown, sort, self.row_filter, self.clock()) if self.shown else []
        if panel.id == "events":
            self._events = {row.key: row.row for row in rows}
        total = len(panel.rows(self.shown)) if self.shown else 0
        if panel.id == "servers":
            table.display = total > 0  # most run dirs have no `wcache serve`: no empty table for them
        shown = f"{len(rows)} of {total}" if self.row_filter is not None else str(total)
        table.border_title = f"{panel.title} ({shown})"
        table.border_subtitle = f"sorted by {panel.columns[sort.column].label} {sort.arrow}"
        labels = tuple(column_label(panel, i, sort) for i in range(len(panel.columns)))
        # Columns that do not fit the table's width are left out whole: a DataTable would scroll them off-screen.
        width = self._table_width(table)
        columns = fitted_columns(panel, labels, rows, width, per_column=2 * table.cell_padding, fixed=TABLE_CHROME)
        # A flexible column (a summary) takes what the others leave; the detail pane shows all of it.
        natural = natural_widths(labels, rows)
        rest = width - TABLE_CHROME - sum(natural[i] + 2 * table.cell_padding for i in columns
                                          if not panel.columns[i].flexible)
        flexible_width = max(FLEXIBLE_WIDTH, rest - 2 * table.cell_padding)
        signature = (labels, tuple(columns), flexible_width,
                     tuple((r.key, tuple((c.plain, str(c.style)) for c in r.cells)) for r in rows))
        if self._signatures.get(panel.id) == signature:
            return  # nothing visible changed: repainting a table is most of the dashboard's CPU
        self._signatures[panel.id] = signature
        selected = self._cursor_key(table)
        self._rendering = True
        try:
            table.clear(columns=True)
            for i in columns:
                table.add_column(Text(labels[i], justify=panel.columns[i].justify), key=str(i),
                                 width=flexible_width if panel.columns[i].flexible else None)
            keys = []
            for row in rows:
                cells = []
                for i in columns:
                    cell = row.cells[i]
                    cell.justify = panel.columns[i].justify
                    cells.append(cell)
                # A row with a flexible cell (a refusal's sentence) takes the lines it wraps to: never cut mid-name.
                wraps = any(panel.columns[i].flexible for i in columns)
                table.add_row(*cells, key=row.key, height=None if wraps else 1)
                keys.append(row.key)
            if panel.id == "events" and not self._event_pinned and rows:
                newest = max(range(len(rows)), key=lambda i: rows[i].row.ts)
                self._followed_event = keys[newest]
                table.move_cursor(row=newest, animate=False)
            elif selected in keys:
                table.move_cursor(row=keys.index(selected), animate=False)
        finally:
            self._rendering = False

    @staticmethod
    def _cursor_key(table: DataTable[Any]) -> str | None:
        if table.row_count == 0:
            return None
        try:
            return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except Exception:  # the cursor is outside the rows (a table that just shrank)
            return None

    def selected_event(self) -> EventRow | None:
        key = self._cursor_key(self.query_one("#events", DataTable))
        return self._events.get(key) if key is not None else None

    def render_detail(self) -> None:
        event = self.selected_event()
        self._update("#detail", event_detail(event, self.clock()) if event else Text(NO_EVENT, style="dim"))

    @on(DataTable.RowHighlighted, "#events")
    @on(DataTable.RowSelected, "#events")
    def _event_selected(self) -> None:
        if self._rendering:
            return
        with contextlib.suppress(NoMatches):  # a highlight that arrives while the app is closing
            key = self._cursor_key(self.query_one("#events", DataTable))
            if key is not None and key != self._followed_event:
                self._event_pinned = True  # not where we put the cursor: the user chose this one
            self.render_detail()

    def on_descendant_focus(self, event: Any) -> None:
        widget = getattr(event, "widget", None)
        if isinstance(widget, DataTable) and widget.id in PANEL_BY_ID:
            self.sort_target = widget.id

    # -- actions ---------------------------------------------------------------------------------------------

    async def action_help(self) -> None:
        await self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)]))

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.newer_while_paused = 0
        if not self.paused and self.latest is not None:
            self.shown = self.latest
            self.render_all()
        else:
            self.render_status()

    def action_filter(self) -> None:
        prompt = self.query_one("#filter", Input)
        prompt.value = self.row_filter.text if self.row_filter else ""
        prompt.cursor_position = len(prompt.value)  # edit the current filter in place
        prompt.display = True
        prompt.focus()

    def _take_filter(self, text: str) -> FilterError | None:
        """Filter the rows by `text`; when it does not parse, the last valid filter stays and the error is
        returned."""
        try:
            self.row_filter = RowFilter.parse(text)
        except FilterError as exc:
            return exc
        self.filter_error = None
        return None

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        error = self._take_filter(event.value)
        if error is not None:
            # The user may still be typing: the status line says why the filter is not applied yet.
            self.filter_error = str(error)
            self.render_status()
            return
        self.render_all()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        error = self._take_filter(event.value)
        if error is not None:
            self.notify(f"{error}; still showing the last valid filter.", title="Filter not applied",
                        severity="error", timeout=6)
            return
        self._close_filter_prompt()
        self.render_all()

    def _close_filter_prompt(self) -> None:
        prompt = self.query_one("#filter", Input)
        if prompt.display:
            prompt.display = False
            self.query_one(f"#{self.sort_target}", DataTable).focus()

    def action_clear_filter(self) -> None:
        self._close_filter_prompt()
        self.filter_error = None
        if self.row_filter is not None:
            self.row_filter = None
            self.render_all()

    def action_cycle_sort(self) -> None:
        panel = PANEL_BY_ID[self.sort_target]
        self.sorts[panel.id] = self.sorts[panel.id].next_column(len(panel.columns))
        self.render_panel(panel)

    def action_reverse_sort(self) -> None:
        panel = PANEL_BY_ID[self.sort_target]
        self.sorts[panel.id] = self.sorts[panel.id].reversed()
        self.render_panel(panel)

    def action_refresh(self) -> None:
        self.poll_now()

    def action_export(self) -> None:
        if self.shown is None:
            self.notify("Nothing to export yet: no sample has arrived.", severity="warning")
            return
        directory = self.export_dir or Path(os.environ.get(EXPORT_DIR_ENV) or Path.cwd())
        try:
            path = export_snapshot(self.shown, directory, self.clock())
        except OSError as exc:
            self.notify(f"Could not write the snapshot to {directory}: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"Wrote the displayed snapshot to {path}", title="Exported", timeout=8)


def export_snapshot(snapshot: Snapshot, directory: Path, now: float) -> Path:
    """Write `snapshot.to_json()` to a new timestamped file in `directory`; never overwrites."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    document = json.dumps(snapshot.to_json(), indent=2, ensure_ascii=False) + "\n"
    for attempt in range(1000):
        path = directory / (f"wcache-top-{stamp}.json" if attempt == 0 else f"wcache-top-{stamp}-{attempt}.json")
        try:
            with path.open("x", encoding="utf-8") as f:
                f.write(document)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"too many exports named wcache-top-{stamp}*.json in {directory}")
