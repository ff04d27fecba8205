"""vLLM (CPU build): switching a running engine to another checkpoint's daemon, against restarting it there.

Two versions of the preset (other random weights, same config) in two daemons. In one run:

* switch: one offline `LLM(load_format="wcache")` process, started once; each repeat times
  `wcache.integrations.vllm_switch.switch(llm, OTHER)` and a one-token generation on the other version;
* restart: each repeat times a fresh process from start to the same one token, `LLM(OTHER,
  load_format="wcache")` on a hit (process start, imports, engine core, weight attach, KV cache, warm-up).

The tokens after each switch must equal those of the restart on the same version (asserted). Medians of
``--repeat``. Run under the vLLM lock where other jobs start engines::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_switch.py            # small, 3 repeats
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_switch.py --preset qwen3-0.6b --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import fmt_seconds, workspace
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm_runner import DEFAULT_KV_CACHE_GIB, VllmRun, greedy_tokens
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint

PROMPT = "the weights cache keeps"
SWITCHING = r"""
import json, sys, time

def main():
    versions, run_dir, repeat, prompt = sys.argv[1:3], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    from vllm import LLM, SamplingParams
    from wcache.integrations.vllm_switch import switch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
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
            child = subprocess.run([sys.executable, "-c", SWITCHING, *map(str, versions), str(run_dir),
                                    str(args.repeat), PROMPT], capture_output=True, text=True, check=False)
            lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            if child.returncode != 0 or not lines:
                raise SystemExit(f"the switching engine failed: {child.stderr[-2000:]}")
            switches = json.loads(lines[-1].removeprefix("RESULT "))
            restarts, tokens = [], {}
            extra = {"run_dir": str(run_dir), "fallback": False}
            for n in range(args.repeat):
                version = (n + 1) % 2
                began = time.perf_counter()
                result = greedy_tokens(VllmRun(str(versions[version]), [PROMPT], 1, load_format="wcache",
                                               extra_config=extra, max_model_len=256))
                restarts.append(time.perf_counter() - began)
                tokens[version] = result.tokens[0]
        finally:
            for group in groups:
                group.stop()
    same = all(run["tokens"] == tokens[run["version"]] for run in switches if run["version"] in tokens)
    switch = statistics.median(run["total_s"] for run in switches)
    reload = statistics.median(run["switch_s"] for run in switches)
    restart = statistics.median(restarts)
    print(f"vLLM CPU, preset {args.preset}, median of {args.repeat}; request → first token on the other version")
    print(f"{'switch in place (switch(), then one token)':<52} {fmt_seconds(switch):>10}")
    print(f"{'  of which switch() (attach, reload, prefix reset)':<52} {fmt_seconds(reload):>10}")
    print(f"{'restart (new process, LLM on a hit, one token)':<52} {fmt_seconds(restart):>10}")
    print(f"switch is {restart / switch:,.1f}× faster than a restart; tokens equal: {same}")
    if not same:
        raise SystemExit("the switched engine answered other tokens than the restarted one")


if __name__ == "__main__":
    main()
