"""The snapshot `wcache top` shows: plain values, numbers as numbers, units in field names.

Schema (`Snapshot`, written by `Snapshot.to_json()`), version `wcache.top/1`:
  taken_at (unix s), interval_s, rates ("interval": rates are deltas over the last interval; "cumulative":
  only one sample yet, so rates are null and totals are since start), run_dir,
  daemons[]: name, pid, device, tp_rank, tp_size, model, key_id, state ("loading" while it loads), weights_bytes,
             leases, uptime_s, health_status (HTTP code or null), alive, hits, misses (hellos since start),
             loaded_fraction (0..1 while loading, else null),
             plan (dtype, TP size, quantization), provenance (its files against what the Hub
             published, at load: matches | differs | unknown, null while loading or for a daemon that did not say)
  engines[]: id, url, kind ("wcache" | "vllm"; "unreachable": a scraped URL that did not answer), model, up,
             weights (attach outcome: hit | miss | fallback | disk | null; corrupt once its daemon found the weights
             it serves changed in memory), mode, daemon, attach_ms, prefix_queries_total, prefix_hits_total,
             hit_rate_interval, hit_rate_overall, adopted_hits_total, replayed_tokens_total,
             prefill_saved_total, swa_cached_bytes, hit_rate_history[] — any of these is null ("off") when
             the engine does not export the series; key_id (of the weights it serves now) and
             hit_rate_by_weights[] ([key id, overall hit rate or null] per weights key it served, current first),
             reason (why a fallback loaded from disk), requests_running, requests_done, kv_usage (0..1), follows
             (a reference engine that moves to its weights' newest version by itself: `attach --serve --follow`)
  servers[]: launcher_pid, url, model, state (starting | serving | backing off | stopping), pid (the vLLM server's
             front process; null between a death and the next start), restarts, last_ready_s (the last start's
             time until /health answered 200), last_exit (why the last server died, one line) — each a running
             `wcache serve`
  events[]: ts, kind, severity (info | warning | error), summary, detail{}
  alerts[]: one sentence each, for what needs a person now (a storm of fallbacks, unverified hits)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

SCHEMA = "wcache.top/1"


@dataclass(frozen=True, slots=True)
class DaemonRow:
    """A daemon: what it holds, its state, memory, leases, hellos and health."""

    name: str
    pid: int
    device: str
    tp_rank: int
    tp_size: int
    model: str
    key_id: str
    state: str
    weights_bytes: int
    leases: int
    uptime_s: float | None
    health_status: int | None
    alive: bool
    hits: int = 0
    misses: int = 0
    loaded_fraction: float | None = None
    provenance: str | None = None
    parent_key_id: str | None = None  # the version this one was built from (preload --from --delta)
    plan: str | None = None  # dtype, TP size, quantization (plan_summary); None while loading


@dataclass(frozen=True, slots=True)
class EngineRow:
    """An engine: how it got its weights, and its prefix-cache series (null: it does not export them)."""

    id: str
    url: str
    kind: str
    model: str
    up: bool
    weights: str | None
    mode: str | None
    daemon: str | None
    attach_ms: float | None
    prefix_queries_total: float | None
    prefix_hits_total: float | None
    hit_rate_interval: float | None
    hit_rate_overall: float | None
    adopted_hits_total: float | None
    replayed_tokens_total: float | None
    prefill_saved_total: float | None
    swa_cached_bytes: float | None
    hit_rate_history: tuple[float, ...] = ()
    key_id: str | None = None  # the content key of the weights the engine serves now (a wcache engine)
    # Overall prefix-cache hit rate per weights key, the current key first: (key id, hit rate or None).
    hit_rate_by_weights: tuple[tuple[str, float | None], ...] = ()
    reason: str | None = None  # why a fallback (or miss) loaded from disk
    requests_running: float | None = None  # a vLLM server's requests in flight, finished, and KV cache use (0..1)
    requests_done: float | None = None
    kv_usage: float | None = None
    follows: bool = False  # a reference engine that moves to its weights' newest version by itself (--follow)


@dataclass(frozen=True, slots=True)
class ServerRow:
    """A vLLM server supervised by `wcache serve`, from its launcher's record in the run dir."""

    launcher_pid: int
    url: str
    model: str
    state: str
    pid: int | None
    restarts: int
    last_ready_s: float | None
    last_exit: str | None


@dataclass(frozen=True, slots=True)
class EventRow:
    """An event of the run dir's log, with its severity and a one-line summary."""

    ts: float
    kind: str
    severity: str
    summary: str
    detail: dict[str, Any] = field(default_factory=dict)


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What `wcache top` shows at one moment; `top --json` writes it field by field, in this order."""

    schema: str = SCHEMA
    taken_at: float
    interval_s: float
    rates: str
    run_dir: str
    daemons: tuple[DaemonRow, ...]
    engines: tuple[EngineRow, ...]
    servers: tuple[ServerRow, ...] = ()
    events: tuple[EventRow, ...]
    alerts: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        # msgspec writes the rows (dataclasses) without the deep copy dataclasses.asdict makes of every event's
        # detail: with a full feed that was most of a `--json` poll's CPU.
        document: dict[str, Any] = msgspec.to_builtins(self)
        return document
