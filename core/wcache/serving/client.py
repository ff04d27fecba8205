"""A client of a served reference engine's HTTP API (`wcache switch`, `wcache verify` of a running engine)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.http.client import NoAnswerError, http_call

TIMEOUT_S = 300.0  # a switch attaches a checkpoint (hashing it when its receipts are stale); a request decodes


class EngineRequestError(UnavailableError):
    """The engine answered with an error; `status` is its HTTP status, the message its sentence."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    @staticmethod
    def of(message: str, status: int) -> EngineRequestError:
        """The error for an answer with `status`: 400, the request was bad input; anything else, unavailable."""
        return (EngineRefusedRequestError if status == 400 else EngineRequestError)(message, status)


class EngineRefusedRequestError(EngineRequestError):
    """The engine refused the request itself (400): the user's input, not the engine, is at fault."""

    exit_code = BadInputError.exit_code


def engine_base_url(url: str) -> str:
    """`url` without a trailing route, checked to be http(s)://host[:port]."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInputError(f"{url!r} is not an engine URL (http://HOST:PORT).")
    return f"{parts.scheme}://{parts.netloc}"


def call_engine(url: str, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """One request to the engine at `url`; its JSON answer, or an error sentence (the engine's own when it gave
    one)."""
    base = engine_base_url(url)
    payload = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if payload is not None else {}
    try:
        status, data = http_call(f"{base}{path}", method=method, body=payload, headers=headers, timeout=timeout)
    except NoAnswerError as exc:
        raise UnavailableError(f"no engine answers at {base} ({exc}).") from None
    try:
        document = json.loads(data)
    except ValueError:
        raise UnavailableError(f"{base}{path} answered {status} without JSON; is it a wcache engine?") from None
    if status != 200:
        error = document.get("error") if isinstance(document, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise EngineRequestError.of(str(message or f"{base}{path} answered {status}"), status)
    if not isinstance(document, dict):
        raise UnavailableError(f"{base}{path} answered something other than a JSON object.")
    return document
