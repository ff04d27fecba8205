"""The daemon wire protocol: versioned, length-prefixed msgpack frames over AF_UNIX; fds by SCM_RIGHTS.

Both sides import this module; it loads without torch. No pickle: a frame is a msgpack map whose fields are
checked against the request or reply type it names, and anything else closes the connection.

Each direction has its own `Limits`: requests are a few short fields, replies carry one entry per tensor.
Decoding multiplies a frame's size (one byte of msgpack, an empty list or map, is ~64 bytes of Python), so
a reader bounds both the frame and what it may hold once decoded, and a frame must arrive whole within a
deadline that starts at its first byte (the idle time before a frame is the caller's business).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
MAX_FDS = 4
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class Limits:
    """The most one frame may be, hold once decoded, and take to arrive after its first byte."""

    frame_bytes: int
    array_len: int
    map_len: int
    str_len: int
    bin_len: int
    deadline_s: float
    # Lists and maps in all: they are what decoding multiplies (a 1-byte empty map is a 64-byte dict), and
    # the per-container lengths alone do not bound how many there are. None: only the frame size bounds them.
    containers: int | None = None


# The largest request, hello, is ~270 bytes in 2 maps of at most 5 entries (four digests, a pid, a DP size).
# These limits leave room to grow, and bound a hostile request to ~1,000 decoded objects (~60 KB).
REQUEST_LIMITS = Limits(frame_bytes=8 * 1024, array_len=32, map_len=32, str_len=1024, bin_len=1024, deadline_s=5.0,
                        containers=16)
# The largest replies are a manifest (~190 bytes a tensor) and a map (~95 bytes a tensor): 100k tensors (large
# MoE checkpoints with per-expert weights and scales come near that) make a manifest of ~19 MB, past what 16 MiB
# held. Replies come from a daemon of our own uid, trusted with our weights anyway; these bound a broken one.
REPLY_LIMITS = Limits(frame_bytes=64 * 1024 * 1024, array_len=4 * 1024 * 1024, map_len=1024 * 1024,
                      str_len=1024 * 1024, bin_len=1024 * 1024, deadline_s=30.0)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection must be closed."""


class PeerClosedError(ProtocolError):
    """The peer closed the connection (cleanly, or by dying)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded message: its type, its fields, and any file descriptors that came with it."""

    type: str
    fields: dict[str, Any]
    fds: tuple[int, ...] = ()


def encode(message_type: str, fields: dict[str, Any], limits: Limits) -> bytes:
    body = msgpack.packb({"v": PROTOCOL_VERSION, "type": message_type, **fields}, use_bin_type=True)
    if len(body) > limits.frame_bytes:
        raise ProtocolError(f"a {message_type} frame of {len(body)} bytes exceeds the {limits.frame_bytes}-byte limit")
    return _LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message_type: str, fields: dict[str, Any], limits: Limits,
         fds: tuple[int, ...] = ()) -> None:
    send_encoded(sock, encode(message_type, fields, limits), fds)


def send_encoded(sock: socket.socket, data: bytes, fds: tuple[int, ...] = ()) -> None:
    if fds:
        # Descriptors travel with the first byte; the rest follows as ordinary stream data.
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


class _FrameReader:
    """Reads one frame's bytes: the socket's own timeout until the first byte, the frame's deadline after it."""

    def __init__(self, sock: socket.socket, deadline_s: float) -> None:
        self.sock = sock
        self.deadline_s = deadline_s
        self.deadline: float | None = None  # set by the first byte
        self.fds: list[int] = []

    def read(self, n: int) -> bytes:
        chunks: list[bytes] = []
        remaining = n
        while remaining:
            started = self.deadline is not None
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise self._too_slow()
                self.sock.settimeout(left)
            try:
                data = self.sock.recv(remaining) if started else self._first_recv(remaining)
            except TimeoutError:
                if not started:
                    raise  # idle before a frame: the caller's timeout, not a bad frame
                raise self._too_slow() from None
            if not data:
                if not started:
                    raise PeerClosedError("the peer closed the connection")
                raise ProtocolError("the connection closed in the middle of a frame")
            if not started:
                self.deadline = time.monotonic() + self.deadline_s
            chunks.append(data)
            remaining -= len(data)
        return b"".join(chunks)

    def _first_recv(self, n: int) -> bytes:
        data, received_fds, flags, _ = socket.recv_fds(self.sock, n, MAX_FDS)
        self.fds.extend(received_fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("the peer sent more file descriptors than allowed")
        return data

    def _too_slow(self) -> ProtocolError:
        return ProtocolError(f"the frame was not complete {self.deadline_s:g} s after its first byte")


class _ContainerBudget:
    """A msgpack list and map hook that stops decoding once a frame has built more containers than allowed."""

    def __init__(self, most: int) -> None:
        self.left = most

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError("frame holds more lists and maps than any message of this protocol")
        return container


def _decode(body: bytes, limits: Limits) -> Any:
    hooks: dict[str, Any] = {}
    if limits.containers is not None:
        budget = _ContainerBudget(limits.containers)
        hooks = {"list_hook": budget, "object_hook": budget}
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_array_len=limits.array_len, max_map_len=limits.map_len,
            max_str_len=limits.str_len, max_bin_len=limits.bin_len, max_ext_len=0,  # no extension types here
            **hooks,
        )
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"frame is not msgpack within this protocol's limits ({exc})") from None


def receive(sock: socket.socket, limits: Limits) -> Frame:
    """Read one frame; raises PeerClosedError on a clean close and ProtocolError on anything malformed, too
    large or too slow. A timeout before the frame's first byte is the socket's own (TimeoutError)."""
    reader = _FrameReader(sock, limits.deadline_s)
    idle_timeout = sock.gettimeout()
    try:
        (length,) = _LENGTH.unpack(reader.read(_LENGTH.size))
        if length == 0 or length > limits.frame_bytes:
            raise ProtocolError(f"frame length {length} is outside 1..{limits.frame_bytes}")
        message = _decode(reader.read(length), limits)
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a map")
        version = message.get("v")
        # type() and not ==: True and 1.0 equal 1 in Python but are not this protocol's version field.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {message.get('v')!r}, expected {PROTOCOL_VERSION}")
        message_type = message.pop("type", None)
        message.pop("v")
        if not isinstance(message_type, str):
            raise ProtocolError("frame has no type")
        return Frame(message_type, message, tuple(reader.fds))
    except BaseException:
        for fd in reader.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    finally:
        if reader.deadline is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(idle_timeout)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid

