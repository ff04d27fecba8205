"""Checkpoint fingerprint cost: vLLM 0.31 header-only hash vs wcache warm and cold keys, local and remote.

One run measures, side by side (interleaved, median of ``--repeat``):

* on a local directory and on the same directory behind ``latencyfs`` (every FUSE request sleeps
  ``--latency-ms``, emulating OSSFS-like round trips):
  (a) header-only fingerprint, vLLM 0.31's ``hash_checkpoint`` (opens every shard, no tensor bytes),
  (b) wcache warm key (every shard's digests come from the stat-validated digest store),
  (c) wcache cold key (every tensor byte hashed with BLAKE3, ``rehash=True``);
* on local disk with the page cache warm: wcache's cold-key hashing throughput against a plain read of
  the same shard files with large reads.

Run::

    .venv/bin/python benchmarks/fingerprint.py                     # many-shards preset, 20 ms, 3 repeats
    .venv/bin/python benchmarks/fingerprint.py --skip-fuse         # machines without FUSE
    .venv/bin/python benchmarks/fingerprint.py --compare-preset many-shards-2000   # + warm key at 2,000 shards

With ``--compare-preset``, a second table puts the warm keys of ``--preset`` and the compared preset side by
side, locally and behind latencyfs, with the ratio of the two and the same ratio for the bare stats of their
shards (as wide as the warm key issues them), which is what the emulator itself needs to answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bench_common import (
    RACY_WINDOW_S,
    READ_CHUNK_BYTES,
    benchmark_arguments,
    fmt_rate,
    fmt_seconds,
    read_all,
    speed_ratio,
    workspace,
)
from rich.console import Console, JustifyMethod
from rich.table import Table
from wcache.checkpoint.files import locate
from wcache.key.compute import compute_key
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import MAX_STAT_THREADS
from wcache.key.shard_hash import FileIdentity
from wcache_dev.synth import PRESETS, TRAINED_PRESET, write_checkpoint
from wcache_dev.vllm_compat import header_fingerprint

TARGET_WARM_SPEEDUP = 20.0
# Issue 11: a warm key's round trips do not grow with the shard count.
TARGET_SHARD_RATIO = 3.0

HEADER = "header-only (vLLM 0.31)"
WARM = "wcache warm key"
COLD = "wcache cold key"
METHODS = (HEADER, WARM, COLD)


@dataclass(slots=True)
class Samples:
    """Wall times of one method on one storage, and what each run reported."""

    seconds: list[float] = field(default_factory=list)
    results: set[str] = field(default_factory=set)
    notes: set[str] = field(default_factory=set)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def timed(fn: Callable[[], str]) -> tuple[float, str]:
    """Run ``fn`` once; its wall time and its result."""
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def measure_storage(model_dir: Path, store: DigestStore, repeat: int) -> dict[str, Samples]:
    """Interleave the three methods ``repeat`` times; the cold key runs first so it fills the store."""
    samples = {m: Samples() for m in METHODS}

    def cold() -> str:
        keyfile = compute_key(model_dir, store=store, rehash=True)
        samples[COLD].notes.add(f"{keyfile.stats.bytes_hashed / 1e6:,.1f} MB hashed")
        return keyfile.key.short_id

    def warm() -> str:
        keyfile = compute_key(model_dir, store=store)
        stats = keyfile.stats
        samples[WARM].notes.add(f"{stats.shards_from_store}/{stats.num_shards} shards from store")
        if stats.shards_hashed:
            samples[WARM].notes.add(f"MISS: {stats.shards_hashed} shards hashed")
        return keyfile.key.short_id

    def header() -> str:
        return header_fingerprint(model_dir)

    for _ in range(repeat):
        for method, fn in ((COLD, cold), (WARM, warm), (HEADER, header)):
            seconds, result = timed(fn)
            samples[method].seconds.append(seconds)
            samples[method].results.add(result)
    return samples


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sorted by name."""
    return sorted(model_dir.glob("*.safetensors"))




def measure_throughput(model_dir: Path, store: DigestStore, repeat: int) -> tuple[float, float, int]:
    """Median raw read and cold-key hashing rates (bytes/s) over local files with a warm page cache."""
    paths = shard_files(model_dir)
    read_all(paths)  # warm the page cache
    read_s: list[float] = []
    hash_s: list[float] = []
    hashed = 0
    for _ in range(repeat):
        began = time.perf_counter()
        nbytes = read_all(paths)
        read_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        hashed = compute_key(model_dir, store=store, rehash=True).stats.bytes_hashed
        hash_s.append(time.perf_counter() - began)
    return nbytes / statistics.median(read_s), hashed / statistics.median(hash_s), nbytes


def stat_latency(model_dir: Path, count: int = 10) -> float:
    """Mean seconds of one sequential ``os.stat`` of a shard (the per-shard cost without concurrency)."""
    path = shard_files(model_dir)[0]
    began = time.perf_counter()
    for _ in range(count):
        path.stat()
    return (time.perf_counter() - began) / count










@dataclass(slots=True)
class ScaleRow:
    """One preset's warm keys, locally and behind latencyfs, and the bare stats of its shards there."""

    preset: str
    shards: int
    first_stats_s: float
    first_key_s: float  # the first warm key through the mount: from the receipts, storing the root
    local: Samples = field(default_factory=Samples)
    remote: Samples = field(default_factory=Samples)
    stats_alone: Samples = field(default_factory=Samples)


def seed_receipts(local_dir: Path, mnt: Path, store: DigestStore) -> tuple[float, float]:
    """Give the files as the mount shows them the receipts of the same local files, then take one key through
    the mount; seconds their first stats took, and seconds that key took.

    A mount has its own st_dev, so local receipts do not cover it, and hashing 2,000 shards through it takes
    minutes. Inode, size and times are the local file's, and so are the bytes: these are the receipts a cold
    key through the mount would store. The stats are the mount's first: the kernel looks up a name it has not
    seen one at a time per directory (libfuse 2 offers no parallel lookups), so they are timed apart. The key
    stores the Merkle root of the mount's state, as a cold key through it would have: every warm key after it
    returns that root.
    """
    local, remote = locate(local_dir).shards, locate(mnt).shards
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(MAX_STAT_THREADS, len(remote))) as pool:
        identities = [FileIdentity.of(st) for st in pool.map(os.stat, remote)]
    first_stats_s = time.perf_counter() - began
    records = store.lookup_many([(path, FileIdentity.of(os.stat(path))) for path in local])
    if len(records) != len(local):
        raise RuntimeError(f"{len(local) - len(records)} shards of {local_dir} have no trusted receipt to copy")
    store.put_many([
        dataclasses.replace(records[here], path=there, identity=identity)
        for here, there, identity in zip(local, remote, identities, strict=True)
    ])
    began = time.perf_counter()
    first = compute_key(mnt, store=store)
    first_key_s = time.perf_counter() - began
    if first.stats is None or first.stats.shards_hashed:
        raise RuntimeError(f"the first key through {mnt} hashed shards: its receipts were not used")
    return first_stats_s, first_key_s


def stat_fanout(paths: list[Path]) -> str:
    """Stat every path as wide as the warm key does, and nothing else: what the storage itself needs."""
    with ThreadPoolExecutor(max_workers=min(MAX_STAT_THREADS, len(paths))) as pool:
        return f"{sum(st.st_size for st in pool.map(os.stat, paths)):,} bytes"


def warm_key(model_dir: Path, store: DigestStore, samples: Samples) -> str:
    """The key from the store alone; a shard that had to be hashed is noted as a miss, a key that did not come
    from the stored root as such."""
    keyfile = compute_key(model_dir, store=store)
    if keyfile.stats.shards_hashed:
        samples.notes.add(f"MISS: {keyfile.stats.shards_hashed} shards hashed")
    elif not keyfile.stats.root_from_store:
        samples.notes.add("root rebuilt from receipts")
    return keyfile.key.short_id


def measure_scale(
    presets: dict[str, Path], store: DigestStore, latency_ms: float, repeat: int
) -> list[ScaleRow]:
    """Warm keys of each preset, locally and behind its own latencyfs mount, interleaved ``repeat`` times."""
    from latencyfs import mounted  # the caller has checked that FUSE works here

    with contextlib.ExitStack() as stack:
        rows: list[tuple[ScaleRow, Path, Path]] = []
        for preset, local_dir in presets.items():
            compute_key(local_dir, store=store)  # receipts for the local files (a cold key where none exist)
            mnt = stack.enter_context(mounted(local_dir, latency_ms))
            row = ScaleRow(preset, len(locate(local_dir).shards), *seed_receipts(local_dir, mnt, store))
            rows.append((row, local_dir, mnt))

        for _ in range(repeat):
            for row, local_dir, mnt in rows:
                for samples, fn in (
                    (row.local, partial(warm_key, local_dir, store, row.local)),
                    (row.remote, partial(warm_key, mnt, store, row.remote)),
                    (row.stats_alone, partial(stat_fanout, list(locate(mnt).shards))),
                ):
                    seconds, result = timed(fn)
                    samples.seconds.append(seconds)
                    samples.results.add(result)
        return [row for row, _, _ in rows]


def scale_table(title: str, rows: list[ScaleRow]) -> Table:
    """Warm keys against shard count: each preset's times and their ratio to the first preset's."""
    table = Table(title=title)
    base = rows[0]
    table.add_column("preset")
    table.add_column("shards", justify="right")
    for name in ("warm key, local", "warm key, latencyfs", f"vs {base.shards}", "stats alone, latencyfs",
                 f"vs {base.shards}", "notes"):
        table.add_column(name, justify="left" if name == "notes" else "right", no_wrap=name != "notes")
    for row in rows:
        notes = [f"first stats through a new mount: {fmt_seconds(row.first_stats_s)}",
                 f"first key through it (receipts, root stored): {fmt_seconds(row.first_key_s)}",
                 *sorted(row.local.notes | row.remote.notes)]
        table.add_row(
            row.preset, f"{row.shards:,}", fmt_seconds(row.local.median), fmt_seconds(row.remote.median),
            f"{row.remote.median / base.remote.median:.2f}×", fmt_seconds(row.stats_alone.median),
            f"{row.stats_alone.median / base.stats_alone.median:.2f}×", "; ".join(notes),
        )
    return table


def results_table(title: str, storages: dict[str, dict[str, Samples]], stat_s: dict[str, float]) -> Table:
    """The fingerprinting table: each storage's three methods and their ratio to header-only."""
    table = Table(title=title)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("storage", "left"),
        ("method", "left"),
        ("time", "right"),
        ("min–max", "right"),
        ("vs header-only", "right"),
        ("notes", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "notes")
    for name, samples in storages.items():
        base = samples[HEADER].median
        for i, method in enumerate(METHODS):
            s = samples[method]
            if method == HEADER:
                notes = f"one sequential stat: {fmt_seconds(stat_s[name])}"
            else:
                notes = ", ".join(sorted(s.notes))
            table.add_row(
                name if i == 0 else "",
                method,
                fmt_seconds(s.median),
                f"{fmt_seconds(min(s.seconds))}–{fmt_seconds(max(s.seconds))}",
                "1.0×" if method == HEADER else speed_ratio(base, s.median),
                notes,
                end_section=i == len(METHODS) - 1,
            )
    return table


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print the tables; exit 1 when keys disagree across storages."""
    parser = benchmark_arguments(__doc__.splitlines()[0], "many-shards")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="latencyfs sleep per request (20)")
    parser.add_argument("--skip-fuse", action="store_true", help="measure local storage only")
    parser.add_argument(
        "--throughput-preset",
        default=None,
        help="preset for the throughput section (default: --preset); qwen3-0.6b (1.5 GB) measures "
        "bandwidth rather than per-file overhead",
    )
    parser.add_argument(
        "--compare-preset",
        default=None,
        help="also time the warm key of this preset (many-shards-2000: 2,000 shards) beside --preset's, locally "
        "and behind latencyfs, and print their ratio; only warm keys, so 2,000 shards take about a minute",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.latency_ms < 0:
        parser.error("--latency-ms must not be negative")
    for option, preset in (("--preset", args.preset), ("--compare-preset", args.compare_preset)):
        if preset is not None and preset not in (*PRESETS, TRAINED_PRESET):
            parser.error(f"{option}: unknown preset {preset!r}; choose one of {', '.join([*PRESETS, TRAINED_PRESET])}")
    if args.compare_preset is not None and args.skip_fuse:
        parser.error("--compare-preset measures behind latencyfs; it cannot be combined with --skip-fuse")
    if args.compare_preset == args.preset:
        parser.error("--compare-preset must differ from --preset")

    # Rich falls back to 80 columns when stdout is not a terminal; the table needs more to stay readable.
    console = Console() if sys.stdout.isatty() else Console(width=140)
    err = Console(stderr=True, soft_wrap=True)
    if not args.skip_fuse:
        # Imported here so --skip-fuse works where fusepy or libfuse 2 is missing.
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            from latencyfs import fuse_available
        except (ImportError, OSError) as exc:  # latencyfs imports fusepy at its top
            problem: str | None = f"fusepy cannot be imported ({exc}); pip install fusepy and apt-get install libfuse2"
        else:
            problem = fuse_available()
        if problem is not None:
            err.print(f"latencyfs cannot run here: {problem}. Use --skip-fuse.")
            return 2

    tput_preset = args.throughput_preset or args.preset
    with workspace(args.workdir) as work:
        model_dir = work / "checkpoint"
        tput_dir = model_dir if tput_preset == args.preset else work / "throughput-checkpoint"
        compare_dir = work / "compare-checkpoint"
        store_dir = work / "digest-store"
        for owned in {model_dir, tput_dir, compare_dir, store_dir}:
            shutil.rmtree(owned, ignore_errors=True)
        os.environ["WCACHE_CACHE_DIR"] = str(store_dir)  # nothing may touch the user's own store

        err.print(f"writing the {args.preset!r} checkpoint to {model_dir} ...")
        write_checkpoint(args.preset, model_dir)
        if tput_dir != model_dir:
            err.print(f"writing the {tput_preset!r} checkpoint to {tput_dir} ...")
            write_checkpoint(tput_preset, tput_dir)
        if args.compare_preset is not None:
            err.print(f"writing the {args.compare_preset!r} checkpoint to {compare_dir} ...")
            write_checkpoint(args.compare_preset, compare_dir)
        shards = shard_files(model_dir)
        total_bytes = sum(p.stat().st_size for p in shards)
        written = max(
            max(p.stat().st_mtime_ns, p.stat().st_ctime_ns)
            for d in (model_dir, compare_dir) if d.exists() for p in d.iterdir()
        )
        # Receipts for files younger than the racy window are not trusted, so the warm key would miss.
        wait_s = RACY_WINDOW_S + 0.2 - (time.time_ns() - written) / 1e9
        if wait_s > 0:
            err.print(f"waiting {wait_s:.1f} s so the digest store trusts receipts (racy-git rule) ...")
            time.sleep(wait_s)

        storages: dict[str, dict[str, Samples]] = {}
        stat_s: dict[str, float] = {}
        remote = f"latencyfs {args.latency_ms:g} ms"
        with DigestStore.open(store_dir) as store:
            err.print(f"local: raw read vs cold-key hashing of {tput_preset!r} ...")
            read_rate, hash_rate, nbytes = measure_throughput(tput_dir, store, args.repeat)
            err.print("local: header-only, warm key, cold key ...")
            storages["local"] = measure_storage(model_dir, store, args.repeat)
            stat_s["local"] = stat_latency(model_dir)
            if not args.skip_fuse:
                err.print(f"{remote}: header-only, warm key, cold key ...")
                from latencyfs import mounted  # fuse_available() said it imports

                with mounted(model_dir, args.latency_ms) as mnt:
                    storages[remote] = measure_storage(mnt, store, args.repeat)
                    stat_s[remote] = stat_latency(mnt)
            scale: list[ScaleRow] = []
            if args.compare_preset is not None:
                err.print(f"{remote}: warm keys of {args.preset!r} and {args.compare_preset!r} ...")
                scale = measure_scale(
                    {args.preset: model_dir, args.compare_preset: compare_dir}, store, args.latency_ms, args.repeat
                )

    # Every storage and every run must agree: same content, same key, same header fingerprint.
    agree = {m: set().union(*(s[m].results for s in storages.values())) for m in (HEADER, WARM)}
    agree[WARM] |= set().union(*(s[COLD].results for s in storages.values()))
    if scale:
        agree[WARM] |= scale[0].local.results | scale[0].remote.results
        for row in scale[1:]:
            agree[f"{row.preset} warm key"] = row.local.results | row.remote.results
    consistent = all(len(v) == 1 for v in agree.values())

    title = f"Fingerprinting {args.preset}: {len(shards)} shards, {total_bytes / 1e6:,.1f} MB, median of {args.repeat}"
    console.print(results_table(title, storages, stat_s))

    tput = Table(
        title=f"Hashing throughput: {tput_preset}, local disk, page cache warm, median of {args.repeat}",
        min_width=100,
        caption=(
            "small checkpoint: per-file costs dominate; --throughput-preset qwen3-0.6b measures bandwidth"
            if nbytes < 256e6
            else None
        ),
    )
    tput.add_column("what")
    tput.add_column("rate", justify="right")
    tput.add_column("vs raw read", justify="right")
    tput.add_row(f"raw read ({READ_CHUNK_BYTES >> 20} MiB reads, {nbytes / 1e6:,.1f} MB)", fmt_rate(read_rate), "1.00")
    tput.add_row("wcache cold key (BLAKE3 of every tensor)", fmt_rate(hash_rate), f"{hash_rate / read_rate:.2f}")
    console.print(tput)

    console.print(
        "keys and header fingerprints identical across storages and runs: "
        + ("[green]yes[/]" if consistent else f"[red]NO[/] {agree}")
    )
    if not args.skip_fuse:
        speedup = storages[remote][HEADER].median / storages[remote][WARM].median
        verdict = "[bold green]PASS[/]" if speedup >= TARGET_WARM_SPEEDUP else "[bold red]FAIL[/]"
        console.print(
            f"[bold]warm key vs header-only, {len(shards)} shards at {args.latency_ms:g} ms per request: "
            f"{speedup:,.1f}× faster[/] (target ≥ {TARGET_WARM_SPEEDUP:g}×) {verdict}"
        )
    if scale:
        console.print(scale_table(
            f"Warm key against shard count: {remote} per request, median of {args.repeat}", scale
        ))
        base, big = scale[0], scale[-1]
        ratio = big.remote.median / base.remote.median
        verdict = "[bold green]PASS[/]" if ratio <= TARGET_SHARD_RATIO else "[bold red]FAIL[/]"
        # What the ratio would be if the only cost that grows with the shards were the emulator's own stats:
        # the small preset's warm key with the big preset's bare stats in place of its own.
        floor = (base.remote.median - base.stats_alone.median + big.stats_alone.median) / base.remote.median
        console.print(
            f"[bold]warm key, {big.shards:,} shards against {base.shards:,} at {args.latency_ms:g} ms per request: "
            f"{ratio:.2f}×[/] (target ≤ {TARGET_SHARD_RATIO:g}×) {verdict}; the stats alone through the same "
            f"mount: {big.stats_alone.median / base.stats_alone.median:.2f}×, so the mount's stats alone put "
            f"the ratio at {floor:.2f}× (the {base.shards:,}-shard key with {big.shards:,} shards' bare stats)"
        )
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
