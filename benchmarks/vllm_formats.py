"""vLLM (CPU build) with pre-quantized and mixture-of-experts checkpoints: `auto` against a `wcache` hit, one run.

For each configuration (compressed-tensors W8A8 int8 and a Qwen3-MoE by default; ``--configs`` picks), a
daemon preloaded with ``wcache.start_daemons`` and three fresh engines (``enforce_eager``, 1 GiB of KV cache):

* ``load_format="auto"``: the greedy tokens vLLM gives from disk;
* ``load_format="wcache"``, a hit: its tokens, its weight phase (load_model, post-processing included) and
  the share of vLLM's parameters that are the daemon's tensors (zero-copy views of its arena);
* ``load_format="wcache"`` against a copy no daemon holds: vLLM's default loader inside wcache's fallback,
  timed exactly as the hit is — the weight phase of a disk load, measured the same way.

Run::

    .venv/bin/python benchmarks/vllm_formats.py
    .venv/bin/python benchmarks/vllm_formats.py --configs int8-w8a8 fp8-w8a8 moe
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

from bench_common import fmt_seconds, speed_ratio, workspace
from rich.console import Console
from rich.table import Table
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.runner import VllmRun, greedy_tokens
from wcache_dev.synth import overwrite_tensor_bytes, write_checkpoint

CONFIGS = {"int8-w8a8": "small-w8a8", "fp8-w8a8": "small-fp8", "moe": "small-moe"}
PROMPTS = ["the weights cache keeps", "a daemon holds the shard and"]
_LOAD_MS = re.compile(r"wcache: .*[(; ]([\d.]+) ms, post-processing included\)")
_PLACED = re.compile(r"(\d+) parameters took the daemon's tensors as zero-copy views of its arena, (\d+) were copied")


def _load_seconds(log: str) -> float:
    loads = [float(m.group(1)) / 1000 for line in log.splitlines() if (m := _LOAD_MS.search(line))]
    if not loads:
        raise SystemExit("wcache's load line is missing from vLLM's log")
    return loads[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["int8-w8a8", "moe"])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    console = Console()
    table = Table(title="vLLM CPU, one run per configuration", title_justify="left")
    for column in ("configuration", "weight phase auto", "weight phase hit", "ratio", "zero-copy parameters",
                   "tokens equal"):
        table.add_column(column)
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        extra = {"run_dir": str(run_dir)}
        for configuration in args.configs:
            model = write_checkpoint(CONFIGS[configuration], work / configuration)
            unserved = work / f"{configuration}-changed"
            shutil.copytree(model, unserved)
            overwrite_tensor_bytes(unserved, "model.norm.weight", 0, bytes(2))
            group = start_daemons(model, run_dir=run_dir)
            try:
                auto = greedy_tokens(VllmRun(str(model), PROMPTS, 8))
                hit = greedy_tokens(VllmRun(str(model), PROMPTS, 8, load_format="wcache",
                                            extra_config={**extra, "fallback": False}))
                disk = greedy_tokens(VllmRun(str(unserved), PROMPTS, 8, load_format="wcache", extra_config=extra))
            finally:
                group.stop(force=True)
            placed = next((m for line in hit.log.splitlines() if (m := _PLACED.search(line))), None)
            if placed is None:
                raise SystemExit(f"{configuration}: the hit's placement line is missing from vLLM's log")
            assigned, copied = int(placed.group(1)), int(placed.group(2))
            hit_s, disk_s = _load_seconds(hit.log), _load_seconds(disk.log)
            table.add_row(configuration, fmt_seconds(disk_s), fmt_seconds(hit_s), speed_ratio(disk_s, hit_s),
                          f"{assigned} of {assigned + copied}", "yes" if hit.tokens == auto.tokens else "NO")
    console.print(table)


if __name__ == "__main__":
    main()
