"""A client of a served reference engine's HTTP API (`wcache switch`, `wcache verify` of a running engine)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.http.client import NoAnswerError, http_call
from wcache.ipc.run_dir.engine_token import operator_token

TIMEOUT_S = 300.0  # a switch attaches a checkpoint (hashing it when its receipts are stale); a request decodes


class EngineRequestError(UnavailableError):
    """The engine answered with an error; `status` is its HTTP status, the message its sentence."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    @staticmethod
    def of(message: str, status: int) -> EngineRequestError:
        """The error for an answer with `status`: 400 (bad input) and 401/403 (not this user's to ask) are the
        caller's; anything else, unavailable."""
        refused = status in (400, 401, 403)
        return (EngineRefusedRequestError if refused else EngineRequestError)(message, status)


class EngineRefusedRequestError(EngineRequestError):
    """The engine refused the request itself (400, or 401/403 for a user it does not take it from): the caller,
    not the engine, is at fault."""

    exit_code = BadInputError.exit_code


def engine_base_url(url: str) -> str:
    """`url` without a trailing route, checked to be http(s)://host[:port]."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInputError(f"{url!r} is not an engine URL (http://HOST:PORT).")
    return f"{parts.scheme}://{parts.netloc}"


def call_engine(url: str, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = TIMEOUT_S, *, token: str | None = None) -> dict[str, Any]:
    """One request to the engine at `url`; its JSON answer, or an error sentence (the engine's own when it gave
    one). It carries the control `token` when given, else the operator's (`WCACHE_ENGINE_TOKEN_FILE`) when set:
    what a proxy in front of vLLM's development routes, or vLLM's own --api-key, asks for."""
    base = engine_base_url(url)
    payload = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if payload is not None else {}
    token = token if token is not None else operator_token()
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
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
