"""An attach report as plain data: what crosses a process when an engine says how it got its weights (a
served engine's `/v1/weights` and its announcement in the run dir, `wcache attach --json`, `verify --json`)."""

from __future__ import annotations

from wcache.key.diff import DiffSummary
from wcache.schema import Schema


class CorruptTensor(Schema, frozen=True):
    """A tensor of the attached weights that their daemon's background re-check found changed in memory."""

    tensor: str
    reason: str  # the daemon's sentence: where it lies and which bytes changed
    # With TP > 1: the rank whose daemon found it, when not the rank whose report this is (rank 0 serves for all).
    rank: int | None = None
    daemon: str | None = None  # that rank's daemon


class AttachSummary(Schema, frozen=True):
    """How an attach went (`wcache.attach.AttachReport.summary()`): hit, miss or fallback, against which daemon,
    why, and how long each step took.

    Every field but `corrupt` is required, so every one is written: a reader sees `reason: null`, not a missing
    key. `corrupt` is written only once the daemon reported a tensor changed, so what a sound engine announces
    reads in earlier versions.
    """

    outcome: str  # "hit", "miss" or "fallback"
    mode: str
    device: str
    key_id: str | None
    daemon: str | None
    daemon_key_id: str | None
    reason: str | None
    mismatched: tuple[str, ...]
    diff: DiffSummary | None
    timings_ms: dict[str, float]
    bytes_mapped: int
    num_tensors: int
    daemon_lost: bool
    corrupt: tuple[CorruptTensor, ...] = ()
