"""Every request an engine or the CLI sends a daemon, and every reply, as frozen dataclasses.

A request names its reply type, so `DaemonConnection.request(Hello(...))` returns a `HelloReply`. The wire
form is the one the daemon has always spoken: a msgpack map per frame (`protocol.encode`), these fields.
`from_wire` raises ProtocolError on anything missing, extra or mistyped (codec.Wire); the daemon answers a
bad request with an error reply, the client turns a bad reply into one DaemonError sentence.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

from wcache.checkpoint.manifest import TensorDigest
from wcache.ipc.codec import Wire
from wcache.ipc.protocol import Frame, ProtocolError
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec

MapMode = Literal["zero_copy", "copy"]
HelloStatus = Literal["hit", "miss", "released", "corrupt"]


@dataclass(frozen=True, slots=True)
class WantedKey(Wire):
    """The key an engine asks for: a whole key, or all of it but the checkpoint digest (--trust-daemon)."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"checkpoint"})

    config: str
    plan: str
    format: int
    checkpoint: str | None = None  # None: the engine trusts the daemon's checkpoint and never compared it

    @classmethod
    def of(cls, key: WeightCacheKey) -> WantedKey:
        return cls(config=key.config, plan=key.plan, format=key.format, checkpoint=key.checkpoint)

    def mismatched_fields(self, held: WeightCacheKey) -> list[str]:
        """The fields of `held` this key asks otherwise for; what it leaves out is taken as `held`'s."""
        checkpoint = held.checkpoint if self.checkpoint is None else self.checkpoint
        return held.mismatched_fields(
            WeightCacheKey(checkpoint=checkpoint, config=self.config, plan=self.plan, format=self.format))


class Message(Wire):
    """A frame's content: its type, and its fields."""

    __slots__ = ()
    TYPE: ClassVar[str]


# -- replies ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReleasedTo(Wire):
    """When a daemon let go of its weights, and to which copy-mode engine."""

    at: str
    client_pid: int | None


@dataclass(frozen=True, slots=True)
class DaemonSummary(Wire):
    """What a daemon holds, sent with hello and manifest replies."""

    name: str
    key_id: str
    key: WeightCacheKey
    plan: PlanSpec
    config: dict[str, Any] | None
    source: str
    device: str
    state: str
    released: ReleasedTo | None


@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    TYPE: ClassVar[str] = "error"
    message: str


@dataclass(frozen=True, slots=True)
class HelloReply(Message):
    TYPE: ClassVar[str] = "hello"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"corrupt"})
    status: HelloStatus
    mismatched: tuple[str, ...]
    daemon: DaemonSummary
    # What the daemon's background re-check found changed in its arena; absent (None) while nothing was, so a
    # clean daemon's reply is what clients of earlier versions read.
    corrupt: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ManifestReply(Message):
    TYPE: ClassVar[str] = "manifest"
    tensors: tuple[TensorDigest, ...]
    daemon: DaemonSummary


@dataclass(frozen=True, slots=True)
class CudaHandle(Wire):
    """The IPC fields a client rebuilds a daemon's CUDA block from (arena.CudaArena.export_handle)."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    total_bytes: int


@dataclass(frozen=True, slots=True)
class MapReply(Message):
    """Where each tensor lies in the arena; a memfd arrives as the frame's one descriptor."""

    TYPE: ClassVar[str] = "map"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"cuda"})
    kind: Literal["memfd", "cuda"]
    total_bytes: int
    # [name, dtype, shape, offset, nbytes] per tensor, viewed as they came (arena_views.views_from_wire checks them):
    # no object per tensor in between.
    entries: list[Any]
    cuda: CudaHandle | None = None
    # Not on the wire: the descriptors that came with the frame (the receiver owns and closes them).
    fds: tuple[int, ...] = field(default=(), metadata={"wire": False})


@dataclass(frozen=True, slots=True)
class ReleaseReply(Message):
    TYPE: ClassVar[str] = "released"
    state: str
    release_queued: bool


@dataclass(frozen=True, slots=True)
class ArenaReport(Message):
    TYPE: ClassVar[str] = "arena"
    checked: int
    changed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """One daemon's state and counters: what `wcache status`, `wcache top` and the health endpoints show."""

    TYPE: ClassVar[str] = "stats"
    # A daemon that judged no provenance, or whose re-check found nothing changed, sends what daemons always sent.
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"provenance", "corrupt"})
    name: str
    pid: int
    device: str
    tp_size: int
    tp_rank: int
    key_id: str
    source: str
    state: str
    holds_weights: bool
    weights_bytes: int
    leases: int
    uptime_s: float
    load_s: float
    counters: dict[str, int]
    connections: int
    release_queued: bool
    released: ReleasedTo | None
    provenance: str | None = None  # its files against what the Hub published, at load (checkpoint.provenance)
    corrupt: tuple[str, ...] | None = None  # tensors its background re-check found changed, one sentence each


@dataclass(frozen=True, slots=True)
class ShutdownReply(Message):
    TYPE: ClassVar[str] = "shutdown"
    stopping: bool
    leases: int


# -- requests -----------------------------------------------------------------------------------------

R = TypeVar("R", bound=Message)


class Request(Message, Generic[R]):
    """A request, and how its reply is read."""

    __slots__ = ()
    REPLY: ClassVar[type[Message]]

    def reply_from(self, frame: Frame) -> R:
        """The typed reply in `frame`; ProtocolError when it is another type or malformed."""
        try:
            if frame.type != self.REPLY.TYPE:
                raise ProtocolError(f"answered {frame.type!r} where {self.REPLY.TYPE!r} was due")
            return cast(R, self.REPLY.from_wire(frame.fields))
        finally:
            _close(frame.fds)  # only a map reply carries descriptors (MapRequest keeps them)


@dataclass(frozen=True, slots=True)
class Hello(Request[HelloReply]):
    """The engine's key; the daemon answers hit, miss or released, and remembers a hit for `map`."""

    TYPE: ClassVar[str] = "hello"
    REPLY: ClassVar[type[Message]] = HelloReply
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"pid", "dp_size"})
    key: WantedKey
    pid: int | None = None
    dp_size: int | None = None  # recorded by the engine's events, never compared

    @classmethod
    def mine(cls, key: WantedKey, dp_size: int | None = None) -> Hello:
        return cls(key=key, pid=os.getpid(), dp_size=dp_size)


@dataclass(frozen=True, slots=True)
class Manifest(Request[ManifestReply]):
    TYPE: ClassVar[str] = "manifest"
    REPLY: ClassVar[type[Message]] = ManifestReply


@dataclass(frozen=True, slots=True)
class MapRequest(Request[MapReply]):
    TYPE: ClassVar[str] = "map"
    REPLY: ClassVar[type[Message]] = MapReply
    mode: MapMode

    def reply_from(self, frame: Frame) -> MapReply:
        try:
            if frame.type != MapReply.TYPE:
                raise ProtocolError(f"answered {frame.type!r} where 'map' was due")
            reply = MapReply.from_wire(frame.fields)
        except ProtocolError:
            _close(frame.fds)
            raise
        return replace(reply, fds=frame.fds)


@dataclass(frozen=True, slots=True)
class Release(Request[ReleaseReply]):
    TYPE: ClassVar[str] = "release"
    REPLY: ClassVar[type[Message]] = ReleaseReply


@dataclass(frozen=True, slots=True)
class CheckArena(Request[ArenaReport]):
    TYPE: ClassVar[str] = "check_arena"
    REPLY: ClassVar[type[Message]] = ArenaReport


@dataclass(frozen=True, slots=True)
class Stats(Request[StatsReply]):
    TYPE: ClassVar[str] = "stats"
    REPLY: ClassVar[type[Message]] = StatsReply


@dataclass(frozen=True, slots=True)
class Shutdown(Request[ShutdownReply]):
    TYPE: ClassVar[str] = "shutdown"
    REPLY: ClassVar[type[Message]] = ShutdownReply
    force: bool = False


REQUESTS: dict[str, type[Request[Any]]] = {
    cls.TYPE: cls for cls in (Hello, Manifest, MapRequest, Release, CheckArena, Stats, Shutdown)
}


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
