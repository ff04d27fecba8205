"""`wcache verify --greedy --engine vllm`: its two engines in one child against one child each, one run.

Both sides of a verify (a `wcache` hit with fallback off, then vLLM's own disk load) on one daemon's
checkpoint, started two ways, interleaved, ``--repeat`` times each:

* one child each, in vLLM's default process layout (an engine core process per engine): `greedy_tokens`
  twice, as verify started them before;
* one child for both, each engine core in it (`greedy_runs`, what verify does now): vLLM imported once.

Prints the median wall time of each (process start to the child's exit: imports, engine starts, shutdowns)
and their ratio, and checks both ways give the same tokens on both sides.

Run::

    .venv/bin/python benchmarks/verify_vllm.py
    .venv/bin/python benchmarks/verify_vllm.py --preset small-moe --repeat 5
"""

from __future__ import annotations

import os
import statistics
import time

from bench_common import benchmark_arguments, fmt_seconds, speed_ratio, workspace
from rich.console import Console
from rich.table import Table
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.runner import IN_PROCESS_ENGINE_CORE, VllmRun, greedy_runs, greedy_tokens
from wcache_dev.synth import PRESETS, write_checkpoint

PROMPTS = ["the weights cache keeps", "a daemon holds the shard and"]
MAX_NEW_TOKENS = 8


def _children_each(runs: list[VllmRun]) -> list[list[list[int]]]:
    return [greedy_tokens(run).tokens for run in runs]


def _one_child(runs: list[VllmRun]) -> list[list[list[int]]]:
    return [result.tokens for result in greedy_runs(runs)]


def main() -> None:
    args = benchmark_arguments(__doc__ or "", "small", sorted(PRESETS)).parse_args()
    for name in IN_PROCESS_ENGINE_CORE:  # vLLM's default layout for the children-each side
        os.environ.pop(name, None)
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        model = write_checkpoint(args.preset, work / args.preset)
        extra = {"run_dir": str(run_dir), "fallback": False}
        runs = [VllmRun(str(model), PROMPTS, MAX_NEW_TOKENS, load_format="wcache", extra_config=extra),
                VllmRun(str(model), PROMPTS, MAX_NEW_TOKENS)]
        ways = {"one child each, vLLM's default layout": _children_each, "one child, engine cores in it": _one_child}
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        tokens: dict[str, list[list[list[int]]]] = {}
        group = start_daemons(model, run_dir=run_dir)
        try:
            for _ in range(args.repeat):
                for way, run_both in ways.items():
                    began = time.perf_counter()
                    tokens[way] = run_both(runs)
                    seconds[way].append(time.perf_counter() - began)
        finally:
            group.stop(force=True)
    base = statistics.median(seconds[next(iter(ways))])
    table = Table(title=f"verify --engine vllm, {args.preset}, TP 1, median of {args.repeat}", title_justify="left")
    for column in ("engines started", "median", "range", "ratio", "tokens: hit = disk"):
        table.add_column(column)
    for way, taken in seconds.items():
        median = statistics.median(taken)
        hit, disk = tokens[way]
        table.add_row(way, fmt_seconds(median), f"{fmt_seconds(min(taken))}–{fmt_seconds(max(taken))}",
                      speed_ratio(base, median), "yes" if hit == disk else "NO")
    Console().print(table)
    if len({str(t) for t in tokens.values()}) != 1:
        raise SystemExit("the two ways gave different tokens")


if __name__ == "__main__":
    main()
