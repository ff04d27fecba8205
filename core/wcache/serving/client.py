"""A client of a served reference engine's HTTP API (`wcache switch`, `wcache verify` of a running engine)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, TypeVar

import msgspec

from wcache.errors import BadInputError, UnavailableError
from wcache.ipc.http.client import NoAnswerError, http_call
from wcache.ipc.run_dir.engine_token import operator_token
from wcache.schema import Schema, SchemaError
from wcache.serving.api import ErrorAnswer
from wcache.serving.tokenize_api import DetokenizeAnswer, TokenizeAnswer

MAX_SHOWN = 300  # characters of a server's own message shown to the user
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
        raise UnavailableError(f"no engine answers at {base} ({shown(str(exc))}).") from None
    try:
        document = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # deep nesting is a RecursionError
        raise UnavailableError(f"{base}{path} answered {status} without JSON; is it a wcache engine?") from None
    if status != 200:
        message = _error_message(document)
        raise EngineRequestError.of(shown(message or f"{base}{path} answered {status}"), status)
    if not isinstance(document, dict):
        raise UnavailableError(f"{base}{path} answered something other than a JSON object.")
    return document


def _error_message(document: Any) -> str | None:
    """The sentence of an error answer (OpenAI's shape, or a bare string under "error"), if it has one."""
    try:
        error = ErrorAnswer.from_wire(document).error
    except SchemaError:
        return None
    return error if isinstance(error, str) else error.message if error is not None else None


def shown(text: str) -> str:
    """A server's own words as one line of at most MAX_SHOWN characters: a server may send a megabyte."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "…"


Answer = TypeVar("Answer", bound=Schema)


def read_answer(kind: type[Answer], document: dict[str, Any], url: str) -> Answer:
    """`document` read as `kind`; UnavailableError naming the field when the engine's answer is not one."""
    try:
        return kind.from_wire(document)
    except SchemaError as exc:
        raise UnavailableError(f"the engine at {engine_base_url(url)} answered in a form wcache does not read "
                               f"({shown(str(exc))}).") from None


def engine_tokens(url: str, prompt: str, model: str | None = None) -> list[int]:
    """`prompt` encoded by the tokenizer the engine at `url` holds (POST /tokenize, vLLM's route; `model`: the
    name a vLLM server serves under)."""
    body: dict[str, Any] = {"prompt": prompt} if model is None else {"prompt": prompt, "model": model}
    return read_answer(TokenizeAnswer, _tokenizer_route(url, "/tokenize", body), url).tokens


def engine_text(url: str, token_ids: list[int], model: str | None = None) -> str:
    """`token_ids` decoded by the tokenizer the engine at `url` holds (POST /detokenize, vLLM's route)."""
    body: dict[str, Any] = {"tokens": token_ids} if model is None else {"tokens": token_ids, "model": model}
    return read_answer(DetokenizeAnswer, _tokenizer_route(url, "/detokenize", body), url).prompt


def _tokenizer_route(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return call_engine(url, "POST", route, body)
    except EngineRequestError as exc:
        if exc.status != 404:
            raise
        raise UnavailableError(f"the engine at {engine_base_url(url)} has no {route} route, so the tokenizer it "
                               "serves with cannot be compared with its checkpoint's; upgrade it.") from None
