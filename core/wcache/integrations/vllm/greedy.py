"""`wcache verify --greedy --engine vllm`: vLLM's `wcache` load format against its default loader, the two
engines one after the other in one child process (`runner`); the attached side's report is its hit in the
run dir's events."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import msgspec

from wcache.attach_options import AttachOptions
from wcache.errors import BadInputError, UnavailableError, option
from wcache.integrations.registry import GreedyAttach, GreedyTokens, RankHit, RankPlacement
from wcache.plan.spec import PlanSpec

# The files a Hugging Face tokenizer is read from; a checkpoint with none of them gives vLLM no tokenizer.
VLLM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def run_greedy(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int, options: AttachOptions,
               device: str) -> GreedyTokens:
    """Both sides' greedy tokens; vLLM picks its own device."""
    from wcache.integrations.vllm.runner import VllmRun, VllmRunError, greedy_runs
    from wcache.ipc.run_dir.directory import default_run_dir

    if not any((model / name).exists() for name in VLLM_TOKENIZER_FILES):
        # vLLM would start anyway, encode every prompt to nothing and stop at "The decoder prompt cannot be empty".
        raise BadInputError(f"{model} has no tokenizer ({', '.join(VLLM_TOKENIZER_FILES)}) for vLLM to encode "
                            f"the prompts with; add one, or verify with {option('engine', 'reference')}.")
    run_dir = Path(options.run_dir) if options.run_dir else default_run_dir()
    extra = msgspec.structs.replace(options, run_dir=str(run_dir)).to_mapping()
    base = VllmRun(str(model), prompts, max_new_tokens, tensor_parallel_size=plan.tp_size, dtype=plan.dtype)
    cached = VllmRun(**{**asdict(base), "load_format": "wcache", "extra_config": extra})
    since = time.time()
    try:
        on_daemon, from_disk = greedy_runs([cached, base])
    except VllmRunError as exc:
        if exc.index == 0:
            raise UnavailableError(f"vLLM could not start on a daemon's weights: {exc}") from None
        raise UnavailableError(f"vLLM could not load {model} from disk: {exc}") from None
    attach = _hit_event(run_dir, "vllm", since)
    return GreedyTokens(on_daemon.tokens, from_disk.tokens, attach)


def _hit_event(run_dir: Path, engine: str, since: float) -> GreedyAttach:
    """How an engine that ran in other processes attached: its ranks' hits in the run dir's events."""
    from wcache.monitor import event_types as ev
    from wcache.monitor.events import engine_events

    hits = engine_events(run_dir, ev.AttachHit, engine, since)
    if not hits:
        return GreedyAttach(engine, "unknown")
    last = hits[-1]
    # One hit per rank; an integration that says where each tensor went (vLLM's) adds its placement events.
    placements = sorted(engine_events(run_dir, ev.Placement, engine, since), key=lambda e: e.tp_rank or 0)
    ranks = tuple(RankPlacement(e.tp_rank, e.daemon, e.mode, e.parameters, e.assigned, tuple(e.copied),
                                e.private_bytes) for e in placements)
    return GreedyAttach(engine, "hit", last.daemon, last.mode, last.key_id, ranks=ranks,
                        hits=tuple(RankHit(e.daemon, e.pid, e.timings_ms) for e in hits))
