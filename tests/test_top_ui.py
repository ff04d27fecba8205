"""Pilot tests of the `wcache top` dashboard: every binding, driven against a fake source and a frozen clock."""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import pytest
from rich.console import Console
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static
from wcache.monitor.snapshot import Snapshot
from wcache_cli.top.app import HELP, HelpScreen, TopApp
from wcache_dev.top_sample import FROZEN_NOW, MISS_REASON, SampleSource, sample_snapshot

pytestmark = pytest.mark.asyncio
SIZE = (120, 40)


def make_app(source: object | None = None, interval_s: float = 3600.0, **kwargs: object) -> TopApp:
    # A long interval: polls happen only when a test asks (r), unless the test wants the timer.
    return TopApp(source or SampleSource(), interval_s=interval_s, run_dir="/run/user/1000/wcache",
                  clock=lambda: FROZEN_NOW, **kwargs)  # type: ignore[arg-type]


async def settle(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def plain(renderable: object, width: int = 200) -> str:
    """A widget's content as plain text, whitespace collapsed (wrapping must not matter)."""
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(renderable)
    return re.sub(r"\s+", " ", console.export_text()).strip()


def static_text(app: TopApp, selector: str) -> str:
    return plain(app.screen.query_one(selector, Static).content)


def table(app: TopApp, table_id: str) -> DataTable:
    return app.query_one(f"#{table_id}", DataTable)


def headers(app: TopApp, table_id: str) -> list[str]:
    return [c.label.plain for c in table(app, table_id).ordered_columns]


def column(app: TopApp, table_id: str, label: str) -> list[str]:
    t = table(app, table_id)
    index = [h.rsplit(" ", 1)[0] if h.endswith(("▲", "▼")) else h for h in headers(app, table_id)]
    i = index.index(label)
    return [t.get_row(row.key)[i].plain for row in t.ordered_rows]


async def wait_until(pilot, predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not met in time")


# -- q, ?, r ---------------------------------------------------------------------------------------------------


async def test_q_quits() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.is_running
        await pilot.press("q")
        assert not app.is_running
    assert app.return_code == 0


async def test_help_lists_every_binding_and_closes() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("?")
        assert isinstance(app.screen, HelpScreen)
        text = static_text(app, "#help-keys")
        bindings = [b for b in TopApp.BINDINGS if isinstance(b, Binding)]
        assert {b.action for b in bindings} <= set(HELP), "every binding needs a help line"
        for binding in bindings:
            key = binding.key_display or binding.key
            assert re.sub(r"\s+", " ", f"{key} {HELP[binding.action]}") in text, binding
        for keys in ("Tab / Shift+Tab", "Enter"):
            assert keys in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("?")
        await pilot.press("q")  # q closes help rather than quitting
        assert not isinstance(app.screen, HelpScreen)
        assert app.is_running


async def test_r_polls_now() -> None:
    source = SampleSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert source.polls == 1
        assert column(app, "daemons", "leases")[1] == "2"  # cuda:0 holds 2 + step leases
        await pilot.press("r")
        await settle(pilot)
        assert source.polls == 2
        assert app.shown == sample_snapshot(1)
        assert column(app, "daemons", "leases")[1] == "3"


# -- pause ------------------------------------------------------------------------------------------------------


async def test_p_pauses_display_while_collection_continues() -> None:
    source = SampleSource()
    app = make_app(source, interval_s=0.05)  # the timer keeps polling throughout
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        banner = app.query_one("#banner", Static)
        assert not banner.display
        await pilot.press("p")
        assert app.paused and banner.display
        assert "PAUSED" in static_text(app, "#banner")
        frozen = app.shown
        frozen_leases = column(app, "daemons", "leases")
        polls_at_pause = source.polls
        await wait_until(pilot, lambda: source.polls >= polls_at_pause + 3)
        await pilot.pause()
        assert app.shown is frozen, "the display must not move while paused"
        assert column(app, "daemons", "leases") == frozen_leases
        assert app.latest is not None and app.latest != frozen, "collection continues while paused"
        assert "newer)" in static_text(app, "#banner")
        await pilot.press("p")
        assert not app.paused and not banner.display
        assert app.shown is not frozen
        latest_leases = int(column(app, "daemons", "leases")[1])
        assert latest_leases >= int(frozen_leases[1]) + 3
        assert latest_leases == app.shown.daemons[0].leases


# -- filter -----------------------------------------------------------------------------------------------------


async def test_slash_filters_rows_and_events_with_regex_and_inverse() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert len(column(app, "daemons", "device")) == 4
        await pilot.press("/")
        prompt = app.query_one("#filter", Input)
        assert prompt.display and prompt.has_focus
        await pilot.press(*"cuda:[01]", "enter")
        assert not prompt.display
        assert column(app, "daemons", "device") == ["cuda:0", "cuda:1"]
        assert table(app, "daemons").border_title == "Daemons (2 of 4)"
        assert "cuda:[01]" in static_text(app, "#status")
        # Events are filtered by the same regex (their visible text and reason).
        kinds = column(app, "events", "kind")
        assert "preload" not in kinds and "attach_miss" in kinds

        # Esc clears; a leading ! inverts.
        await pilot.press("escape")
        assert len(column(app, "daemons", "device")) == 4
        await pilot.press("/", *"!cuda", "enter")
        assert column(app, "daemons", "device") == ["cpu"]
        assert all("cuda" not in s.lower() for s in column(app, "events", "summary"))
        await pilot.press("/", "ctrl+a", "ctrl+k", *"miss|fallback", "enter")
        assert sorted(column(app, "events", "kind")) == ["attach_miss", "fallback"]
        assert column(app, "engines", "weights") == ["fallback"]

        # An invalid regex is reported, and the last valid filter stays; the prompt stays open to fix it.
        await pilot.press("/", *"|(")
        assert "invalid regex" in static_text(app, "#status")
        assert app.row_filter is not None and app.row_filter.text == "miss|fallback|"
        await pilot.press("backspace", "backspace", *"|fell(", "enter")
        assert app.row_filter is not None and app.row_filter.text == "miss|fallback|fell"
        assert sorted(column(app, "events", "kind")) == ["attach_miss", "fallback"]
        assert prompt.display
        messages = [n.message for n in app._notifications]
        assert any("invalid regex" in m for m in messages), messages
        assert app.is_running
        await pilot.press("escape")
        assert not prompt.display and app.row_filter is None
        assert len(column(app, "events", "kind")) == len(sample_snapshot().events)


# -- sort -------------------------------------------------------------------------------------------------------


async def test_s_cycles_sort_column_and_S_reverses() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert headers(app, "daemons")[0] == "device ▲"
        assert column(app, "daemons", "device") == ["cpu", "cuda:0", "cuda:1", "cuda:2"]
        await pilot.press("s")
        assert headers(app, "daemons")[:2] == ["device", "rank ▲"]
        await pilot.press(*"sssss")  # model, key id, state, origin, memory
        assert headers(app, "daemons")[6] == "memory ▲"
        assert "sorted by memory ▲" in table(app, "daemons").border_subtitle
        # Ascending by bytes; the gone daemon (memory "off") sorts last either way.
        assert column(app, "daemons", "memory") == ["740.2 KiB", "7.6 GiB", "7.6 GiB", "off"]
        assert column(app, "daemons", "device")[-1] == "cuda:2"
        await pilot.press("S")
        assert headers(app, "daemons")[6] == "memory ▼"
        assert column(app, "daemons", "memory") == ["7.6 GiB", "7.6 GiB", "740.2 KiB", "off"]
        # Sorting follows focus: the event feed starts newest first and reverses on S.
        table(app, "events").focus()
        await pilot.pause()
        assert headers(app, "events")[0] == "when ▼"
        assert column(app, "events", "kind")[0] == "release"  # the newest
        await pilot.press("S")
        assert headers(app, "events")[0] == "when ▲"
        assert column(app, "events", "kind")[0] == "preload"  # the oldest
        await pilot.press("s")
        assert headers(app, "events")[1] == "severity ▲"
        assert column(app, "events", "severity")[-1] == "error"
        assert headers(app, "daemons")[6] == "memory ▼", "each table keeps its own sort"


# -- export -----------------------------------------------------------------------------------------------------


async def test_e_writes_the_displayed_snapshot_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WCACHE_TOP_EXPORT_DIR", str(tmp_path))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("e")
        await pilot.press("e")  # a second export in the same second gets its own file
        files = sorted(tmp_path.glob("wcache-top-*.json"))
        assert len(files) == 2
        assert app.shown is not None
        expected = json.loads(json.dumps(app.shown.to_json()))
        for path in files:
            assert json.loads(path.read_text()) == expected
        messages = [n.message for n in app._notifications]
        assert any(str(files[0]) in m for m in messages), messages


async def test_e_defaults_to_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WCACHE_TOP_EXPORT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("e")
        [path] = tmp_path.glob("wcache-top-*.json")
        assert json.loads(path.read_text())["schema"] == "wcache.top/1"


# -- events -----------------------------------------------------------------------------------------------------


async def test_selecting_a_miss_event_shows_its_reason_and_key_diff() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("tab", "tab", "tab", "tab")  # daemons → engines → servers → replay → events
        events = table(app, "events")
        assert events.has_focus
        kinds = column(app, "events", "kind")
        for _ in range(kinds.index("attach_miss")):
            await pilot.press("down")
        await pilot.press("enter")
        assert app.selected_event() is not None and app.selected_event().kind == "attach_miss"
        detail = static_text(app, "#detail")
        assert f"reason: {MISS_REASON}" in detail
        assert "key diff: fields: checkpoint" in detail
        assert "tensors changed (1): model.layers.3.mlp.down_proj.weight" in detail
        # Severity stands out: misses and fallbacks in yellow, losses in red.
        row = events.get_row(events.ordered_rows[kinds.index("attach_miss")].key)
        assert "yellow" in str(row[2].style)
        lost = events.get_row(events.ordered_rows[kinds.index("daemon_lost")].key)
        assert "red" in str(lost[2].style)
        # The selection survives a refresh that adds an event above it.
        await pilot.press("r")
        await settle(pilot)
        assert app.selected_event() is not None and app.selected_event().kind == "attach_miss"


async def test_absent_series_show_off_not_zero() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        by_engine = {where: i for i, where in enumerate(column(app, "replay", "engine"))}
        vllm, down = by_engine["10.0.0.7:8000"], by_engine["10.0.0.8:8000"]
        for label in ("adopted", "replayed tok", "prefill saved"):
            assert column(app, "replay", label)[vllm] == "off"
        assert column(app, "replay", "hit % (interval)")[vllm] == "20.0 %"
        for label in ("hit % (interval)", "hit % (overall)", "history"):
            assert column(app, "replay", label)[down] == "off"
        fallback = by_engine["127.0.0.1:8002"]
        assert column(app, "replay", "hit % (interval)")[fallback] == "–"  # exported, but no queries yet
        assert column(app, "replay", "replayed tok")[fallback] == "0"
        assert column(app, "engines", "up")[down] == "down"


class FlakySource:
    """Fails its second poll, then recovers."""

    def __init__(self) -> None:
        self.polls = 0
        self.lock = threading.Lock()

    def poll(self) -> Snapshot:
        with self.lock:
            self.polls += 1
            n = self.polls
        if n == 2:
            raise ConnectionError("daemon socket vanished")
        return sample_snapshot(n)

    def close(self) -> None:
        pass


async def test_a_failing_poll_is_reported_and_the_next_one_recovers() -> None:
    app = make_app(FlakySource())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("r")
        await settle(pilot)
        assert "last poll failed: ConnectionError: daemon socket vanished" in static_text(app, "#status")
        assert app.shown == sample_snapshot(1)
        await pilot.press("r")
        await settle(pilot)
        assert "failed" not in static_text(app, "#status")
        assert app.shown == sample_snapshot(3)


async def test_nothing_to_show_before_the_first_sample() -> None:
    class NeverSource:
        def __init__(self) -> None:
            self.release = threading.Event()

        def poll(self) -> Snapshot:
            self.release.wait(10)
            return sample_snapshot()

        def close(self) -> None:
            pass

    source = NeverSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "waiting for the first sample" in static_text(app, "#status")
        await pilot.press("e")  # nothing to export: says so, no crash
        assert any("Nothing to export" in n.message for n in app._notifications)
        source.release.set()
        await settle(pilot)
        assert app.shown == sample_snapshot()


async def test_help_fits_an_80_column_terminal() -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("?")
        await pilot.pause()
        box = app.screen.query_one("#help-body").region
        assert box.x >= 0 and box.right <= 80, box  # whole, not clipped at the terminal's edge


async def test_an_event_summary_wraps_at_80_columns_instead_of_being_cut() -> None:
    """A refusal's sentence names tensors and paths: cut to the column (`model.embed_t…`) it cannot be read."""
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        events = table(app, "events")
        assert any(row.height > 1 for row in events.rows.values()), "a long summary wraps onto more lines"
