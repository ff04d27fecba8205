"""Preload against its floor: the steps it cannot skip on these bytes, and cold and warm preloads, in one run.

Floor terms, each measured in this run (median of ``--repeat``):

* raw read of the shard files with the page cache dropped (16 MiB reads into one reused buffer);
* the kernel giving an arena of the plan's size its pages: ``posix_fallocate`` of a fresh memfd;
* BLAKE3 of every checkpoint byte, multi-threaded, from memory;
* process start-up: ``wcache preload`` of the tiny preset, start to READY (CLI, supervisor, daemon imports).

One more term is printed but is not part of the floor: the arena fill, the arena's bytes written from memory into
a fresh memfd with 4 MiB ``pwrite`` calls (what a preload does). It is what fallocate leaves out, the kernel's copy
into each 4 KiB shmem page, and a memfd takes one write at a time; the last column holds each rank load against it.

Preloads (``wcache preload --detach --json``, start to READY, each on a fresh digest store unless said):

* cold: page cache dropped first; its floor is the slowest of read, fallocate and BLAKE3 (each file's SHA-256 is
  read after READY, the verdict following it);
* cold, ``--require-provenance``: the same, each file's SHA-256 streamed in the pass, before READY;
* warm: checkpoint pages in the page cache; its floor is the slower of fallocate and BLAKE3, plus start-up;
* warm, receipts stored: as warm, on the store the warm preload filled (the key is known before any read).

Each preload row also shows the rank's own ``load_s`` against the same floor without start-up, and against
max(arena fill, BLAKE3): the issue's target for a preload whose receipts are stored is 1.25× that. A last, untimed
cold preload samples memory every 50 ms: the daemon's anonymous RSS plus the pages its arena memfd holds plus the
checkpoint's pages left in the page cache, against the arena's size.

Run::

    .venv/bin/python benchmarks/preload_floor.py                   # qwen3-0.6b (1.5 GB), fused, 3 repeats
    .venv/bin/python benchmarks/preload_floor.py --preset small --repeat 1
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_common as common
import blake3
import psutil
import torch
from restart import our_leftovers, resident_fraction, try_drop_caches
from rich.console import Console, JustifyMethod
from rich.table import Table
from wcache.checkpoint.files import locate
from wcache.ipc.arenas.daemon_side import plan_layout
from wcache.key.compute import compute_key
from wcache.plan.processing import build_plan
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import write_checkpoint

TARGET_RATIO = 1.25
STOP_GRACE_S = 10.0
SAMPLE_EVERY_S = 0.05

RAW_READ = "raw read, page cache dropped"
FALLOCATE = "arena pages (memfd posix_fallocate)"
BLAKE3 = "BLAKE3 of every byte (multi-threaded)"
STARTUP = "process start-up (tiny preset preload)"
ARENA_FILL = "arena fill (pwrite into a fresh memfd)"
COLD = "cold preload, start → READY"
COLD_LOAD = "  rank load_s"
COLD_REQUIRE = "cold, --require-provenance"
COLD_REQUIRE_LOAD = "  rank load_s   "
WARM = "warm preload, start → READY"
WARM_LOAD = "  rank load_s "
WARM_STORE = "warm preload, receipts stored"
WARM_STORE_LOAD = "  rank load_s  "
FLOOR_ROWS = (RAW_READ, FALLOCATE, BLAKE3, STARTUP, ARENA_FILL)
WRITE_BYTES = 4 * 1024 * 1024  # the preload's write size (shard_hash.CHUNK_BYTES)


@dataclass(slots=True)
class Bench:
    model: Path
    tiny: Path
    spec: PlanSpec
    run_dir: Path
    stores: Path
    cli: list[str]
    shards: list[Path]
    checkpoint_bytes: int
    arena_bytes: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    spawned: list[psutil.Process] = field(default_factory=list)
    preloads: int = 0

    def record(self, row: str, seconds: float) -> None:
        self.samples.setdefault(row, []).append(seconds)

    def median(self, row: str) -> float:
        return statistics.median(self.samples[row])


def drop_caches() -> None:
    reason = try_drop_caches()
    if reason is not None:
        raise SystemExit(f"this benchmark needs a dropped page cache: {reason}")


def timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def fallocate_arena(nbytes: int) -> float:
    fd = os.memfd_create("wcache-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return timed(lambda: os.posix_fallocate(fd, 0, nbytes))
    finally:
        os.close(fd)


def fill_arena(buffer: torch.Tensor, nbytes: int) -> float:
    """`nbytes` of `buffer` pwritten into a fresh memfd, WRITE_BYTES at a time."""
    data = memoryview(buffer.numpy())
    fd = os.memfd_create("wcache-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)

        def fill() -> None:
            for offset in range(0, nbytes, WRITE_BYTES):
                os.pwrite(fd, data[offset % len(data) :][: min(WRITE_BYTES, nbytes - offset)], offset)

        return timed(fill)
    finally:
        os.close(fd)


def shmem_huge_pages() -> str:
    """The kernel's transparent huge page mode for shmem (memfds), e.g. "never"."""
    with contextlib.suppress(OSError):
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
        return next((w.strip("[]") for w in text.split() if w.startswith("[")), text.strip())
    return "unknown"


def blake3_all(buffer: torch.Tensor) -> float:
    data = buffer.numpy()
    return timed(lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest())


def checkpoint_in_memory(shards: list[Path], nbytes: int) -> torch.Tensor:
    """Every shard's bytes in one faulted buffer, so BLAKE3 is timed on memory, not on I/O or page faults."""
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    offset = 0
    for path in shards:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view[offset:]):
                offset += n
    return buffer


def preload(bench: Bench, model: Path, store_dir: Path,
            sampler: MemorySampler | None = None, *extra: str) -> tuple[float, float]:
    """`wcache preload --detach` of `model`; (seconds from start to READY, the slowest rank's load_s)."""
    bench.preloads += 1
    command = [*bench.cli, "preload", str(model), "--detach", "--json", "--run-dir", str(bench.run_dir),
               "--plan", bench.spec.layout, *extra]
    env = {**os.environ, "WCACHE_CACHE_DIR": str(store_dir)}
    try:
        seconds, ready = common.timed_preload(command, env, bench.run_dir, bench.spawned,
                                       on_start=sampler.start if sampler is not None else None)
    finally:
        if sampler is not None:
            sampler.stop()
    return seconds, max(float(r.get("load_s", 0.0)) for r in ready["ranks"])


def stop_daemons(bench: Bench) -> None:
    """`wcache stop --all --force`, then end whatever of ours is still running (by pid, never by name)."""
    common.stop_preloaded(bench.cli, bench.run_dir, bench.spawned)


class MemorySampler:
    """Peak of (daemon anonymous RSS + pages its arena memfd holds + checkpoint pages in the page cache)."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.peak = 0
        self.peak_parts = (0, 0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, cli_pid: int) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(cli_pid,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _daemons(self, cli_pid: int) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return [p for p in psutil.Process(cli_pid).children(recursive=True) if "wcache.daemon" in p.cmdline()]
        return []

    def _sample(self, daemons: list[psutil.Process]) -> None:
        anon = 0
        arenas: dict[int, int] = {}  # by inode: a daemon may hold its memfd under more than one descriptor
        for daemon in daemons:
            with contextlib.suppress(OSError, psutil.Error):
                for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        anon += int(line.split()[1]) * 1024
                for entry in Path(f"/proc/{daemon.pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if "memfd:wcache-arena" in str(entry.readlink()):
                            st = os.stat(entry)
                            arenas[st.st_ino] = st.st_blocks * 512
        arena = sum(arenas.values())
        cached = int(resident_fraction(self.bench.shards) * self.bench.checkpoint_bytes)
        if anon + arena + cached > self.peak:
            self.peak, self.peak_parts = anon + arena + cached, (anon, arena, cached)

    def _run(self, cli_pid: int) -> None:
        daemons: list[psutil.Process] = []
        while not self._stop.wait(SAMPLE_EVERY_S):
            daemons = daemons or self._daemons(cli_pid)
            self._sample(daemons)


def measure_floor(bench: Bench, in_memory: torch.Tensor) -> None:
    drop_caches()
    bench.record(RAW_READ, timed(lambda: common.read_all(bench.shards)))
    bench.record(FALLOCATE, fallocate_arena(bench.arena_bytes))
    bench.record(BLAKE3, blake3_all(in_memory))
    bench.record(ARENA_FILL, fill_arena(in_memory, bench.arena_bytes))
    common.read_all([p for p in bench.tiny.iterdir() if p.is_file()])
    seconds, _ = preload(bench, bench.tiny, bench.stores / f"tiny-{bench.preloads}")
    bench.record(STARTUP, seconds)
    stop_daemons(bench)


def measure_preloads(bench: Bench, index: int) -> None:
    drop_caches()
    seconds, load_s = preload(bench, bench.model, bench.stores / f"cold-{index}")
    bench.record(COLD, seconds)
    bench.record(COLD_LOAD, load_s)
    stop_daemons(bench)
    drop_caches()
    seconds, load_s = preload(bench, bench.model, bench.stores / f"cold-require-{index}", None,
                              "--require-provenance")
    bench.record(COLD_REQUIRE, seconds)
    bench.record(COLD_REQUIRE_LOAD, load_s)
    stop_daemons(bench)
    common.read_all(bench.shards)
    warm_store = bench.stores / f"warm-{index}"
    seconds, load_s = preload(bench, bench.model, warm_store)
    bench.record(WARM, seconds)
    bench.record(WARM_LOAD, load_s)
    stop_daemons(bench)
    common.read_all(bench.shards)
    seconds, load_s = preload(bench, bench.model, warm_store)
    bench.record(WARM_STORE, seconds)
    bench.record(WARM_STORE_LOAD, load_s)
    stop_daemons(bench)


def results_table(bench: Bench, title: str, caption: str) -> Table:
    table = Table(title=title, caption=caption, caption_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("step", "left"), ("time", "right"), ("min–max", "right"), ("GB/s", "right"), ("vs its floor", "right"),
        ("floor", "left"), ("vs max(fill, BLAKE3)", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    m = bench.median
    cold_floor = max(m(RAW_READ), m(FALLOCATE), m(BLAKE3))
    warm_floor = max(m(FALLOCATE), m(BLAKE3))
    floors = {
        COLD: (cold_floor + m(STARTUP), "max(read, fallocate, BLAKE3) + start-up"),
        COLD_LOAD: (cold_floor, "max(read, fallocate, BLAKE3)"),
        COLD_REQUIRE: (cold_floor + m(STARTUP), "max(read, fallocate, BLAKE3) + start-up"),
        COLD_REQUIRE_LOAD: (cold_floor, "max(read, fallocate, BLAKE3)"),
        WARM: (warm_floor + m(STARTUP), "max(fallocate, BLAKE3) + start-up"),
        WARM_LOAD: (warm_floor, "max(fallocate, BLAKE3)"),
        WARM_STORE: (warm_floor + m(STARTUP), "max(fallocate, BLAKE3) + start-up"),
        WARM_STORE_LOAD: (warm_floor, "max(fallocate, BLAKE3)"),
    }
    sized = {FALLOCATE: bench.arena_bytes, ARENA_FILL: bench.arena_bytes, STARTUP: 0}
    loads = (COLD_LOAD, COLD_REQUIRE_LOAD, WARM_LOAD, WARM_STORE_LOAD)
    fill_or_hash = max(m(ARENA_FILL), m(BLAKE3))
    rows = [*FLOOR_ROWS, COLD, COLD_LOAD, COLD_REQUIRE, COLD_REQUIRE_LOAD, WARM, WARM_LOAD, WARM_STORE,
            WARM_STORE_LOAD]
    for row in rows:
        seconds = bench.samples[row]
        nbytes = sized.get(row, bench.checkpoint_bytes)
        floor, floor_text = floors.get(row, (0.0, ""))
        table.add_row(
            row, common.fmt_seconds(m(row)), f"{common.fmt_seconds(min(seconds))}–{common.fmt_seconds(max(seconds))}",
            common.fmt_rate(nbytes / m(row)) if nbytes else "", f"{m(row) / floor:.2f}×" if floor else "", floor_text,
            f"{m(row) / fill_or_hash:.2f}×" if row in loads else "",
            end_section=row in (ARENA_FILL, COLD_LOAD, COLD_REQUIRE_LOAD, WARM_LOAD),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = common.preload_arguments(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    console = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True, soft_wrap=True)
    began = time.perf_counter()
    with common.workspace(args.workdir) as work:
        model, tiny, run_dir, stores = work / "checkpoint", work / "tiny", work / "run", work / "digest-stores"
        for owned in (model, tiny, run_dir, stores):
            shutil.rmtree(owned, ignore_errors=True)
        stores.mkdir(parents=True)
        os.environ["WCACHE_RUN_DIR"] = str(run_dir)
        err.print(f"writing the {args.preset!r} checkpoint to {model} ...")
        write_checkpoint(args.preset, model)
        write_checkpoint("tiny", tiny)
        os.sync()
        spec = PlanSpec(layout=args.plan)
        key_file = compute_key(model, spec)
        plan = build_plan(key_file.plan, locate(model).config, key_file.manifest)
        _, arena_bytes = plan_layout([(o.name, o.dtype, o.shape, o.nbytes) for o in plan.outputs])
        shards = sorted(model.glob("*.safetensors"))
        bench = Bench(model=model, tiny=tiny, spec=spec, run_dir=run_dir, stores=stores, cli=common.wcache_command(),
                      shards=shards, checkpoint_bytes=sum(p.stat().st_size for p in shards),
                      arena_bytes=arena_bytes)
        in_memory = checkpoint_in_memory(shards, bench.checkpoint_bytes)
        time.sleep(common.RACY_WINDOW_S + 0.2)  # so that the stored receipts of the last row are trusted
        sampler = MemorySampler(bench)
        try:
            for i in range(args.repeat):
                err.print(f"[{i + 1}/{args.repeat}] floor terms ...")
                measure_floor(bench, in_memory)
                err.print(f"[{i + 1}/{args.repeat}] cold (also --require-provenance), warm, receipts-stored preloads")
                measure_preloads(bench, i)
            err.print("memory: one more cold preload, sampled every 50 ms ...")
            drop_caches()
            preload(bench, model, stores / "memory", sampler)
            left = resident_fraction(shards)
            stop_daemons(bench)
        finally:
            stop_daemons(bench)
            for process in our_leftovers(run_dir):
                with contextlib.suppress(psutil.Error):
                    process.kill()
    elapsed = time.perf_counter() - began
    anon, arena, cached = sampler.peak_parts
    m = bench.median
    store_ratio = m(WARM_STORE_LOAD) / max(m(ARENA_FILL), m(BLAKE3))
    cold_ratio = m(COLD) / m(COLD_REQUIRE)
    caption = (
        f"GB/s: checkpoint bytes ({bench.checkpoint_bytes / 1e9:,.2f} GB) / time; fallocate: arena bytes "
        f"({bench.arena_bytes / 1e9:,.2f} GB) / time. Drops: `echo 1 > /proc/sys/vm/drop_caches`.\n"
        f"Memory during a cold preload: peak {sampler.peak / bench.arena_bytes:.2f}× the arena (daemon anonymous "
        f"RSS {anon / 1e9:.2f} GB + arena memfd {arena / 1e9:.2f} GB + checkpoint page cache {cached / 1e9:.2f} "
        f"GB at the peak sample); {left:.0%} of the checkpoint's pages stayed cached after READY.\n"
        f"Transparent huge pages for shmem: {shmem_huge_pages()}.\n"
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {bench.preloads} preloads, whole run {elapsed:.0f} s. "
        f"Target: each preload within {TARGET_RATIO}× of its floor; receipts stored: the rank's load within "
        f"{TARGET_RATIO}× of max(arena fill, BLAKE3) ({store_ratio:.2f}×); "
        f"cold to READY with the SHA-256 after READY against --require-provenance: {cold_ratio:.2f}×."
    )
    title = f"Preload {args.preset} vs its floor ({args.plan} plan, CPU daemon), median of {args.repeat}"
    console.print(results_table(bench, title, caption))
    return 0


if __name__ == "__main__":
    sys.exit(main())
