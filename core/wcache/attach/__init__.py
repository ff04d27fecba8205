"""The engine side of an attach: compute the local key while connecting, compare, then map, copy or fall back.

Every outcome is an event in the run dir's log: a hit, a miss with its reason and key diff, a fallback, and
the loss of a daemon a zero-copy engine depends on. One module per step: `flow` (`attach`, `attach_with`:
the steps in order), `found` (the daemons that may serve, and the key computed while connecting to them),
`mapping` (hello and map, or the daemon's refusal), `hit` (its report, event and lease), `lease` (the
weights and the lease that keeps zero-copy tensors backed), `miss` (why no daemon served, against the nearest
one), `fallback` (the miss logged, then the disk load or the refusal), `report` (what happened, as the
engine and the events show it), `context` (what the steps share).

Names load on first use: an attach that only reports never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache.lazy_exports import lazy_exports

_EXPORTS = {
    "attach": "wcache.attach.flow",
    "attach_with": "wcache.attach.flow",
    "AttachedWeights": "wcache.attach.lease",
    "AttachMissError": "wcache.attach.report",
    "AttachReport": "wcache.attach.report",
    "describe_diff": "wcache.attach.miss",
}
__all__ = ["AttachMissError", "AttachReport", "AttachedWeights", "attach", "attach_with", "describe_diff"]
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:
    from wcache.attach.flow import attach, attach_with
    from wcache.attach.lease import AttachedWeights
    from wcache.attach.miss import describe_diff
    from wcache.attach.report import AttachMissError, AttachReport

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
