"""Switch a served reference engine to another checkpoint in place, against restarting it on that checkpoint.

Two versions of one preset (other random weights, same config) are preloaded into two daemons; one
`wcache attach MODEL --serve` engine serves them. Each run measures, from the moment a client asks for the
other version to the first token generated on it:

- switch: `POST /v1/weights` (the engine attaches the other daemon's weights and swaps them in between
  requests), then a completion of one token;
- restart: SIGTERM the engine, start `wcache attach OTHER --serve` (a fresh process: imports, attach, engine),
  wait for its SERVING line, then the same completion.

Both sides hit a daemon: the restart row is a restart that wcache already made cheap, not a disk load. The
first token of the engine already serving (no switch) is printed beside them; the greedy tokens after a
switch are checked against those after a restart (the same weights must answer the same).

    .venv/bin/python benchmarks/switch.py [--preset qwen3-0.6b] [--repeat 3]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from bench_common import fmt_seconds, preload_arguments, stop_preloaded, timed_preload, workspace
from wcache.serving.credentials import control_token
from wcache_dev.synth import write_checkpoint

SERVING = re.compile(r"SERVING (http://127\.0\.0\.1:\d+)/v1/completions")
PROMPT = "Hello"  # short: the first token measures the switch, not a long prefill on a CPU
START_TIMEOUT_S = 300.0


def cli() -> list[str]:
    # This interpreter's wcache (the checkout on PYTHONPATH), not whichever console script is installed.
    return [sys.executable, "-m", "wcache_cli.main"]


def post(url: str, route: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}{route}", data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=START_TIMEOUT_S) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def first_token(url: str) -> list[int]:
    answer = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    return list(answer["choices"][0]["token_ids"])


class Engine:
    """One `wcache attach MODEL --serve --port 0` process; its URL once it says SERVING."""

    def __init__(self, model: Path, env: dict[str, str], run_dir: Path) -> None:
        self.process = subprocess.Popen([*cli(), "attach", str(model), "--serve", "--port", "0", "--run-dir",
                                         str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        stdin=subprocess.DEVNULL, text=True, env=env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        for line in self.process.stdout:
            if match := SERVING.search(line):
                self.url = match.group(1)
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"the engine on {model} did not start serving")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def main() -> None:
    parser = preload_arguments(__doc__.split("\n", 1)[0])
    parser.set_defaults(repeat=3)
    args = parser.parse_args()
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        env = {**os.environ, "WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(work / "cache")}
        versions = [write_checkpoint(args.preset, work / f"v{seed}", seed=seed) for seed in (0, 1)]
        spawned: list[psutil.Process] = []
        engine: Engine | None = None
        try:
            for model in versions:
                timed_preload([*cli(), "preload", str(model), "--detach", "--json", "--plan", args.plan, "--run-dir",
                               str(run_dir)], env, run_dir, spawned)
            engine = Engine(versions[0], env, run_dir)
            serving = 0
            steady, switches, restarts, switch_ms = [], [], [], []
            tokens: dict[str, dict[int, list[int]]] = {"switch": {}, "restart": {}}
            first_token(engine.url)  # warm: the first request of a process pays for lazy set-up
            for _ in range(args.repeat):
                began = time.perf_counter()
                first_token(engine.url)
                steady.append(time.perf_counter() - began)

                other = 1 - serving
                # The engine's control token, as `wcache switch` finds it (read before the clock starts).
                token = control_token(engine.url, run_dir)
                began = time.perf_counter()
                result = post(engine.url, "/v1/weights", {"model": str(versions[other])}, token)
                tokens["switch"][other] = first_token(engine.url)
                switches.append(time.perf_counter() - began)
                switch_ms.append(result["switch_ms"] / 1000)
                serving = other

                other = 1 - serving
                began = time.perf_counter()
                engine.stop()
                engine = Engine(versions[other], env, run_dir)
                tokens["restart"][other] = first_token(engine.url)
                restarts.append(time.perf_counter() - began)
                serving = other
            same = all(tokens["switch"][v] == tokens["restart"][v] for v in tokens["switch"] if v in tokens["restart"])
        finally:
            if engine is not None:
                engine.stop()
            for line in stop_preloaded(cli(), run_dir, spawned):
                print(line, file=sys.stderr)
    switch, restart = statistics.median(switches), statistics.median(restarts)
    print(f"preset {args.preset}, plan {args.plan}, median of {args.repeat}; request → first token on the other "
          "version")
    print(f"{'what':<58} {'time':>12}")
    print(f"{'first token, engine already serving that version':<58} {fmt_seconds(statistics.median(steady)):>12}")
    print(f"{'switch in place (POST /v1/weights, then first token)':<58} {fmt_seconds(switch):>12}")
    print(f"{'  of which the switch itself (attach + swap)':<58} {fmt_seconds(statistics.median(switch_ms)):>12}")
    print(f"{'restart (SIGTERM, new attach --serve on a hit, first token)':<58} {fmt_seconds(restart):>12}")
    print(f"switch is {restart / switch:,.1f}× faster than a restart; tokens after a switch equal those after a "
          f"restart: {same}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    if not same:
        raise SystemExit("the switched engine answered other tokens than the restarted one")


if __name__ == "__main__":
    main()
