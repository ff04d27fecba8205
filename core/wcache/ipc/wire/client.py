"""Talking to a daemon: connect, check who is listening, send one request and read its reply."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import TypeVar

from wcache.errors import UnavailableError
from wcache.ipc.wire.framing import REPLY_LIMITS, REQUEST_LIMITS, ProtocolError, peer_uid, receive
from wcache.ipc.wire.messages import Message, RefusedError, Request, send

R = TypeVar("R", bound=Message)

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
# Back-off between connects while the daemon's listen queue is full: short at first (it drains in
# microseconds), never long enough to waste much of the connect timeout.
CONNECT_RETRY_FIRST_S = 0.002
CONNECT_RETRY_MAX_S = 0.1


class DaemonError(UnavailableError):
    """The daemon answered with an error, or could not be reached."""


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    """connect(), retried with back-off while the listen queue is full (EAGAIN), until `timeout` has passed.

    A socket with a timeout connects without blocking, so a burst of engines that outruns the daemon's
    accept loop gets EAGAIN at once instead of waiting its turn.
    """
    deadline = time.monotonic() + timeout
    pause = CONNECT_RETRY_FIRST_S
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(pause, left))
            pause = min(pause * 2, CONNECT_RETRY_MAX_S)


class DaemonConnection:
    """One connection to one daemon; for a zero-copy engine, keeping it open is its lease."""

    def __init__(self, path: str | Path, timeout: float = CONNECT_TIMEOUT_S,
                 request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            _connect(self.sock, self.path, timeout)
            uid = peer_uid(self.sock)
        except OSError as exc:
            self.sock.close()
            raise DaemonError(f"cannot connect to the daemon at {self.path} ({exc.strerror or exc}).") from None
        if uid != os.getuid():
            self.sock.close()
            # Fail closed the other way too: weights from another user's process are not ours to trust.
            raise DaemonError(f"the socket {self.path} belongs to a process of uid {uid}, not yours.")
        self.sock.settimeout(request_timeout)

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def request(self, message: Request[R], fds: tuple[int, ...] = ()) -> R:
        """Send a request (with descriptors `fds`, which stay the caller's) and return its reply; an error reply,
        or a malformed one, raises DaemonError."""
        send_error: OSError | None = None
        try:
            send(self.sock, message, REQUEST_LIMITS, fds)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # A daemon that refuses a connection (too many clients) says why and closes before reading:
            # its error frame may still be waiting to be read.
            send_error = exc
        except (OSError, ProtocolError) as exc:
            raise DaemonError(f"the daemon at {self.path} stopped answering ({exc}).") from None
        try:
            reply = receive(self.sock, REPLY_LIMITS)
        except (OSError, ProtocolError) as exc:
            raise DaemonError(f"the daemon at {self.path} stopped answering ({send_error or exc}).") from None
        try:
            return message.reply_from(reply)
        except RefusedError as refusal:
            reason = str(refusal).rstrip(".")
            raise DaemonError(f"the daemon at {self.path} refused {message.TYPE}: {reason}.") from None
        except ProtocolError as exc:
            raise DaemonError(f"the daemon at {self.path} sent a malformed reply to {message.TYPE} ({exc}).") from None


def request_once(path: str | Path, message: Request[R], *, timeout: float | None = None) -> R:
    """Open a connection, make one request, close; `timeout` bounds connect and reply alike."""
    connect, reply = (timeout, timeout) if timeout is not None else (CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S)
    with DaemonConnection(path, connect, reply) as conn:
        return conn.request(message)
