"""The one HTTP stack wcache serves with (the standard library's threading server) and its shared handler."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class QuietHandler(BaseHTTPRequestHandler):
    """Replies with explicit lengths (keep-alive safe) and logs nothing per request."""

    protocol_version = "HTTP/1.1"

    def send_body(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, value: Any) -> None:
        self.send_body(code, "application/json", json.dumps(value).encode())

    def send_metrics(self, registry: CollectorRegistry) -> None:
        self.send_body(200, PROMETHEUS_TEXT, generate_latest(registry))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # health probes and scrapes every few seconds would drown the logs


def make_http_server(host: str, port: int, handler: type[QuietHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
