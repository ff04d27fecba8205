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
from typing import TYPE_CHECKING, Any

from wcache.errors import BadInputError, option

if TYPE_CHECKING:
    from wcache.attach_options import AttachOptions
    from wcache.plan.spec import PlanSpec


@dataclass(frozen=True, slots=True)
class GreedyTokens:
    """One greedy run per side, prompt by prompt, and how the attached side got its weights."""

    cached: list[list[int]]
    disk: list[list[int]]
    attach: dict[str, Any]


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
    EngineEntry("reference", "wcache.integrations.greedy_reference:run_greedy", tensor_parallel=True,
                own_plan=False),
    EngineEntry("vllm", "wcache.integrations.greedy_vllm:run_greedy", tensor_parallel=True, own_plan=True,
                plan_refusal=f"{option('engine', 'vllm')} takes its plan from vLLM; drop {option('quantization')} and "
                f"{option('layout')}."),
    EngineEntry("transformers", "wcache.integrations.greedy_transformers:run_greedy", tensor_parallel=False,
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
