"""The daemon wire protocol's framing: versioned, length-prefixed msgpack frames over AF_UNIX; fds by SCM_RIGHTS.

Both sides import this module; it loads without torch. No pickle: a frame is a 6-byte header (the protocol
version, the body's length) and a msgpack body that `messages` decodes, in one pass, into the request or
reply it names; anything else closes the connection. The version is checked before a byte of the body is
read, so a peer of another version is told so, not that its fields are wrong.

Each direction has its own `Limits`: requests are a few short fields, replies carry one entry per tensor. A
body is decoded straight into its message type, so what it may build once decoded is bounded by the type
(a field no message has is refused without building it); the frame's size bounds the rest, and a frame must
arrive whole within a deadline that starts at its first byte (the idle time before a frame is the caller's
business).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from dataclasses import dataclass

# 2: a frame's version moved from its body's "v" field to its header, and the body is a tagged map decoded
# in one pass (msgspec); fields at their default are left out.
PROTOCOL_VERSION = 2
MAX_FDS = 4
HEADER = struct.Struct("!HI")  # protocol version, body length


@dataclass(frozen=True, slots=True)
class Limits:
    """The most one frame may be, and take to arrive after its first byte."""

    frame_bytes: int
    deadline_s: float


# The largest request, hello, is ~270 bytes (four digests, a pid, a DP size); this leaves room to grow.
REQUEST_LIMITS = Limits(frame_bytes=8 * 1024, deadline_s=5.0)
# The largest replies are a manifest (~190 bytes a tensor) and a map (~95 bytes a tensor): 100k tensors (large
# MoE checkpoints with per-expert weights and scales come near that) make a manifest of ~19 MB, past what 16 MiB
# held. Replies come from a daemon of our own uid, trusted with our weights anyway; these bound a broken one.
REPLY_LIMITS = Limits(frame_bytes=64 * 1024 * 1024, deadline_s=30.0)
# What a daemon sends a lease holder unasked (a tensor name and one sentence); an engine reads nothing larger there.
NOTICE_LIMITS = Limits(frame_bytes=16 * 1024, deadline_s=5.0)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection must be closed."""


class PeerClosedError(ProtocolError):
    """The peer closed the connection (cleanly, or by dying)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame as it arrived: its body (undecoded) and any file descriptors that came with it."""

    body: bytes
    fds: tuple[int, ...] = ()


def frame_bytes(body: bytes, what: str, limits: Limits) -> bytes:
    """`body` with its header; ProtocolError when it is larger than `limits` allow."""
    if len(body) > limits.frame_bytes:
        raise ProtocolError(f"a {what} frame of {len(body)} bytes exceeds the {limits.frame_bytes}-byte limit")
    return HEADER.pack(PROTOCOL_VERSION, len(body)) + body


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


def receive(sock: socket.socket, limits: Limits) -> Frame:
    """Read one frame's bytes; raises PeerClosedError on a clean close and ProtocolError on anything malformed, too
    large or too slow. A timeout before the frame's first byte is the socket's own (TimeoutError)."""
    reader = _FrameReader(sock, limits.deadline_s)
    idle_timeout = sock.gettimeout()
    try:
        version, length = HEADER.unpack(reader.read(HEADER.size))
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
        if length == 0 or length > limits.frame_bytes:
            raise ProtocolError(f"frame length {length} is outside 1..{limits.frame_bytes}")
        return Frame(reader.read(length), tuple(reader.fds))
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

