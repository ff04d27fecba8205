"""Fixed, deterministic data for the dashboard: what its tests and screenshots run on (no Textual here).

`SampleSource` behaves like the real source, but each `poll()` returns the next step of a scripted run:
counters grow, one daemon's lease count follows the step, and a new event arrives every poll. Pair it with
`FROZEN_NOW` as the clock and every rendering is reproducible.
"""

from __future__ import annotations

import threading
from typing import Any

from wcache.monitor.collector import summarize
from wcache.monitor.snapshot import DaemonRow, EngineRow, EventRow, ServerRow, Snapshot

FROZEN_NOW = 1_800_000_000.0
"""The display clock of tests and screenshots (2027-01-15 08:00:00 UTC)."""
TAKEN_AT = FROZEN_NOW - 1.0
INTERVAL_S = 2.0
RUN_DIR = "/run/user/1000/wcache"

MISS_REASON = ("checkpoint differs from daemon cuda:0-3f9a1c2b7d10 (1 tensor(s) changed: "
               "model.layers.3.mlp.down_proj.weight)")
MISS_DIFF: dict[str, Any] = {
    "fields": ["checkpoint"], "plan": {}, "config": [],
    "changed": ["model.layers.3.mlp.down_proj.weight"], "added": [], "removed": [],
    "num_changed": 1, "num_added": 0, "num_removed": 0,
}


def _daemons(step: int) -> tuple[DaemonRow, ...]:
    gib = 1 << 30
    return (
        DaemonRow("cuda:0-3f9a1c2b7d10", 4101, "cuda:0", 0, 2, "Qwen3-8B", "3f9a1c2b7d10", "ready",
                  int(7.6 * gib), 2 + step, 3 * 3600 + 125.0, 200, True, hits=12, misses=1, provenance="matches"),
        DaemonRow("cuda:1-3f9a1c2b7d10", 4102, "cuda:1", 1, 2, "Qwen3-8B", "3f9a1c2b7d10", "ready",
                  int(7.6 * gib), 2, 3 * 3600 + 124.0, 200, True, hits=12, misses=1, provenance="matches"),
        DaemonRow("cpu-ad8c5d955e07", 5120, "cpu", 0, 1, "tiny", "ad8c5d955e07", "ready", 758_016, 0, 125.0,
                  None, True, hits=3, provenance="unknown"),
        DaemonRow("cuda:2-77e01a9c4b22", 3999, "cuda:2", 0, 1, "Llama-3.1-8B", "77e01a9c4b22", "gone", 0, 0, None,
                  None, False),
    )


def _history(step: int, base: tuple[float, ...]) -> tuple[float, ...]:
    return (base * 3 + tuple(base[(i + step) % len(base)] for i in range(step)))[-24:]


def _engines(step: int) -> tuple[EngineRow, ...]:
    q, h = 120_000 + 4_000 * step, 90_000 + 3_300 * step
    vq, vh = 800_000 + 10_000 * step, 320_000 + 2_000 * step
    return (
        EngineRow(
            id="pid 4242", url="http://127.0.0.1:8001", kind="wcache", model="Qwen3-8B", up=True, weights="hit",
            mode="zero_copy", daemon="cuda:0-3f9a1c2b7d10", attach_ms=41.7, prefix_queries_total=q,
            prefix_hits_total=h, hit_rate_interval=0.825, hit_rate_overall=h / q, adopted_hits_total=310 + 10 * step,
            replayed_tokens_total=9_920 + 320 * step, prefill_saved_total=80_000 + 3_000 * step,
            swa_cached_bytes=1_048_576, hit_rate_history=_history(step, (0.62, 0.71, 0.78, 0.80, 0.83, 0.825)),
            key_id="3f9a1c2b7d10", hit_rate_by_weights=(("3f9a1c2b7d10", 0.71), ("8be0d4471c2a", 0.64)),
        ),
        EngineRow(
            id="pid 4243", url="http://127.0.0.1:8002", kind="wcache", model="tiny", up=True, weights="fallback",
            mode=None, daemon=None, attach_ms=812.5, prefix_queries_total=5_000.0, prefix_hits_total=0.0,
            hit_rate_interval=None, hit_rate_overall=0.0, adopted_hits_total=0.0, replayed_tokens_total=0.0,
            prefill_saved_total=0.0, swa_cached_bytes=0.0, hit_rate_history=(),
        ),
        EngineRow(
            id="http://10.0.0.7:8000", url="http://10.0.0.7:8000", kind="vllm", model="meta-llama/Llama-3.1-8B",
            up=True, weights=None, mode=None, daemon=None, attach_ms=None, prefix_queries_total=vq,
            prefix_hits_total=vh, hit_rate_interval=0.2, hit_rate_overall=vh / vq, adopted_hits_total=None,
            replayed_tokens_total=None, prefill_saved_total=None, swa_cached_bytes=None,
            hit_rate_history=_history(step, (0.35, 0.30, 0.22, 0.18, 0.2)),
        ),
        EngineRow(
            id="http://10.0.0.8:8000", url="http://10.0.0.8:8000", kind="vllm", model="?", up=False, weights=None,
            mode=None, daemon=None, attach_ms=None, prefix_queries_total=None, prefix_hits_total=None,
            hit_rate_interval=None, hit_rate_overall=None, adopted_hits_total=None, replayed_tokens_total=None,
            prefill_saved_total=None, swa_cached_bytes=None, hit_rate_history=(),
        ),
    )


RAW_EVENTS: tuple[dict[str, Any], ...] = (
    {"ts": FROZEN_NOW - 3 * 3600 - 130, "kind": "preload", "source": "/models/Qwen3-8B", "device": "cuda:0,cuda:1",
     "tp_size": 2},
    {"ts": FROZEN_NOW - 3 * 3600 - 125, "kind": "ready", "daemon": "cuda:0-3f9a1c2b7d10", "key_id": "3f9a1c2b7d10",
     "rank": 0, "device": "cuda:0", "weights_bytes": 8160437862, "load_s": 4.2},
    {"ts": FROZEN_NOW - 3 * 3600 - 124, "kind": "ready", "daemon": "cuda:1-3f9a1c2b7d10", "key_id": "3f9a1c2b7d10",
     "rank": 1, "device": "cuda:1", "weights_bytes": 8160437862, "load_s": 4.3},
    {"ts": FROZEN_NOW - 3600, "kind": "attach_hit", "source": "/models/Qwen3-8B", "key_id": "3f9a1c2b7d10",
     "daemon": "cuda:0-3f9a1c2b7d10", "device": "cuda:0", "mode": "zero_copy", "bytes": 8160437862,
     "timings_ms": {"connect": 1.2, "key": 35.1, "map": 5.4, "total": 41.7}},
    {"ts": FROZEN_NOW - 1800, "kind": "daemon_exited", "daemon": "cuda:2-77e01a9c4b22", "exit_code": -9},
    {"ts": FROZEN_NOW - 900, "kind": "daemon_lost", "daemon": "cuda:2-77e01a9c4b22", "key_id": "77e01a9c4b22",
     "device": "cuda:2", "tensors_valid": False},
    {"ts": FROZEN_NOW - 125, "kind": "attach_miss", "source": "/models/Qwen3-8B-patched", "key_id": "c41d0e9b5a77",
     "device": "cuda:0", "reason": MISS_REASON, "daemon": "cuda:0-3f9a1c2b7d10", "mismatched": ["checkpoint"],
     "diff": MISS_DIFF, "dp_size": 1},
    {"ts": FROZEN_NOW - 124, "kind": "fallback", "source": "/models/Qwen3-8B-patched", "key_id": "c41d0e9b5a77",
     "device": "cuda:0", "reason": MISS_REASON, "seconds": 0.8, "dp_size": 1},
    {"ts": FROZEN_NOW - 60, "kind": "release", "daemon": "cpu-ad8c5d955e07", "key_id": "ad8c5d955e07",
     "mode": "copy", "client_pid": 5150},
)


def _events(step: int) -> tuple[EventRow, ...]:
    extra = tuple(
        {"ts": FROZEN_NOW - 30 + i, "kind": "attach_hit", "source": "/models/tiny", "key_id": "ad8c5d955e07",
         "daemon": "cpu-ad8c5d955e07", "device": "cpu", "mode": "copy", "bytes": 758016,
         "timings_ms": {"total": 3.0 + i}}
        for i in range(step)
    )
    return tuple(summarize(e) for e in (*RAW_EVENTS, *extra))


# One `wcache serve` whose server was killed once and came back.
SERVERS = (ServerRow(launcher_pid=7001, url="http://127.0.0.1:8000", model="Qwen/Qwen3-0.6B", state="serving",
                     pid=7342, restarts=1, last_ready_s=6.4,
                     last_exit="the vLLM server (pid 7020) was killed by SIGKILL"),)


def sample_snapshot(step: int = 0) -> Snapshot:
    """Step 0 is the fixed picture; each later step grows the counters and adds one event."""
    return Snapshot(taken_at=TAKEN_AT, interval_s=INTERVAL_S, rates="interval", run_dir=RUN_DIR,
                    daemons=_daemons(step), engines=_engines(step), events=_events(step), servers=SERVERS)


class SampleSource:
    """A source that returns `sample_snapshot(0)`, then `(1)`, ... one step per poll (thread-safe)."""

    def __init__(self, *, advance: bool = True) -> None:
        self.advance = advance
        self.polls = 0
        self.closed = False
        self._lock = threading.Lock()

    def poll(self) -> Snapshot:
        with self._lock:
            step = self.polls if self.advance else 0
            self.polls += 1
        return sample_snapshot(step)

    def close(self) -> None:
        self.closed = True
