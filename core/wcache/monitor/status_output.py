"""`wcache status --json`'s document: the daemons' rows, and the engines and servers as `top` shows them.

Apart from `status_row` so that `status` without --json never imports `top`'s rows (`snapshot`).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import get_type_hints

import msgspec

from wcache.monitor.snapshot import EngineRow, ServerRow
from wcache.monitor.status_row import StaleDaemon, StatusRow
from wcache.schema import Schema


def _status_engine() -> type[msgspec.Struct]:
    """An engine as `status` lists it: `top`'s row (`EngineRow`) without the hit-rate histories a one-off read
    has none of."""
    hints = get_type_hints(EngineRow)
    engine = msgspec.defstruct(
        "StatusEngine",
        [(f.name, hints[f.name]) if f.default is MISSING else (f.name, hints[f.name], f.default)
         for f in fields(EngineRow) if f.name not in STATUS_ENGINE_OMITS],
        frozen=True, forbid_unknown_fields=True, module=__name__)
    engine.__doc__ = "An engine as `status` lists it: `top`'s engine row without the hit-rate histories."
    return engine


STATUS_ENGINE_OMITS = ("hit_rate_history", "hit_rate_by_weights")
StatusEngine = _status_engine()


class StatusOutput(Schema, frozen=True):
    """`wcache status --json`: the run dir, each daemon's row, the stale descriptors removed, whether every
    daemon is ready, the engines announced and the servers `wcache serve` supervises."""

    run_dir: str
    daemons: list[StatusRow]
    stale_removed: list[StaleDaemon]
    ready: bool
    engines: list[StatusEngine]  # type: ignore[valid-type]  # top's engine rows (EngineRow) without the histories
    servers: list[ServerRow]
