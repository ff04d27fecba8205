"""A miss logged with its explanation, then the disk load, or the refusal when falling back is not allowed."""

from __future__ import annotations

import time
from dataclasses import replace

from wcache.attach.context import AttachContext
from wcache.attach.found import Found
from wcache.attach.lease import AttachedWeights
from wcache.attach.mapping import Refusal
from wcache.attach.miss import explain_miss
from wcache.attach.report import AttachMissError, AttachReport
from wcache.errors import option
from wcache.key.cache_key import KeyFile
from wcache.key.diff import diff_summary
from wcache.monitor import event_types as ev
from wcache.monitor.events import append_event


def miss(local: KeyFile, found: Found, refusal: Refusal | None, ctx: AttachContext,
         timings: dict[str, float]) -> AttachedWeights:
    """Explain the miss against the nearest daemon, log it, then fall back to disk or refuse."""
    explained = explain_miss(local, found, refusal, ctx.device, ctx.model)
    key_id = local.key.short_id
    report = AttachReport(outcome="miss", mode=ctx.options.mode, device=ctx.device, key_id=key_id,
                          daemon=explained.daemon, daemon_key_id=explained.daemon_key_id, reason=explained.reason,
                          mismatched=list(explained.mismatched), diff=explained.diff, timings_ms=timings)
    append_event(ctx.run_dir, ev.AttachMiss(
        source=str(ctx.model), key_id=key_id, device=ctx.device, reason=explained.reason, daemon=explained.daemon,
        mismatched=list(report.mismatched), diff=diff_summary(explained.diff) if explained.diff else None,
        dp_size=ctx.dp_size, engine=ctx.engine))
    if not ctx.options.fallback:
        raise AttachMissError(f"{explained.reason}; not falling back to disk ({option('fallback', False)}).", report)
    t = time.perf_counter()
    from wcache.load.loader import load_from_disk

    tensors = load_from_disk(local, ctx.model)
    disk_ms = (time.perf_counter() - t) * 1000
    timings = {**timings, "disk_load": disk_ms, "total": (time.perf_counter() - ctx.began) * 1000}
    append_event(ctx.run_dir, ev.Fallback(source=str(ctx.model), key_id=key_id, device=ctx.device,
                                          reason=explained.reason, seconds=round(disk_ms / 1000, 3),
                                          dp_size=ctx.dp_size, engine=ctx.engine))
    return AttachedWeights(tensors, replace(report, outcome="fallback", timings_ms=timings,
                                            num_tensors=len(tensors)), ctx.run_dir, local)
