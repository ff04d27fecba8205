"""Serving a real vLLM (the CPU build) in tests: its OpenAI server through the wcache load format, with vLLM's
dev endpoints, in a session of its own that is stopped (then killed, engine core and workers included) however
a test ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from daemon_fixtures import DaemonRig, http_status, wait_for
from helpers import free_port
from wcache.vllm_served import DEV_MODE

SERVER_START_S = 240.0
SERVED_NAME = "small"


def healthy(url: str) -> bool:
    try:
        return http_status(url, timeout=2)[0] == 200
    except OSError:  # not listening yet
        return False


@dataclass
class ServedVllm:
    url: str
    log: Path
    process: subprocess.Popen[bytes]

    def complete(self, prompt: str, max_tokens: int) -> list[int]:
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == max_tokens, completion
        return list(completion["choices"][0]["token_ids"])


@contextlib.contextmanager
def serving_vllm(rig: DaemonRig, model: Path, extra: dict[str, object], log_name: str = "vllm-server.log",
                 env: dict[str, str] | None = None) -> Iterator[ServedVllm]:
    """vLLM's OpenAI server on `model` through the wcache load format (`extra`: its extra config), on
    127.0.0.1, serving the model as "small", until the block ends."""
    port = free_port()
    log_path = rig.base / log_name
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--port", str(port), "--host", "127.0.0.1", "--load-format", "wcache",
               "--model-loader-extra-config", json.dumps(extra), "--enforce-eager",
               "--max-model-len", "512", "--served-model-name", SERVED_NAME]
    environment = {**os.environ, **rig.env, "VLLM_CPU_KVCACHE_SPACE": "1", DEV_MODE: "1", **(env or {})}
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=environment, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: server.poll() is not None or healthy(f"{base}/health"),
                 timeout=SERVER_START_S, interval=1.0, what="the vLLM server to come up")
        assert server.poll() is None, log_path.read_text()[-3000:]
        yield ServedVllm(base, log_path, server)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # vLLM's engine core and workers share its session
