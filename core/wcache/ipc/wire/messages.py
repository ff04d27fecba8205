"""Every request an engine or the CLI sends a daemon, and every reply, as tagged msgspec Structs.

A frame's body is one msgpack map whose `type` names the message (`Hello` is "hello"); it is decoded in one
pass into the request or reply it names (`read_request`, `read_reply`), every field checked on the way: a
missing, unknown or mistyped field (a bool for a pid) is refused with one sentence naming it. A request names
its reply type, so `DaemonConnection.request(Hello(...))` returns a `HelloReply`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

import msgspec

from wcache.checkpoint.manifest import TensorDigest
from wcache.errors import WcacheError
from wcache.ipc.wire.framing import Frame, Limits, ProtocolError, frame_bytes, send_encoded
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec
from wcache.schema import Schema, schema_error

# One entry as a map reply carries it: (name, dtype, shape, offset, nbytes) (`arena.ArenaEntry.to_wire()`).
WireEntry = tuple[str, str, tuple[int, ...], int, int]
MapMode = Literal["zero_copy", "copy"]
HelloStatus = Literal["hit", "miss", "released", "corrupt"]


class WantedKey(Schema, frozen=True):
    """The key an engine asks for: a whole key, or all of it but the checkpoint digest (--trust-daemon)."""

    config: str
    tokenizer: str
    plan: str
    format: int
    checkpoint: str | None = None  # None: the engine trusts the daemon's checkpoint and never compared it

    @classmethod
    def of(cls, key: WeightCacheKey) -> WantedKey:
        return cls(config=key.config, tokenizer=key.tokenizer, plan=key.plan, format=key.format,
                   checkpoint=key.checkpoint)

    def mismatched_fields(self, held: WeightCacheKey) -> list[str]:
        """The fields of `held` this key asks otherwise for; what it leaves out is taken as `held`'s."""
        checkpoint = held.checkpoint if self.checkpoint is None else self.checkpoint
        return held.mismatched_fields(
            WeightCacheKey(checkpoint=checkpoint, config=self.config, tokenizer=self.tokenizer, plan=self.plan,
                           format=self.format))


class Message(Schema, frozen=True, tag_field="type"):
    """A frame's content: its type (the Struct's tag, also `TYPE`), and its fields."""

    TYPE: ClassVar[str]  # its tag, set below for every message (msgspec fixes a tag after __init_subclass__)

    def to_wire(self) -> dict[str, Any]:
        """Its fields as plain data, without the tag (what `/health` and `status --json` show of a reply)."""
        fields = super().to_wire()
        del fields["type"]
        return fields

    @classmethod
    def from_wire(cls, data: Any) -> Any:
        """From plain fields (the tag may be left out); ProtocolError with one sentence on anything wrong."""
        return _converted(cls, data)


# -- replies ------------------------------------------------------------------------------------------


class ReleasedTo(Schema, frozen=True):
    """When a daemon let go of its weights, and to which copy-mode engine."""

    at: str
    client_pid: int | None


class DaemonSummary(Schema, frozen=True):
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


class ErrorReply(Message, frozen=True, tag="error"):
    message: str


class HelloReply(Message, frozen=True, tag="hello"):
    status: HelloStatus
    mismatched: tuple[str, ...]
    daemon: DaemonSummary
    # What the daemon's background re-check found changed in its arena; absent (None) while nothing was, so a
    # clean daemon's reply is what clients of earlier versions read.
    corrupt: tuple[str, ...] | None = None


class ManifestReply(Message, frozen=True, tag="manifest"):
    tensors: tuple[TensorDigest, ...]
    daemon: DaemonSummary


class CudaHandle(Schema, frozen=True):
    """The IPC fields a client rebuilds a daemon's CUDA block from (arena.CudaArena.export_handle)."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    total_bytes: int


class MapReply(Message, frozen=True, tag="map"):
    """Where each tensor lies in the arena; a memfd arrives as the frame's one descriptor."""

    kind: Literal["memfd", "cuda"]
    total_bytes: int
    # (name, dtype, shape, offset, nbytes) per tensor, as `ArenaEntry.to_wire()` writes them: a tuple per tensor,
    # not an object, and mapped_arena.views_from_wire checks that they fit the arena.
    entries: list[WireEntry]
    cuda: CudaHandle | None = None
    # Not a wire field: the descriptors that came with the frame, set by `MapRequest.reply_from` (the receiver
    # owns and closes them). A reply that names it in its fields is refused.
    fds: tuple[int, ...] = ()


class ReleaseReply(Message, frozen=True, tag="released"):
    state: str
    release_queued: bool


class ArenaReport(Message, frozen=True, tag="arena"):
    checked: int
    changed: tuple[str, ...]


class DaemonStats(Schema, frozen=True):
    """One daemon's state and counters: what `wcache status`, `wcache top` and the health endpoints show (a
    supervisor's `/health` rank rows are these, untagged)."""

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


class StatsReply(Message, DaemonStats, frozen=True, tag="stats"):
    """A daemon's answer to `Stats`: its `DaemonStats` as a tagged reply."""

    def stats(self) -> DaemonStats:
        """Its fields, untagged."""
        return DaemonStats(**msgspec.structs.asdict(self))


class ShutdownReply(Message, frozen=True, tag="shutdown"):
    stopping: bool
    leases: int


class BuiltNext(Message, frozen=True, tag="built_next"):
    """A version built in the daemon's own process (`name`, serving `key_id`), or, with `elsewhere`, why it must
    be built by a process of its own (nothing was read)."""

    name: str | None = None
    key_id: str | None = None
    checkpoint: str | None = None  # the new key's checkpoint digest (its other fields are the parent's)
    already_served: bool = False
    elsewhere: str | None = None
    bytes_written: int = 0  # into the new arena: the changed elements' when an ancestor was brought forward
    forwarded: bool = False  # a pooled arena holding an ancestor was brought forward (else the parent was copied)


class CorruptNotice(Message, frozen=True, tag="corrupt"):
    """The one frame a daemon sends unasked, on a zero-copy lease: its background re-check found `tensor` changed
    in memory (`reason` says where). An engine reads it as it reads a reply (`read_reply`)."""

    tensor: str
    reason: str


# -- requests -----------------------------------------------------------------------------------------

R = TypeVar("R", bound=Message)


class Request(Message, Generic[R], frozen=True):
    """A request, and how its reply is read."""

    REPLY: ClassVar[type[Message]]

    def reply_from(self, frame: Frame) -> R:
        """The typed reply in `frame`; ProtocolError when it is another type or malformed."""
        try:
            return self._expected(read_reply(frame))
        finally:
            _close(frame.fds)  # only a map reply carries descriptors (MapRequest keeps them)

    def _expected(self, reply: Message) -> R:
        if isinstance(reply, ErrorReply):
            raise RefusedError(reply.message)
        if not isinstance(reply, self.REPLY):
            raise ProtocolError(f"answered {reply.TYPE!r} where {self.REPLY.TYPE!r} was due")
        return cast(R, reply)


class Hello(Request[HelloReply], frozen=True, tag="hello"):
    """The engine's key; the daemon answers hit, miss or released, and remembers a hit for `map`."""

    REPLY: ClassVar[type[Message]] = HelloReply
    key: WantedKey
    pid: int | None = None
    dp_size: int | None = None  # recorded by the engine's events, never compared

    @classmethod
    def mine(cls, key: WantedKey, dp_size: int | None = None) -> Hello:
        return cls(key=key, pid=os.getpid(), dp_size=dp_size)


class Manifest(Request[ManifestReply], frozen=True, tag="manifest"):
    REPLY: ClassVar[type[Message]] = ManifestReply


class MapRequest(Request[MapReply], frozen=True, tag="map"):
    REPLY: ClassVar[type[Message]] = MapReply
    mode: MapMode

    def reply_from(self, frame: Frame) -> MapReply:
        try:
            reply = self._expected(read_reply(frame))
            if reply.fds:
                raise ProtocolError("MapReply.fds: descriptors come with the frame, never in its fields")
        except ProtocolError:
            _close(frame.fds)
            raise
        return msgspec.structs.replace(reply, fds=frame.fds)


class Release(Request[ReleaseReply], frozen=True, tag="release"):
    REPLY: ClassVar[type[Message]] = ReleaseReply


class CheckArena(Request[ArenaReport], frozen=True, tag="check_arena"):
    REPLY: ClassVar[type[Message]] = ArenaReport


class Stats(Request[StatsReply], frozen=True, tag="stats"):
    REPLY: ClassVar[type[Message]] = StatsReply


class Shutdown(Request[ShutdownReply], frozen=True, tag="shutdown"):
    REPLY: ClassVar[type[Message]] = ShutdownReply
    force: bool = False


class BuildNext(Request[BuiltNext], frozen=True, tag="build_next"):
    """Build the next version from this daemon's arena and the delta sent with the request (the one descriptor
    of its frame: a memfd sealed against writes, `wcache.delta.format.sealed_delta`), and serve it from this
    daemon's process (`wcache.daemon.version_host`). The daemon reads no file a client names."""

    REPLY: ClassVar[type[Message]] = BuiltNext


REQUEST_TYPES: tuple[type[Request[Any]], ...] = (Hello, Manifest, MapRequest, Release, CheckArena, Stats, Shutdown,
                                                 BuildNext)
REPLY_TYPES: tuple[type[Message], ...] = (
    ErrorReply, HelloReply, ManifestReply, MapReply, ReleaseReply, ArenaReport, StatsReply, ShutdownReply,
    CorruptNotice, BuiltNext)
for _kind in (*REQUEST_TYPES, *REPLY_TYPES):
    _kind.TYPE = cast(str, _kind.__struct_config__.tag)
REQUESTS: dict[str, type[Request[Any]]] = {cls.TYPE: cls for cls in REQUEST_TYPES}
REPLIES: dict[str, type[Message]] = {cls.TYPE: cls for cls in REPLY_TYPES}

# One decoder per direction, built once: a frame is decoded in one pass into the message its tag names.
_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Hello | Manifest | MapRequest | Release | CheckArena | Stats | Shutdown | BuildNext)
_REPLY_DECODER: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    ErrorReply | HelloReply | ManifestReply | MapReply | ReleaseReply | ArenaReport | StatsReply | ShutdownReply
    | CorruptNotice | BuiltNext)


class RefusedError(Exception):
    """The daemon answered a request with an error reply; the message is its sentence."""


class _Tagged(msgspec.Struct):
    """Just a frame's tag, read only to explain a frame that did not decode (every other field skipped)."""

    type: str


class BadRequestError(Exception):
    """A well-formed frame that is no valid request: the daemon answers with the reason and keeps the connection.

    `unknown` tells a type no request has from a known request with bad fields."""

    def __init__(self, message: str, *, unknown: bool) -> None:
        super().__init__(message)
        self.unknown = unknown


def encode(message: Message, limits: Limits) -> bytes:
    """`message` as one frame (header and body); ProtocolError when it is larger than `limits` allow."""
    return frame_bytes(_ENCODER.encode(message), message.TYPE, limits)


def send(sock: socket.socket, message: Message, limits: Limits, fds: tuple[int, ...] = ()) -> None:
    send_encoded(sock, encode(message, limits), fds)


def read_request(frame: Frame) -> Request[Any]:
    """The request in `frame`: BadRequestError for a map that is no valid request, ProtocolError for a frame
    that is not a map with a string `type` at all (the connection is then closed)."""
    try:
        request: Request[Any] = _REQUEST_DECODER.decode(frame.body)
        return request
    except msgspec.ValidationError as exc:
        tag = _tag(frame.body)
        kind = REQUESTS.get(tag)
        if kind is None:
            raise BadRequestError(f"unknown request {tag!r}", unknown=True) from None
        raise BadRequestError(schema_error(kind.__name__, exc), unknown=False) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame is not msgpack ({exc})") from None
    except WcacheError as exc:
        raise BadRequestError(str(exc), unknown=False) from None


def read_reply(frame: Frame) -> Message:
    """The reply in `frame`; ProtocolError with one sentence naming what is wrong."""
    try:
        reply: Message = _REPLY_DECODER.decode(frame.body)
        return reply
    except msgspec.ValidationError as exc:
        kind = REPLIES.get(_tag(frame.body))
        raise ProtocolError(schema_error("reply" if kind is None else kind.__name__, exc)) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame is not msgpack ({exc})") from None
    except WcacheError as exc:
        raise ProtocolError(str(exc)) from None


def _tag(body: bytes) -> str:
    """The `type` of a frame that did not decode; ProtocolError when it has none (not a map, no string tag)."""
    try:
        return msgspec.msgpack.decode(body, type=_Tagged).type
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise ProtocolError("frame is not a map with a string type") from None


def _converted(kind: type[Message], data: Any) -> Any:
    if isinstance(data, dict):
        data = {**data, "type": kind.TYPE}
    try:
        return msgspec.convert(data, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(schema_error(kind.__name__, exc)) from None
    except WcacheError as exc:
        raise ProtocolError(f"{kind.__name__}: {exc}") from None


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
