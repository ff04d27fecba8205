"""Both HTTP servers (the served engine's and the supervisor's health server) against clients that misbehave.

The engine server runs in this process on port 0 with `tiny` loaded from disk and a KV cache of 128 tokens;
health servers run over a RankTable, and the liveness/readiness test over a real preloaded daemon. Clients
are raw sockets (for what no HTTP library would send) and urllib. The request deadline is shortened per
server (a class attribute of its handler) so slow clients are seen in a second, not ten.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import (
    copy_checkpoint,
    daemon_rig,
    http_status,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
    read_until_closed,
    wait_for,
)
from helpers import serving_in_thread
from wcache.errors import BadInputError, ListenError
from wcache.ipc.http.server import QuietHandler, make_http_server

KV_TOKENS = 128  # 8 blocks of 16: a short prompt already overflows it
SHORT_DEADLINE_S = 0.6
READ_TIMEOUT_S = 10.0


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        assert self.headers.get("content-type") == "application/json", self
        return json.loads(self.body)


def exchange(port: int, data: bytes, host: str = "127.0.0.1", timeout: float = READ_TIMEOUT_S) -> Reply | None:
    """Send raw bytes, read until the server closes; the parsed reply, or None when it closed saying nothing.
    Fails if the server neither replies nor closes within `timeout`."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_reply(sock, timeout)


def read_reply(sock: socket.socket, timeout: float) -> Reply | None:
    raw = read_until_closed(sock, timeout)
    if not raw:
        return None
    raw = raw.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")  # an interim reply to Expect: 100-continue
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert status_line.startswith("HTTP/1.1 "), raw[:200]
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    assert int(headers["content-length"]) == len(body), raw[:300]
    return Reply(int(status_line.split()[1]), headers, body)


def error_sentence(reply: Reply) -> str:
    """The one sentence of an error reply, whichever server's shape (the engine's is OpenAI's)."""
    error = reply.json()["error"]
    sentence = error["message"] if isinstance(error, dict) else error
    assert isinstance(sentence, str) and sentence.endswith(".") and "\n" not in sentence, error
    assert reply.headers.get("connection") == "close"
    return sentence


def post(port: int, body: bytes, host: str = "127.0.0.1") -> tuple[int, Any]:
    request = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())




@contextlib.contextmanager
def deadline(server: ThreadingHTTPServer, seconds: float) -> Iterator[None]:
    handler = server.RequestHandlerClass
    before = handler.request_deadline_s  # type: ignore[attr-defined]
    handler.request_deadline_s = seconds  # type: ignore[attr-defined]
    try:
        yield
    finally:
        handler.request_deadline_s = before  # type: ignore[attr-defined]


# -- the servers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from wcache.engine import Engine, EngineConfig
    from wcache_dev.synth import write_checkpoint

    base = tmp_path_factory.mktemp("hardening")
    model = write_checkpoint("tiny", base / "tiny")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WCACHE_CACHE_DIR", str(base / "cache"))
        loaded = Engine.from_disk(model, engine_config=EngineConfig(num_blocks=KV_TOKENS // 16, block_size=16))
    try:
        yield loaded
    finally:
        loaded.close()


@pytest.fixture(scope="module")
def served(engine: Any) -> Any:
    from wcache.serving.server import ServedEngine

    return ServedEngine(engine, engine.generate)


@pytest.fixture(scope="module")
def engine_server(served: Any) -> Iterator[tuple[ThreadingHTTPServer, int]]:
    from wcache.serving.server import make_server

    server = make_server(served, "127.0.0.1", 0)
    with serving_in_thread(server) as port:
        yield server, port


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[ThreadingHTTPServer, int]]:
    from wcache.daemon.health import RankTable, serve_health

    table = RankTable(1)  # one rank, still loading: /livez 200, /readyz 503
    server = serve_health(table, "127.0.0.1", 0)
    try:
        yield server, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(params=["engine", "health"])
def any_server(request: pytest.FixtureRequest) -> tuple[ThreadingHTTPServer, int]:
    return request.getfixturevalue(f"{request.param}_server")


# -- 1. every error is one JSON sentence -------------------------------------------------------------------

PROTOCOL_ERRORS = {
    "garbage request line": (b"\x16\x03\x01 garbage\r\n\r\n", 400, "not valid HTTP"),
    "one word": (b"hello\r\n\r\n", 400, "not valid HTTP"),
    "unsupported method": (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501, "'BREW'"),
    "HTTP/2.0": (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/1.1"),
    "bad version": (b"GET /metrics HTTP/x.y\r\nHost: x\r\n\r\n", 400, "version"),
    "HTTP/0.9": (b"GET /metrics\r\n\r\n", 400, "HTTP/0.9"),
    "header too long": (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431, "headers"),
    "too many headers": (b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 120 + b"\r\n", 431, "headers"),
    "request line too long": (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "65536"),
    "unknown route": (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "/nowhere"),
}


@pytest.mark.parametrize("case", PROTOCOL_ERRORS)
def test_protocol_errors_are_one_json_sentence(any_server: tuple[ThreadingHTTPServer, int], case: str) -> None:
    data, status, needle = PROTOCOL_ERRORS[case]
    reply = exchange(any_server[1], data)
    assert reply is not None and reply.status == status, reply
    assert needle in error_sentence(reply)
    assert b"<html" not in reply.body.lower()


def test_health_errors_use_the_plain_shape(health_server: tuple[ThreadingHTTPServer, int]) -> None:
    reply = exchange(health_server[1], b"hello\r\n\r\n")
    assert reply is not None and isinstance(reply.json()["error"], str)


def test_engine_errors_keep_the_openai_shape(engine_server: tuple[ThreadingHTTPServer, int]) -> None:
    reply = exchange(engine_server[1], b"hello\r\n\r\n")
    assert reply is not None
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", 400) and error["message"]


def test_an_exception_in_a_route_is_a_500_and_the_server_keeps_serving() -> None:
    class Fragile(QuietHandler):
        def do_GET(self) -> None:
            if self.route() == "/boom":
                raise ZeroDivisionError("division by zero")
            self.send_json(200, {"ok": True})

    with serving_in_thread(make_http_server("127.0.0.1", 0, Fragile)) as port:
        reply = exchange(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply is not None and reply.status == 500
        assert "ZeroDivisionError" in error_sentence(reply)
        assert http_status(f"http://127.0.0.1:{port}/fine") == (200, {"ok": True})


# -- 2. deadlines and body limits --------------------------------------------------------------------------


def test_headers_dripped_byte_by_byte_get_a_408_at_the_deadline(
    engine_server: tuple[ThreadingHTTPServer, int],
) -> None:
    # A byte every 0.1 s never trips a per-recv timeout; only a deadline for the whole request ends it.
    server, port = engine_server
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    # Timed from before the connect: the server's deadline starts at its accept, which may come first.
    began = time.monotonic()
    with deadline(server, SHORT_DEADLINE_S), socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in request:
                if select.select([sock], [], [], 0.1)[0]:
                    break  # the server answered (or closed)
                sock.sendall(bytes([byte]))
                assert time.monotonic() - began < 5, "the server was still reading one request after 5 s"
        reply = read_reply(sock, READ_TIMEOUT_S)
        took = time.monotonic() - began
    assert reply is not None and reply.status == 408 and "0.6 s" in error_sentence(reply)
    assert SHORT_DEADLINE_S <= took < SHORT_DEADLINE_S + 1.5, took


def test_a_body_that_never_comes_gets_a_408_and_frees_the_handler(
    engine_server: tuple[ThreadingHTTPServer, int],
) -> None:
    server, port = engine_server
    with deadline(server, SHORT_DEADLINE_S):
        began = time.monotonic()
        reply = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        took = time.monotonic() - began
        assert reply is not None and reply.status == 408 and "not received" in error_sentence(reply)
        assert took < SHORT_DEADLINE_S + 1.5, took
        # The same after the server invited the body with "100 Continue".
        reply = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n"
                               b"Expect: 100-continue\r\n\r\n")
        assert reply is not None and reply.status == 408, reply
        # An idle keep-alive connection is closed at the deadline without a word.
        assert exchange(port, b"") is None
    code, body = post(port, json.dumps({"prompt": "still serving", "max_tokens": 2}).encode())
    assert code == 200 and len(body["choices"][0]["token_ids"]) == 2


BODY_ERRORS = {
    "no Content-Length": (b"", 411, "Content-Length"),
    "chunked": (b"Transfer-Encoding: chunked\r\n", 411, "chunked"),
    "Content-Length not a number": (b"Content-Length: ten\r\n", 400, "Content-Length"),
    "negative Content-Length": (b"Content-Length: -5\r\n", 400, "Content-Length"),
    "two Content-Lengths": (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, "Content-Length"),
    "thousands of digits": (b"Content-Length: " + b"9" * 5000 + b"\r\n", 413, "larger than"),
    "over the limit": (b"Content-Length: 2000000\r\n", 413, "1048576 bytes accepted"),
    "empty body": (b"Content-Length: 0\r\n", 400, "empty"),
}


@pytest.mark.parametrize("case", BODY_ERRORS)
def test_body_framing_is_checked_before_reading(engine_server: tuple[ThreadingHTTPServer, int], case: str) -> None:
    headers, status, needle = BODY_ERRORS[case]
    # No body follows: a server that tried to read one would sit until the deadline and answer 408.
    reply = exchange(engine_server[1], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert reply is not None and reply.status == status, reply
    assert needle in error_sentence(reply)


# -- 3. the served engine's bodies -------------------------------------------------------------------------

DEPTH = 100_000
BAD_BODIES = {
    "nested arrays": (b"[" * DEPTH + b"]" * DEPTH, "nested too deeply"),
    "nested objects": (b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, "nested too deeply"),
    "nested prompt": (b'{"prompt": ' + b"[" * DEPTH + b"]" * DEPTH + b"}", "nested too deeply"),
    "a list": (b'[{"prompt": "hi"}]', "JSON object, not list"),
    "a string": (b'"hi"', "JSON object, not str"),
    "not JSON": (b"prompt=hi", "not JSON"),
    "not UTF-8": (b'{"prompt": "\xff\xfe"}', "not JSON"),
    "a lone surrogate": (b'{"prompt": "\\ud800"}', "not valid Unicode"),
    "prompt over the KV cache": (json.dumps({"prompt": "x" * 200, "max_tokens": 4}).encode(), "KV cache"),
    "prompt and max_tokens over the KV cache": (json.dumps({"prompt": list(range(1, 101)), "max_tokens": 64})
                                                .encode(), "holds 128"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_bodies_are_a_400_with_the_reason(engine_server: tuple[ThreadingHTTPServer, int], case: str) -> None:
    body, needle = BAD_BODIES[case]
    code, reply = post(engine_server[1], body)
    assert code == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and needle in reply["error"]["message"], reply


def test_the_engine_serves_after_every_bad_body(engine_server: tuple[ThreadingHTTPServer, int], engine: Any) -> None:
    for body, _ in BAD_BODIES.values():
        post(engine_server[1], body)
    # The longest request the cache holds still runs: the refusal is the cache's size, not a guess.
    prompt = list(range(1, KV_TOKENS - 3))
    code, reply = post(engine_server[1], json.dumps({"prompt": prompt, "max_tokens": 4}).encode())
    assert code == 200, reply
    assert reply["usage"]["prompt_tokens"] == len(prompt) and engine.blocks.num_free == KV_TOKENS // 16


# -- 4. where a server listens -----------------------------------------------------------------------------


def ipv6_loopback() -> str | None:
    """None when this kernel can listen on ::1; else why not."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return f"this kernel has no IPv6 loopback ({exc.strerror})"
        raise
    return None


def test_ipv6_loopback(served: Any) -> None:
    from wcache.daemon.health import RankTable, serve_health
    from wcache.serving.server import make_server

    if (missing := ipv6_loopback()) is not None:
        pytest.skip(missing)
    health = serve_health(RankTable(1), "::1", 0)
    try:
        code, body = http_status(f"http://[::1]:{health.server_address[1]}/livez")
        assert code == 200 and isinstance(body, dict) and body["ranks"][0]["state"] == "loading"
    finally:
        health.shutdown()
        health.server_close()
    with serving_in_thread(make_server(served, "::1", 0)) as port:
        code, reply = post(port, json.dumps({"prompt": "over IPv6", "max_tokens": 2}).encode(), host="[::1]")
        assert code == 200 and len(reply["choices"][0]["token_ids"]) == 2


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_listen_failures_are_one_sentence_naming_the_flag(busy_port: int, served: Any) -> None:
    from wcache.daemon.health import RankTable, serve_health
    from wcache.serving.server import make_server

    health_flags, serve_flags = ("--health-host", "--health-port"), ("--host", "--port")
    cases = [
        (lambda: serve_health(RankTable(1), "127.0.0.1", busy_port, health_flags),
         [f"127.0.0.1:{busy_port} (--health-port)", "already in use", "0 for a free one"]),
        (lambda: make_server(served, "127.0.0.1", busy_port, serve_flags),
         [f"127.0.0.1:{busy_port} (--port)", "already in use"]),
        (lambda: serve_health(RankTable(1), "no-such-host.invalid", 0, health_flags),
         ["no-such-host.invalid:0 (--health-host)", "does not resolve"]),
        (lambda: serve_health(RankTable(1), "192.0.2.1", 0, health_flags),  # TEST-NET-1: never this machine's
         ["192.0.2.1:0 (--health-host)", "not one of this machine's"]),
        (lambda: make_server(served, "127.0.0.1", 70000, serve_flags), ["127.0.0.1:70000 (--port)", "0 to 65535"]),
    ]
    for start, needles in cases:
        with pytest.raises(ListenError) as failure:
            start()
        sentence = str(failure.value)
        assert isinstance(failure.value, BadInputError) and failure.value.exit_code == 2
        assert all(n in sentence for n in needles), sentence
        assert sentence.count(". ") == 0 and sentence.endswith("."), sentence


def test_busy_health_port_fails_preload_with_the_sentence(busy_port: int, tiny_template: Path) -> None:
    with daemon_rig() as rig:
        result = rig.cli("preload", str(tiny_template), "--detach", "--health-port", str(busy_port),
                         "--run-dir", str(rig.run_dir))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
        assert f"127.0.0.1:{busy_port} (--health-port)" in result.stderr and "already in use" in result.stderr
        assert not rig.descriptors(), "no rank may start when the health server cannot listen"


def test_busy_serve_port_fails_attach_serve_with_the_sentence(busy_port: int, tiny_template: Path) -> None:
    with daemon_rig() as rig:
        result = rig.cli("attach", str(tiny_template), "--serve", "--port", str(busy_port),
                         "--run-dir", str(rig.run_dir))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert f"127.0.0.1:{busy_port} (--port)" in result.stderr and "already in use" in result.stderr


# -- 5. liveness and readiness -----------------------------------------------------------------------------


def probe(url: str) -> tuple[int, dict[str, Any]]:
    code, body = http_status(url)
    assert isinstance(body, dict), body
    return code, body


def metric(url: str, name: str) -> float:
    code, text = http_status(f"{url}/metrics")
    assert code == 200 and isinstance(text, str)
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def test_a_released_daemon_is_alive_but_not_ready(tiny_template: Path) -> None:
    from wcache.attach import attach
    from wcache.plan.spec import PlanSpec

    # Over IPv6 where the kernel has it: the supervisor's --health-host ::1 and the URL it publishes.
    host = "::1" if ipv6_loopback() is None else "127.0.0.1"
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        (daemon,) = rig.preload(model, "--health-host", host)
        url = daemon.health_url
        assert url is not None and url.startswith("http://[::1]:" if host == "::1" else "http://127.0.0.1:"), url
        for path in ("/livez", "/readyz", "/health"):
            assert probe(f"{url}{path}")[0] == 200, path
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("WCACHE_CACHE_DIR", str(rig.cache_dir))
            with attach(model, PlanSpec(), mode="copy", run_dir=rig.run_dir) as weights:
                assert (weights.report.outcome, weights.report.mode) == ("hit", "copy")

        code, live = probe(f"{url}/livez")
        assert code == 200 and live["status"] == "ok"
        assert (live["ranks"][0]["state"], live["ranks"][0]["holds_weights"]) == ("released", False)
        for path in ("/readyz", "/health"):
            code, ready = probe(f"{url}{path}")
            assert code == 503 and ready["status"] == "unavailable" and ready["ranks"][0]["state"] == "released"
        assert metric(url, "wcache_daemon_alive") == 1.0 and metric(url, "wcache_daemon_ready") == 0.0
        # `wcache status` reads the published URL (bracketed for IPv6) and reports readiness.
        assert [d["health_status"] for d in rig.status()["daemons"]] == [503]


def test_an_exited_or_unreachable_rank_is_not_alive(tmp_path: Path) -> None:
    from wcache.daemon.health import RankTable, serve_health

    table = RankTable(3)
    table.ready(1, str(tmp_path / "nobody-listens.sock"))
    table.gone(2)
    server = serve_health(table, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, live = probe(f"{url}/livez")
        assert code == 503 and live["status"] == "down"
        assert [r["state"] for r in live["ranks"]] == ["loading", "unreachable", "exited"]
        assert probe(f"{url}/readyz")[0] == 503
        assert metric(url, "wcache_daemon_alive") == 1.0  # the loading rank only
    finally:
        server.shutdown()
        server.server_close()


# -- 6. counter events and the stats log -------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_idle_engines_write_no_counter_lines_and_busy_ones_log_stats(
    engine_server: tuple[ThreadingHTTPServer, int], served: Any, tmp_path: Path
) -> None:
    from wcache.ipc.run_dir.directory import ensure_run_dir
    from wcache.monitor.events import read_events
    from wcache.serving.server import CounterEvents

    run_dir = ensure_run_dir(tmp_path / "run")
    logger = logging.getLogger("wcache.engine")
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    counters = CounterEvents(served, run_dir, "http://test", interval=0.1)

    def written() -> list[dict[str, Any]]:
        return [e for e in read_events(run_dir) if e["kind"] == "engine_counters"]

    try:
        counters.start()
        time.sleep(0.6)
        assert written() == [] and lines.lines == [], "an idle engine wrote or logged"
        code, _ = post(engine_server[1], json.dumps({"prompt": "some activity", "max_tokens": 3}).encode())
        assert code == 200
        now = served.engine.counters.snapshot()
        # A tick in the middle of the request may write a line of its own; the one after it has the totals.
        wait_for(lambda: written() and written()[-1]["counters"]["generation_tokens"] == now["generation_tokens"],
                 timeout=5, what="a counter line with the request's totals")
        events, logged = len(written()), len(lines.lines)
        time.sleep(0.6)
        assert len(written()) == events, "unchanged counters were written again"
        assert len(lines.lines) == logged, f"an idle engine kept logging: {lines.lines[logged:]}"
        assert all(line.startswith("Avg prompt throughput: ") and "Avg generation throughput: " in line
                   and "Prefix cache hit rate: " in line for line in lines.lines), lines.lines

        def rate(line: str, name: str) -> float:
            return float(line.split(f"Avg {name} throughput: ")[1].split()[0])

        assert sum(rate(line, "prompt") for line in lines.lines) > 0, lines.lines
        assert sum(rate(line, "generation") for line in lines.lines) > 0, lines.lines
        assert "Running: 0 reqs" in lines.lines[-1], lines.lines
    finally:
        counters.stop()
        logger.removeHandler(lines)
        logger.setLevel(level)
    final = written()
    assert len(final) == events + 1 and final[-1]["counters"]["requests"] == now["requests"], "no final line at stop"

