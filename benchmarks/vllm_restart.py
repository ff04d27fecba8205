"""A served vLLM (CPU build) killed with SIGKILL, then back to its first completion: what operators time.

For the ``--preset`` checkpoint (qwen3-0.6b: the real shape) and one daemon preloaded with
``wcache.start_daemons``, each repeat runs three rows, interleaved. Each row starts an OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, ``--enforce-eager``, 1 GiB of KV cache), waits for its first
completion, kills its whole process group with SIGKILL and times the restart from the kill to the new
server's first completion (greedy, 4 tokens; every row's tokens must equal `auto`'s):

* auto: a plain server with vLLM's default loader (``--load-format auto``), started as users start it;
* hit: the same with ``--load-format wcache`` (the daemon holds the weights);
* warm: the hit's server started by ``wcache.integrations.vllm.warm.WarmStarter``: forked from a zygote
  that imported vLLM, its engine core and CPU workers forked by a forkserver that imported what they import
  (its one-time ``prepare`` is timed apart).

The warm restart is also set against what no start-up can skip, measured in that same server: vLLM's engine
initialisation (its log's ``init engine (profile, create kv cache, warmup model) took``), the weight phase
(wcache's ``load_model``: the model's build, the attach and vLLM's post-processing) and the completion's own
compute (the same completion asked again once the server is up). Medians of ``--repeat``; the ratio to that
sum also as the median of each repeat's own ratio (its rows share one machine load). Run under the vLLM
lock where other jobs start engines::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_restart.py               # qwen3-0.6b, TP 1
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_restart.py --tp 2   # VLLM_CPU_OMP_THREADS_BIND=0|1
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_restart.py --preset small --repeat 2
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from bench_common import benchmark_arguments, fmt_seconds, speed_ratio, workspace
from rich.console import Console
from rich.table import Table
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.warm import WarmStarter
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint

ROWS = ("auto", "hit", "warm")
PROMPT = "the weights cache keeps"
MAX_TOKENS = 4
SERVER_START_S = 900.0
# vLLM's own line for its engine initialisation (KV cache, profile and warm-up), and wcache's weight phase.
_INIT_ENGINE_S = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_LOAD_MS = re.compile(r"wcache: .*[(; ]([\d.]+) ms, post-processing included\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_argv(row: str, model: Path, port: int, run_dir: Path, tp: int) -> list[str]:
    argv = ["--model", str(model), "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
            "--max-model-len", "512", "--served-model-name", "bench", "--tensor-parallel-size", str(tp)]
    if row != "auto":
        argv += ["--load-format", "wcache", "--model-loader-extra-config",
                 json.dumps({"run_dir": str(run_dir), "fallback": False})]
    return argv


def start_server(row: str, argv: list[str], env: dict[str, str], log_path: Path, starter: WarmStarter) -> Any:
    """A server process (`Popen`, or the warm starter's) with `.pid` and `.poll()`."""
    if row == "warm":
        return starter.start(argv, env, log_path)
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def first_completion(url: str, process: Any, log_path: Path) -> list[int]:
    """Ask for a greedy completion until the server gives one; its tokens."""
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "return_token_ids": True}).encode()
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the vLLM server exited with {process.poll()}; its log: {log_path}")
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return list(json.loads(response.read())["choices"][0]["token_ids"])
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise SystemExit(f"the vLLM server gave no completion in {SERVER_START_S:.0f} s; its log: {log_path}")


def kill_server(process: Any) -> None:
    """SIGKILL the server's process group (front, engine core, workers) and wait until none of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_members(pgid: int) -> list[int]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
    return members


def unavoidable(log_text: str, tp: int) -> tuple[float, float]:
    """vLLM's engine initialisation and the weight phase (its slowest rank) of one start's log, seconds."""
    inits = [float(m.group(1)) for m in _INIT_ENGINE_S.finditer(log_text)]
    loads = [float(m.group(1)) / 1000 for m in _LOAD_MS.finditer(log_text)]
    if len(inits) != 1 or len(loads) != tp:
        raise SystemExit("the server's log lacks vLLM's engine initialisation line or a rank's wcache load line")
    return inits[0], max(loads)


def _mark(log: Path, what: str) -> None:
    """A line with the wall-clock time (ms) in the server's log, to place vLLM's own (second-resolution) lines."""
    now = time.time()
    with log.open("a") as f:
        f.write(f"benchmark {time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d}: {what}\n")


def restart(row: str, argv: list[str], url: str, env: dict[str, str], logs: Path, starter: WarmStarter
            ) -> tuple[float, list[int], Path, float]:
    """Start a server, wait for its first completion, kill it, and time its restart; seconds, tokens, log, and
    the seconds of the same completion asked again of the restarted server (its compute, once it is up)."""
    victim_log, log = logs / f"{row}-victim.log", logs / f"{row}-restart.log"
    victim = start_server(row, argv, env, victim_log, starter)
    try:
        first_completion(url, victim, victim_log)
    finally:
        kill_server(victim)
    log.unlink(missing_ok=True)  # one start a log: its lines are the ones read back
    _mark(log, "killed; restarting")
    began = time.perf_counter()
    server = start_server(row, argv, env, log, starter)
    try:
        tokens = first_completion(url, server, log)
        seconds = time.perf_counter() - began
        _mark(log, f"first completion, {seconds:.2f} s after the start")
        again = time.perf_counter()
        assert first_completion(url, server, log) == tokens, "a second greedy completion must repeat the first"
        return seconds, tokens, log, time.perf_counter() - again
    finally:
        kill_server(server)


def main() -> None:
    parser = benchmark_arguments(__doc__ or "")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor parallel size (1)")
    args = parser.parse_args()
    console = Console()
    with workspace(args.workdir) as work:
        run_dir, logs = work / "run", work / "logs"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        logs.mkdir(exist_ok=True)
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        model = write_checkpoint(args.preset, work / args.preset)
        if not (model / "tokenizer.json").exists():  # vLLM needs one; the byte-level one fits any of our presets
            write_byte_tokenizer(model, PRESETS[args.preset].config)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        if args.tp == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        group = start_daemons(model, run_dir=run_dir, tp=args.tp)
        starter = WarmStarter(zygote_log=logs / "zygote.log", env=env)
        samples: dict[str, list[float]] = {row: [] for row in (*ROWS, "init", "load", "completion",
                                                                  "warm_over_floor")}
        try:
            began = time.perf_counter()
            starter.prepare()
            prepare_s = time.perf_counter() - began
            console.print(f"warm starter prepared in {prepare_s:.1f} s (once: the zygote's and forkserver's imports)")
            for i in range(args.repeat):
                tokens: dict[str, list[int]] = {}
                for row in ROWS:
                    port = free_port()
                    argv = server_argv(row, model, port, run_dir, args.tp)
                    seconds, tokens[row], log, completion = restart(row, argv, f"http://127.0.0.1:{port}", env,
                                                                    logs, starter)
                    samples[row].append(seconds)
                    if row == "warm":
                        samples["completion"].append(completion)
                        init, load = unavoidable(log.read_text(errors="replace"), args.tp)
                        samples["init"].append(init)
                        samples["load"].append(load)
                assert tokens["hit"] == tokens["auto"] == tokens["warm"], f"tokens differ from auto's: {tokens}"
                floor_s = samples["init"][-1] + samples["load"][-1] + samples["completion"][-1]
                samples["warm_over_floor"].append(samples["warm"][-1] / floor_s)
                console.print(f"repeat {i + 1}: auto {samples['auto'][-1]:.1f} s, hit {samples['hit'][-1]:.1f} s, "
                              f"warm {samples['warm'][-1]:.1f} s (engine init {samples['init'][-1]:.2f} s, "
                              f"weights {samples['load'][-1]:.2f} s, completion {samples['completion'][-1]:.2f} s: "
                              f"warm is {samples['warm_over_floor'][-1]:.2f}× their sum); tokens {tokens['auto']}")
        finally:
            starter.close()
            group.stop(force=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    floor = med["init"] + med["load"] + med["completion"]
    table = Table(title=f"vLLM CPU server, SIGKILL to first completion, {args.preset}, TP {args.tp}, median of "
                  f"{args.repeat} (tokens equal auto's in every row)", title_justify="left")
    for column in ("restart", "seconds", "against auto"):
        table.add_column(column)
    table.add_row("(a) plain server, --load-format auto", fmt_seconds(med["auto"]), "1.0×")
    table.add_row("(b) plain server, --load-format wcache (hit)", fmt_seconds(med["hit"]),
                  speed_ratio(med["auto"], med["hit"]))
    table.add_row("(c) warm starter, --load-format wcache (hit)", fmt_seconds(med["warm"]),
                  speed_ratio(med["auto"], med["warm"]))
    table.add_row("unavoidable, in (c)'s server: vLLM engine init + weight phase (model build, attach, "
                  "post-processing) + the completion itself",
                  f"{fmt_seconds(med['init'])} + {fmt_seconds(med['load'])} + {fmt_seconds(med['completion'])} = "
                  f"{fmt_seconds(floor)}", f"(c) is {med['warm'] / floor:.2f}× this (median of each repeat's own "
                  f"ratio: {med['warm_over_floor']:.2f}×)")
    console.print(table)


if __name__ == "__main__":
    main()
