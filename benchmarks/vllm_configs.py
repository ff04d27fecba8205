"""vLLM (CPU build) in the configurations people run: `load_format="auto"` against a wcache hit, in one run.

For each configuration in ``CONFIGS`` (a checkpoint, a TP size, the `wcache preload` options that serve it and
the environment vLLM needs) this preloads the daemons, then starts vLLM twice in fresh processes (greedy, the
same prompts, ``enforce_eager``, 1 GiB of KV cache): with its default loader, and with ``load_format="wcache"``
and ``"fallback": false``. It prints two tables:

* the configurations: vLLM's weight phase for ``auto`` and for the hit, the share of vLLM's parameters that are
  the daemon's tensors (zero-copy, every rank), the hit engine's private memory added by building the model
  and attaching (before vLLM's post-processing; the largest rank), the weights each rank holds, and whether
  the greedy tokens equal;
* vLLM's start-up broken into phases, read from vLLM's own log lines (timestamped to the millisecond through
  vLLM's ``VLLM_LOGGING_PREFIX``): imports up to vLLM's first line; engine core and worker start up to the last
  rank's "Starting to load model"; the weight phase, up to where vLLM's "init engine (profile, create kv cache,
  warmup model) took X s" began; that line's X (memory profiling, KV cache, warm-up); the front end's set-up
  until `LLM(...)` returns; and generating the tokens (vLLM's shutdown after them is left out).

A new configuration is one more ``Config`` in ``CONFIGS``, with its own checkpoint writer; the pre-quantized and
MoE rows use their own tiny presets whatever ``--preset`` says (`own_preset`).

Run under the machine's vLLM lock (one vLLM at a time)::

    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_configs.py                  # qwen3-0.6b
    flock /tmp/wcache-vllm.lock .venv/bin/python benchmarks/vllm_configs.py --preset small   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import fmt_seconds, workspace
from rich.console import Console
from rich.table import Table
from wcache.integrations.vllm.runner import VllmRun, VllmRunError, greedy_tokens
from wcache.verify import default_prompts
from wcache_dev.synth import PRESETS, write_byte_tokenizer, write_checkpoint

NUM_PROMPTS = 2
MAX_NEW_TOKENS = 8
# vLLM puts its prefix in front of its log format: the record's epoch time with milliseconds.
TIMESTAMPED = {"VLLM_LOGGING_PREFIX": "%(created).3f "}
_LINE = re.compile(r"^(\d+\.\d{3}) \((\S+) pid=(\d+)\) \w+ .*?\] (.*)$")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_PLACED = re.compile(r"for TP rank (\d+) of \d+: (\d+) of (\d+) parameters are the daemon's tensors")
_PRIVATE = re.compile(r"for TP rank (\d+) of .*private memory grew by ([\d.]+) MiB")
PHASES = ("imports", "engine core and worker start", "weight phase", "memory profiling, KV cache, warm-up",
          "front end set-up", "generation")


@dataclass(frozen=True, slots=True)
class Config:
    """One row: the checkpoint it writes, how vLLM runs it, and how `wcache preload` serves it."""

    name: str
    write: Callable[[Path, str], Path]  # (directory, preset) -> checkpoint
    tp: int = 1
    preload: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


def dense(dest: Path, preset: str) -> Path:
    """The preset as written by wcache_dev.synth, with a byte-level tokenizer for vLLM when it has none."""
    model = write_checkpoint(preset, dest)
    if not (model / "tokenizer.json").exists():
        write_byte_tokenizer(model, PRESETS[preset].config)
    return model


def own_preset(preset: str) -> Callable[[Path, str], Path]:
    """A writer of `preset` itself whatever --preset asks: the pre-quantized and MoE checkpoints exist as tiny
    presets only (wcache_dev.synth)."""

    def write(dest: Path, _: str) -> Path:
        return dense(dest, preset)

    return write


# vLLM's CPU workers at TP 2 need a core each bound (it refuses otherwise).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
MOE = own_preset("small-moe")  # one writer: both MoE rows share its checkpoint
CONFIGS: list[Config] = [
    Config("dense bf16, TP 1", dense),
    Config("dense bf16, TP 2", dense, tp=2, preload=("--tp", "2"), env=TP2_ENV),
    Config("int8 W8A8 (small-w8a8), TP 1", own_preset("small-w8a8")),
    Config("Qwen3-MoE (small-moe), TP 1", MOE),
    Config("Qwen3-MoE (small-moe), TP 2", MOE, tp=2, preload=("--tp", "2"), env=TP2_ENV),
]


@dataclass(frozen=True, slots=True)
class EngineRun:
    tokens: list[list[int]]
    phases: dict[str, float]
    placed: dict[int, tuple[int, int]]  # rank -> (the daemon's tensors, parameters)
    private_mib: dict[int, float]  # rank -> private memory added before post-processing


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`greedy_tokens` hands this process's environment to vLLM."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def phases(log: str, began: float, ready: float, generated: float) -> dict[str, float]:
    lines = [(float(m[1]), m[4]) for line in log.splitlines() if (m := _LINE.match(line))]
    if not lines:
        raise RuntimeError("vLLM logged no timestamped line; is VLLM_LOGGING_PREFIX honoured?")
    first = lines[0][0]
    loading = max(ts for ts, text in lines if text.startswith("Starting to load model"))
    init_at, init_s = next((ts, float(m[1])) for ts, text in lines if (m := _INIT_ENGINE.search(text)))
    init_began = init_at - init_s
    return dict(zip(PHASES, (first - began, loading - first, init_began - loading, init_s, ready - init_at,
                             generated - ready), strict=True))


def run_engine(model: Path, config: Config, load_format: str, run_dir: Path) -> EngineRun:
    extra = {"run_dir": str(run_dir), "fallback": False} if load_format == "wcache" else {}
    run = VllmRun(str(model), default_prompts(NUM_PROMPTS), MAX_NEW_TOKENS, load_format=load_format,
                  extra_config=extra, tensor_parallel_size=config.tp)
    with environment({**TIMESTAMPED, "VLLM_CPU_KVCACHE_SPACE": "1", **config.env}):
        began = time.time()
        result = greedy_tokens(run, timeout=900)
    placed = {int(m[1]): (int(m[2]), int(m[3])) for m in _PLACED.finditer(result.log)}
    private = {int(m[1]): float(m[2]) for m in _PRIVATE.finditer(result.log)}
    return EngineRun(result.tokens, phases(result.log, began, result.engine_ready_at, result.generated_at), placed,
                     private)


def wcache(*args: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wcache_cli.main", *args, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--only", action="append", help="run only the configurations whose name contains this")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    console = Console(width=160)
    chosen = [c for c in CONFIGS if not args.only or any(o in c.name for o in args.only)]
    results: list[tuple[Config, EngineRun, EngineRun, int]] = []
    written: dict[Callable[[Path, str], Path], Path] = {}  # configurations with one writer share its checkpoint
    with workspace(args.workdir) as work:
        os.environ["WCACHE_CACHE_DIR"] = str(work / "store")
        for number, config in enumerate(chosen):
            run_dir = work / f"run-{number}"
            run_dir.mkdir(mode=0o700, exist_ok=True)
            if config.write not in written:
                written[config.write] = config.write(work / f"model-{len(written)}", args.preset)
            model = written[config.write]
            preloaded = wcache("preload", str(model), "--detach", "--json", *config.preload, run_dir=run_dir)
            if preloaded.returncode != 0:
                raise SystemExit(f"{config.name}: wcache preload failed: {preloaded.stderr.strip()}")
            per_rank = max(int(r["weights_bytes"]) for r in json.loads(preloaded.stdout)["ranks"])
            try:
                auto = run_engine(model, config, "auto", run_dir)
                hit = run_engine(model, config, "wcache", run_dir)
            except VllmRunError as exc:
                raise SystemExit(f"{config.name}: {exc}") from None
            finally:
                wcache("stop", "--all", "--force", run_dir=run_dir)
            console.print(f"{config.name}: weight phase auto {auto.phases['weight phase']:.2f} s, hit "
                          f"{hit.phases['weight phase']:.2f} s; tokens equal: {auto.tokens == hit.tokens}")
            results.append((config, auto, hit, per_rank))
    console.print(configurations_table(args.preset, results))
    console.print(phases_table(args.preset, results))


def configurations_table(preset: str, results: list[tuple[Config, EngineRun, EngineRun, int]]) -> Table:
    table = Table(title=f"vLLM CPU configurations, {preset}: load_format auto vs a wcache hit", title_justify="left")
    for column in ("configuration", "weight phase auto", "weight phase hit", "params zero-copy (all ranks)",
                   "private memory added by build + attach", "weights per rank", "greedy tokens equal"):
        table.add_column(column)
    for config, auto, hit, per_rank in results:
        taken = sum(a for a, _ in hit.placed.values())
        total = sum(t for _, t in hit.placed.values())
        private = max(hit.private_mib.values(), default=float("nan"))
        table.add_row(config.name, fmt_seconds(auto.phases["weight phase"]), fmt_seconds(hit.phases["weight phase"]),
                      f"{taken}/{total} ({taken / total:.0%})" if total else "not logged", f"{private:.1f} MiB",
                      f"{per_rank / 2**20:,.0f} MiB", "yes" if auto.tokens == hit.tokens else "NO")
    return table


def phases_table(preset: str, results: list[tuple[Config, EngineRun, EngineRun, int]]) -> Table:
    table = Table(title=f"vLLM CPU start-up by phase (vLLM's own log lines), {preset}", title_justify="left")
    table.add_column("phase")
    for config, _, _, _ in results:
        table.add_column(f"{config.name}: auto")
        table.add_column("hit")
    for phase in (*PHASES, "total"):
        cells = []
        for _, auto, hit, _ in results:
            for engine in (auto, hit):
                cells.append(fmt_seconds(sum(engine.phases.values()) if phase == "total" else engine.phases[phase]))
        table.add_row(phase, *cells)
    return table


if __name__ == "__main__":
    main()
