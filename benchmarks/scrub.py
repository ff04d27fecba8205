"""What the background re-check of an arena costs, and how soon it finds a planted bit flip, in one run.

On the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16, fused plan), a daemon preloaded with ``--scrub-interval``
short enough that passes run back to back measures one pass: its wall time and the CPU the rank process spent in
it (psutil), so the share of one core while a pass runs (bounded by the scrubber to 5%) and the share at the
default interval (one pass's CPU over the interval). A second daemon starts with ``WCACHE_FAULT_FLIP`` (one bit of
the last tensor in the arena flipped after its digest was taken, before the seal) and the same short interval:
the time from READY to the ``scrub_failed`` event, against the pass time.

Run::

    .venv/bin/python benchmarks/scrub.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from bench_common import fmt_seconds, stop_preloaded, timed_preload, wcache_command, workspace
from restart import our_leftovers
from wcache.daemon.scrub import DEFAULT_INTERVAL_S, SHARE
from wcache.ipc.run_dir.directory import read_descriptors
from wcache.monitor.events import read_events


def _stats(descriptor: Any) -> dict[str, Any]:
    from wcache.ipc.wire.client import request_once
    from wcache.ipc.wire.messages import Stats

    return request_once(descriptor.socket, Stats()).to_wire()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--interval", type=float, default=1.0, help="scrub interval for the measured passes")
    args = parser.parse_args(argv)
    cli = wcache_command()
    with workspace(args.workdir) as work:
        model, run_dir = work / "n", work / "run-scrub"
        shutil.rmtree(run_dir, ignore_errors=True)
        env = {**os.environ, "WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(work / "store-scrub")}
        if not model.exists():
            from wcache_dev.synth import write_checkpoint

            write_checkpoint(args.preset, model)
        spawned: list[psutil.Process] = []
        try:
            _, ready = timed_preload([*cli, "preload", str(model), "--detach", "--json", "--scrub-interval",
                                      str(args.interval)], env, run_dir, spawned)
            daemon = next(d for d in read_descriptors(run_dir) if d.name == ready["ranks"][0]["name"])
            process = psutil.Process(daemon.pid)
            # Wait for the first pass to finish, then time the second one from its start to its end.
            while _stats(daemon)["counters"].get("scrub_passes", 0) < 1:
                time.sleep(0.05)
            while _stats(daemon)["counters"].get("scrub_passes", 0) < 2:
                time.sleep(0.2)
            cpu0 = sum(process.cpu_times()[:2])
            while _stats(daemon)["counters"].get("scrub_passes", 0) < 3:
                time.sleep(0.2)
            cpu1 = sum(process.cpu_times()[:2])
            # The pass's own duration (the daemon times it); the CPU between the two counts is that pass's, the
            # interval's wait costing none.
            pass_cpu, pass_wall = cpu1 - cpu0, _stats(daemon)["counters"]["scrub_last_pass_ms"] / 1000
            subprocess.run([*cli, "stop", daemon.name], env=env, check=True, capture_output=True)
            entries = _last_tensor(model)
            flip = {**env, "WCACHE_FAULT_FLIP": f"{entries}:1"}
            _, ready = timed_preload([*cli, "preload", str(model), "--detach", "--json", "--scrub-interval",
                                      str(args.interval)], flip, run_dir, spawned)
            name = ready["ranks"][0]["name"]
            ready_ts = [e["ts"] for e in read_events(run_dir) if e["kind"] == "ready" and e["daemon"] == name][-1]
            found = None
            deadline = time.monotonic() + 10 * pass_wall + 60
            while found is None and time.monotonic() < deadline:
                found = next((e for e in read_events(run_dir) if e["kind"] == "scrub_failed"), None)
                time.sleep(0.05)
        finally:
            stop_preloaded(cli, run_dir, spawned)
            for leftover in our_leftovers(run_dir):
                with contextlib.suppress(psutil.Error):
                    leftover.kill()
    arena = daemon.weights_bytes
    print(f"Background re-check of a {arena / 1e9:.2f} GB arena ({args.preset}), one run:")
    print(f"  one pass: {fmt_seconds(pass_wall)} wall, {fmt_seconds(pass_cpu)} CPU → {pass_cpu / pass_wall:.1%} of one "
          f"core while it runs (bound {SHARE:.0%}); {arena / pass_cpu / 1e9:.2f} GB/s per CPU second")
    print(f"  at the default --scrub-interval {DEFAULT_INTERVAL_S:.0f} s: {pass_cpu / DEFAULT_INTERVAL_S:.3%} of one "
          "core on average")
    if found is None:
        print("  planted flip: NOT FOUND")
        return 1
    detect = found["ts"] - ready_ts
    print(f"  planted flip in {found['tensor']!r} (the arena's last tensor): found {fmt_seconds(detect)} after READY "
          f"with --scrub-interval {args.interval:g} s ({detect / (args.interval + pass_wall):.2f}× interval + one "
          f"pass); at the default interval: within {fmt_seconds(DEFAULT_INTERVAL_S + pass_wall)}")
    print(f"  event: {json.dumps({k: found[k] for k in ('tensor', 'arena_offset', 'reason')})}")
    return 0


def _last_tensor(model: Path) -> str:
    """The engine tensor the fused plan puts last in the arena (the pass reaches it last)."""
    from wcache.checkpoint.files import locate
    from wcache.key.compute import compute_key
    from wcache.plan.processing import build_plan
    from wcache.plan.spec import PlanSpec

    key = compute_key(model, PlanSpec())
    return build_plan(key.plan, locate(model).config, key.manifest).outputs[-1].name


if __name__ == "__main__":
    sys.exit(main())
