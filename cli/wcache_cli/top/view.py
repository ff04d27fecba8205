"""What `wcache top` shows, as plain data: columns, cells, sorting, filtering and event details.

Both the Textual dashboard and `--once` render from these, so the two never disagree. No Textual imports:
cells are rich `Text`, which both a `DataTable` and a rich `Table` accept. A value the source did not report
(`None`) renders as "off", never as 0 and never as an exception.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rich.text import Text
from wcache.monitor.snapshot import DaemonRow, EngineRow, EventRow, ServerRow, Snapshot

from wcache_cli.cells import PROVENANCE_MARK, human_bytes
from wcache_cli.fit import RICH_FIXED, RICH_PER_COLUMN, visible_columns
from wcache_cli.output import printable

if TYPE_CHECKING:
    from rich.console import JustifyMethod

OFF = "off"
NOT_YET = "–"  # the series exists but this interval has no value (first sample, or nothing was queried)
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 20
SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": ""}
SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}
WEIGHTS_STYLE = {"hit": "green", "miss": "bold red", "fallback": "bold red", "disk": "yellow",
                 "corrupt": "bold white on red"}
FEED_LIMIT = 20  # events that --once prints
DIFF_NAMES = 8  # tensor names listed per kind of change

R = TypeVar("R")


# -- formatting -----------------------------------------------------------------------------------------------


def off(style: str = "dim") -> Text:
    return Text(OFF, style=style)


def count(value: float | None) -> Text:
    """A cumulative counter: an integer with separators, or "off" when the series is absent."""
    if value is None or not math.isfinite(value):
        return off()
    return Text(f"{value:,.0f}")


def percent(value: float | None, *, present: bool) -> Text:
    """A ratio as a percentage; "off" when the series is absent, "–" when it exists but has no value yet."""
    if not present:
        return off()
    if value is None:
        return Text(NOT_YET, style="dim")
    return Text(f"{value * 100:.1f} %")


def sparkline(history: Sequence[float], *, present: bool, width: int = SPARK_WIDTH) -> Text:
    """Hit rates on a fixed 0–100 % scale, oldest left, newest right."""
    if not present:
        return off()
    if not history:
        return Text(NOT_YET, style="dim")
    cells = [SPARK[min(len(SPARK) - 1, max(0, int(v * len(SPARK))))] for v in history[-width:]]
    return Text("".join(cells), style="cyan")


def duration(seconds: float | None) -> str:
    """Compact: 42s, 3m07s, 2h05m, 4d03h."""
    if seconds is None or not math.isfinite(seconds):
        return OFF
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clock_time(ts: float, now: float) -> str:
    """Local time of day, with the date once it is a day old: a row that does not change every second."""
    fmt = "%H:%M:%S" if now - ts < 86400 else "%m-%d %H:%M"
    return time.strftime(fmt, time.localtime(ts))


def health(d: DaemonRow) -> Text:
    if not d.alive:
        return Text("gone", style="bold red")
    if d.health_status is None:
        return off()
    if d.health_status == 200:
        return Text("ok", style="green")
    return Text(str(d.health_status), style="bold red")


def state(d: DaemonRow) -> Text:
    style = {"ready": "green", "gone": "bold red"}.get(d.state, "yellow")
    if d.state == "loading" and d.loaded_fraction is not None:
        return Text(f"loading {d.loaded_fraction:.0%}", style=style)
    return Text(d.state, style=style)


def provenance(d: DaemonRow) -> Text:
    """Its files against what the Hub published: ✓ all match, ✗ one differs (wcache verify --provenance names
    it), ? not known (not from the Hugging Face cache, a non-LFS file)."""
    mark, style = PROVENANCE_MARK.get(d.provenance or "", ("-", "dim"))
    return Text(mark, style=style)


def misses(d: DaemonRow) -> Text:
    """Misses against hellos: a daemon that engines keep missing is holding the wrong key for them."""
    asked = d.hits + d.misses
    if not d.alive or asked == 0:
        return off()
    return Text(f"{d.misses} ({d.misses / asked:.0%})", style="bold yellow" if d.misses else "")


def shown(value: str, style: str = "") -> Text:
    """Text from outside (paths, names, reasons) with its control characters escaped for the terminal."""
    return Text(printable(value), style=style)


def weights(e: EngineRow) -> Text:
    if e.weights is None:
        return off()
    return shown(e.weights, style=WEIGHTS_STYLE.get(e.weights, ""))


def attach_ms(e: EngineRow) -> Text:
    if e.attach_ms is None:
        return off()
    return Text(f"{e.attach_ms:,.1f} ms")


def plain(value: str | None) -> Text:
    return off() if value is None else shown(value)


def by_weights(e: EngineRow) -> Text:
    """Overall hit rate per weights key the engine served, its current key first (bold); "off" for engines that
    do not count by weights (vLLM)."""
    if not e.hit_rate_by_weights:
        return off()
    text = Text()
    for n, (key, rate) in enumerate(e.hit_rate_by_weights):
        if n:
            text.append(" · ", style="dim")
        shown_rate = NOT_YET if rate is None else f"{rate * 100:.0f} %"
        text.append(f"{key[:8]} {shown_rate}", style="bold" if key == e.key_id else "")
    return text


# -- columns --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column(Generic[R]):
    """One column: its label, how a row renders in it (given the display clock), and its sort key."""

    label: str
    cell: Callable[[R, float], Text]
    key: Callable[[R], Any]
    justify: JustifyMethod = "left"
    # On a narrow terminal the columns of highest `drop` go first; 0: never dropped (what commands take). What an
    # operator reads a row by (model, state, leases, health) goes last; ranks, uptimes and pids first.
    drop: int = 0
    flexible: bool = False  # wraps to fit (a summary); only FLEXIBLE_WIDTH of it counts when fitting


def _has_prefix(e: EngineRow) -> bool:
    return e.prefix_queries_total is not None


DAEMON_COLUMNS: tuple[Column[DaemonRow], ...] = (
    Column("device", lambda d, _: shown(d.device), lambda d: d.device, drop=3),
    Column("rank", lambda d, _: Text(f"{d.tp_rank}/{d.tp_size}"), lambda d: (d.tp_size, d.tp_rank),
           drop=6),
    Column("model", lambda d, _: shown(d.model), lambda d: d.model, drop=1),
    Column("key id", lambda d, _: lineage(d), lambda d: d.key_id),
    Column("state", lambda d, _: state(d), lambda d: d.state, drop=1),
    Column("origin", lambda d, _: provenance(d), lambda d: d.provenance or "", drop=5),
    Column("memory", lambda d, _: Text(human_bytes(d.weights_bytes)) if d.alive else off(),
           lambda d: d.weights_bytes if d.alive else None, "right", drop=4),
    Column("leases", lambda d, _: Text(str(d.leases)) if d.alive else off(),
           lambda d: d.leases if d.alive else None, "right", drop=2),
    Column("uptime", lambda d, _: Text(duration(d.uptime_s), style="" if d.uptime_s is not None else "dim"),
           lambda d: d.uptime_s, "right", drop=7),
    Column("misses", lambda d, _: misses(d), lambda d: d.misses, "right", drop=8),
    Column("health", lambda d, _: health(d), lambda d: (d.alive, d.health_status or 0), drop=2),
    Column("pid", lambda d, _: Text(str(d.pid), style="dim"), lambda d: d.pid, "right", drop=9),
    # What engines must ask for to hit it: two daemons of one model differ here.
    Column("plan", lambda d, _: plain(d.plan), lambda d: d.plan or "", drop=5),
)

def lineage(d: DaemonRow) -> Text:
    """The key id, after the key it was built from for a version made from a delta (`N → N+1`)."""
    key = shown(d.key_id, style="cyan")
    return Text.assemble(shown(f"{d.parent_key_id} → ", style="dim"), key) if d.parent_key_id else key


def address(e: EngineRow) -> str:
    """Where the engine listens, without the scheme: the engine's name in every table."""
    url = e.url.split("://", 1)[-1].rstrip("/")
    return url.removesuffix("/metrics") or "(no URL)"  # an offline engine


def engine_daemon(e: EngineRow) -> Text:
    """The daemon whose weights (its name holds their key id) the engine serves now, and "follows" when it moves
    to each newer version by itself."""
    return Text.assemble(plain(e.daemon), Text(" follows", style="dim")) if e.follows else plain(e.daemon)


def engine_pid(e: EngineRow) -> int | None:
    """Engines announced in the run dir are named "pid N"; scraped ones have no pid we know."""
    head, _, tail = e.id.partition(" ")
    return int(tail) if head == "pid" and tail.isdigit() else None


ENGINE_COLUMNS: tuple[Column[EngineRow], ...] = (
    Column("where", lambda e, _: shown(address(e)), address),
    Column("pid", lambda e, _: Text(str(engine_pid(e)), style="dim") if engine_pid(e) else Text("scraped", style="dim"),
           lambda e: engine_pid(e), "right", drop=7),
    Column("kind", lambda e, _: Text(e.kind), lambda e: e.kind, drop=6),
    Column("model", lambda e, _: shown(e.model), lambda e: e.model, drop=2),
    Column("weights", lambda e, _: weights(e), lambda e: e.weights, drop=1),
    Column("mode", lambda e, _: plain(e.mode), lambda e: e.mode, drop=5),
    Column("daemon", lambda e, _: engine_daemon(e), lambda e: e.daemon, drop=3),
    Column("attach", lambda e, _: attach_ms(e), lambda e: e.attach_ms, "right", drop=4),
    Column("up", lambda e, _: Text("up", style="green") if e.up else Text("down", style="bold red"),
           lambda e: e.up, drop=1),
    # A vLLM server's own /metrics: requests in flight and finished, and how full its KV cache is.
    Column("reqs", lambda e, _: requests(e), lambda e: e.requests_running, "right", drop=8),
    Column("kv", lambda e, _: percent(e.kv_usage, present=e.kv_usage is not None), lambda e: e.kv_usage, "right",
           drop=8),
    # Left out whole where it does not fit: the events panel and its detail say the same reason.
    Column("why disk", lambda e, _: shown(e.reason, style="bold red") if e.reason else Text(""),
           lambda e: e.reason or "", drop=9),
)


def requests(e: EngineRow) -> Text:
    """Requests running now / finished since start, from a vLLM server's /metrics."""
    if e.requests_running is None and e.requests_done is None:
        return off()
    return Text.assemble(count(e.requests_running), " / ", count(e.requests_done))

REPLAY_COLUMNS: tuple[Column[EngineRow], ...] = (
    Column("engine", lambda e, _: shown(address(e)), address),
    Column("hit % (interval)", lambda e, _: percent(e.hit_rate_interval, present=_has_prefix(e)),
           lambda e: e.hit_rate_interval, "right", drop=1),
    Column("hit % (overall)", lambda e, _: percent(e.hit_rate_overall, present=_has_prefix(e)),
           lambda e: e.hit_rate_overall, "right", drop=2),
    Column("adopted", lambda e, _: count(e.adopted_hits_total), lambda e: e.adopted_hits_total, "right",
           drop=3),
    Column("replayed tok", lambda e, _: count(e.replayed_tokens_total), lambda e: e.replayed_tokens_total,
           "right", drop=4),
    Column("prefill saved", lambda e, _: count(e.prefill_saved_total), lambda e: e.prefill_saved_total, "right",
           drop=5),
    Column("history", lambda e, _: sparkline(e.hit_rate_history, present=_has_prefix(e)),
           lambda e: e.hit_rate_history[-1] if e.hit_rate_history else None, drop=6),
    Column("hit % by weights", lambda e, _: by_weights(e), lambda e: e.key_id, drop=7),
)


SERVER_STATE_STYLE = {"serving": "green", "starting": "yellow", "backing off": "bold red", "stopping": "dim"}


def server_address(s: ServerRow) -> str:
    return s.url.split("://", 1)[-1].rstrip("/")


def ready_in(s: ServerRow) -> Text:
    """The last start's time until /health answered 200."""
    return Text(f"{s.last_ready_s:.1f} s") if s.last_ready_s is not None else Text(NOT_YET, style="dim")


SERVER_COLUMNS: tuple[Column[ServerRow], ...] = (
    Column("where", lambda s, _: shown(server_address(s)), server_address),
    Column("state", lambda s, _: shown(s.state, SERVER_STATE_STYLE.get(s.state, "")), lambda s: s.state, drop=1),
    Column("pid", lambda s, _: Text(str(s.pid)) if s.pid is not None else off(), lambda s: s.pid or 0, "right",
           drop=4),
    Column("restarts", lambda s, _: Text(str(s.restarts)), lambda s: s.restarts, "right", drop=2),
    Column("ready in", lambda s, _: ready_in(s), lambda s: s.last_ready_s or 0.0, "right", drop=3),
    Column("model", lambda s, _: shown(s.model), lambda s: s.model, drop=5),
    Column("launcher", lambda s, _: Text(str(s.launcher_pid), style="dim"), lambda s: s.launcher_pid, "right",
           drop=7),
    # Why the last server died: its whole line is in the launcher's output and `status --json`.
    Column("last exit", lambda s, _: shown(s.last_exit, style="red") if s.last_exit else Text(""),
           lambda s: s.last_exit or "", drop=6),
)


def _severity_text(value: str, e: EventRow) -> Text:
    return shown(value, SEVERITY_STYLE.get(e.severity, ""))


EVENT_COLUMNS: tuple[Column[EventRow], ...] = (
    Column("when", lambda e, now: Text(clock_time(e.ts, now), style="dim"), lambda e: e.ts, "right"),
    Column("severity", lambda e, _: _severity_text(e.severity, e), lambda e: SEVERITY_RANK.get(e.severity, 0),
           drop=2),
    Column("kind", lambda e, _: _severity_text(e.kind, e), lambda e: e.kind, drop=1),
    Column("summary", lambda e, _: _severity_text(e.summary, e), lambda e: e.summary, flexible=True),
)


@dataclass(frozen=True, slots=True)
class Panel(Generic[R]):
    """One table of the dashboard: which rows of a snapshot it shows, and how."""

    id: str
    title: str
    columns: tuple[Column[R], ...]
    rows: Callable[[Snapshot], Sequence[R]]
    row_key: Callable[[R], str]  # stable across polls, so the cursor stays on its row
    extra_text: Callable[[R], str]  # searched by the filter besides the visible cells
    default_sort: int = 0
    default_reverse: bool = False


PANELS: tuple[Panel[Any], ...] = (
    Panel("daemons", "Daemons", DAEMON_COLUMNS, lambda s: s.daemons, lambda d: d.name,
          lambda d: f"{d.name} {d.pid}"),
    Panel("engines", "Engines", ENGINE_COLUMNS, lambda s: s.engines, lambda e: e.id,
          lambda e: f"{e.id} {e.url}"),
    Panel("servers", "Served by wcache serve", SERVER_COLUMNS, lambda s: s.servers, lambda s: str(s.launcher_pid),
          lambda s: f"{s.url} {s.launcher_pid} {s.last_exit or ''}"),
    Panel("replay", "Replay and prefix cache (hit % = hit tokens / queried tokens)", REPLAY_COLUMNS,
          lambda s: s.engines, lambda e: e.id, lambda e: f"{e.id} {e.url} {e.model} {e.kind}"),
    Panel("events", "Events", EVENT_COLUMNS, lambda s: s.events, lambda e: f"{e.ts!r}/{e.kind}/{e.summary}",
          lambda e: str(e.detail.get("reason") or ""), default_sort=0, default_reverse=True),
)
PANEL_BY_ID: dict[str, Panel[Any]] = {p.id: p for p in PANELS}


# -- sorting and filtering ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sort:
    column: int
    reverse: bool = False

    def next_column(self, num_columns: int) -> Sort:
        return Sort((self.column + 1) % num_columns, self.reverse)

    def reversed(self) -> Sort:
        return Sort(self.column, not self.reverse)

    @property
    def arrow(self) -> str:
        return "▼" if self.reverse else "▲"


def default_sort(panel: Panel[Any]) -> Sort:
    return Sort(panel.default_sort, panel.default_reverse)


class FilterError(ValueError):
    """The filter text is not a valid regular expression."""


@dataclass(frozen=True, slots=True)
class RowFilter:
    """A regex searched in each row's text (case-insensitive unless it has a capital letter); `!` inverts."""

    text: str
    pattern: re.Pattern[str]
    invert: bool

    @classmethod
    def parse(cls, text: str) -> RowFilter | None:
        """None for an empty filter; FilterError (with the regex error) when the pattern does not compile."""
        invert = text.startswith("!")
        body = text[1:] if invert else text
        if not body:
            return None
        flags = 0 if any(c.isupper() for c in body) else re.IGNORECASE
        try:
            pattern = re.compile(body, flags)
        except re.error as exc:
            raise FilterError(f"invalid regex {body!r}: {exc}") from None
        return cls(text, pattern, invert)

    def matches(self, haystack: str) -> bool:
        return (self.pattern.search(haystack) is not None) != self.invert


@dataclass(frozen=True, slots=True)
class RenderedRow:
    key: str
    cells: tuple[Text, ...]
    row: Any


def render_rows(panel: Panel[R], snapshot: Snapshot, sort: Sort, row_filter: RowFilter | None,
                now: float) -> list[RenderedRow]:
    """The panel's rows: filtered on their visible text, then sorted (absent values last either way)."""
    rows = panel.rows(snapshot)
    column = panel.columns[sort.column]
    present = sorted((r for r in rows if column.key(r) is not None), key=column.key, reverse=sort.reverse)
    absent = [r for r in rows if column.key(r) is None]
    rendered = []
    seen: dict[str, int] = {}
    for row in present + absent:
        cells = tuple(c.cell(row, now) for c in panel.columns)
        if row_filter is not None:
            haystack = " ".join([*(c.plain for c in cells), panel.extra_text(row)])
            if not row_filter.matches(haystack):
                continue
        key = panel.row_key(row)
        seen[key] = seen.get(key, 0) + 1
        rendered.append(RenderedRow(key if seen[key] == 1 else f"{key}#{seen[key]}", cells, row))
    return rendered


FLEXIBLE_WIDTH = 24


def fitted_columns(panel: Panel[Any], labels: Sequence[str], rows: Sequence[RenderedRow], width: int | None, *,
                   per_column: int = RICH_PER_COLUMN, fixed: int = RICH_FIXED) -> list[int]:
    """The panel's columns that fit `width` (all with None): whole columns dropped by priority, never cut."""
    if width is None:
        return list(range(len(panel.columns)))
    widths = [min(natural, FLEXIBLE_WIDTH) if column.flexible else natural
              for column, natural in zip(panel.columns, natural_widths(labels, rows), strict=True)]
    return visible_columns(widths, [c.drop for c in panel.columns], width, per_column=per_column, fixed=fixed)


def natural_widths(labels: Sequence[str], rows: Sequence[RenderedRow]) -> list[int]:
    """Each column's width with nothing cut: its widest cell or its label."""
    return [max([len(label), *(row.cells[i].cell_len for row in rows)]) for i, label in enumerate(labels)]


def column_label(panel: Panel[Any], index: int, sort: Sort) -> str:
    label = panel.columns[index].label
    return f"{label} {sort.arrow}" if index == sort.column else label


# -- event details --------------------------------------------------------------------------------------------


def _as_list(value: Any) -> list[str]:
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return [] if value in (None, "") else [str(value)]


def diff_lines(diff: dict[str, Any]) -> list[str]:
    """A key diff as `wcache.key.diff.diff_summary` records it, one fact per line."""
    lines = []
    fields = _as_list(diff.get("fields"))
    if fields:
        lines.append(f"fields: {', '.join(fields)}")
    plan = diff.get("plan")
    if isinstance(plan, dict):
        for name, pair in plan.items():
            if isinstance(pair, list | tuple) and len(pair) == 2:
                lines.append(f"plan {name}: {pair[0]} → {pair[1]}")
            else:
                lines.append(f"plan {name}: {pair}")
    config = _as_list(diff.get("config"))
    if config:
        lines.append(f"config: {', '.join(config)}")
    for what in ("changed", "added", "removed"):
        names = _as_list(diff.get(what))
        total = diff.get(f"num_{what}", len(names))
        if names or total:
            lines.append(f"tensors {what} ({total}):")
            lines.extend(f"  {name}" for name in names[:DIFF_NAMES])
            if isinstance(total, int) and total > min(len(names), DIFF_NAMES):
                lines.append(f"  … and {total - min(len(names), DIFF_NAMES)} more")
    return [printable(line) for line in lines]  # tensor and field names come from the event log


def event_detail(event: EventRow, now: float) -> Text:
    """The selected event: what, when, why, and for a miss the key diff."""
    style = SEVERITY_STYLE.get(event.severity, "")
    text = Text()
    text.append(f"{event.kind}", style=style or "bold")
    text.append(f"  {event.severity} · {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(event.ts))}\n", style="dim")
    detail = dict(event.detail)
    reason = detail.pop("reason", None)
    diff = detail.pop("diff", None)
    if not (reason and str(reason) in event.summary):  # a miss's summary is mostly its reason: say it once
        text.append(f"{printable(event.summary)}\n")
    if reason:
        text.append("reason: ", style="bold")
        text.append(f"{printable(str(reason))}\n")
    if isinstance(diff, dict):
        text.append("key diff:\n", style="bold")
        for line in diff_lines(diff):
            text.append(f"  {line}\n")
    for name in sorted(detail):
        value = detail[name]
        if value is None or value == [] or value == {}:
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, list | tuple):
            value = ", ".join(str(v) for v in value)
        text.append(f"{printable(name)}: ", style="dim")
        text.append(f"{printable(str(value))}\n")
    text.rstrip()
    return text


def counts_line(snapshot: Snapshot) -> str:
    warnings = sum(1 for e in snapshot.events if e.severity == "warning")
    errors = sum(1 for e in snapshot.events if e.severity == "error")
    served = f"{len(snapshot.servers)} served · " if snapshot.servers else ""
    return (f"{len(snapshot.daemons)} daemon(s) · {len(snapshot.engines)} engine(s) · {served}"
            f"{len(snapshot.events)} event(s), {warnings} warning(s), {errors} error(s)")


def rates_line(snapshot: Snapshot) -> str:
    if snapshot.rates == "interval":
        return f"hit rates over the last {snapshot.interval_s:g} s; totals since each engine started"
    return "first sample: interval rates need a second one; totals since each engine started"
