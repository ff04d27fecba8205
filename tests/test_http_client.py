"""wcache's HTTP client (wcache.ipc.http.client): the health probe that reads only a status line, against real
servers on loopback ports, agreeing with `http_get` wherever a server answers at all."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer

import pytest
from helpers import serving_in_thread
from wcache.ipc.http.client import health_status, http_get
from wcache.ipc.http.server import QuietHandler

TIMEOUT_S = 1.0


class _Answers(QuietHandler):
    """GET /<status> answers that status with a short body."""

    def do_GET(self) -> None:
        status = int(self.path.strip("/").split("/")[0])
        body = b"ok\n"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    with serving_in_thread(ThreadingHTTPServer(("127.0.0.1", 0), _Answers)) as port:
        yield port


@pytest.mark.parametrize("status", [200, 404, 503])
def test_the_probe_reads_the_status_http_get_reads(server: int, status: int) -> None:
    url = f"http://127.0.0.1:{server}/{status}/health"
    assert health_status(url, TIMEOUT_S) == http_get(url, TIMEOUT_S)[0] == status


def _raw_server(reply: Callable[[socket.socket], None]) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            reply(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _silent(conn: socket.socket) -> None:
    conn.recv(1)  # blocks until the prober gives up and closes


@pytest.mark.parametrize("reply", [
    lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"),  # something that is not HTTP
    lambda conn: None,  # closes saying nothing
    _silent,  # never answers: the probe's deadline ends it
], ids=["not-http", "closed", "silent"])
def test_no_status_line_is_no_answer(reply: Callable[[socket.socket], None]) -> None:
    listener, thread = _raw_server(reply)
    with listener:
        assert health_status(f"http://127.0.0.1:{listener.getsockname()[1]}/health", TIMEOUT_S) is None
    thread.join(timeout=5)


def test_nothing_listening_and_no_http_url_are_no_answer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    assert health_status(f"http://127.0.0.1:{port}/health", TIMEOUT_S) is None
    assert health_status("http://127.0.0.1:99999/health", TIMEOUT_S) is None
    assert health_status("ftp://127.0.0.1/health", TIMEOUT_S) is None
