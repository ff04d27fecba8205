"""`wcache switch URL` and `wcache verify URL --greedy` against a stand-in server that lies: answers of the
wrong shape, sizes or numbers, nested thousands deep, a megabyte of error message, or dripped a byte at a
time. Each time: one sentence on stderr, a non-zero exit, no traceback, and nothing allocated from the
server's word.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import daemon_rig
from helpers import cli_env, serving_in_thread, wcache_in_process
from wcache.engine.tokenizer import load_tokenizer
from wcache.ipc.http.client import NoAnswerError, http_call
from wcache.key.compute import compute_key
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint

# A route's answer: (status, body bytes), or a callable that writes the whole reply itself.
Answer = tuple[int, bytes] | Callable[[BaseHTTPRequestHandler], None]


class StandIn(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, Answer]
    requests: list[str]

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up on a lie is what these tests provoke; socketserver's report of it would land
        on the stderr `wcache_in_process` captures from this same interpreter."""


class Handler(BaseHTTPRequestHandler):
    server: StandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        route = f"{self.command} {self.path.split('?', 1)[0]}"
        self.server.requests.append(route)
        answer = self.server.routes.get(route, (404, b'{"detail": "Not Found"}'))
        if callable(answer):
            answer(self)
            return
        status, data = answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    server = StandIn(("127.0.0.1", 0), Handler)
    server.routes, server.requests = {}, []
    with serving_in_thread(server):
        yield server


@pytest.fixture
def lying(stand_in: StandIn) -> StandIn:
    stand_in.routes, stand_in.requests = {}, []
    return stand_in


def _url(server: StandIn) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _one_sentence(result: Any, *words: str) -> str:
    everything = result.stdout + result.stderr
    assert result.returncode not in (0, 1) and "Traceback" not in everything, everything
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _endless(handler: BaseHTTPRequestHandler) -> None:
    """200 with no length, then zeros until the client hangs up."""
    handler.send_response(200)
    handler.send_header("Connection", "close")
    handler.end_headers()
    chunk = b"0" * (1 << 20)
    try:
        while True:
            handler.wfile.write(chunk)
    except OSError:
        pass


SWITCHED = {"model": "/m", "key_id": "abc", "key": None}
GOOD_SWITCH = {"object": "weights_switch", "previous": SWITCHED, "current": SWITCHED, "attach": {"daemon": "d"},
               "switch_ms": 1.5}
SWITCH_ANSWERS: dict[str, tuple[Answer, str]] = {
    "no previous or current": ((200, b'{"object": "weights_switch"}'), "previous"),
    "switch_ms a string": ((200, json.dumps({**GOOD_SWITCH, "switch_ms": "fast"}).encode()), "switch_ms"),
    "switch_ms 1e400": ((200, json.dumps(GOOD_SWITCH).replace("1.5", "1e400").encode()), "without JSON"),
    "key_id a number": ((200, json.dumps({**GOOD_SWITCH, "current": {"key_id": 7}}).encode()), "key_id"),
    "deep JSON": ((200, b"[" * 200_000 + b"]" * 200_000), "without JSON"),
    "not JSON": ((200, b"<html>"), "without JSON"),
    "a list": ((200, b"[1, 2]"), "other than a JSON object"),
    "a megabyte of error": ((500, json.dumps({"error": {"message": "no " * 350_000}}).encode()), "no no"),
    "an announced gigabyte": ((200, b"{}"), "larger than"),  # Content-Length rewritten below
    "an endless answer": (_endless, "larger than"),
}


@pytest.mark.parametrize("case", list(SWITCH_ANSWERS))
def test_switch_against_a_lying_engine_is_one_sentence(lying: StandIn, case: str) -> None:
    answer, words = SWITCH_ANSWERS[case]
    if case == "an announced gigabyte":
        def announced(handler: BaseHTTPRequestHandler) -> None:
            handler.send_response(200)
            handler.send_header("Content-Length", str(1 << 30))
            handler.end_headers()
            handler.wfile.write(b"{}")
        answer = announced
    lying.routes["POST /v1/weights"] = answer
    result = wcache_in_process("switch", _url(lying), "--daemon", "cpu-0", env=cli_env())
    line = _one_sentence(result, words)
    assert len(line) < 500, line
    assert lying.requests == ["POST /v1/weights"], lying.requests


def test_a_good_switch_answer_is_printed(lying: StandIn) -> None:
    """Guards the cases above: the answer they start from is read."""
    lying.routes["POST /v1/weights"] = (200, json.dumps(GOOD_SWITCH).encode())
    result = wcache_in_process("switch", _url(lying), "--daemon", "cpu-0", env=cli_env())
    assert result.returncode == 0 and "SWITCHED" in result.stdout and "1.5 ms" in result.stdout, result


def test_an_answer_dripped_a_byte_at_a_time_ends_at_the_time_cap(lying: StandIn) -> None:
    stop = threading.Event()

    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not stop.wait(0.3):  # a byte now and then, so no single read ever times out
            try:
                handler.wfile.write(b"X")
                handler.wfile.flush()
            except OSError:
                return

    lying.routes["GET /drip"] = drip
    began = time.monotonic()
    try:
        with pytest.raises(NoAnswerError, match=r"within 1\.5 s"):
            http_call(f"{_url(lying)}/drip", timeout=1.5)
    finally:
        stop.set()
    assert time.monotonic() - began < 5


# -- verify URL --greedy: the engine's claim and completions ------------------------------------------------


@pytest.fixture(scope="module")
def claim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("lying") / "tiny")
    key = compute_key(model, PlanSpec()).key
    return {"object": "weights", "model": str(model), "key": key.to_json(), "key_id": key.short_id,
            "plan": PlanSpec().to_json(), "tp_size": 1, "device": "cpu",
            "engine_config": {"block_size": 16, "num_blocks": 64}, "attach": None}


def _completion(claim: dict[str, Any], **changes: Any) -> bytes:
    answer = {"choices": [{"index": 0, "text": "", "token_ids": [1, 2]}],
              "wcache": {"hit_tokens": 0, "weights_key": claim["key_id"]}}
    answer.update(changes)
    return json.dumps(answer).encode()


CONFIG_LIES = {"block_size 0": {"block_size": 0}, "block_size -16": {"block_size": -16},
               "num_blocks 10**12": {"num_blocks": 10**12}, "num_blocks a string": {"num_blocks": "many"}}


@pytest.mark.parametrize("case", list(CONFIG_LIES))
def test_verify_allocates_nothing_from_a_lying_cache_config(lying: StandIn, claim: dict[str, Any], case: str,
                                                            tmp_path: Path) -> None:
    document = {**claim, "engine_config": {**claim["engine_config"], **CONFIG_LIES[case]}}
    lying.routes["GET /v1/weights"] = (200, json.dumps(document).encode())
    result = wcache_in_process("verify", _url(lying), "--greedy", "--num-prompts", "1",
                               env=cli_env(tmp_path / "cache"))
    _one_sentence(result, "does not read", next(iter(CONFIG_LIES[case])))
    assert not [r for r in lying.requests if r.startswith("POST")], lying.requests


COMPLETION_LIES: dict[str, tuple[Callable[[dict[str, Any]], bytes], str]] = {
    "choices missing": (lambda c: json.dumps({"wcache": {"weights_key": c["key_id"]}}).encode(), "choices"),
    "choices empty": (lambda c: _completion(c, choices=[]), "choices"),
    "hit_tokens abc": (lambda c: _completion(c, wcache={"hit_tokens": "abc", "weights_key": c["key_id"]}),
                       "hit_tokens"),
    "hit_tokens 1e400": (lambda c: _completion(c).replace(b'"hit_tokens": 0', b'"hit_tokens": 1e400'),
                         "without JSON"),
    "token ids negative": (lambda c: _completion(c, choices=[{"token_ids": [-1]}]), "token_ids"),
}


PROMPT = "hello"  # the one prompt verify sends the stand-in, which answers /tokenize with its true ids


def _verify_one_prompt(lying: StandIn, claim: dict[str, Any], tmp_path: Path) -> Any:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n")
    return wcache_in_process("verify", _url(lying), "--greedy", "--prompts", str(prompts),
                             env=cli_env(tmp_path / "cache"))


def _tokenized(claim: dict[str, Any], **changes: Any) -> bytes:
    tokens = load_tokenizer(Path(claim["model"])).encode(PROMPT)
    return json.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": 1024, **changes}).encode()


@pytest.mark.parametrize("case", list(COMPLETION_LIES))
def test_verify_against_lying_completions_is_one_sentence(lying: StandIn, claim: dict[str, Any], case: str,
                                                          tmp_path: Path) -> None:
    make, words = COMPLETION_LIES[case]
    lying.routes["GET /v1/weights"] = (200, json.dumps(claim).encode())
    lying.routes["POST /tokenize"] = (200, _tokenized(claim))
    lying.routes["POST /v1/completions"] = (200, make(claim))
    _one_sentence(_verify_one_prompt(lying, claim, tmp_path), words)


TOKENIZE_LIES: dict[str, tuple[Callable[[dict[str, Any]], Answer], str]] = {
    "no /tokenize": (lambda c: (404, b'{"detail": "Not Found"}'), "no /tokenize route"),
    "tokens missing": (lambda c: (200, b'{"count": 1, "max_model_len": 9}'), "tokens"),
    "tokens negative": (lambda c: (200, _tokenized(c, tokens=[-1])), "tokens"),
    "tokens a string": (lambda c: (200, _tokenized(c, tokens="104")), "tokens"),
    "detokenize prompt a number": (lambda c: (200, _tokenized(c)), "prompt"),
}


@pytest.mark.parametrize("case", list(TOKENIZE_LIES))
def test_verify_against_a_lying_tokenizer_route_is_one_sentence(lying: StandIn, claim: dict[str, Any], case: str,
                                                                tmp_path: Path) -> None:
    make, words = TOKENIZE_LIES[case]
    lying.routes["GET /v1/weights"] = (200, json.dumps(claim).encode())
    lying.routes["POST /tokenize"] = make(claim)
    lying.routes["POST /v1/completions"] = (200, _completion(claim))
    lying.routes["POST /detokenize"] = (200, b'{"prompt": 7}')
    _one_sentence(_verify_one_prompt(lying, claim, tmp_path), words)


# -- a served vLLM whose /pause fails -----------------------------------------------------------------------


def _dev_mode_vllm_routes(model: Path, run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """What a dev-mode vLLM 0.32 on `--load-format wcache` answers for `model` before a switch pauses it."""
    config = {"model_config": {"model": str(model), "tokenizer": str(model), "dtype": "torch.float32",
                               "max_model_len": 128},
              "load_config": {"load_format": "wcache", "model_loader_extra_config": {"run_dir": str(run_dir)}},
              "parallel_config": {"tensor_parallel_size": 1}, "device_config": {"device": "cpu"}}
    return {
        "GET /version": (200, b'{"version": "0.32.0"}'),
        "GET /server_info": (200, json.dumps({"vllm_config": config}).encode()),
        "GET /v1/models": (200, b'{"data": [{"id": "tiny"}]}'),
        "GET /weight_info": (200, b'{"weight_version": null}'),
    }


def test_a_vllm_pause_answered_with_500_is_still_followed_by_resume(lying: StandIn) -> None:
    """The pause may have taken effect before the server failed: a switch that stops there must resume it."""
    with daemon_rig() as rig:
        model = write_checkpoint("tiny", rig.base / "tiny")
        rig.publish_stand_in()  # a live daemon of the engine's device and TP size, so the switch gets to /pause
        lying.routes.update({
            **_dev_mode_vllm_routes(model, rig.run_dir),
            "POST /pause": (500, b'{"error": "the engine core died while pausing"}'),
            "POST /resume": (200, b"{}"),
        })
        result = wcache_in_process("switch", _url(lying), str(model), env={**cli_env(), **rig.env})
        _one_sentence(result, "died while pausing")
        assert lying.requests[-2:] == ["POST /pause", "POST /resume"], lying.requests


# -- a served vLLM asked to switch to weights beside another tokenizer --------------------------------------


def test_a_vllm_switch_to_another_tokenizer_is_refused_by_name(lying: StandIn) -> None:
    """vLLM keeps the tokenizer it started with across a reload: the same tensors and config beside tokenizer
    files of their own would be served through the old one, so the switch is refused before anything is paused."""
    with daemon_rig() as rig:
        model = write_checkpoint("tiny", rig.base / "tiny")
        retokenized = rig.base / "retokenized"
        shutil.copytree(model, retokenized)
        write_byte_tokenizer(retokenized, PRESETS["tiny"].config)
        rig.publish_stand_in()  # a live daemon of the engine's device and TP size, so the switch gets to its checks
        lying.routes.update(_dev_mode_vllm_routes(model, rig.run_dir))
        result = wcache_in_process("switch", _url(lying), str(retokenized), env={**cli_env(), **rig.env})
        _one_sentence(result, "tokenizer.json, tokenizer_config.json differ", "start a new engine")
        assert not [r for r in lying.requests if r in ("POST /pause", "POST /collective_rpc")], lying.requests
