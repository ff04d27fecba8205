"""Engine restart: disk load with the plan vs zero-copy and copy attach; cold preload vs raw read.

One run measures, side by side (interleaved, median of ``--repeat``), for rank 0 of ``--tp`` under ``--plan``:

* restart: what an engine pays to get its processed tensors back
  (a) ``safetensors.torch.load_file`` of every shard, then the processing plan (what an engine does today),
  (b) ``wcache.load.loader.load_from_disk``: the same plan over read-only maps of the shards (wcache's disk path),
  (c) zero-copy attach to a preloaded daemon (warm key from the digest store + connect + map),
  (d) zero-copy attach, then one read per page (what the first use of every weight adds),
  (e) copy attach (attach, copy every tensor, release: the daemon lets go of its weights);
  the disk loads with the page cache warm and, where ``/proc/sys/vm/drop_caches`` is writable, dropped;
* preload: ``wcache preload --detach`` on a fresh (cold) digest store, from start to its READY line, and the
  rank's own load (read + hash + plan + arena fill), against a plain read of the same shard files with
  large reads in the same page-cache state.

Every repeat preloads twice (page cache dropped, then warm; each on a fresh digest store) and runs the restart
methods against the second daemon, copy attach last because it releases the daemon's weights.

Run::

    .venv/bin/python benchmarks/restart.py                         # qwen3-0.6b, fused plan, TP 1, 3 repeats
    .venv/bin/python benchmarks/restart.py --plan identity --repeat 5
    .venv/bin/python benchmarks/restart.py --skip-drop             # warm page cache only, about half the time
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_common as common
import psutil
import torch
from rich.console import Console, JustifyMethod
from rich.table import Table
from safetensors.torch import load_file
from wcache.attach import attach
from wcache.checkpoint.files import locate
from wcache.key.cache_key import KeyFile
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache.load.loader import load_from_disk
from wcache.plan.processing import build_plan, process_all
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import write_checkpoint

TARGET_ZERO_COPY_SPEEDUP = 50.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
STOP_GRACE_S = 10.0

WARM = "warm"
DROPPED = "dropped"

ST_LOAD = "safetensors load_file + plan"
WC_LOAD = "wcache disk load (one read per tensor + plan)"
ZERO_COPY = "zero-copy attach"
ZERO_COPY_TOUCH = "zero-copy attach + 1 read/page"
COPY = "copy attach"
RAW_READ = f"raw read ({common.READ_CHUNK_BYTES >> 20} MiB reads)"
PRELOAD = "cold preload, start → READY"
RANK_LOAD = "  rank load (read+hash+plan+fill)"

DISK_LOADS = (ST_LOAD, WC_LOAD)


@dataclass(slots=True)
class Samples:
    """Wall times of one row, and the sub-timings (ms) each run reported."""

    seconds: list[float] = field(default_factory=list)
    parts_ms: dict[str, list[float]] = field(default_factory=dict)

    def add(self, seconds: float, **parts_ms: float) -> None:
        self.seconds.append(seconds)
        for name, ms in parts_ms.items():
            self.parts_ms.setdefault(name, []).append(ms)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def part(self, name: str) -> float:
        """Median of one sub-timing, in ms."""
        return statistics.median(self.parts_ms[name])


@dataclass(slots=True)
class Bench:
    """Everything one run needs: the checkpoint, the plan, where daemons and stores live."""

    model: Path
    spec: PlanSpec
    run_dir: Path
    stores: Path
    wcache_cli: list[str]
    shards: list[Path]
    checkpoint_bytes: int
    can_drop: bool
    samples: dict[tuple[str, str], Samples] = field(default_factory=dict)
    resident_after_drop: list[float] = field(default_factory=list)
    preloads: int = 0
    spawned: list[psutil.Process] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def record(self, row: str, cache: str, seconds: float, **parts_ms: float) -> None:
        self.samples.setdefault((row, cache), Samples()).add(seconds, **parts_ms)


# -- page cache ------------------------------------------------------------------------------------------


def try_drop_caches() -> str | None:
    """Write back dirty pages and drop the page cache; None when that worked, else why not."""
    os.sync()
    try:
        DROP_CACHES.write_text("1\n")
    except OSError as exc:
        return f"{DROP_CACHES} is not writable here ({exc.strerror or exc})"
    return None


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages that are in the page cache (mmap + mincore, nothing is read)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = pages = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        count = (size + PAGE_BYTES - 1) // PAGE_BYTES
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = (ctypes.c_ubyte * count)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                resident += count - bytes(vec).count(0)  # a byte is nonzero (bit 0 set) when resident
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        pages += count
    return resident / pages if pages else 0.0




def set_cache(bench: Bench, cache: str) -> None:
    """Put the checkpoint's pages in the page cache (warm) or drop the page cache (dropped)."""
    if cache == WARM:
        common.read_all(bench.shards)
        return
    reason = try_drop_caches()
    if reason is not None:
        raise RuntimeError(reason)
    bench.resident_after_drop.append(resident_fraction(bench.shards))


# -- daemons -----------------------------------------------------------------------------------------------


def preload(bench: Bench, store_dir: Path) -> tuple[float, dict[str, Any]]:
    """`wcache preload --detach` on a fresh digest store; seconds from start to READY, and the READY fields."""
    bench.preloads += 1
    command = [
        *bench.wcache_cli, "preload", str(bench.model), "--detach", "--json", "--run-dir", str(bench.run_dir),
        "--tp", str(bench.spec.tp_size), "--plan", bench.spec.layout,
    ]
    return common.timed_preload(command, {**os.environ, "WCACHE_CACHE_DIR": str(store_dir)}, bench.run_dir,
                                bench.spawned)


def stop_daemons(bench: Bench) -> None:
    """`wcache stop --all --force`, then end whatever of ours is still running (by pid, never by name)."""
    bench.problems += common.stop_preloaded(bench.wcache_cli, bench.run_dir, bench.spawned)


def our_leftovers(run_dir: Path) -> list[psutil.Process]:
    """Processes started with `--run-dir` equal to this run's own (temporary) run dir, if any outlived us."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.pid != os.getpid() and any(
            a == "--run-dir" and b == str(run_dir) for a, b in itertools.pairwise(cmdline)
        ):
            found.append(process)
    return found


# -- the measured steps ------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def safetensors_load(bench: Bench, key_file: KeyFile) -> tuple[float, dict[str, torch.Tensor], float, float]:
    """Every shard with `load_file`, then the plan; total seconds, tensors, and the two parts in ms."""
    began = time.perf_counter()
    loaded: dict[str, torch.Tensor] = {}
    for shard in bench.shards:
        loaded.update(load_file(shard))
    read_done = time.perf_counter()
    plan = build_plan(key_file.plan, locate(bench.model).config, key_file.manifest)
    tensors = process_all(plan, loaded.__getitem__)
    ended = time.perf_counter()
    del loaded
    return ended - began, tensors, (read_done - began) * 1000, (ended - read_done) * 1000


def touch_pages(tensors: dict[str, torch.Tensor]) -> int:
    """Read one byte of every page of every tensor (faults the mapping in); a checksum so nothing is skipped."""
    total = 0
    for tensor in tensors.values():
        if tensor.numel():
            total += int(tensor.reshape(-1).view(torch.uint8)[::PAGE_BYTES].sum())
    return total


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        and a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        for n in a
    )


def measure_preload(bench: Bench, index: int, cache: str) -> None:
    """Raw read and a cold-store preload, both in the page-cache state `cache`; the daemon stays running."""
    set_cache(bench, cache)
    seconds, nbytes = timed(lambda: common.read_all(bench.shards))
    bench.record(RAW_READ, cache, seconds)
    if cache == DROPPED:
        set_cache(bench, cache)
    store_dir = bench.stores / f"preload-{index}-{cache}"
    seconds, ready = preload(bench, store_dir)
    load_s = max(float(r.get("load_s", 0.0)) for r in ready["ranks"])
    bench.record(PRELOAD, cache, seconds, supervisor=float(ready.get("seconds", 0.0)) * 1000)
    bench.record(RANK_LOAD, cache, load_s)
    assert nbytes == bench.checkpoint_bytes


def measure_restart(bench: Bench, store_dir: Path, check: bool) -> bool:
    """Every restart method once against the running daemon; copy attach last. True if the bytes agree."""
    spec = bench.spec
    ok = True
    with DigestStore.open(store_dir) as store:
        compared: dict[str, dict[str, torch.Tensor]] = {}

        def zero_copy(cache: str, touch: bool = False) -> None:
            began = time.perf_counter()
            weights = attach(bench.model, spec, run_dir=bench.run_dir, mode="zero_copy", store=store,
                             fallback=False)
            attached = time.perf_counter()
            parts = dict(weights.report.timings_ms)
            if touch:
                touch_pages(weights.tensors)
                parts["touch"] = (time.perf_counter() - attached) * 1000
            ended = time.perf_counter()
            if weights.report.outcome != "hit":
                raise RuntimeError(f"zero-copy attach did not hit: {weights.report.reason}")
            bench.record(ZERO_COPY_TOUCH if touch else ZERO_COPY, cache, ended - began, **parts)
            weights.close()  # ends the lease; CPU tensors stay readable while referenced
            if check and not touch and cache == WARM:
                compared[ZERO_COPY] = weights.tensors
            del weights

        # The first key computation of this process against the store the daemon just filled.
        zero_copy(WARM)
        key_file = compute_key(bench.model, spec, store=store)
        if key_file.stats.shards_hashed:
            bench.problems.append(f"the warm key hashed {key_file.stats.shards_hashed} shard(s)")

        set_cache(bench, WARM)
        seconds, tensors, read_ms, plan_ms = safetensors_load(bench, key_file)
        bench.record(ST_LOAD, WARM, seconds, load_file=read_ms, plan=plan_ms)
        if check:
            compared[ST_LOAD] = tensors
        del tensors

        set_cache(bench, WARM)
        seconds, tensors = timed(lambda: load_from_disk(key_file, bench.model))
        bench.record(WC_LOAD, WARM, seconds)
        if check:
            compared[WC_LOAD] = tensors
        del tensors

        if check:
            base = compared.pop(WC_LOAD)
            ok = all(same_bytes(base, other) for other in compared.values())
            compared.clear()
            del base
        gc.collect()

        zero_copy(WARM, touch=True)
        if bench.can_drop:
            set_cache(bench, DROPPED)
            zero_copy(DROPPED)
            set_cache(bench, DROPPED)
            seconds, tensors, read_ms, plan_ms = safetensors_load(bench, key_file)
            bench.record(ST_LOAD, DROPPED, seconds, load_file=read_ms, plan=plan_ms)
            del tensors
            set_cache(bench, DROPPED)
            seconds, tensors = timed(lambda: load_from_disk(key_file, bench.model))
            bench.record(WC_LOAD, DROPPED, seconds)
            del tensors
            gc.collect()

        set_cache(bench, WARM)
        began = time.perf_counter()
        weights = attach(bench.model, spec, run_dir=bench.run_dir, mode="copy", store=store, fallback=False)
        ended = time.perf_counter()
        if weights.report.outcome != "hit":
            raise RuntimeError(f"copy attach did not hit: {weights.report.reason}")
        bench.record(COPY, WARM, ended - began, **weights.report.timings_ms)
        weights.close()
        del weights
        gc.collect()
    return ok


# -- output ------------------------------------------------------------------------------------------------






def _faster(base: float, seconds: float) -> str:
    speed = base / seconds
    return f"{speed:,.1f}× faster" if speed >= 1 else f"{1 / speed:,.1f}× slower"


def _ms(value: float) -> str:
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def notes_for(row: str, cache: str, s: Samples, bench: Bench) -> str:
    if row == ST_LOAD:
        return f"load_file (lazy mmap) {_ms(s.part('load_file'))} ms + plan (reads) {_ms(s.part('plan'))} ms"
    if row == WC_LOAD:
        return "each tensor read once with pread; the plan writes each output once"
    if row in (ZERO_COPY, ZERO_COPY_TOUCH, COPY):
        text = (f"key {_ms(s.part('key'))} ‖ connect {_ms(s.part('connect'))}, map {_ms(s.part('map'))}")
        if "copy" in s.parts_ms:
            text += f", copy {_ms(s.part('copy'))}"
        if "touch" in s.parts_ms:
            text += f", then touch {_ms(s.part('touch'))}"
        text += f" ms (attach total {_ms(s.part('total'))} ms)"
        if row == COPY:
            text += "; releases the daemon's weights"
        return text
    if row == RAW_READ:
        return f"{bench.checkpoint_bytes / 1e6:,.1f} MB in {len(bench.shards)} shard(s)"
    if row == PRELOAD:
        ranks = bench.spec.tp_size
        text = (f"CLI → supervisor → {ranks} daemon(s), fresh digest store; "
                f"supervisor's own count {_ms(s.part('supervisor'))} ms")
        if cache == DROPPED:
            text += "; the drop evicted Python and torch too, so their imports read from disk"
        return text
    if row == RANK_LOAD:
        return "the daemon's load_s" + (" (slowest rank; each reads all shards)" if bench.spec.tp_size > 1 else "")
    return ""


def results_table(bench: Bench, title: str, baseline: tuple[str, str], caption: str) -> Table:
    table = Table(title=title, caption=caption, caption_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("phase", "left"), ("what", "left"), ("page cache", "left"), ("time", "right"), ("min–max", "right"),
        ("GB/s", "right"), ("vs baseline", "right"), ("notes", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "notes")
    caches = (WARM, DROPPED) if bench.can_drop else (WARM,)
    restart = [(r, c) for r in DISK_LOADS for c in caches]
    restart += [(ZERO_COPY, c) for c in caches] + [(ZERO_COPY_TOUCH, WARM), (COPY, WARM)]
    sections = {
        f"restart, rank 0 of TP {bench.spec.tp_size}": restart,
        "preload": [(r, c) for c in caches for r in (RAW_READ, PRELOAD, RANK_LOAD)],
    }
    base = bench.samples[baseline].median
    for phase, rows in sections.items():
        for i, (row, cache) in enumerate(rows):
            s = bench.samples[(row, cache)]
            rate = ("" if row in (ZERO_COPY, ZERO_COPY_TOUCH, COPY)
                    else common.fmt_rate(bench.checkpoint_bytes / s.median))
            if (row, cache) == baseline:
                versus = "baseline"
            elif phase == "preload":
                raw = bench.samples[(RAW_READ, cache)].median
                versus = "baseline" if row == RAW_READ else f"{raw / s.median:.2f}× raw read"
            else:
                versus = _faster(base, s.median)
            table.add_row(
                phase if i == 0 else "", row, cache, common.fmt_seconds(s.median),
                f"{common.fmt_seconds(min(s.seconds))}–{common.fmt_seconds(max(s.seconds))}", rate, versus,
                notes_for(row, cache, s, bench), end_section=i == len(rows) - 1,
            )
    return table


# -- main --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print the table; exit 1 when the tensors of the paths differ."""
    parser = common.preload_arguments(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size; rank 0 is measured (1)")
    parser.add_argument("--skip-drop", action="store_true",
                        help="measure with a warm page cache only (about half the run time)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.tp < 1:
        parser.error("--tp must be at least 1")
    if args.plan == "identity" and args.tp != 1:
        parser.error("the identity plan holds unsharded weights; use --tp 1 with --plan identity")

    console = Console() if sys.stdout.isatty() else Console(width=190)
    err = Console(stderr=True, soft_wrap=True)
    began = time.perf_counter()
    with common.workspace(args.workdir) as work:
        model_dir, run_dir, stores = work / "checkpoint", work / "run", work / "digest-stores"
        for owned in (model_dir, run_dir, stores):
            shutil.rmtree(owned, ignore_errors=True)
        stores.mkdir(parents=True)
        os.environ["WCACHE_CACHE_DIR"] = str(stores / "engine")  # nothing may touch the user's own store
        os.environ["WCACHE_RUN_DIR"] = str(run_dir)

        err.print(f"writing the {args.preset!r} checkpoint to {model_dir} ...")
        write_checkpoint(args.preset, model_dir)
        os.sync()
        shards = sorted(model_dir.glob("*.safetensors"))
        drop_problem = "skipped (--skip-drop)" if args.skip_drop else try_drop_caches()
        bench = Bench(
            model=model_dir, spec=PlanSpec(tp_size=args.tp, tp_rank=0, layout=args.plan), run_dir=run_dir,
            stores=stores, wcache_cli=common.wcache_command(), shards=shards,
            checkpoint_bytes=sum(p.stat().st_size for p in shards), can_drop=drop_problem is None,
        )
        written = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in model_dir.iterdir())
        # Receipts for files younger than the racy window are not trusted, so the warm key would miss.
        wait_s = common.RACY_WINDOW_S + 0.2 - (time.time_ns() - written) / 1e9
        if wait_s > 0:
            err.print(f"waiting {wait_s:.1f} s so the digest store trusts receipts (racy-git rule) ...")
            time.sleep(wait_s)

        consistent = True
        try:
            for i in range(args.repeat):
                if bench.can_drop:
                    err.print(f"[{i + 1}/{args.repeat}] page cache dropped: raw read, cold preload ...")
                    measure_preload(bench, i, DROPPED)
                    stop_daemons(bench)
                err.print(f"[{i + 1}/{args.repeat}] page cache warm: raw read, cold preload ...")
                measure_preload(bench, i, WARM)
                err.print(f"[{i + 1}/{args.repeat}] disk loads, zero-copy and copy attach ...")
                consistent &= measure_restart(bench, stores / f"preload-{i}-{WARM}", check=i == 0)
                stop_daemons(bench)
        finally:
            stop_daemons(bench)
            for process in our_leftovers(run_dir):
                bench.problems.append(f"leftover pid {process.pid} ({' '.join(process.cmdline()[:3])}) killed")
                with contextlib.suppress(psutil.Error):
                    process.kill()
    elapsed = time.perf_counter() - began

    baseline = min(((r, WARM) for r in DISK_LOADS), key=lambda k: bench.samples[k].median)
    if bench.can_drop:
        resident = max(bench.resident_after_drop)
        cache_note = (f"dropped: `echo 1 > {DROP_CACHES}` before the step; at most {resident:.1%} of the "
                      "checkpoint's pages stayed resident (mincore). The VM's host may still cache the disk.")
    else:
        cache_note = f"dropped page cache not measured: {drop_problem}."
    caption = (
        f"warm: checkpoint pages in the page cache. {cache_note}\n"
        f"Baseline of the restart rows: the faster warm disk load ({baseline[0]}); disk loads exclude the key. "
        f"Attach times are wall-clock around attach(); key ‖ connect run in parallel.\n"
        f"GB/s: checkpoint bytes / time. {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{bench.preloads} preloads, whole run {elapsed:.0f} s."
    )
    plan = f"{args.plan} plan" + ("" if args.tp == 1 else f", TP {args.tp}")
    title = (f"Restart {args.preset} ({bench.checkpoint_bytes / 1e9:,.2f} GB, {plan}, CPU daemon), "
             f"median of {args.repeat}")
    console.print(results_table(bench, title, baseline, caption))
    console.print(
        "processed tensors byte-identical (zero-copy attach, wcache disk load, safetensors + plan): "
        + ("[green]yes[/]" if consistent else "[red]NO[/]")
    )
    for problem in bench.problems:
        console.print(f"[yellow]note:[/] {problem}")
    speedup = bench.samples[baseline].median / bench.samples[(ZERO_COPY, WARM)].median
    verdict = "[bold green]PASS[/]" if speedup >= TARGET_ZERO_COPY_SPEEDUP else "[bold red]FAIL[/]"
    line = (f"[bold]zero-copy attach vs disk load ({baseline[0]}, page cache warm): {speedup:,.1f}×[/] "
            f"(target ≥ {TARGET_ZERO_COPY_SPEEDUP:g}×) {verdict}")
    if bench.can_drop:
        dropped = min(bench.samples[(r, DROPPED)].median for r in DISK_LOADS)
        zero_copy = bench.samples[(ZERO_COPY, WARM)].median
        line += f"; vs the faster disk load with the page cache dropped: {dropped / zero_copy:,.1f}×"
    console.print(line)
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
