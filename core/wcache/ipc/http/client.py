"""The one HTTP client of wcache's own endpoints (a supervisor's /health, an engine's /metrics and API) for `top`,
`status`, the demo, and the served engine's client (`wcache switch`, `wcache verify --url`).

http.client rather than urllib: urllib's opener machinery costs about a third more CPU per request, and `top`
makes dozens of requests a second; there is no proxy and no redirect to follow to a process of our own.
"""

from __future__ import annotations

import http.client
import urllib.parse


class NoAnswerError(Exception):
    """Nothing answered an HTTP request; the message says why (refused, timed out, a broken answer)."""


def http_call(url: str, *, method: str = "GET", body: bytes | None = None,
              headers: dict[str, str] | None = None, timeout: float) -> tuple[int, bytes]:
    """One request to the http(s) `url`: (status, body), or NoAnswerError when nothing answers."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NoAnswerError(f"{url!r} is no http(s) URL")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request(method, target, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise NoAnswerError(str(exc)) from None


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
