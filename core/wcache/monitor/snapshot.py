"""The snapshot `wcache top` shows: plain values, numbers as numbers, units in field names.

Its schema is `Snapshot` (written by `Snapshot.to_json()`, version `wcache.top/1`) and the rows below; each
field's words are its comment here, which docs/json-outputs.md lists (`python -m wcache_dev.docgen`).
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
    state: str  # "loading" while it loads
    weights_bytes: int
    leases: int
    uptime_s: float | None
    health_status: int | None  # the HTTP code its health server answered, null without one or an answer
    alive: bool
    hits: int = 0  # hellos that hit, since start
    misses: int = 0  # hellos that missed, since start
    loaded_fraction: float | None = None  # 0..1 while loading, else null
    # Its files against what the Hub published, at load: matches | differs | unknown; null while loading or for a
    # daemon that did not say.
    provenance: str | None = None
    parent_key_id: str | None = None  # the version this one was built from (preload --from --delta)
    plan: str | None = None  # dtype, TP size, quantization (plan_summary); null while loading


@dataclass(frozen=True, slots=True)
class EngineRow:
    """An engine: how it got its weights, and its prefix-cache series (null: it does not export them)."""

    id: str
    url: str
    kind: str  # "wcache" | "vllm"; "unreachable": a scraped URL that did not answer
    model: str
    up: bool
    # The attach's outcome: hit | miss | fallback | disk | null; corrupt once its daemon found the weights it
    # serves changed in memory.
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
    hit_rate_history: tuple[float, ...] = ()  # the interval hit rate of each recent poll, oldest first
    key_id: str | None = None  # the content key of the weights the engine serves now (a wcache engine)
    # Overall prefix-cache hit rate per weights key, the current key first: (key id, hit rate or None).
    hit_rate_by_weights: tuple[tuple[str, float | None], ...] = ()
    reason: str | None = None  # why a fallback (or miss) loaded from disk
    requests_running: float | None = None  # a vLLM server's requests in flight
    requests_done: float | None = None  # a vLLM server's requests finished
    kv_usage: float | None = None  # a vLLM server's KV cache use (0..1)
    follows: bool = False  # it moves to its weights' newest version by itself (`--follow`)


@dataclass(frozen=True, slots=True)
class ServerRow:
    """A vLLM server supervised by `wcache serve`, from its launcher's record in the run dir."""

    launcher_pid: int  # the running `wcache serve` that supervises it
    url: str
    model: str
    state: str  # starting | serving | backing off | stopping
    pid: int | None  # the vLLM server's front process; null between a death and the next start
    restarts: int
    last_ready_s: float | None  # the last start's time until /health answered 200
    last_exit: str | None  # why the last server died, one line


@dataclass(frozen=True, slots=True)
class EventRow:
    """An event of the run dir's log, with its severity and a one-line summary."""

    ts: float
    kind: str
    severity: str  # info | warning | error
    summary: str
    detail: dict[str, Any] = field(default_factory=dict)


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What `wcache top` shows at one moment; `top --json` writes it field by field, in this order."""

    schema: str = SCHEMA
    taken_at: float  # unix seconds
    interval_s: float
    # "interval": rates are deltas over the last interval; "cumulative": only one sample yet, so rates are null
    # and totals are since start.
    rates: str
    run_dir: str
    daemons: tuple[DaemonRow, ...]
    engines: tuple[EngineRow, ...]
    servers: tuple[ServerRow, ...] = ()  # each a running `wcache serve`'s
    events: tuple[EventRow, ...]
    # One sentence each, for what needs a person now (a storm of fallbacks, unverified hits).
    alerts: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        # msgspec writes the rows (dataclasses) without the deep copy dataclasses.asdict makes of every event's
        # detail: with a full feed that was most of a `--json` poll's CPU.
        document: dict[str, Any] = msgspec.to_builtins(self)
        return document
