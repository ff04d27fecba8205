"""The one HTTP client of wcache's own endpoints (a supervisor's /health, an engine's /metrics and API) for `top`,
`status`, the demo, and the served engine's client (`wcache switch`, `wcache verify --url`).

http.client rather than urllib: urllib's opener machinery costs about a third more CPU per request, and `top`
makes dozens of requests a second; there is no proxy and no redirect to follow to a process of our own.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse


class NoAnswerError(Exception):
    """Nothing answered an HTTP request; the message says why (refused, timed out, a broken answer)."""


MAX_ANSWER_BYTES = 64 << 20  # an engine's answers are kilobytes; a larger one is not from a process of ours


def http_call(url: str, *, method: str = "GET", body: bytes | None = None,
              headers: dict[str, str] | None = None, timeout: float,
              max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int, bytes]:
    """One request to the http(s) `url`: (status, body), or NoAnswerError when nothing answers, the whole
    exchange takes longer than `timeout` seconds (a server dripping its answer included), or the answer is
    longer than `max_bytes`."""
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
