"""vLLM (CPU build): switching a running engine to another checkpoint's daemon, against restarting it there.

Two versions of the preset (other random weights, same config) in two daemons. In one run:

* switch: one offline `LLM(load_format="wcache")` process, started once; each repeat times
  `wcache.integrations.vllm.switch.switch(llm, OTHER)` and a one-token generation on the other version;
* restart: each repeat times a fresh process from start to the same one token, `LLM(OTHER,
  load_format="wcache")` on a hit (process start, imports, engine core, weight attach, KV cache, warm-up).

and the same for the OpenAI server (`python -m vllm.entrypoints.openai.api_server --load-format wcache`, with
VLLM_SERVER_DEV_MODE=1), request to first token:

* served switch: one server, started once; each repeat times `wcache switch URL OTHER` (pause, update_config
  and reload_weights through /collective_rpc, prefix-cache reset, resume) and a one-token completion;
* served restart: each repeat times a fresh server on OTHER, from its start to the same one-token completion.

The tokens after each switch must equal those of the restart on the same version (asserted). Medians of
``--repeat``. Run under the vLLM lock where other jobs start engines::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_switch.py            # small, 3 repeats
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_switch.py --preset qwen3-0.6b --repeat 2
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_switch.py --rows served   # the server's only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from bench_common import fmt_seconds, workspace
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.runner import DEFAULT_KV_CACHE_GIB, VllmRun, greedy_tokens
from wcache.vllm_served import DEV_MODE, switch_served, vllm_version
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint

PROMPT = "the weights cache keeps"
SWITCHING = r"""
import json, sys, time

def main():
    versions, run_dir, repeat, prompt = sys.argv[1:3], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    from vllm import LLM, SamplingParams
    from wcache.integrations.vllm.switch import switch

    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm = LLM(versions[0], load_format="wcache", model_loader_extra_config={"run_dir": run_dir, "fallback": False},
              max_model_len=256, enforce_eager=True, seed=0)
    llm.generate([prompt], params, use_tqdm=False)
    runs = []
    for n in range(repeat):
        other = (n + 1) % 2
        began = time.perf_counter()
        switch(llm, versions[other])
        switched = time.perf_counter()
        tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        runs.append({"version": other, "switch_s": switched - began, "total_s": time.perf_counter() - began,
                     "tokens": tokens})
    print("RESULT " + json.dumps(runs), flush=True)

if __name__ == "__main__":
    main()
"""


SERVER_START_S = 600.0


@contextlib.contextmanager
def server(model: Path, run_dir: Path) -> Iterator[str]:
    """A vLLM OpenAI server on `model` (dev endpoints on, wcache load format); its URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    extra = json.dumps({"run_dir": str(run_dir), "fallback": False})
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
         "--host", "127.0.0.1", "--load-format", "wcache", "--model-loader-extra-config", extra, "--enforce-eager",
         "--max-model-len", "256", "--served-model-name", "bench"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env={**os.environ, DEV_MODE: "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the vLLM server on {model} exited with {process.returncode}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the vLLM server on {model} did not come up in {SERVER_START_S:.0f} s")
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(psutil.Error):
            family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its engine core and workers share its session
        process.wait()
        # Gone, worker included, before the daemons are stopped: a worker still dying holds its lease.
        psutil.wait_procs(family, timeout=60)


def first_token(url: str) -> list[int]:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return list(json.loads(response.read())["choices"][0]["token_ids"])


def served_rows(versions: list[Path], run_dir: Path, repeat: int) -> dict[str, Any]:
    """Served switch (`switch_served` and one token) against a server restart on the other version."""
    switches, restarts, tokens = [], [], {}
    with server(versions[0], run_dir) as url:
        first_token(url)
        version = vllm_version(url)
        for n in range(repeat):
            other = (n + 1) % 2
            began = time.perf_counter()
            result = switch_served(url, version, versions[other], None)
            switched = time.perf_counter()
            answered = first_token(url)
            if not result["attach"]["confirmed"]:
                raise SystemExit(f"the switch to {versions[other]} was not confirmed by an attach event: {result}")
            switches.append({"version": other, "switch_s": switched - began, "total_s": time.perf_counter() - began,
                             "tokens": answered})
    for n in range(repeat):
        other = (n + 1) % 2
        began = time.perf_counter()
        with server(versions[other], run_dir) as url:
            tokens[other] = first_token(url)
            restarts.append(time.perf_counter() - began)
    return {"switches": switches, "restarts": restarts, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rows", choices=("all", "offline", "served"), default="all",
                        help="offline LLM rows, the OpenAI server's, or both")
    args = parser.parse_args()
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
        versions = []
        for seed in (0, 1):
            path = write_checkpoint(args.preset, work / f"v{seed}", seed=seed)
            if not PRESETS[args.preset].tokenizer:
                write_byte_tokenizer(path, PRESETS[args.preset].config)  # vLLM needs one to take text
            versions.append(path)
        groups = [start_daemons(path, run_dir=run_dir) for path in versions]
        try:
            offline = offline_rows(versions, run_dir, args.repeat) if args.rows != "served" else None
            served = served_rows(versions, run_dir, args.repeat) if args.rows != "offline" else None
        finally:
            for group in groups:
                group.stop(force=True)  # every engine this run started is gone; a lease may lag its death
    print(f"vLLM CPU, preset {args.preset}, median of {args.repeat}; request → first token on the other version")
    same = _print_offline(offline) if offline is not None else True
    if served is not None:
        same = _print_served(served) and same
    if not same:
        raise SystemExit("the switched engine answered other tokens than the restarted one")


def offline_rows(versions: list[Path], run_dir: Path, repeat: int) -> dict[str, Any]:
    """Offline switch (`switch()` and one token, one process) against a fresh process on the other version."""
    child = subprocess.run([sys.executable, "-c", SWITCHING, *map(str, versions), str(run_dir), str(repeat), PROMPT],
                           capture_output=True, text=True, check=False)
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode != 0 or not lines:
        raise SystemExit(f"the switching engine failed: {child.stderr[-2000:]}")
    restarts, tokens = [], {}
    extra = {"run_dir": str(run_dir), "fallback": False}
    for n in range(repeat):
        version = (n + 1) % 2
        began = time.perf_counter()
        result = greedy_tokens(VllmRun(str(versions[version]), [PROMPT], 1, load_format="wcache",
                                       extra_config=extra, max_model_len=256))
        restarts.append(time.perf_counter() - began)
        tokens[version] = result.tokens[0]
    return {"switches": json.loads(lines[-1].removeprefix("RESULT ")), "restarts": restarts, "tokens": tokens}


def _print_offline(offline: dict[str, Any]) -> bool:
    switches, tokens = offline["switches"], offline["tokens"]
    same = all(run["tokens"] == tokens[run["version"]] for run in switches if run["version"] in tokens)
    switch = statistics.median(run["total_s"] for run in switches)
    reload = statistics.median(run["switch_s"] for run in switches)
    restart = statistics.median(offline["restarts"])
    print(f"{'switch in place (switch(), then one token)':<52} {fmt_seconds(switch):>10}")
    print(f"{'  of which switch() (attach, reload, prefix reset)':<52} {fmt_seconds(reload):>10}")
    print(f"{'restart (new process, LLM on a hit, one token)':<52} {fmt_seconds(restart):>10}")
    print(f"switch is {restart / switch:,.1f}× faster than a restart; tokens equal: {same}")
    return same


def _print_served(served: dict[str, Any]) -> bool:
    """The served rows; whether the switched server answered as the restarted one on each version."""
    switches, tokens = served["switches"], served["tokens"]
    same = all(run["tokens"] == tokens[run["version"]] for run in switches if run["version"] in tokens)
    switch = statistics.median(run["total_s"] for run in switches)
    print(f"{'served switch (wcache switch URL, then one token)':<52} {fmt_seconds(switch):>10}")
    print(f"{'  of which the switch (pause … resume, confirmed)':<52} "
          f"{fmt_seconds(statistics.median(run['switch_s'] for run in switches)):>10}")
    restart = statistics.median(served["restarts"])
    print(f"{'served restart (new server on a hit, one token)':<52} {fmt_seconds(restart):>10}")
    print(f"served switch is {restart / switch:,.1f}× faster than a server restart; tokens equal: {same}")
    return same


if __name__ == "__main__":
    main()
