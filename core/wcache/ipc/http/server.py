"""The one HTTP stack wcache serves with (the standard library's threading server) and its shared handler.

The handler is hardened for clients that misbehave: every error is one JSON sentence (never the standard
library's HTML page), receiving a request has a total deadline (a client that drips its headers or never
sends its announced body cannot hold a thread), bodies are bounded, and an exception in a route is a 500
reply while the server keeps serving.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import logging
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from wcache.errors import ListenError

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
JSON_TYPE = "application/json"
REQUEST_DEADLINE_S = 10.0  # to receive one whole request: line, headers and body
WRITE_TIMEOUT_S = 30.0  # per send, for a reply to a client that stopped reading
MAX_SENTENCE = 200  # characters of a client's own bytes echoed in an error
# A route's own sentence (a refusal naming tensors, paths and keys) goes whole: a user acts on it. This only
# bounds what a route echoes of a request (a path).
MAX_ROUTE_SENTENCE = 4096
LISTEN_BACKLOG = 128  # socketserver's 5 refuses bursts of probes and scrapes
# What the standard library's request parser refuses, said as wcache says things (its detail follows).
_PARSE_ERRORS = {
    HTTPStatus.BAD_REQUEST: "the request is not valid HTTP",
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "the request's headers are too long or too many",
    HTTPStatus.HTTP_VERSION_NOT_SUPPORTED: "only HTTP/1.0 and HTTP/1.1 are supported",
}

log = logging.getLogger("wcache.http")


class HTTPRequestError(Exception):
    """A request a route refuses: answered with `status` and this one-sentence message."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}


class _DeadlineReader(io.RawIOBase):
    """Socket reads that share the current request's deadline, however many recv calls it takes."""

    def __init__(self, sock: socket.socket, handler: QuietHandler) -> None:
        self.sock, self.handler = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received within its deadline")
        self.sock.settimeout(left)
        try:
            count = self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(WRITE_TIMEOUT_S)  # what a reply's sends wait at most
        self.handler.received += count
        return count


def _sentence(text: str, limit: int = MAX_SENTENCE) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.rstrip(".") + "."


class QuietHandler(BaseHTTPRequestHandler):
    """Replies with explicit lengths (keep-alive safe), answers every error in JSON, logs nothing per request.

    Routes raise HTTPRequestError for what they refuse; anything else they raise is a 500. An error reply
    closes the connection: after a broken request line or an unread body the stream cannot be trusted.
    """

    protocol_version = "HTTP/1.1"
    request_deadline_s = REQUEST_DEADLINE_S  # a class attribute, so a test can shorten it per server

    deadline = 0.0
    received = 0  # bytes read since the current request began
    _replying = False  # a status line went out: too late for an error reply
    _route_sentence = False  # the error is a route's own sentence (HTTPRequestError), not the parser's
    _parsing = False  # inside the standard library's parse_request, whose messages are terse
    _error_headers: tuple[tuple[str, str], ...] = ()  # what the route's HTTPRequestError asks its error reply to carry

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain file from makefile(): replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        # The standard library's loop, with a deadline and JSON errors; an idle keep-alive connection is
        # closed silently at the deadline, a half-received request gets a 408.
        self.deadline = time.monotonic() + self.request_deadline_s
        self.received, self._replying = 0, False
        self.command, self.requestline, self.request_version = "", "", self.default_request_version
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG, "the request line is longer than 65536 bytes")
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return  # parse_request sent the error
            if self.request_version == "HTTP/0.9":
                self.send_error(HTTPStatus.BAD_REQUEST, "HTTP/0.9 requests are not supported")
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"method {self.command!r} is not supported")
                return
            self._dispatch(method)
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self.received and not self._replying:
                self._try_error(HTTPStatus.REQUEST_TIMEOUT,
                                f"the request was not received within {self.request_deadline_s:g} s")
        except ConnectionError:
            self.close_connection = True  # the client went away; nobody to answer

    def parse_request(self) -> bool:
        self._parsing = True
        try:
            return super().parse_request()
        finally:
            self._parsing = False

    def _dispatch(self, method: Any) -> None:
        try:
            method()
        except HTTPRequestError as exc:
            self._error_headers = tuple(exc.headers.items())
            self._route_sentence = True
            self.send_error(exc.status, str(exc))
        except (TimeoutError, ConnectionError):
            raise
        except Exception as exc:  # a bug in a route must cost one request, never the server
            log.exception("%s %s failed", self.command, self.path)
            self.send_error(HTTPStatus.INTERNAL_SERVER_ERROR,
                            f"the server failed on this request ({type(exc).__name__}: {exc})")

    def _try_error(self, code: int, message: str) -> None:
        with contextlib.suppress(OSError):  # the client is gone or not reading; the connection closes anyway
            self.send_error(code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error, the standard library's own included (bad request line, header too long, ...), as
        one JSON sentence; the connection closes after it."""
        self.close_connection = True
        if self._replying:
            return  # part of a reply went out already; closing is the only signal left
        text = message or HTTPStatus(code).phrase
        if self._parsing and code in _PARSE_ERRORS:
            text = f"{_PARSE_ERRORS[HTTPStatus(code)]}: {text[:1].lower()}{text[1:]}"
        sentence = _sentence(text, MAX_ROUTE_SENTENCE if self._route_sentence else MAX_SENTENCE)
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"  # nobody speaks 0.9: answer with a status line and headers
        body = json.dumps(self.error_document(code, sentence)).encode()
        self.send_response(code)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", JSON_TYPE)
        self.send_header("Content-Length", str(len(body)))
        for name, value in self._error_headers:
            self.send_header(name, value)
        self._error_headers = ()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error_document(self, code: int, sentence: str) -> Any:
        """The JSON body of an error reply; a server with its own convention (OpenAI's) overrides it."""
        return {"error": sentence}

    def send_response_only(self, code: int, message: str | None = None) -> None:
        if code >= 200:  # a "100 Continue" is no reply yet: an error may still follow it
            self._replying = True
        super().send_response_only(code, message)

    def read_body(self, max_bytes: int) -> bytes:
        """The request's body, exactly as long as its Content-Length, which must be there and at most
        `max_bytes`; within the request's deadline."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise HTTPRequestError("send the body with a Content-Length; chunked bodies are not accepted",
                                   HTTPStatus.LENGTH_REQUIRED)
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise HTTPRequestError("a Content-Length header is required", HTTPStatus.LENGTH_REQUIRED)
        text = values[0].strip()
        if len(set(values)) > 1 or not text.isascii() or not text.isdigit():
            raise HTTPRequestError("the Content-Length header is not one non-negative integer")
        length = int(text) if len(text) <= 18 else max_bytes + 1  # int() refuses a few thousand digits
        if length > max_bytes:
            raise HTTPRequestError(f"the body is larger than the {max_bytes} bytes accepted",
                                   HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        body = self.rfile.read(length)
        if len(body) < length:
            raise HTTPRequestError(f"the body ended after {len(body)} of its {length} bytes")
        return body

    def read_json_object(self, max_bytes: int) -> dict[str, Any]:
        """The body as a JSON object; anything else (empty, not JSON, nested too deeply, not an object) is a 400."""
        body = self.read_body(max_bytes)
        if not body:
            raise HTTPRequestError("the body is empty; send a JSON object")
        try:
            value = json.loads(body)
        except RecursionError:
            raise HTTPRequestError("the JSON body is nested too deeply") from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise HTTPRequestError(f"the body is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise HTTPRequestError(f"the body must be a JSON object, not {type(value).__name__}")
        return value

    def send_body(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, value: Any) -> None:
        self.send_body(code, JSON_TYPE, json.dumps(value).encode())

    def send_metrics(self, registry: CollectorRegistry) -> None:
        self.send_body(200, PROMETHEUS_TEXT, generate_latest(registry))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # health probes and scrapes every few seconds would drown the logs

    def route(self) -> str:
        return self.path.split("?", 1)[0]

    def require_token(self, token: str | None, what: str) -> None:
        """Refuse the request unless it carries `Authorization: Bearer <token>`: 401 without one (or when the server
        has no token: then nobody may), 403 with another. `what` says what the request would do, for the sentence."""
        sent = self.headers.get("Authorization", "")
        scheme, _, value = sent.partition(" ")
        if token is None:
            raise HTTPRequestError(f"{what} is not allowed on this server (it has no control token)", 403)
        if scheme.lower() != "bearer" or not value.strip():
            raise HTTPRequestError(f"{what} needs the engine's control token (Authorization: Bearer), which only the "
                                   "engine's user can read in its run dir", 401,
                                   {"WWW-Authenticate": 'Bearer realm="wcache"'})
        # Digests of equal length, so the comparison's time says nothing about the token's length either.
        if not hmac.compare_digest(hashlib.sha256(value.strip().encode(errors="replace")).digest(),
                                   hashlib.sha256(token.encode()).digest()):
            raise HTTPRequestError(f"the control token sent is not this engine's; {what} is for the engine's user "
                                   "only", 403)


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    return f"http://{host_port(host, port)}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, family: socket.AddressFamily, address: Any, handler: type[QuietHandler]) -> None:
        self.address_family = family  # read by TCPServer.__init__ when it makes the socket
        super().__init__(address, handler)


def make_http_server(host: str, port: int, handler: type[QuietHandler],
                     flags: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """A server bound to `host:port` (an IPv4 or IPv6 address or a host name; the family is the address's).

    `flags` names the options that chose the host and the port (`errors.option("health_host")`, …), so a
    ListenError's one sentence says which one to change.
    """
    host_flag, port_flag = (f" ({flags[0]})", f" ({flags[1]})") if flags else ("", "")
    host_at, port_at = f"{host_port(host, port)}{host_flag}", f"{host_port(host, port)}{port_flag}"
    if not 0 <= port <= 65535:
        raise ListenError(f"cannot listen on {port_at}: a port is a number from 0 to 65535.")
    try:
        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a valid host name"
        raise ListenError(f"cannot listen on {host_at}: the host does not resolve ({reason}); "
                          f"use an address such as 127.0.0.1 or ::1.") from None
    try:
        return _Server(family, address, handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"cannot listen on {port_at}: the port is already in use; "
                              f"pick another or 0 for a free one.") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ListenError(f"cannot listen on {host_at}: the address is not one of this machine's; "
                              f"use 127.0.0.1, ::1, 0.0.0.0 or a local address.") from None
        if exc.errno == errno.EACCES:
            raise ListenError(f"cannot listen on {port_at}: permission denied; ports below 1024 need "
                              f"privileges, pick a higher one or 0 for a free one.") from None
        if exc.errno == errno.EAFNOSUPPORT:
            raise ListenError(f"cannot listen on {host_at}: this machine has no IPv6.") from None
        raise ListenError(f"cannot listen on {host_at}: {exc.strerror or exc}.") from None
