"""vLLM (CPU build) start-up: its default loader against the load format `wcache` on a hit, in one run.

For the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16) and one daemon preloaded with ``wcache.start_daemons``,
each repeat starts, interleaved, in fresh processes (``enforce_eager``, 1 GiB of KV cache):

* ``LLM(load_format="auto")``: the whole construction, as users run it today;
* ``LLM(load_format="wcache")`` with a hit: the whole construction;
* ``LLM(load_format="wcache")`` against a copy no daemon holds: vLLM's default loader runs inside wcache's
  fallback, which times its ``load_model`` (read, post-process) exactly as it times its own hit path — the
  weight-loading phase, measured the same way on both sides.

On CPU, vLLM repacks every linear weight for oneDNN after loading (`process_weights_after_loading`) into memory
of its own; that copy runs on both sides and no cache can skip it. Medians of ``--repeat``.

Run::

    .venv/bin/python benchmarks/vllm_startup.py                  # qwen3-0.6b, 3 repeats (~10 minutes here)
    .venv/bin/python benchmarks/vllm_startup.py --preset small --repeat 2
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import time

from bench_common import benchmark_arguments, fmt_seconds, speed_ratio, workspace
from rich.console import Console
from rich.table import Table
from wcache.daemon.launch import start_daemons
from wcache.integrations.vllm.runner import VllmRun, greedy_tokens
from wcache_dev.synth import PRESETS, overwrite_tensor_bytes, write_byte_tokenizer, write_checkpoint

_LOAD_MS = re.compile(r"wcache: .*(?:\(|; )([\d.]+) ms, post-processing included\)")


def _timed(run: VllmRun) -> tuple[float, float | None, list[list[int]]]:
    """Whole-process seconds (start to generated tokens), wcache's load_model seconds if logged, tokens."""
    began = time.perf_counter()
    result = greedy_tokens(run)
    total = time.perf_counter() - began
    loads = [float(m.group(1)) / 1000 for line in result.log.splitlines() if (m := _LOAD_MS.search(line))]
    return total, (loads[-1] if loads else None), result.tokens


def main() -> None:
    args = benchmark_arguments(__doc__ or "").parse_args()
    console = Console()
    with workspace(args.workdir) as work:
        run_dir = work / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        model = write_checkpoint(args.preset, work / args.preset)
        if not (model / "tokenizer.json").exists():  # vLLM needs one; the byte-level one fits any of our presets
            write_byte_tokenizer(model, PRESETS[args.preset].config)
        unserved = work / f"{args.preset}-changed"
        shutil.copytree(model, unserved)
        overwrite_tensor_bytes(unserved, "model.norm.weight", 0, bytes(2))
        group = start_daemons(model, run_dir=run_dir)
        extra = {"run_dir": str(run_dir)}
        prompts = ["the weights cache keeps"]
        rows: dict[str, list[float]] = {"auto": [], "hit": [], "auto_load": [], "hit_load": []}
        try:
            for i in range(args.repeat):
                auto_total, _, auto_tokens = _timed(VllmRun(str(model), prompts, 4))
                hit_total, hit_load, hit_tokens = _timed(
                    VllmRun(str(model), prompts, 4, load_format="wcache", extra_config=extra))
                _, disk_load, _ = _timed(VllmRun(str(unserved), prompts, 4, load_format="wcache",
                                                 extra_config=extra))
                assert hit_tokens == auto_tokens, "a hit must give vLLM's own tokens"
                assert hit_load is not None and disk_load is not None, "wcache's load lines are missing"
                rows["auto"].append(auto_total)
                rows["hit"].append(hit_total)
                rows["auto_load"].append(disk_load)
                rows["hit_load"].append(hit_load)
                console.print(f"repeat {i + 1}: auto {auto_total:.1f} s, hit {hit_total:.1f} s; load phase "
                              f"{disk_load:.2f} s vs {hit_load:.3f} s")
        finally:
            group.stop(force=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    table = Table(title=f"vLLM CPU start-up, {args.preset}, median of {args.repeat}", title_justify="left")
    for column in ("phase", "load_format auto", "load_format wcache (hit)", "ratio"):
        table.add_column(column)
    table.add_row("weight loading (load_model, post-processing included)", fmt_seconds(med["auto_load"]),
                  fmt_seconds(med["hit_load"]), speed_ratio(med["auto_load"], med["hit_load"]))
    table.add_row("whole run (process start to tokens: imports, LLM(...), generate)", fmt_seconds(med["auto"]),
                  fmt_seconds(med["hit"]), speed_ratio(med["auto"], med["hit"]))
    console.print(table)


if __name__ == "__main__":
    main()
