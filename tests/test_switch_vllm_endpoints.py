"""`wcache switch URL` and `wcache verify URL` against servers that are not what they should be, without starting
an engine: a stand-in HTTP server answers as vLLM 0.32's OpenAI server does without VLLM_SERVER_DEV_MODE (GET
/version, 404 elsewhere), as no engine at all, or as a reference engine whose `/v1/weights` is forged. Each
time: one sentence, exit 3, and nothing that would change weights is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import serving_in_thread, wcache_process
from wcache.key.compute import compute_key
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import write_checkpoint


class StandIn(ThreadingHTTPServer):
    version: str | None
    weights: dict[str, Any] | None  # GET /v1/weights answers this, as a reference engine does
    requests: list[str]


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        if self.path == "/version" and self.server.version is not None:
            status, body = 200, {"version": self.server.version}
        elif self.path == "/v1/weights" and self.server.weights is not None:
            status, body = 200, self.server.weights
        else:
            status, body = 404, {"detail": "Not Found"}  # FastAPI's answer for a route it lacks
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn(("127.0.0.1", 0), Handler)
    server.version, server.weights, server.requests = "0.32.0", None, []
    with serving_in_thread(server):
        yield server


def _url(server: StandIn) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_a_vllm_server_without_dev_mode_is_told_how_to_start(stand_in: StandIn, tmp_path: Path) -> None:
    model = write_checkpoint("tiny", tmp_path / "tiny")
    result = wcache_process("switch", _url(stand_in), str(model))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "VLLM_SERVER_DEV_MODE=1" in result.stderr and "keeps its weights" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not [r for r in stand_in.requests if "/collective_rpc" in r or "/pause" in r], stand_in.requests


def test_a_server_that_is_no_engine_is_named_so(stand_in: StandIn, tmp_path: Path) -> None:
    stand_in.version = None
    model = write_checkpoint("tiny", tmp_path / "tiny")
    result = wcache_process("switch", _url(stand_in), str(model))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "neither a wcache reference engine" in result.stderr and "nor a vLLM server" in result.stderr


def test_a_reference_engine_whose_attach_report_is_forged_is_named_so(stand_in: StandIn, tmp_path: Path) -> None:
    """The report in /v1/weights is read by its schema: a field it does not have is named, not trusted."""
    model = write_checkpoint("tiny", tmp_path / "tiny")
    key = compute_key(model, PlanSpec()).key
    report = {"outcome": "hit", "mode": "zero-copy", "device": "cpu", "key_id": key.short_id, "daemon": "cpu-x",
              "daemon_key_id": key.short_id, "reason": None, "mismatched": [], "diff": None, "timings_ms": {},
              "bytes_mapped": 1, "num_tensors": 1, "daemon_lost": False, "verified_by": "trust me"}
    stand_in.weights = {"object": "weights", "model": str(model), "key": key.to_json(), "key_id": key.short_id,
                        "plan": PlanSpec().to_json(), "tp_size": 1, "device": "cpu", "engine_config": {},
                        "attach": report}
    result = wcache_process("verify", _url(stand_in), "--greedy", "--num-prompts", "1")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "describes its weights in a form wcache does not read" in result.stderr, result.stderr
    assert "verified_by" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not [r for r in stand_in.requests if r.startswith("POST")], stand_in.requests
