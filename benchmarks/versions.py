"""The next version from the daemon holding N: a sparse delta applied to N's arena, against a full preload of N+1.

In one run, on the ``--preset`` checkpoint (qwen3-0.6b: 1.5 GB bf16, fused plan, TP 1):

* N+1 is N after a simulated training step: ``--fraction`` (1.5%) of the elements of every tensor moved; and a
  variant with frozen embeddings (``embed_tokens`` and ``lm_head`` unchanged). ``wcache delta N N+1`` writes
  each delta, ``wcache delta --apply`` materializes N+1 from it.
* ``wcache preload N`` holds N; ``wcache preload --from N --delta FILE``, with the delta's and N's pages evicted
  from the page cache first, is timed start → READY. Bytes read: the rank's own count (the delta file plus any
  parent tensor the arena could not give back) and the kernel's ``read_bytes`` of the rank process (storage
  reads), each against the delta file's size (goal ≤ 1.2×).
* Against it: a full ``wcache preload`` of the materialized N+1 (its pages evicted, fresh digest store), and the
  memcpy floor of one arena (its bytes ``pwrite``n from memory into a fresh memfd, as preload_floor.py measures).
* The new daemon's key against a cold key (``--rehash``) of the materialized checkpoint: equal, or the run fails.

``--delta-only`` times just ``wcache delta N N+1`` (the whole command, process start included) against reading
both checkpoints once, interleaved, median of ``--repeat``: with a fresh digest store (both checkpoints hashed)
and with the parent's receipts stored (as after ``wcache preload N``; only N+1 hashed), each with the page cache
as the checkpoints left it (just written) and with both checkpoints' pages evicted before the read and before the
command. The goal is ≤ 2×.

Run::

    .venv/bin/python benchmarks/versions.py                    # qwen3-0.6b, 1.5% of every tensor
    .venv/bin/python benchmarks/versions.py --preset small --fraction 0.02
    .venv/bin/python benchmarks/versions.py --delta-only --repeat 5   # wcache delta against reading both
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from bench_common import RACY_WINDOW_S, fmt_seconds, read_all, stop_preloaded, timed_preload, wcache_command, workspace
from preload_floor import checkpoint_in_memory, fill_arena
from restart import our_leftovers, resident_fraction
from rich.console import Console
from rich.table import Table
from wcache.ipc.run_dir.directory import read_descriptors
from wcache.plan import family

_WRITE_STEP = """
import sys
from pathlib import Path
from wcache_dev.synth import write_training_step
frozen = tuple(sys.argv[4].split(",")) if sys.argv[4] else ()
write_training_step(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), frozen=frozen)
"""


def _run(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return dict(json.loads(result.stdout))


def _read_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, psutil.Error):
        return int(psutil.Process(pid).io_counters().read_bytes)
    return -1


def _evict(paths: list[Path]) -> str:
    """The files' pages out of the page cache (written back first), and only theirs: a global drop would make
    the rank's kernel read count mostly the Python libraries it imports."""
    os.sync()
    resident = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    resident = resident_fraction(paths)
    return f"evicted, {resident:.0%} left"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--fraction", type=float, default=0.015, help="share of every tensor's elements changed")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--delta-only", action="store_true", help="time only `wcache delta` against reading both")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement with --delta-only (median)")
    args = parser.parse_args(argv)
    if args.delta_only:
        return _delta_only(args)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True, soft_wrap=True)
    cli = wcache_command()
    began = time.perf_counter()
    with workspace(args.workdir) as work:
        run_dir, stores = work / "run", work / "stores"
        for owned in (run_dir, stores):
            shutil.rmtree(owned, ignore_errors=True)
        stores.mkdir(parents=True)
        env = {**os.environ, "WCACHE_RUN_DIR": str(run_dir), "WCACHE_CACHE_DIR": str(stores / "main")}
        parent = work / "n"
        if not parent.exists():
            err.print(f"writing the {args.preset!r} checkpoint ...")
            from wcache_dev.synth import write_checkpoint

            write_checkpoint(args.preset, parent)
        variants = {"every tensor": "", "frozen embeddings": f"{family.EMBED},{family.LM_HEAD}"}
        rows: list[dict[str, Any]] = []
        spawned: list[psutil.Process] = []
        floor_s = 0.0
        try:
            _, parent_ready = timed_preload([*cli, "preload", str(parent), "--detach", "--json"], env, run_dir,
                                            spawned)
            parent_name = parent_ready["ranks"][0]["name"]
            arena_bytes = int(parent_ready["ranks"][0]["weights_bytes"])
            for label, frozen in variants.items():
                child = work / f"n1-{len(rows)}"
                delta = work / f"step-{len(rows)}.safetensors"
                made = work / f"materialized-{len(rows)}"
                for owned in (child, made):
                    shutil.rmtree(owned, ignore_errors=True)
                err.print(f"{label}: writing N+1, its delta and the materialized checkpoint ...")
                subprocess.run([sys.executable, "-c", _WRITE_STEP, str(parent), str(child), str(args.fraction),
                                frozen], check=True, env=env)
                read_both_s = _timed_read([*sorted(parent.glob("*.safetensors")), *sorted(child.glob("*.safetensors"))])
                t = time.perf_counter()
                summary = _run([*cli, "delta", str(parent), str(child), "-o", str(delta), "--json"], env)
                delta_s = time.perf_counter() - t
                _run([*cli, "delta", "--apply", str(parent), str(delta), "-o", str(made), "--json"], env)
                cold = _run([*cli, "key", str(made), "--rehash", "--json"],
                            {**env, "WCACHE_CACHE_DIR": str(stores / f"cold-{len(rows)}")})
                shutil.rmtree(child)
                cache = _evict([delta, *sorted(parent.glob("*.safetensors"))])
                seconds, ready = timed_preload(
                    [*cli, "preload", "--from", parent_name, "--delta", str(delta), "--detach", "--json"], env,
                    run_dir, spawned)
                rank = next(d for d in read_descriptors(run_dir) if d.name == ready["ranks"][0]["name"])
                kernel_read = _read_bytes(rank.pid)
                event = next(e for e in _events(run_dir) if e.get("kind") == "ready" and e.get("daemon") == rank.name)
                subprocess.run([*cli, "stop", rank.name], env=env, check=True, capture_output=True)
                _evict(sorted(made.glob("*.safetensors")))
                full_s, full = timed_preload([*cli, "preload", str(made), "--detach", "--json"],
                                             {**env, "WCACHE_CACHE_DIR": str(stores / f"full-{len(rows)}")},
                                             run_dir, spawned)
                full_name = full["ranks"][0]["name"]
                subprocess.run([*cli, "stop", full_name], env=env, check=True, capture_output=True)
                if not floor_s:
                    in_memory = checkpoint_in_memory(sorted(made.glob("*.safetensors")), arena_bytes)
                    floor_s = fill_arena(in_memory, arena_bytes)
                    del in_memory
                rows.append({"label": label, "summary": summary, "delta_s": delta_s, "read_both_s": read_both_s,
                             "seconds": seconds,
                             "load_s": float(event["load_s"]), "own_read": int(event["bytes_read"]),
                             "kernel_read": kernel_read, "cache": cache, "full_s": full_s,
                             "full_load_s": float(full["ranks"][0]["load_s"]),
                             "key": ready["ranks"][0]["key_id"], "cold_key": cold["id"],
                             "full_key": full["ranks"][0]["key_id"]})
                shutil.rmtree(made)
        finally:
            stop_preloaded(cli, run_dir, spawned)
            for process in our_leftovers(run_dir):
                with contextlib.suppress(psutil.Error):
                    process.kill()
    elapsed = time.perf_counter() - began
    console.print(_table(rows, floor_s, arena_bytes, args))
    console.print(f"memcpy floor: the {arena_bytes / 1e9:.2f} GB arena pwritten from memory into a fresh memfd, "
                  f"{fmt_seconds(floor_s)}. {os.cpu_count()} CPUs, torch {torch.__version__}, whole run "
                  f"{elapsed:.0f} s.")
    bad = [r["label"] for r in rows if not r["key"] == r["cold_key"] == r["full_key"]]
    if bad:
        console.print(f"KEY MISMATCH for {', '.join(bad)}")
        return 1
    return 0


def _delta_only(args: argparse.Namespace) -> int:
    """`wcache delta N N+1` against reading both checkpoints, with a fresh store and with N's receipts stored."""
    console = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True, soft_wrap=True)
    cli = wcache_command()
    table = Table(title=f"wcache delta N N+1 on {args.preset}, {args.fraction:.1%} of every tensor's elements "
                        f"changed, median of {args.repeat} (interleaved with the reads)", title_justify="left")
    for column in ("digest store, page cache", "read both checkpoints", "wcache delta", "its CPU (user + sys)",
                   "ratio (goal ≤ 2×)", "delta file"):
        table.add_column(column, justify="left" if column.startswith("digest") else "right")
    with workspace(args.workdir) as work:
        parent, child, delta = work / "n", work / "n1", work / "step.safetensors"
        if not parent.exists():
            err.print(f"writing the {args.preset!r} checkpoint ...")
            from wcache_dev.synth import write_checkpoint

            write_checkpoint(args.preset, parent)
        if not child.exists():  # a kept --workdir keeps N+1 too (same --fraction assumed)
            err.print("writing N+1 ...")
            subprocess.run([sys.executable, "-c", _WRITE_STEP, str(parent), str(child), str(args.fraction), ""],
                           check=True)
        files = [*sorted(parent.glob("*.safetensors")), *sorted(child.glob("*.safetensors"))]
        stores = work / "delta-stores"
        shutil.rmtree(stores, ignore_errors=True)
        env = {**os.environ, "WCACHE_RUN_DIR": str(work / "run")}
        warm_env = {**env, "WCACHE_CACHE_DIR": str(stores / "parent-receipts")}
        _run([*cli, "key", str(parent), "--json"], warm_env)  # N's receipts, as its preload leaves them
        time.sleep(RACY_WINDOW_S + 0.1)  # receipts of files written just now are not trusted before this
        cases = [(f"{store}, {cache}", fresh, evict) for evict, cache in ((False, "page cache warm"),
                                                                           (True, "N and N+1 evicted"))
                 for fresh, store in ((True, "fresh store (N and N+1 hashed)"),
                                      (False, "N's receipts stored (N+1 hashed)"))]
        for label, fresh, evict in cases:
            reads, deltas, cpus = [], [], []
            for attempt in range(args.repeat):
                if evict:
                    _evict(files)
                reads.append(_timed_read(files))
                if evict:
                    _evict(files)
                run_env = {**env, "WCACHE_CACHE_DIR": str(stores / f"fresh-{attempt}")} if fresh else warm_env
                began, cpu_before = time.perf_counter(), _children_cpu()
                summary = _run([*cli, "delta", str(parent), str(child), "-o", str(delta), "--json"], run_env)
                deltas.append(time.perf_counter() - began)
                cpus.append(_children_cpu() - cpu_before)
            read_s, delta_s = statistics.median(reads), statistics.median(deltas)
            table.add_row(label, fmt_seconds(read_s), fmt_seconds(delta_s), fmt_seconds(statistics.median(cpus)),
                          f"{delta_s / read_s:.2f}×",
                          f"{int(summary['bytes']) / 1e6:,.1f} MB, {summary['tensors_changed']} tensors, "
                          f"{summary['elements_changed'] / summary['elements_total']:.2%} of elements")
    console.print(table)
    console.print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; the read is every "
                  "file once in 16 MiB reads.")
    return 0


def _children_cpu() -> float:
    """CPU seconds (user + system) of the child processes waited for so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _timed_read(paths: list[Path]) -> float:
    """Seconds to read every file once (as `wcache delta` reads each checkpoint), page cache as it is."""
    began = time.perf_counter()
    read_all(paths)
    return time.perf_counter() - began


def _events(run_dir: Path) -> list[dict[str, Any]]:
    from wcache.monitor.events import read_events

    return list(read_events(run_dir))


def _table(rows: list[dict[str, Any]], floor_s: float, arena_bytes: int, args: argparse.Namespace) -> Table:
    table = Table(title=f"N → N+1 on {args.preset} ({arena_bytes / 1e9:.2f} GB arena), {args.fraction:.1%} of "
                        "each changed tensor's elements, one run", title_justify="left")
    for column in ("delta", "delta file", "bytes read (own / kernel)", "vs delta file", "READY", "rank build",
                   "full preload of N+1", "vs full", "vs memcpy floor", "key = cold key"):
        table.add_column(column, justify="left" if column == "delta" else "right")
    for r in rows:
        s = r["summary"]
        size = int(s["bytes"])
        kernel = f"{r['kernel_read'] / 1e6:,.1f} MB" if r["kernel_read"] >= 0 else "?"
        table.add_row(
            f"{r['label']} ({s['tensors_changed']} tensors, {s['elements_changed'] / s['elements_total']:.2%} of "
            f"elements; delta and N {r['cache']})",
            f"{size / 1e6:,.1f} MB (written in {fmt_seconds(r['delta_s'])}, "
            f"{r['delta_s'] / r['read_both_s']:.2f}× reading both)",
            f"{r['own_read'] / 1e6:,.1f} MB / {kernel}",
            f"{r['own_read'] / size:.2f}× / " + (f"{r['kernel_read'] / size:.2f}×" if r["kernel_read"] >= 0 else "?"),
            fmt_seconds(r["seconds"]), fmt_seconds(r["load_s"]),
            f"{fmt_seconds(r['full_s'])} (rank {fmt_seconds(r['full_load_s'])})",
            f"{r['full_s'] / r['seconds']:.2f}× faster",
            f"{r['load_s'] / floor_s:.2f}× the floor" if floor_s else "?",
            "yes" if r["key"] == r["cold_key"] == r["full_key"] else f"NO ({r['key']} vs {r['cold_key']})",
        )
    return table


if __name__ == "__main__":
    sys.exit(main())
