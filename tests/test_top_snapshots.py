"""SVG snapshots of `wcache top` (pytest-textual-snapshot): fixed data, a frozen clock, a fixed terminal size.

Regenerate after an intended change with `pytest tests/test_top_snapshots.py --snapshot-update`, then look
at the SVGs under tests/__snapshots__/test_top_snapshots/ before committing them.
"""

from __future__ import annotations

import pytest
from wcache_cli.top.app import TopApp
from wcache_dev.top_sample import FROZEN_NOW, RUN_DIR, SampleSource

pytestmark = pytest.mark.usefixtures("utc")  # event times are shown in local time
SIZE = (120, 40)




def make_app() -> TopApp:
    # A long interval: only the first poll (and any `r`) runs, so nothing moves while the screenshot is taken.
    return TopApp(SampleSource(), interval_s=3600.0, run_dir=RUN_DIR, clock=lambda: FROZEN_NOW)


async def first_sample(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_main_screen(snap_compare) -> None:
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=first_sample)


def test_main_screen_small_terminal(snap_compare) -> None:
    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=first_sample)


def test_paused_screen(snap_compare) -> None:
    async def pause_then_collect(pilot) -> None:
        await first_sample(pilot)
        await pilot.press("p")
        await pilot.press("r")  # collected while paused: the banner counts it, the tables do not move
        await first_sample(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=pause_then_collect)


def test_filtered_screen(snap_compare) -> None:
    async def filter_cuda_and_misses(pilot) -> None:
        await first_sample(pilot)
        await pilot.press("/", *"cuda:0|miss", "enter")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=filter_cuda_and_misses)


def test_miss_selected(snap_compare) -> None:
    async def select_miss(pilot) -> None:
        await first_sample(pilot)
        await pilot.press("tab", "tab", "tab", "down", "down", "enter")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=select_miss)


def test_help_screen(snap_compare) -> None:
    async def open_help(pilot) -> None:
        await first_sample(pilot)
        await pilot.press("?")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_help)
