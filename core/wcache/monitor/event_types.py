"""Every kind of event in `<run dir>/events.jsonl`: one Struct per kind, its tag the line's `kind`.

These are the schema of the log: writers build one and `events.append_event` writes it; readers decode a line
into the kind it names in one pass. Logs outlive versions, so a reader skips fields it does not know, and
every field but the time has a default: a line an older version wrote (without a field added since) still
reads. `FEED` says whether `wcache top` shows the kind in its feed; its list of kinds is this module's.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any, ClassVar

import msgspec

from wcache.key.diff import DiffSummary

# Seconds since the epoch no event can be from (the year 5138): a larger ts is a forged line, not a time to show.
MAX_TS = 1e11
Timestamp = Annotated[float, msgspec.Meta(ge=0, lt=MAX_TS)]


def _now() -> float:
    return round(time.time(), 6)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """What every line has: when, and which process wrote it."""

    FEED: ClassVar[bool] = True  # shown in `wcache top`'s feed; bookkeeping kinds say False
    KIND: ClassVar[str]  # the tag, set below for every kind

    ts: Timestamp = msgspec.field(default_factory=_now)
    pid: int = msgspec.field(default_factory=os.getpid)

    def to_wire(self) -> dict[str, Any]:
        """The line's fields as plain data, `kind` first (what readers of dicts and `top --json` take)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


# -- daemons ----------------------------------------------------------------------------------------------


class Preload(Event, frozen=True, tag="preload"):
    source: str | None = None
    device: str | None = None
    tp_size: int | None = None
    health_url: str | None = None


class PreloadFailed(Event, frozen=True, tag="preload_failed"):
    source: str | None = None
    reason: str | None = None


class Ready(Event, frozen=True, tag="ready"):
    daemon: str | None = None
    key_id: str | None = None
    rank: int | None = None
    device: str | None = None
    source: str | None = None
    weights_bytes: int | None = None
    load_s: float | None = None
    bytes_read: int | None = None
    # A version built from another daemon's arena and a delta: that daemon's key id and name.
    parent_key_id: str | None = None
    parent: str | None = None


class Provenance(Event, frozen=True, tag="provenance"):
    daemon: str | None = None
    key_id: str | None = None
    verdict: str | None = None
    counts: dict[str, int] = {}
    differs: list[str] = []
    unknown: list[str] = []


class DaemonExited(Event, frozen=True, tag="daemon_exited"):
    daemon: str | None = None
    rank: int | None = None
    exit_code: int | None = None


class GroupStopped(Event, frozen=True, tag="group_stopped"):
    """A rank of a tensor-parallel group exited, so its supervisor stopped the whole group."""

    source: str | None = None
    rank: int | None = None
    reason: str | None = None


class Stop(Event, frozen=True, tag="stop"):
    daemon: str | None = None
    key_id: str | None = None
    leases: int | None = None


class Release(Event, frozen=True, tag="release"):
    """A lease ended (zero_copy), or a copy-mode engine's release was carried out or kept back (copy)."""

    daemon: str | None = None
    key_id: str | None = None
    mode: str | None = None
    client_pid: int | None = None
    weights_dropped: bool | None = None
    queued_s: float | None = None
    kept_for_attaches: int | None = None
    kept_for_leases: int | None = None


class ScrubFailed(Event, frozen=True, tag="scrub_failed"):
    daemon: str | None = None
    key_id: str | None = None
    tensor: str | None = None
    arena_offset: int | None = None
    block: list[int] | None = None
    byte: int | None = None
    reason: str | None = None
    lease_pids: list[int] = []


# -- engines ----------------------------------------------------------------------------------------------


class AttachHit(Event, frozen=True, tag="attach_hit"):
    source: str | None = None
    daemon_source: str | None = None
    verified: bool | None = None
    key_id: str | None = None
    daemon: str | None = None
    device: str | None = None
    mode: str | None = None
    bytes: int | None = None
    dp_size: int | None = None
    engine: str | None = None
    timings_ms: dict[str, float] = {}


class AttachMiss(Event, frozen=True, tag="attach_miss"):
    source: str | None = None
    key_id: str | None = None
    device: str | None = None
    reason: str | None = None
    daemon: str | None = None
    mismatched: list[str] = []
    diff: DiffSummary | None = None
    dp_size: int | None = None
    engine: str | None = None


class Fallback(Event, frozen=True, tag="fallback"):
    """An engine loaded from disk after a miss: wcache's own attach and the vLLM loader write the same kind."""

    source: str | None = None
    key_id: str | None = None  # None: the engine fell back before it had a key (the vLLM loader's failures)
    device: str | None = None
    reason: str | None = None
    seconds: float | None = None
    dp_size: int | None = None
    engine: str | None = None


class DaemonLost(Event, frozen=True, tag="daemon_lost"):
    daemon: str | None = None
    key_id: str | None = None
    device: str | None = None
    tensors_valid: bool | None = None
    unexpected_data: bool | None = None


class EngineWeightsCorrupt(Event, frozen=True, tag="engine_weights_corrupt"):
    """An engine holding a lease heard from its daemon that a tensor it maps changed in memory (`pid` is the
    engine's); it refuses to serve them until it switches or restarts."""

    daemon: str | None = None
    key_id: str | None = None
    tensor: str | None = None
    reason: str | None = None


class Placement(Event, frozen=True, tag="placement"):
    """How a vLLM rank's parameters took the arena's tensors; detail for `verify`, not news."""

    FEED: ClassVar[bool] = False
    engine: str | None = None
    daemon: str | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    mode: str | None = None
    parameters: int | None = None
    assigned: int | None = None
    copied: list[str] = []
    private_bytes: int | None = None
    device_peak_bytes: int | None = None
    post_processing_ms: float | None = None


class EngineSwitch(Event, frozen=True, tag="engine_switch"):
    engine_pid: int | None = None
    source: str | None = None
    previous_key_id: str | None = None
    key_id: str | None = None
    daemon: str | None = None
    seconds: float | None = None


class SwitchRefused(Event, frozen=True, tag="switch_refused"):
    engine_pid: int | None = None
    source: str | None = None
    key_id: str | None = None
    reason: str | None = None


class EngineCounters(Event, frozen=True, tag="engine_counters"):
    """A served engine's cumulative counters, written when they change: bookkeeping for rates, not news."""

    FEED: ClassVar[bool] = False
    engine_pid: int | None = None
    url: str | None = None
    model: str | None = None
    outcome: str | None = None
    counters: dict[str, int] = {}


EVENT_TYPES: tuple[type[Event], ...] = (
    Preload, PreloadFailed, Ready, Provenance, DaemonExited, GroupStopped, Stop, Release, ScrubFailed, AttachHit,
    AttachMiss, Fallback, DaemonLost, EngineWeightsCorrupt, Placement, EngineSwitch, SwitchRefused, EngineCounters,
)
for _kind in EVENT_TYPES:
    _kind.KIND = str(_kind.__struct_config__.tag)
KINDS: frozenset[str] = frozenset(k.KIND for k in EVENT_TYPES)
# What `wcache top` shows in its feed.
FEED_KINDS: frozenset[str] = frozenset(k.KIND for k in EVENT_TYPES if k.FEED)

AnyEvent = (Preload | PreloadFailed | Ready | Provenance | DaemonExited | GroupStopped | Stop | Release | ScrubFailed
            | AttachHit | AttachMiss | Fallback | DaemonLost | EngineWeightsCorrupt | Placement | EngineSwitch
            | SwitchRefused | EngineCounters)
