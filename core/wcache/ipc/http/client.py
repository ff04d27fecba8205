"""The one HTTP client of wcache's own endpoints (a supervisor's /health, an engine's /metrics and API) for `top`,
`status`, the demo, and the served engine's client (`wcache switch`, `wcache verify --url`).

http.client rather than urllib: urllib's opener machinery costs about a third more CPU per request, and `top`
makes dozens of requests a second; there is no proxy and no redirect to follow to a process of our own.
A health probe needs only the status line, and reads it over a plain socket (`health_status`): importing
http.client (ssl, email) would cost `wcache status` more than the probe itself.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import http.client


class NoAnswerError(Exception):
    """Nothing answered an HTTP request; the message says why (refused, timed out, a broken answer)."""


MAX_ANSWER_BYTES = 64 << 20  # an engine's answers are kilobytes; a larger one is not from a process of ours


def http_call(url: str, *, method: str = "GET", body: bytes | None = None,
              headers: dict[str, str] | None = None, timeout: float,
              max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int, bytes]:
    """One request to the http(s) `url`: (status, body), or NoAnswerError when nothing answers, the whole
    exchange takes longer than `timeout` seconds (a server dripping its answer included), or the answer is
    longer than `max_bytes`."""
    import http.client

    connection: http.client.HTTPConnection | None = None
    expired = threading.Event()

    def cut_off() -> None:  # wakes a read blocked on a server that sends a byte now and then
        expired.set()
        sock = connection.sock if connection is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, cut_off)
    watchdog.daemon = True
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NoAnswerError(f"{url!r} is no http(s) URL")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        watchdog.start()
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request(method, target, body=body, headers=headers or {})
            response = connection.getresponse()
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length.strip()[:20]) > max_bytes:
                raise NoAnswerError(f"the answer is larger than {max_bytes} bytes")
            data = response.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise NoAnswerError(f"the answer is larger than {max_bytes} bytes")
            if expired.is_set():
                raise TimeoutError
            return response.status, data
        finally:
            watchdog.cancel()
            connection.close()
    except NoAnswerError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set():
            raise NoAnswerError(f"no whole answer within {timeout:g} s") from None
        raise NoAnswerError(str(exc) or type(exc).__name__) from None


def http_request(url: str, *, method: str = "GET", body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float) -> tuple[int | None, bytes | None]:
    """One request to `url`: (status, body), or (None, None) when nothing answers or `url` is no http(s) URL."""
    try:
        return http_call(url, method=method, body=body, headers=headers, timeout=timeout)
    except NoAnswerError:
        return None, None


def http_get(url: str, timeout: float) -> tuple[int | None, bytes | None]:
    """GET `url`: (status, body), or (None, None) when nothing answers."""
    return http_request(url, headers={"Accept": "text/plain"}, timeout=timeout)


# The longest status line a health probe reads ("HTTP/1.1 200 OK" and a reason phrase): more is no answer of ours.
_STATUS_LINE_BYTES = 256


def health_status(url: str, timeout: float) -> int | None:
    """The status a GET of the http `url` answers, read from its status line, or None when nothing answers one
    within `timeout` seconds (an https URL goes through `http_get`)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        return http_get(url, timeout)[0]
    deadline = time.monotonic() + timeout
    try:
        host, port = parts.hostname, parts.port or 80  # a port out of range raises ValueError
        if not host:
            return None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\nAccept: text/plain\r\n"
                   "Connection: close\r\n\r\n").encode("ascii")
        line = b""
        # getaddrinfo encodes a str host with the idna codec, an import of its own; an ASCII host needs none.
        address = (host.encode("ascii") if host.isascii() else host, port)
        with socket.create_connection(address, timeout=timeout) as sock:  # type: ignore[arg-type]  # bytes too
            sock.sendall(request)
            while b"\n" not in line and len(line) < _STATUS_LINE_BYTES:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                sock.settimeout(remaining)
                chunk = sock.recv(_STATUS_LINE_BYTES)
                if not chunk:
                    break
                line += chunk
    except (OSError, ValueError):  # UnicodeError (a URL that is not ASCII) is a ValueError
        return None
    fields = line.split(b"\n", 1)[0].split(None, 2)
    if len(fields) >= 2 and fields[0].startswith(b"HTTP/1.") and len(fields[1]) == 3 and fields[1].isdigit():
        return int(fields[1])
    return None
