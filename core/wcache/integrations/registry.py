"""The engines that attach, one entry each: everything the rest of wcache asks of an engine.

`wcache verify --greedy --engine NAME` runs its greedy runner; `wcache verify URL` and `wcache switch URL` ask
each engine that can be served, in order, whether the engine at URL is one of its own; `wcache doctor` checks
each engine's installed version against its supported range, then runs its check. An engine is added here
(one entry) and in its folder, `integrations/NAME/`, which holds the modules the entry names ("module:name",
docs/layout.md, "Adding an engine"). Importing this module imports no engine (the CLI builds its engine
choices from it): what an entry names loads when it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from wcache.errors import BadInputError, UnavailableError, option
from wcache.ipc.attach_summary import AttachSummary
from wcache.schema import Schema

if TYPE_CHECKING:
    from wcache.attach_options import AttachOptions
    from wcache.integrations.versions import SupportedVersions
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
# (url, prompts, max_new_tokens) → `wcache verify URL`'s report, or None when the engine at url is not this one.
ServedVerifier = Callable[[str, list[str], int], Any]  # a wcache.verify.GreedyReport (a later layer) or None
# (url, model, daemon) → the engine's switch answer (a SwitchAnswer's wire form), or None when it is not this one.
ServedSwitcher = Callable[[str, Path | None, str | None], "dict[str, Any] | None"]
# (whether the host has an NVIDIA GPU) → doctor's status and one line, reported under the engine's name.
DoctorCheck = Callable[[bool], tuple[Literal["ok", "warn", "fail"], str]]


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine: its `--engine` name, its greedy runner and the plans it runs, how it places a daemon's tensors,
    the versions it is supported in, how a served one is verified and switched, and doctor's check of it. Every
    "module:name" is imported only when it is asked for."""

    name: str
    runner: str  # a GreedyRunner
    tensor_parallel: bool  # runs TP > 1 plans (every rank attaches its own shard)
    own_plan: bool  # takes quantization and layout from the engine itself, never from --quantization/--plan
    # How the daemon's tensors become the engine's parameters (an engine that replaces parameters borrows
    # `integrations/placement.py`, torch only).
    placement: str
    versions: str | None = None  # a SupportedVersions, the range's one owner; None: wcache's own engine
    plan_refusal: str | None = None  # the sentence for a plan it does not run
    served_verify: str | None = None  # a ServedVerifier; None: wcache does not verify it served
    served_switch: str | None = None  # a ServedSwitcher; None: wcache does not switch it served
    served_as: str | None = None  # what a served one is and the endpoint that tells it, for "neither …" sentences
    doctor_check: str | None = None  # a DoctorCheck; None: doctor has nothing to check for it

    def refusal(self, plan: PlanSpec) -> str | None:
        """Why this engine cannot run `plan`, or None when it can."""
        from wcache.plan.spec import PlanSpec

        default = PlanSpec()
        wrong_tp = plan.tp_size != 1 and not self.tensor_parallel
        wrong_plan = self.own_plan and (plan.quantization != default.quantization or plan.layout != default.layout)
        return self.plan_refusal if wrong_tp or wrong_plan else None

    def load_runner(self) -> GreedyRunner:
        runner: GreedyRunner = _load(self.runner)
        return runner

    def load_placement(self) -> Callable[..., Any]:
        """The function that places a daemon's tensors as this engine's parameters (its own signature)."""
        placement: Callable[..., Any] = _load(self.placement)
        return placement

    def load_versions(self) -> SupportedVersions | None:
        """The versions this engine is supported in, from their owner; None for an engine without a range."""
        versions: SupportedVersions | None = None if self.versions is None else _load(self.versions)
        return versions


def _load(reference: str) -> Any:
    """What a "module:name" names (a dotted name reaches an attribute: "module:Class.method")."""
    module, _, name = reference.partition(":")
    return reduce(getattr, name.split("."), import_module(module))


def served_verifiers() -> list[ServedVerifier]:
    """Each engine's verifier of a served engine, in the registry's order."""
    return [_load(entry.served_verify) for entry in REGISTRY if entry.served_verify is not None]


def served_switchers() -> list[ServedSwitcher]:
    """Each engine's switch of a served engine, in the registry's order."""
    return [_load(entry.served_switch) for entry in REGISTRY if entry.served_switch is not None]


def doctor_check(entry: EngineEntry) -> DoctorCheck | None:
    """The engine's doctor check, or None where it has none."""
    check: DoctorCheck | None = None if entry.doctor_check is None else _load(entry.doctor_check)
    return check


def not_served(base_url: str) -> UnavailableError:
    """The error for a URL no engine of the registry recognizes as its own."""
    kinds = [entry.served_as for entry in REGISTRY if entry.served_as is not None]
    return UnavailableError(f"{base_url} is neither {' nor '.join(kinds)}.")


# wcache's reference engine first: the default.
REGISTRY = (
    EngineEntry("reference", "wcache.integrations.reference.greedy:run_greedy", tensor_parallel=True,
                own_plan=False, placement="wcache.engine.engine:Engine.from_weights",
                served_verify="wcache.verify_served:verify_served_reference",
                served_switch="wcache.serving.remote_switch:switch_served_reference",
                served_as="a wcache reference engine (no /v1/weights)"),
    # A served vLLM is reached over HTTP only (`wcache.vllm_served`, which verifies through `wcache.verify`).
    EngineEntry("vllm", "wcache.integrations.vllm.greedy:run_greedy", tensor_parallel=True, own_plan=True,
                placement="wcache.integrations.vllm.loader:attach_into",
                versions="wcache.integrations.vllm.version:SUPPORTED",
                plan_refusal=f"{option('engine', 'vllm')} takes its plan from vLLM; drop {option('quantization')} and "
                f"{option('layout')}.", served_verify="wcache.vllm_served:verify_if_vllm",
                served_switch="wcache.vllm_served:switch_if_vllm", served_as="a vLLM server (no /version)",
                doctor_check="wcache.integrations.vllm.doctor:check"),
    EngineEntry("transformers", "wcache.integrations.transformers.greedy:run_greedy", tensor_parallel=False,
                own_plan=True, placement="wcache.integrations.transformers.attach:place_into",
                versions="wcache.integrations.transformers.version:SUPPORTED",
                plan_refusal=f"{option('engine', 'transformers')} runs TP 1 without quantization; drop "
                f"{option('tp_size')}, {option('quantization')} and {option('layout')}."),
)
ENGINES = tuple(entry.name for entry in REGISTRY)


def engine_entry(name: str) -> EngineEntry:
    """The registry's entry for `name`, or one error sentence naming the engines there are."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise BadInputError(f"{option('engine')} must be one of {', '.join(ENGINES)}, not {name!r}.")
