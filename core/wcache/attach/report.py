"""What an attach did: hit, miss or fallback, why, against which daemon, and how long each step took."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from wcache.errors import UnavailableError
from wcache.ipc.attach_summary import AttachSummary, CorruptTensor
from wcache.key.diff import KeyDiff, diff_summary


class AttachMissError(UnavailableError):
    """No daemon could serve this key and falling back to disk was not allowed."""

    def __init__(self, message: str, report: AttachReport) -> None:
        super().__init__(message)
        self.report = report


class CorruptFound:
    """What the daemon behind a zero-copy lease reported changed in memory after the attach, one tensor at a time
    (the lease's watcher adds them; requests read them). Only ever grows: those tensors stay as they are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: tuple[CorruptTensor, ...] = ()
        self._listeners: list[Callable[[], object]] = []

    def add(self, tensor: str, reason: str, *, rank: int | None = None, daemon: str | None = None) -> None:
        """A tensor found changed; `rank` and `daemon` when another tensor-parallel rank's daemon found it."""
        with self._lock:
            if any((t.tensor, t.rank) == (tensor, rank) for t in self._found):
                return
            self._found = (*self._found, CorruptTensor(tensor=tensor, reason=reason, rank=rank, daemon=daemon))
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], object]) -> None:
        """Call `listener` (on the lease's watcher thread) each time a tensor is added."""
        with self._lock:
            self._listeners.append(listener)

    @property
    def tensors(self) -> tuple[CorruptTensor, ...]:
        return self._found  # replaced whole, never changed in place: reading needs no lock

    def __bool__(self) -> bool:
        return bool(self._found)


@dataclass(frozen=True, slots=True)
class AttachReport:
    """What happened: hit, miss or fallback, why, against which daemon, and how long each step took.

    Built once, when the attach is over; only `daemon_lost` and `corrupt` change after (the lease's watcher sets
    `lost` and adds what the daemon reports changed in memory).
    """

    outcome: str
    mode: str
    device: str
    key_id: str | None
    daemon: str | None = None
    daemon_key_id: str | None = None
    reason: str | None = None
    mismatched: list[str] = field(default_factory=list)
    diff: KeyDiff | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    bytes_mapped: int = 0
    num_tensors: int = 0
    lost: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
    corrupt: CorruptFound = field(default_factory=CorruptFound, compare=False, repr=False)

    @property
    def daemon_lost(self) -> bool:
        """The daemon backing zero-copy tensors went away after the attach."""
        return self.lost.is_set()

    def summary(self) -> AttachSummary:
        """The report as it crosses a process (`/v1/weights`, the engine descriptor, `verify --json`)."""
        return AttachSummary(
            outcome=self.outcome, mode=self.mode, device=self.device, key_id=self.key_id, daemon=self.daemon,
            daemon_key_id=self.daemon_key_id, reason=self.reason, mismatched=tuple(self.mismatched),
            diff=diff_summary(self.diff) if self.diff else None, timings_ms=self.timings_ms,
            bytes_mapped=self.bytes_mapped, num_tensors=self.num_tensors, daemon_lost=self.daemon_lost,
            corrupt=self.corrupt.tensors)

    def corrupt_sentence(self) -> str | None:
        """Why the weights must not serve, naming every changed tensor; None while the daemon reported none."""
        found = self.corrupt.tensors
        if not found:
            return None
        if all(t.rank is None for t in found):
            return (f"the daemon {self.daemon} found the weights this engine maps changed in memory: "
                    f"{'; '.join(t.reason for t in found)}")
        return ("the daemons of this engine's tensor-parallel ranks found the weights it maps changed in memory: "
                + "; ".join(f"on rank {t.rank or 0} (daemon {t.daemon or self.daemon}), {t.reason}" for t in found))
