"""Serving the reference engine in tests: `wcache attach MODEL --serve --port 0` as a subprocess of its own
session, killed however a test ends, and small readers of its HTTP API (/metrics, POST routes)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from daemon_fixtures import DaemonRig, http_status
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
SERVING = re.compile(rb"SERVING (http://127\.0\.0\.1:\d+)/v1/completions")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    stderr: Path
    run_dir: Path

    def token(self) -> str:
        """The engine's control token, read as its user reads it: from its file in the run dir."""
        return (self.run_dir / "engines" / f"{self.process.pid}.token").read_text().strip()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> int:
        """SIGTERM, as a service manager would; the exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def serving(rig: DaemonRig, model: Path, *options: str, prelude: str = "") -> Iterator[Server]:
    """`wcache attach MODEL --serve --port 0` until the block ends; killed (whole session) however it ends.
    `prelude`: Python statements the server's process runs first (an engine altered in memory)."""
    stderr = rig.base / f"serve-{len(list(rig.base.glob('serve-*.err')))}.err"
    entry = ["-c", f"{prelude}\nfrom wcache_cli.main import main\nmain()"] if prelude else ["-m", "wcache_cli.main"]
    with open(stderr, "wb") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                *entry,
                "attach",
                str(model),
                "--serve",
                "--port",
                "0",
                "--run-dir",
                str(rig.run_dir),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **rig.env},
            start_new_session=True,
        )
    try:
        yield Server(process, _read_url(process, stderr), stderr, rig.run_dir)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT_S)
        assert process.stdout is not None
        process.stdout.close()


def _read_url(process: subprocess.Popen[bytes], stderr: Path) -> str:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (match := SERVING.search(seen)) is None:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            why = "exited" if process.poll() is not None else f"printed no SERVING line in {START_TIMEOUT_S} s"
            raise AssertionError(f"the server {why}; stdout {seen!r}; stderr {stderr.read_text()!r}")
        seen += chunk
    return match.group(1).decode()


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, read with prometheus_client's text parser."""
    code, text = http_status(f"{url}/metrics")
    assert code == 200 and isinstance(text, str)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def post(url: str, body: bytes, route: str = "/v1/completions", token: str | None = None) -> tuple[int, Any]:
    """POST `body` to `route` (with the control `token` when given); the status and the JSON answer, whether 2xx
    or not."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}{route}", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
