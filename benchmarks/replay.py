"""SWA bounded replay: prefill tokens, prefill time and sliding-window memory after a prefix hit.

Every request is ``--prefix`` shared tokens followed by a ``--tail``-token tail of its own, on a small
checkpoint whose sliding-window layers use a ``--window``-token window. One run measures, side by side
(the two modes interleaved, median of ``--repeat``):

* cold: a fresh engine prefills prefix + tail;
* hit, replay off (``swa_bounded_replay=False``): the same engine, having served that request, prefills
  prefix + another tail; the cached prefix's sliding-window KV is stored per block and reused;
* hit, replay on (the default): likewise, but sliding-window layers keep nothing for cached prefixes and
  the hit's last window is recomputed to rebuild them;

the sliding-window KV each mode holds for the cached prefix against what one window per running request
costs; and, for each tail, how far the hit's greedy tokens stray from the cold run of the same prompt:
replay off must match, replay on may differ by design (a replayed token's window attention sees nothing
before H − W, so it sees a shorter window than in the cold run).

Prefill time is the engine's first forward pass of a request (the benchmark wraps the model's
``forward``), so the greedy tokens decoded afterwards for the divergence check are not counted in it.
Each repeat's hit tail is the next repeat's cold tail (cyclically), so every tail has a cold and a hit run
in each mode without extra cold prefills.

Run::

    .venv/bin/python benchmarks/replay.py                          # 6,144 + 256 tokens, W = 128, 3 repeats
    .venv/bin/python benchmarks/replay.py --layers 8 --repeat 2    # deeper model, slower
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_common import fmt_seconds, speed_ratio, workspace
from rich.console import Console, JustifyMethod
from rich.table import Table
from wcache.engine.config import EngineConfig
from wcache.engine.engine import Engine, Generation
from wcache.plan.spec import PlanSpec
from wcache_dev.synth import PRESETS, Preset, make_tensors, write_tensors

BLOCK_SIZE = 16
OFF = "replay off"
ON = "replay on"
MODES = {OFF: False, ON: True}


def checkpoint_config(layers: int, window: int, max_positions: int) -> dict[str, Any]:
    """The tiny preset's config with ``layers`` alternating sliding/full layers and a ``window`` window.

    One attention head and one KV head keep a 6,400-token CPU prefill to seconds (attention over the prompt,
    not the hidden size, dominates here). No EOS token, so every request decodes exactly ``--new-tokens``.
    Layer 0 is sliding: a replayed token's truncated window changes what later layers see, so with at least
    three layers replay can change the tail's sliding-window keys (with two, [sliding, full], it cannot).
    """
    config = dict(PRESETS["tiny"].config)
    config.update(
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        sliding_window=window,
        max_window_layers=layers,
        max_position_embeddings=max(8192, max_positions),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        eos_token_id=None,
    )
    return config


@dataclass(slots=True)
class Run:
    """One request: its greedy tokens, what the cache did, its prefill forward time, its first token's logits."""

    generation: Generation
    prefill_s: float
    first_logits: torch.Tensor


@dataclass(slots=True)
class Samples:
    """Every run of one row (a request kind in one mode)."""

    runs: list[Run] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [r.prefill_s for r in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def prefill_tokens(self) -> set[int]:
        return {r.generation.prefill_tokens for r in self.runs}


class TimedEngine:
    """An engine whose model reports each request's first forward pass (the prefill step): its time and logits."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._forward = engine.model.forward
        self._logits = engine.model.logits
        self._first_s: float | None = None
        self._first_logits: torch.Tensor | None = None
        engine.model.forward = self._timed_forward  # type: ignore[method-assign]
        engine.model.logits = self._kept_logits  # type: ignore[method-assign]

    def _timed_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        began = time.perf_counter()
        hidden = self._forward(*args, **kwargs)
        if self._first_s is None:
            self._first_s = time.perf_counter() - began
        return hidden

    def _kept_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._logits(hidden)
        if self._first_logits is None:
            self._first_logits = logits[-1].clone()
        return logits

    def run(self, token_ids: list[int], max_new_tokens: int) -> Run:
        self._first_s, self._first_logits = None, None
        generation = self.engine.generate(token_ids, max_new_tokens)
        assert self._first_s is not None and self._first_logits is not None, "generate ran no forward pass"
        return Run(generation, self._first_s, self._first_logits)


@dataclass(slots=True)
class Memory:
    """Sliding-window KV one mode holds for cached prefixes."""

    bytes_per_block: int = 0  # sliding layers' KV per cached block (0 with replay on)
    after_cold: int = 0  # swa_cached_bytes after the first request
    after_hit: int = 0  # ... and after the second
    cached_blocks: int = 0


def prompt_tokens(prefix: int, tail: int, tails: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A random byte prefix and ``tails`` random byte tails whose first tokens all differ.

    Distinct first tokens make every tail's first block differ, so a hit is exactly the prefix's whole blocks.
    """
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(prefix)]
    firsts = rng.sample(range(256), tails)
    return shared, [[first] + [rng.randrange(256) for _ in range(tail - 1)] for first in firsts]


def expected_prefill(prefix: int, tail: int, window: int, replay: bool) -> tuple[int, int]:
    """(hit tokens, prefill tokens) the engine should report for a hit request."""
    hit = min(prefix // BLOCK_SIZE, (prefix + tail - 1) // BLOCK_SIZE) * BLOCK_SIZE
    if replay and hit <= window:
        return hit, prefix + tail  # not adopted: replay would recompute all of it
    return hit, prefix + tail - hit + (min(window, hit) if replay else 0)


def divergence(cold: list[int], hit: list[int]) -> tuple[int, int | None]:
    """Positions where the two token lists differ (a missing token counts) and the first of them."""
    length = max(len(cold), len(hit))
    differing = [i for i in range(length) if i >= len(cold) or i >= len(hit) or cold[i] != hit[i]]
    return len(differing), (differing[0] if differing else None)






def fmt_bytes(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:,.0f} B"
    if nbytes < 1024**2:
        return f"{nbytes / 1024:,.1f} KiB"
    return f"{nbytes / 1024**2:,.2f} MiB"




def _columns(table: Table, columns: tuple[tuple[str, JustifyMethod], ...]) -> None:
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print the tables; exit 1 when a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=6144, help="shared prefix tokens (6144)")
    parser.add_argument("--tail", type=int, default=256, help="tokens of each request's own tail (256)")
    parser.add_argument("--window", type=int, default=128, help="sliding window W of the checkpoint (128)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row, at least 2; the median is shown (3)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request for divergence (32)")
    parser.add_argument("--layers", type=int, default=4, help="layers, alternating sliding/full (4)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: temp dir)")
    args = parser.parse_args(argv)
    if args.repeat < 2:
        parser.error("--repeat must be at least 2 (each repeat's hit tail is another repeat's cold tail)")
    if args.prefix < BLOCK_SIZE or args.tail < 1 or args.window < 1 or args.new_tokens < 1:
        parser.error(f"--prefix must be at least {BLOCK_SIZE}; --tail, --window and --new-tokens at least 1")
    if args.layers < 2:
        parser.error("--layers must be at least 2 (one sliding, one full)")

    console = Console() if sys.stdout.isatty() else Console(width=140)
    err = Console(stderr=True, soft_wrap=True)
    total = args.prefix + args.tail + args.new_tokens
    config = checkpoint_config(args.layers, args.window, total)
    sliding = sum(t == "sliding_attention" for t in config["layer_types"])
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    dtype = getattr(torch, config["torch_dtype"])
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    window_bytes = args.window * sliding * kv_heads * head_dim * 2 * dtype_bytes
    blocks_per_request = -(-total // BLOCK_SIZE)
    engine_config = {
        mode: EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=2 * blocks_per_request + 8,
            swa_bounded_replay=replay,
        )
        for mode, replay in MODES.items()
    }
    prefix, tails = prompt_tokens(args.prefix, args.tail, args.repeat)

    cold = {m: Samples() for m in MODES}
    hit = {m: Samples() for m in MODES}
    memory = {m: Memory() for m in MODES}
    began = time.perf_counter()
    with workspace(args.workdir) as work:
        model_dir = work / "checkpoint"
        store_dir = work / "digest-store"
        for owned in (model_dir, store_dir):
            shutil.rmtree(owned, ignore_errors=True)
        os.environ["WCACHE_CACHE_DIR"] = str(store_dir)  # nothing may touch the user's own store
        err.print(f"writing a {args.layers}-layer checkpoint (W = {args.window}) to {model_dir} ...")
        write_tensors(make_tensors(Preset(config, 1, True)), config, model_dir, 1)

        def fresh(mode: str) -> TimedEngine:
            return TimedEngine(Engine.from_disk(model_dir, plan=PlanSpec(), engine_config=engine_config[mode]))

        fresh(ON).run(list(range(2 * BLOCK_SIZE)), 2)  # first-call costs out of the first timed run
        for r in range(args.repeat):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                cold_tail, hit_tail = tails[r], tails[(r + 1) % args.repeat]
                err.print(f"repeat {r + 1}/{args.repeat}, {mode}: cold prefill, then a hit with another tail ...")
                engine = fresh(mode)
                cold[mode].runs.append(engine.run(prefix + cold_tail, args.new_tokens))
                after_cold = engine.engine.counters.swa_cached_bytes
                hit[mode].runs.append(engine.run(prefix + hit_tail, args.new_tokens))
                kv = engine.engine.kv
                memory[mode] = Memory(
                    bytes_per_block=kv.bytes_per_block(
                        tuple(i for i in engine.engine.model_config.sliding_layers if i in kv.k)
                    ),
                    after_cold=after_cold,
                    after_hit=engine.engine.counters.swa_cached_bytes,
                    cached_blocks=engine.engine.blocks.num_cached,
                )
    elapsed = time.perf_counter() - began

    # -- prefill tokens and time ------------------------------------------------------------------------
    title = (
        f"Prefill after a prefix hit: {args.prefix:,}-token shared prefix + {args.tail:,}-token tails, "
        f"W = {args.window}, {args.layers} layers ({sliding} sliding), median of {args.repeat}"
    )
    table = Table(title=title)
    _columns(
        table,
        (
            ("engine", "left"),
            ("request", "left"),
            ("hit", "right"),
            ("prefill tokens", "right"),
            ("of cold", "right"),
            ("prefill time", "right"),
            ("min–max", "right"),
            ("vs cold", "right"),
        ),
    )
    checks: dict[str, bool] = {}
    cold_tokens = args.prefix + args.tail
    for mode, replay in MODES.items():
        base = cold[mode].median
        want_hit, want_prefill = expected_prefill(args.prefix, args.tail, args.window, replay)
        checks[f"{mode}: cold prefills {cold_tokens:,}, hit at {want_hit:,} prefills {want_prefill:,}"] = (
            cold[mode].prefill_tokens == {cold_tokens}
            and hit[mode].prefill_tokens == {want_prefill}
            and {r.generation.hit_tokens for r in hit[mode].runs} == {want_hit}
        )
        for kind, samples in (("cold", cold[mode]), (f"hit, {mode}", hit[mode])):
            tokens = sorted(samples.prefill_tokens)
            hits = sorted({r.generation.hit_tokens for r in samples.runs})
            rejected = (
                " (not adopted)"
                if any(r.generation.hit_tokens and not r.generation.adopted for r in samples.runs)
                else ""
            )
            table.add_row(
                f"{mode}" if kind == "cold" else "",
                kind,
                "/".join(f"{h:,}" for h in hits) + rejected,
                "/".join(f"{t:,}" for t in tokens),
                f"{tokens[0] / cold_tokens:.0%}",
                fmt_seconds(samples.median),
                f"{fmt_seconds(min(samples.seconds))}–{fmt_seconds(max(samples.seconds))}",
                "1.0×" if kind == "cold" else speed_ratio(base, samples.median),
                end_section=kind != "cold",
            )
    console.print(table)

    # -- sliding-window memory ----------------------------------------------------------------------------
    prefix_blocks = args.prefix // BLOCK_SIZE
    mem = Table(title=f"Sliding-window KV held for cached prefixes ({sliding} sliding layers, {config['torch_dtype']})")
    _columns(
        mem,
        (
            ("mode", "left"),
            (f"held for the {prefix_blocks * BLOCK_SIZE:,}-token prefix", "right"),
            ("swa_cached_bytes, after request 1 / 2", "right"),
            ("vs one window", "right"),
        ),
    )
    for mode, m in memory.items():
        held = prefix_blocks * m.bytes_per_block
        mem.add_row(
            mode,
            fmt_bytes(held),
            f"{fmt_bytes(m.after_cold)} / {fmt_bytes(m.after_hit)} ({m.cached_blocks} blocks cached)",
            f"{held / window_bytes:,.1f}×",
        )
    mem.add_row(
        "one window per running request",
        fmt_bytes(window_bytes),
        "",
        "1.0×",
        style="dim",
    )
    mem.caption = (
        f"one window = W {args.window} × {sliding} sliding layers × {kv_heads} KV heads × head_dim {head_dim} "
        f"× 2 (k, v) × {dtype_bytes} B = {window_bytes:,} B"
    )
    console.print(mem)
    checks["replay on holds no sliding-window KV for cached prefixes"] = (
        memory[ON].after_cold == memory[ON].after_hit == 0
    )
    off_block = memory[OFF].bytes_per_block
    checks["replay off: swa_cached_bytes = cached blocks × the engine's sliding-window KV per block"] = (
        memory[OFF].after_hit == memory[OFF].cached_blocks * off_block > 0
    )
    checks["one window (formula above) = W tokens of the engine's sliding-window KV"] = (
        off_block * args.window == window_bytes * BLOCK_SIZE
    )

    # -- divergence -------------------------------------------------------------------------------------
    div = Table(title=f"Greedy tokens after a hit vs a cold run of the same prompt ({args.new_tokens} new tokens)")
    _columns(
        div,
        (
            ("tail", "right"),
            (f"{OFF}:\ntokens differing", "right"),
            (f"{OFF}:\nfirst differing", "right"),
            (f"{OFF}:\nmax |Δ logit|", "right"),
            (f"{ON}:\ntokens differing", "right"),
            (f"{ON}:\nfirst differing", "right"),
            (f"{ON}:\nmax |Δ logit|", "right"),
        ),
    )
    identical_off = True
    for tail_index in range(args.repeat):
        cells = []
        for mode in MODES:
            reference = cold[mode].runs[tail_index]  # repeat r ran tail r cold ...
            got = hit[mode].runs[(tail_index - 1) % args.repeat]  # ... and repeat r - 1 ran it as a hit
            n, first = divergence(reference.generation.token_ids, got.generation.token_ids)
            delta = float((reference.first_logits - got.first_logits).abs().max())
            cells += [f"{n} / {len(got.generation.token_ids)}", "-" if first is None else str(first), f"{delta:.2g}"]
            identical_off &= mode != OFF or n == 0
        div.add_row(str(tail_index + 1), *cells)
    div.caption = (
        "max |Δ logit|: the first generated token's logits, hit vs cold. Replay on: differences are expected by "
        "design\n(replayed tokens' window attention sees nothing before H − W). Replay off must match."
    )
    console.print(div)
    checks["replay off: greedy tokens after a hit identical to cold"] = identical_off

    for name, ok in checks.items():
        console.print(f"{name}: " + ("[green]yes[/]" if ok else "[red]NO[/]"))
    console.print(f"[dim]{elapsed:,.0f} s in all, torch {torch.__version__}, {torch.get_num_threads()} threads[/]")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
