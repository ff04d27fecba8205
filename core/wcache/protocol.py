"""The daemon wire protocol: versioned, length-prefixed msgpack frames over AF_UNIX; fds by SCM_RIGHTS.

Both sides import this module; it loads without torch. No pickle: a frame is a msgpack map whose fields are
checked against the request or reply type it names, and anything else closes the connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
# Largest frame either side accepts; a manifest of a few thousand tensors is well under it.
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_FDS = 4
_LENGTH = struct.Struct("!I")


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


def encode(message_type: str, fields: dict[str, Any]) -> bytes:
    body = msgpack.packb({"v": PROTOCOL_VERSION, "type": message_type, **fields}, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {message_type} frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message_type: str, fields: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = encode(message_type, fields)
    if fds:
        # Descriptors travel with the first byte; the rest follows as ordinary stream data.
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int], *, first: bool) -> bytes:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        if first and not chunks:
            data, received_fds, flags, _ = socket.recv_fds(sock, remaining, MAX_FDS)
            fds.extend(received_fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("the peer sent more file descriptors than allowed")
        else:
            data = sock.recv(remaining)
        if not data:
            if not chunks and first:
                raise PeerClosedError("the peer closed the connection")
            raise ProtocolError("the connection closed in the middle of a frame")
        chunks.append(data)
        remaining -= len(data)
    return b"".join(chunks)


def receive(sock: socket.socket) -> Frame:
    """Read one frame; raises PeerClosedError on a clean close and ProtocolError on anything malformed."""
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _LENGTH.size, fds, first=True)
        (length,) = _LENGTH.unpack(header)
        if length == 0 or length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame length {length} is outside 1..{MAX_FRAME_BYTES}")
        body = _recv_exact(sock, length, fds, first=False)
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"frame is not msgpack ({exc})") from None
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
        return Frame(message_type, message, tuple(fds))
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def require(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A field of the expected type, or ProtocolError naming it."""
    value = fields.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} is missing or has the wrong type")
    return value
