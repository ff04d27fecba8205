"""Proof instead of trust: greedy tokens from cached weights vs disk weights, and content re-hashing.

`verify_greedy` runs the same prompts at temperature 0 through an engine attached to a daemon and an
engine loaded from disk, and compares token ids; it catches a wrong hit whatever the key said.
`verify_content` compares a daemon's recorded source digests with a fresh hash of the checkpoint, and has
the daemon re-hash its processed arena against the digests it recorded when it built it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from wcache.attach_options import ENGINES, AttachOptions
from wcache.checkpoint.provenance import FileVerdict, overall, report
from wcache.daemon_choice import pick_daemon
from wcache.errors import BadInputError, UnavailableError, option
from wcache.ipc.client import DaemonConnection, DaemonError
from wcache.ipc.messages import CheckArena, Manifest
from wcache.ipc.remote_key import daemon_key_file
from wcache.key.compute import compute_key
from wcache.key.diff import KeyDiff, diff_keys
from wcache.key.provenance import verdicts_of
from wcache.plan.spec import PlanSpec

# The files a Hugging Face tokenizer is read from; a checkpoint with none of them gives vLLM no tokenizer.
VLLM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WORDS = (
    "weights", "cache", "daemon", "engine", "restart", "shard", "tensor", "prefix", "window", "replay", "token",
    "block", "memory", "attach", "checkpoint", "digest", "merkle", "plan", "rank", "device", "socket", "health",
    "metric", "event", "verify", "greedy", "content", "arena", "the", "a", "of", "and", "to", "in", "is", "on",
    "for", "with", "that", "this", "from", "by", "at", "as", "be", "are", "was", "it", "not", "or",
)


def default_prompts(count: int, seed: int = 0) -> list[str]:
    """Deterministic English-like prompts, long enough to cross a small sliding window."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(14, 28))) for _ in range(count)]


@dataclass(frozen=True, slots=True)
class PromptResult:
    index: int
    prompt: str
    match: bool
    first_divergence: int | None
    cached_tokens: list[int]
    disk_tokens: list[int]


@dataclass
class GreedyReport:
    """Per-prompt comparison of cached and disk engines, and how the cached engine got its weights."""

    results: list[PromptResult]
    attach: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # a difference found before or beside the tokens (a served engine's claim)

    @property
    def all_match(self) -> bool:
        return self.problem is None and all(r.match for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {"all_match": self.all_match, "attach": self.attach, "problem": self.problem,
                "prompts": [asdict(r) for r in self.results]}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _run_prompts(tp: Any, model: Path, plan: dict[str, Any], prompts: list[str], max_new_tokens: int,
                 options: AttachOptions, device: str) -> GreedyReport:
    from wcache.engine import Engine, EngineConfig

    spec = PlanSpec.from_json(plan)
    # No prefix caching: each prompt must exercise the weights, not a cache shared between prompts.
    engine_config = EngineConfig(enable_prefix_caching=False)
    cached = Engine.from_attach(model, spec, engine_config, tp, options=options, device=device)
    try:
        disk = Engine.from_disk(model, spec, engine_config, tp)
        if cached.tokenizer is None:
            raise BadInputError(f"{model} has no tokenizer to encode the prompts.")
        encoded = [cached.tokenizer.encode(prompt) for prompt in prompts]
        from_cache = [cached.generate(ids, max_new_tokens).token_ids for ids in encoded]
        from_disk = [disk.generate(ids, max_new_tokens).token_ids for ids in encoded]
        report = cached.attach_report
        attach = report.to_json() if report is not None else {}
        return GreedyReport(compare_prompts(prompts, from_cache, from_disk), attach)
    finally:
        cached.close()


def compare_prompts(prompts: list[str], cached: list[list[int]], disk: list[list[int]]) -> list[PromptResult]:
    results = []
    for index, (prompt, a, b) in enumerate(zip(prompts, cached, disk, strict=True)):
        divergence = _first_divergence(a, b)
        results.append(PromptResult(index, prompt, divergence is None, divergence, a, b))
    return results


def _hit_event(run_dir: Path, engine: str, since: float) -> dict[str, Any]:
    """The attach report of an engine that ran in other processes: its latest hit in the run dir's events."""
    from wcache.monitor.events import read_events

    hits = [e for e in read_events(run_dir) if e["kind"] == "attach_hit" and e.get("engine") == engine
            and float(e.get("ts", 0)) >= since]
    if not hits:
        return {"outcome": "unknown", "engine": engine}
    last = hits[-1]
    # One hit per rank; an integration that says where each tensor went (vLLM's) adds its placement events.
    placements = sorted((e for e in read_events(run_dir) if e["kind"] == "placement" and e.get("engine") == engine
                         and float(e.get("ts", 0)) >= since), key=lambda e: int(e.get("tp_rank", 0)))
    ranks = [{key: e.get(key) for key in ("tp_rank", "daemon", "mode", "parameters", "assigned", "copied",
                                          "private_bytes")} for e in placements]
    return {"outcome": "hit", "engine": engine, "daemon": last.get("daemon"), "mode": last.get("mode"),
            "key_id": last.get("key_id"), "timings_ms": last.get("timings_ms", {}),
            "hits": [{"daemon": e.get("daemon"), "pid": e.get("pid")} for e in hits], "ranks": ranks}


def _verify_vllm(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int,
                 options: AttachOptions) -> GreedyReport:
    import time

    from wcache.integrations.vllm_runner import VllmRun, VllmRunError, greedy_tokens
    from wcache.ipc.rundir import default_run_dir

    if plan.quantization != "none" or plan.layout != "fused":
        raise BadInputError(f"{option('engine', 'vllm')} takes its plan from vLLM; drop {option('quantization')} "
                            f"and {option('layout')}.")
    if not any((model / name).exists() for name in VLLM_TOKENIZER_FILES):
        # vLLM would start anyway, encode every prompt to nothing and stop at "The decoder prompt cannot be empty".
        raise BadInputError(f"{model} has no tokenizer ({', '.join(VLLM_TOKENIZER_FILES)}) for vLLM to encode "
                            f"the prompts with; add one, or verify with {option('engine', 'reference')}.")
    run_dir = Path(options.run_dir) if options.run_dir else default_run_dir()
    extra = replace(options, run_dir=str(run_dir)).to_mapping()
    base = VllmRun(str(model), prompts, max_new_tokens, tensor_parallel_size=plan.tp_size, dtype=plan.dtype)
    since = time.time()
    try:
        cached = greedy_tokens(VllmRun(**{**asdict(base), "load_format": "wcache", "extra_config": extra})).tokens
    except VllmRunError as exc:
        raise UnavailableError(f"vLLM could not start on a daemon's weights: {exc}") from None
    attach = _hit_event(run_dir, "vllm", since)
    try:
        disk = greedy_tokens(base).tokens
    except VllmRunError as exc:
        raise UnavailableError(f"vLLM could not load {model} from disk: {exc}") from None
    return GreedyReport(compare_prompts(prompts, cached, disk), attach)


def _verify_transformers(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int,
                         options: AttachOptions) -> GreedyReport:
    import torch
    from transformers import AutoModelForCausalLM

    from wcache.engine.tokenizer import load_tokenizer
    from wcache.integrations.transformers import from_pretrained

    if plan.tp_size != 1 or plan.quantization != "none" or plan.layout != "fused":
        raise BadInputError(f"{option('engine', 'transformers')} runs TP 1 without quantization; drop "
                            f"{option('tp_size')}, {option('quantization')} and {option('layout')}.")
    dtype = {} if plan.dtype == "auto" else {"dtype": getattr(torch, plan.dtype)}
    cached_model = from_pretrained(model, **dtype, **options.to_mapping())
    disk_model = AutoModelForCausalLM.from_pretrained(model, **dtype).eval()
    tokenizer = load_tokenizer(model)

    def generate(engine: Any, prompt: str) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.int64)
        with torch.inference_mode():
            output = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=engine.config.eos_token_id)
        return [int(t) for t in output[0, ids.shape[1]:]]

    cached = [generate(cached_model, p) for p in prompts]
    disk = [generate(disk_model, p) for p in prompts]
    report = cached_model.wcache_report.to_json()
    cached_model._wcache_weights.close()
    return GreedyReport(compare_prompts(prompts, cached, disk), {**report, "engine": "transformers"})


def verify_greedy(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int, engine: str = "reference",
                  *, options: AttachOptions | None = None, device: str = "cpu") -> GreedyReport:
    """Compare greedy tokens of an attached engine and a disk engine; TP plans run every rank (gloo).

    `engine` is whose engine runs both sides: wcache's reference engine, vLLM (its `wcache` load format
    against its default loader), or transformers (`from_pretrained` through wcache against its own). The
    attached side never falls back to disk, whatever `options` say: a miss is an error, not a comparison.
    `device` is the reference engine's; vLLM and transformers pick their own.
    """
    options = replace(options or AttachOptions(), fallback=False)
    if not prompts:
        raise BadInputError("there are no prompts to verify with.")
    if engine not in ENGINES:
        raise BadInputError(f"{option('engine')} must be one of {', '.join(ENGINES)}, not {engine!r}.")
    if engine == "vllm":
        return _verify_vllm(model, plan, prompts, max_new_tokens, options)
    if engine == "transformers":
        return _verify_transformers(model, plan, prompts, max_new_tokens, options)
    if plan.tp_size == 1:
        from wcache.engine.parallel import TensorParallel

        return _run_prompts(TensorParallel(), model, plan.to_json(), prompts, max_new_tokens, options, device)
    from wcache.engine.tp_launch import run_tensor_parallel

    # Every rank must attach its own shard; each runs the same prompts and rank 0's answer is the report.
    # No timeout: loading a large model on every rank may take long; Ctrl-C stops every rank.
    reports = run_tensor_parallel(_run_prompts_rank, plan.tp_size, model, plan.to_json(), prompts,
                                  max_new_tokens, options, device, timeout=None)
    return reports[0]


def _run_prompts_rank(tp: Any, model: Path, plan: dict[str, Any], prompts: list[str], max_new_tokens: int,
                      options: AttachOptions, device: str) -> GreedyReport:
    rank_plan = {**plan, "tp_rank": tp.rank}
    return _run_prompts(tp, model, rank_plan, prompts, max_new_tokens, options, device)


@dataclass
class ContentReport:
    """Source tensors that differ between the daemon's record and the disk, and arena tensors that changed."""

    daemon: str
    source_diff: KeyDiff | None
    arena_changed: list[str]
    arena_checked: int
    provenance: tuple[FileVerdict, ...] = ()  # the fresh hash's files against what was published

    @property
    def ok(self) -> bool:
        source_ok = self.source_diff is None or not (
            self.source_diff.changed or self.source_diff.added or self.source_diff.removed
        )
        return source_ok and not self.arena_changed and overall(self.provenance) != "differs"

    def to_json(self) -> dict[str, Any]:
        diff = self.source_diff
        return {
            "ok": self.ok,
            "daemon": self.daemon,
            "source": {
                "changed": [c.name for c in diff.changed] if diff else [],
                "added": [e.name for e in diff.added] if diff else [],
                "removed": [e.name for e in diff.removed] if diff else [],
            },
            "arena": {"checked": self.arena_checked, "changed": self.arena_changed},
            "provenance": report(self.provenance),
        }


def verify_content(model: Path, plan: PlanSpec, run_dir: Path, device: str = "cpu",
                   daemon: str | None = None, expected: Path | None = None) -> ContentReport:
    """Fresh full hash of the checkpoint (no digest store) against the daemon's record, and its arena; the
    fresh hash's SHA-256 of each file against what was published (the Hugging Face cache, or `expected`)."""
    descriptor = pick_daemon(model, plan, run_dir, device, daemon)
    fresh = compute_key(model, plan, store=None, rehash=True)
    try:
        with DaemonConnection(descriptor.socket) as connection:
            manifest = connection.request(Manifest()).tensors
            arena = connection.request(CheckArena())
    except DaemonError as exc:
        raise UnavailableError(f"daemon {descriptor.name} could not be checked ({exc})") from None
    source = diff_keys(daemon_key_file(descriptor, manifest), fresh)
    return ContentReport(descriptor.name, source, list(arena.changed), arena.checked,
                         verdicts_of(fresh.source, fresh.files, expected))
