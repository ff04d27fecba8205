"""`status`, `top --once` and the live screen at 80×24 and 120×40: columns chosen by width, never cut.

The text snapshots live under tests/__snapshots__/test_narrow_terminals/; regenerate after an intended change
with `pytest tests/test_narrow_terminals.py --snapshot-update` and read the diff before committing it.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console
from textual.widgets import DataTable
from wcache.monitor.status_row import StatusRow
from wcache_cli.commands.status import _table as status_table
from wcache_cli.top.app import TopApp
from wcache_cli.top.once import once_renderable
from wcache_dev.top_sample import FROZEN_NOW, RUN_DIR, SampleSource, sample_snapshot

pytestmark = pytest.mark.usefixtures("utc")  # event times are shown in local time
SIZES = [(80, 24), (120, 40)]
SAMPLE = sample_snapshot(0)
KEY_IDS = sorted({d.key_id for d in SAMPLE.daemons})




def _text(renderable: Any, width: int, height: int) -> str:
    console = Console(width=width, height=height, file=io.StringIO(), color_system=None, record=True)
    console.print(renderable)
    return console.export_text()


def _status_rows() -> list[StatusRow]:
    """What `status --json` lists for the sample's daemons."""
    return [StatusRow(
        name=d.name, pid=d.pid, device=d.device, tp_size=d.tp_size, tp_rank=d.tp_rank,
        source=f"/models/{d.model}", key_id=d.key_id, state="ready" if d.alive else "unreachable",
        holds_weights=d.alive, weights_bytes=d.weights_bytes, leases=d.leases, uptime_s=d.uptime_s,
        health_url=None, health_status=d.health_status, counters={}, provenance=d.provenance,
    ) for d in SAMPLE.daemons]


def _lines_fit(text: str, width: int) -> None:
    assert max(len(line) for line in text.splitlines()) <= width


@pytest.mark.parametrize(("width", "height"), SIZES, ids=lambda v: str(v))
def test_status_fits_and_keeps_every_name_whole(width: int, height: int, snapshot: Any) -> None:
    text = _text(status_table(RUN_DIR, _status_rows(), width), width, height)
    _lines_fit(text, width)
    for d in SAMPLE.daemons:
        assert d.name in text
    assert "7.6 GiB" in text and "✓ hub" in text  # memory on one line; the provenance marker shown
    assert text == snapshot


@pytest.mark.parametrize(("width", "height"), SIZES, ids=lambda v: str(v))
def test_top_once_fits_and_keeps_every_key_id_whole(width: int, height: int, snapshot: Any) -> None:
    text = _text(once_renderable(SAMPLE, FROZEN_NOW, 2.0, width), width, height)
    _lines_fit(text, width)
    daemons = text.split("Daemons", 1)[1].split("Engines", 1)[0]
    for key_id in KEY_IDS:
        assert key_id in daemons
    assert "…" not in daemons and "7.6 GiB" in daemons
    header = next(line for line in daemons.splitlines() if "key id" in line)
    assert all(f" {label} " in header for label in ("model", "leases", "health")), header  # what a row is read by
    assert text == snapshot


@pytest.mark.asyncio
@pytest.mark.parametrize(("width", "height"), SIZES, ids=lambda v: str(v))
async def test_live_screen_shows_what_fits_without_scrolling(width: int, height: int) -> None:
    app = TopApp(SampleSource(), interval_s=3600.0, run_dir=RUN_DIR, clock=lambda: FROZEN_NOW)
    async with app.run_test(size=(width, height)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.pause()
        daemons = app.query_one("#daemons", DataTable)
        labels = [str(c.label.plain).split(" ")[0] for c in daemons.ordered_columns]
        assert {"key", "model", "leases", "health"} <= set(labels), labels  # what an operator reads a row by
        index = labels.index("key")
        assert sorted({str(daemons.get_row_at(r)[index].plain) for r in range(daemons.row_count)}) == KEY_IDS
        for table in app.query(DataTable):
            assert table.virtual_size.width <= table.scrollable_content_region.width, table.id
