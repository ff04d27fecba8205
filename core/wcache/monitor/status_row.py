"""A daemon's row in `wcache status` (and `status --json`, `status_output`): built once from its descriptor and
stats reply, or from the record of a daemon still loading."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from msgspec import UNSET, UnsetType

from wcache.checkpoint.display_name import display_name
from wcache.plan.spec import plan_summary
from wcache.schema import Schema

if TYPE_CHECKING:
    from wcache.ipc.run_dir.directory import DaemonDescriptor
    from wcache.ipc.run_dir.loading import LoadingRecord
    from wcache.monitor.daemon_status import DaemonStatus


class StatusRow(Schema, frozen=True, kw_only=True):
    """One daemon as `status` lists it. Every field is written (None as null) but those at UNSET: a loading
    daemon has no parent key or re-check yet, a published one no loading progress."""

    name: str | None
    pid: int
    device: str
    tp_size: int
    tp_rank: int
    source: str
    key_id: str | None  # null while loading: the key is not known before the checkpoint is read
    state: str
    phase: str | UnsetType = UNSET
    done_bytes: int | UnsetType = UNSET
    total_bytes: int | UnsetType = UNSET
    holds_weights: bool
    weights_bytes: int
    leases: int
    uptime_s: float | None
    health_url: str | None
    health_status: int | None  # what the rank's health server answered, null without one or an answer
    counters: dict[str, int]
    provenance: str | None
    parent_key_id: str | UnsetType | None = UNSET
    corrupt: list[str] | UnsetType = UNSET
    plan: str | UnsetType = UNSET  # dtype, TP size, quantization (plan_summary): what engines must ask for
    model: str | UnsetType = UNSET  # the checkpoint as people name it (display_name), a version's lineage's origin

    @classmethod
    def of(cls, descriptor: DaemonDescriptor, answer: DaemonStatus, health_status: int | None) -> StatusRow:
        stats = answer.stats
        return cls(
            name=descriptor.name, pid=descriptor.pid, device=descriptor.device, tp_size=descriptor.tp_size,
            tp_rank=descriptor.tp_rank, source=descriptor.source, key_id=descriptor.key_id, state=answer.state,
            holds_weights=stats is not None and stats.holds_weights, weights_bytes=stats.weights_bytes if stats else 0,
            leases=stats.leases if stats else 0, uptime_s=stats.uptime_s if stats else None,
            health_url=descriptor.health_url, health_status=health_status, counters=stats.counters if stats else {},
            provenance=descriptor.provenance, parent_key_id=descriptor.parent_key_id,
            corrupt=list(stats.corrupt or ()) if stats else [], plan=plan_summary(descriptor.plan),
            model=display_name(descriptor.model_source))

    @classmethod
    def loading(cls, record: LoadingRecord) -> StatusRow:
        return cls(
            name=record.name, pid=record.pid, device=record.device, tp_size=record.tp_size, tp_rank=record.tp_rank,
            source=record.source, key_id=None, state="loading", phase=record.phase, done_bytes=record.done_bytes,
            total_bytes=record.total_bytes, holds_weights=False, weights_bytes=0, leases=0,
            uptime_s=round(time.time() - record.started, 3), health_url=None, health_status=None, counters={},
            provenance=None)


class StaleDaemon(Schema, frozen=True):
    """A daemon whose descriptor outlived it: `status` reports it and removes the descriptor."""

    name: str
    pid: int
    source: str
