"""A hit: its report and event, and the lease a zero-copy map keeps open."""

from __future__ import annotations

import time

from wcache.attach.context import AttachContext
from wcache.attach.lease import AttachedWeights
from wcache.attach.mapping import Mapped
from wcache.attach.report import AttachReport
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.ipc.wire.client import DaemonConnection
from wcache.key.cache_key import KeyFile
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event


def hit(mapped: Mapped, descriptor: DaemonDescriptor, connection: DaemonConnection, local: KeyFile | None,
        ctx: AttachContext, timings: dict[str, float]) -> AttachedWeights:
    """The report of a hit, its event, and the lease a zero-copy map keeps open."""
    timings = {**timings, **mapped.timings_ms, "total": (time.perf_counter() - ctx.began) * 1000}
    mode = ctx.options.mode
    report = AttachReport(
        outcome="hit", mode=mode, device=ctx.device, key_id=local.key.short_id if local is not None else None,
        daemon=descriptor.name, daemon_key_id=descriptor.key_id, timings_ms=timings,
        bytes_mapped=mapped.total_bytes, num_tensors=mapped.num_tensors,
    )
    # `verified`: the checkpoint's content key was compared with the daemon's (not so with --trust-daemon);
    # `source` is the engine's checkpoint, `daemon_source` what the daemon loaded (they differ for a copy).
    append_event(ctx.run_dir, ev.AttachHit(
        source=str(ctx.model.absolute()), daemon_source=descriptor.source, verified=local is not None,
        key_id=descriptor.key_id, daemon=descriptor.name, device=ctx.device, mode=mode, bytes=mapped.total_bytes,
        dp_size=ctx.dp_size, engine=ctx.engine, timings_ms={k: round(v, 3) for k, v in timings.items()}))
    weights = AttachedWeights(mapped.tensors, report, ctx.run_dir, mapped.key_file)
    if mode == "zero_copy" and ctx.views:
        weights._hold_lease(connection, mapped.mapping)
    elif mode == "zero_copy":
        connection.close()  # nothing was mapped, so there is nothing to lease
    return weights
