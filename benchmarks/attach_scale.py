"""Zero-copy attach against the tensor count: a fixed cost plus µs per tensor.

For each ``--layers`` count, writes a Qwen3-shaped checkpoint with tiny dimensions (11 tensors per layer plus 3,
so 28 layers is Qwen3-0.6B's 311 tensors and 1,024 layers 11,267), preloads it with a real daemon
(``wcache.start_daemons``), then times ``wcache.attach.attach(..., mode="zero_copy", fallback=False)``
``--repeat`` times against a warm digest store (the daemon's), and prints the median wall time, each stage of
``AttachReport.timings_ms``, the cost per tensor above the smallest size's, and the same for this process's CPU
time (steadier than wall time on a shared machine). The attached tensors of every size are compared byte for
byte with the disk path (``wcache.load.loader.load_from_disk``).

Run::

    .venv/bin/python benchmarks/attach_scale.py                      # 28, 272 and 1,024 layers, identity plan
    .venv/bin/python benchmarks/attach_scale.py --plan fused --repeat 9
    .venv/bin/python benchmarks/attach_scale.py --profile 1024       # cProfile of one attach at 1,024 layers
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_common import RACY_WINDOW_S, workspace
from rich.console import Console
from rich.table import Table
from wcache.attach import attach
from wcache.daemon.launch import DaemonGroup, start_daemons
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache.load.loader import load_from_disk
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, Preset, make_tensors, write_tensors

TARGET_US_PER_TENSOR = 3.0
TARGET_LARGEST_MS = 100.0
STOP_GRACE_S = 10.0
DEFAULT_LAYERS = (28, 272, 1024)
NUM_SHARDS = 4


@dataclass(slots=True)
class SizeResult:
    """Every attach of one checkpoint size."""

    layers: int
    num_tensors: int = 0
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time: steadier on a busy machine
    stages_ms: dict[str, list[float]] = field(default_factory=dict)
    identical: bool = False

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1000

    @property
    def median_cpu_ms(self) -> float:
        return statistics.median(self.cpu_seconds) * 1000

    def stage(self, name: str) -> float | None:
        values = self.stages_ms.get(name)
        return statistics.median(values) if values else None


def preset_with(layers: int) -> Preset:
    """The "tiny" shape (hidden 64, bfloat16) with `layers` layers, all full attention."""
    base = dict(PRESETS["tiny"].config)
    base.update(num_hidden_layers=layers, layer_types=["full_attention"] * layers, use_sliding_window=False,
                max_window_layers=layers, torch_dtype="bfloat16")
    return Preset(config=base, num_shards=min(NUM_SHARDS, layers), write_lm_head=True)


def preload(model: Path, run_dir: Path, store: Path, plan: str) -> DaemonGroup:
    """Start a daemon for `model` (on a digest store of its own) and return once it is ready."""
    return start_daemons(model, run_dir=run_dir, layout=plan, env={**os.environ, "WCACHE_CACHE_DIR": str(store)})


def stop(group: DaemonGroup | None, problems: list[str]) -> None:
    """Stop the daemon; if it will not stop cleanly, say so and end its supervisor (which ends the ranks)."""
    if group is None:
        return
    try:
        group.stop(force=True)
    except Exception as exc:  # a benchmark reports what went wrong and still cleans up
        problems.append(f"the daemons did not stop cleanly ({exc}); terminated their supervisor")
        group.terminate()


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


def measure(result: SizeResult, model: Path, spec: PlanSpec, run_dir: Path, store_dir: Path, repeat: int,
            profile_to: Path | None) -> None:
    with DigestStore.open(store_dir) as store:
        key_file = compute_key(model, spec, store=store)  # warms this process's imports and the store's pages
        if key_file.stats is not None and key_file.stats.shards_hashed:
            raise RuntimeError(f"the warm key hashed {key_file.stats.shards_hashed} shard(s)")
        for i in range(repeat + 1):  # the first attach is a warm-up, not counted
            gc.collect()
            profiler = cProfile.Profile() if profile_to is not None and i == repeat else None
            began, began_cpu = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.enable()
            weights = attach(model, spec, run_dir=run_dir, mode="zero_copy", store=store, fallback=False)
            if profiler is not None:
                profiler.disable()
            seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - began_cpu
            if profiler is not None and profile_to is not None:
                profiler.dump_stats(profile_to)
            if weights.report.outcome != "hit":
                raise RuntimeError(f"zero-copy attach did not hit: {weights.report.reason}")
            if i == 0:
                result.num_tensors = weights.report.num_tensors
                result.identical = same_bytes(weights.tensors, load_from_disk(key_file, model))
            else:
                result.seconds.append(seconds)
                result.cpu_seconds.append(cpu_seconds)
                for name, ms in weights.report.timings_ms.items():
                    result.stages_ms.setdefault(name, []).append(ms)
            weights.close()
            del weights


def run_size(layers: int, args: argparse.Namespace, work: Path, problems: list[str], err: Console) -> SizeResult:
    result = SizeResult(layers)
    model, run_dir, store = work / f"ckpt-{layers}", work / f"run-{layers}", work / f"store-{layers}"
    for owned in (model, run_dir, store):
        shutil.rmtree(owned, ignore_errors=True)
    chosen = preset_with(layers)
    err.print(f"{layers} layers: writing the checkpoint ...")
    write_tensors(make_tensors(chosen), chosen.config, model, chosen.num_shards)
    written = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in model.iterdir())
    wait_s = RACY_WINDOW_S + 0.2 - (time.time_ns() - written) / 1e9
    if wait_s > 0:
        time.sleep(wait_s)  # receipts for younger files are not trusted, so the warm key would rehash
    err.print(f"{layers} layers: preloading ...")
    group: DaemonGroup | None = None
    try:
        group = preload(model, run_dir, store, args.plan)
        err.print(f"{layers} layers: {args.repeat} zero-copy attaches ...")
        profile_to = work / f"attach-{layers}.prof" if args.profile == layers else None
        measure(result, model, PlanSpec(layout=args.plan), run_dir, store, args.repeat, profile_to)
        if profile_to is not None:
            pstats.Stats(str(profile_to)).sort_stats("cumulative").print_stats(args.profile_lines)
    finally:
        stop(group, problems)
        if args.workdir is None:
            shutil.rmtree(model, ignore_errors=True)
    return result


def per_tensor_us(ms: float, base_ms: float, tensors: int, base_tensors: int) -> float | None:
    """Microseconds per tensor above the smallest size's cost; None for the smallest size itself."""
    return (ms - base_ms) * 1000 / (tensors - base_tensors) if tensors > base_tensors else None


def table(results: list[SizeResult], plan: str, repeat: int) -> Table:
    order = ["key", "connect", "map", "total"]
    found = {s for r in results for s in r.stages_ms}
    stages = [s for s in order if s in found] + sorted(found - set(order))
    out = Table(title=f"Zero-copy attach by tensor count ({plan} plan, CPU daemon), median of {repeat}")
    for name in ("layers", "tensors", "attach (wall)", *(f"{s} ms" for s in stages), "µs/tensor above fixed",
                 "attach CPU", "CPU µs/tensor", "same bytes as disk"):
        out.add_column(name, justify="right")
    base = results[0]
    for r in results:
        wall = per_tensor_us(r.median_ms, base.median_ms, r.num_tensors, base.num_tensors)
        cpu = per_tensor_us(r.median_cpu_ms, base.median_cpu_ms, r.num_tensors, base.num_tensors)
        cells = [f"{r.stage(s):,.1f}" if r.stage(s) is not None else "" for s in stages]
        out.add_row(f"{r.layers:,}", f"{r.num_tensors:,}", f"{r.median_ms:,.1f} ms", *cells,
                    "(fixed)" if wall is None else f"{wall:,.2f}", f"{r.median_cpu_ms:,.1f} ms",
                    "(fixed)" if cpu is None else f"{cpu:,.2f}", "yes" if r.identical else "NO")
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure every size and print the table; exit 1 when bytes differ or the per-tensor target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                        help="layer counts to measure, smallest first (28 272 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="attaches per size; the median is shown (5)")
    parser.add_argument("--plan", choices=("identity", "fused"), default="identity", help="processing plan")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: temp dir)")
    parser.add_argument("--profile", type=int, default=None, metavar="LAYERS",
                        help="cProfile one extra attach at this layer count and print the top functions")
    parser.add_argument("--profile-lines", type=int, default=30, help="functions the profile prints (30)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or any(n < 1 for n in args.layers):
        parser.error("--repeat and every --layers value must be at least 1")
    layers = sorted(set(args.layers))
    console = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True, soft_wrap=True)
    problems: list[str] = []
    results = []
    with workspace(args.workdir) as work:
        os.environ["WCACHE_CACHE_DIR"] = str(work / "engine-store")  # nothing may touch the user's own store
        for n in layers:
            results.append(run_size(n, args, work, problems, err))
    console.print(table(results, args.plan, args.repeat))
    for problem in problems:
        console.print(f"[yellow]note:[/] {problem}")
    ok = all(r.identical for r in results)
    if len(results) > 1:
        base, top = results[0], results[-1]
        per_us = per_tensor_us(top.median_ms, base.median_ms, top.num_tensors, base.num_tensors) or 0.0
        cpu_us = per_tensor_us(top.median_cpu_ms, base.median_cpu_ms, top.num_tensors, base.num_tensors) or 0.0
        met = per_us <= TARGET_US_PER_TENSOR and top.median_ms < TARGET_LARGEST_MS
        verdict = "[bold green]PASS[/]" if met else "[bold red]FAIL[/]"
        console.print(
            f"[bold]{per_us:,.2f} µs per tensor on top of {base.median_ms:,.1f} ms at {base.num_tensors:,} "
            f"tensors; {top.median_ms:,.1f} ms at {top.num_tensors:,}[/] (target ≤ {TARGET_US_PER_TENSOR:g} µs "
            f"per tensor, < {TARGET_LARGEST_MS:g} ms at the largest) {verdict}; this process's CPU time: "
            f"{cpu_us:,.2f} µs per tensor, {top.median_cpu_ms:,.1f} ms at the largest"
        )
        ok &= met
    console.print(json.dumps({"results": [
        {"layers": r.layers, "tensors": r.num_tensors, "median_ms": round(r.median_ms, 2),
         "median_cpu_ms": round(r.median_cpu_ms, 2),
         "stages_ms": {s: round(v, 2) for s in r.stages_ms if (v := r.stage(s)) is not None}}
        for r in results
    ]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
