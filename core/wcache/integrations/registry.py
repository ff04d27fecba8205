"""The engines that attach, one entry each: what `wcache verify --greedy --engine NAME` needs to run one.

An engine is added here (one line) and in the one module its `runner` names, which runs the same prompts
greedily through the engine attached to a daemon and the engine loading from disk its own way. Importing this
module imports no engine (the CLI builds its `--engine` choices from it): a runner loads when verify runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from wcache.errors import BadInputError, option
from wcache.ipc.attach_summary import AttachSummary
from wcache.schema import Schema

if TYPE_CHECKING:
    from wcache.attach_options import AttachOptions
    from wcache.plan.spec import PlanSpec


class RankHit(Schema, frozen=True):
    """One rank's attach of an engine that ran in other processes, as its `attach_hit` event tells it."""

    daemon: str | None
    pid: int
    timings_ms: dict[str, float] = msgspec.field(default_factory=dict)


class RankPlacement(Schema, frozen=True):
    """How one vLLM rank's parameters took the arena's tensors, as its `placement` event tells it."""

    tp_rank: int | None
    daemon: str | None
    mode: str | None
    parameters: int | None
    assigned: int | None
    copied: tuple[str, ...]
    private_bytes: int | None


class GreedyAttach(Schema, frozen=True):
    """How the attached side of a greedy verification got its weights.

    The head (engine to key_id) is what every engine tells; the rest is what one kind of engine adds: the
    whole report where wcache's attach ran in reach (in this process, or a served reference engine's own), the
    ranks' hits and placements where vLLM ran them, the address of a served engine.
    """

    engine: str  # an entry of REGISTRY, or a served engine: "reference (served)", "vllm 0.32.0 (served)"
    outcome: str  # an attach's ("hit", "fallback"), "disk", or "unknown": ran elsewhere and told nothing
    daemon: str | None = None
    mode: str | None = None
    key_id: str | None = None
    report: AttachSummary | None = None
    hits: tuple[RankHit, ...] = ()
    ranks: tuple[RankPlacement, ...] = ()
    url: str | None = None
    model: str | None = None

    @classmethod
    def of_report(cls, engine: str, report: AttachSummary, *, url: str | None = None,
                  model: str | None = None) -> GreedyAttach:
        """The head read off a whole report."""
        return cls(engine, report.outcome, report.daemon, report.mode, report.key_id, report=report, url=url,
                   model=model)


@dataclass(frozen=True, slots=True)
class GreedyTokens:
    """One greedy run per side, prompt by prompt, and how the attached side got its weights."""

    cached: list[list[int]]
    disk: list[list[int]]
    attach: GreedyAttach


# (model, plan, prompts, max_new_tokens, options, device) → both sides' tokens; the attached side never
# falls back to disk (verify passes options with fallback off).
GreedyRunner = Callable[[Path, "PlanSpec", list[str], int, "AttachOptions", str], GreedyTokens]


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine: its `--engine` name, where its greedy runner lives, and which plans it runs."""

    name: str
    runner: str  # "module:function", a GreedyRunner, imported only when it runs
    tensor_parallel: bool  # runs TP > 1 plans (every rank attaches its own shard)
    own_plan: bool  # takes quantization and layout from the engine itself, never from --quantization/--plan
    plan_refusal: str | None = None  # the sentence for a plan it does not run

    def refusal(self, plan: PlanSpec) -> str | None:
        """Why this engine cannot run `plan`, or None when it can."""
        from wcache.plan.spec import PlanSpec

        default = PlanSpec()
        wrong_tp = plan.tp_size != 1 and not self.tensor_parallel
        wrong_plan = self.own_plan and (plan.quantization != default.quantization or plan.layout != default.layout)
        return self.plan_refusal if wrong_tp or wrong_plan else None

    def load_runner(self) -> GreedyRunner:
        module, _, function = self.runner.partition(":")
        runner: GreedyRunner = getattr(import_module(module), function)
        return runner


# wcache's reference engine first: the default.
REGISTRY = (
    EngineEntry("reference", "wcache.integrations.reference.greedy:run_greedy", tensor_parallel=True,
                own_plan=False),
    EngineEntry("vllm", "wcache.integrations.vllm.greedy:run_greedy", tensor_parallel=True, own_plan=True,
                plan_refusal=f"{option('engine', 'vllm')} takes its plan from vLLM; drop {option('quantization')} and "
                f"{option('layout')}."),
    EngineEntry("transformers", "wcache.integrations.transformers.greedy:run_greedy", tensor_parallel=False,
                own_plan=True, plan_refusal=f"{option('engine', 'transformers')} runs TP 1 without quantization; drop "
                f"{option('tp_size')}, {option('quantization')} and {option('layout')}."),
)
ENGINES = tuple(entry.name for entry in REGISTRY)


def engine_entry(name: str) -> EngineEntry:
    """The registry's entry for `name`, or one error sentence naming the engines there are."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise BadInputError(f"{option('engine')} must be one of {', '.join(ENGINES)}, not {name!r}.")
