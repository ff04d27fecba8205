"""Proof instead of trust: greedy tokens from cached weights vs disk weights, and content re-hashing.

`verify_greedy` runs the same prompts at temperature 0 through an engine attached to a daemon and an
engine loaded from disk, and compares token ids; it catches a wrong hit whatever the key said.
`verify_content` compares a daemon's recorded source digests with a fresh hash of the checkpoint, and has
the daemon re-hash its processed arena against the digests it recorded when it built it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from wcache.attach import AttachMissError
from wcache.attach_options import AttachOptions
from wcache.checkpoint.provenance import FileVerdict, ProvenanceReport, overall, provenance_report
from wcache.daemon_choice import pick_daemon
from wcache.errors import BadInputError, UnavailableError
from wcache.integrations.registry import GreedyAttach, engine_entry
from wcache.ipc.run_dir.remote_key import daemon_key_file
from wcache.ipc.wire.client import DaemonConnection, DaemonError
from wcache.ipc.wire.messages import CheckArena, Manifest
from wcache.key.compute import compute_key
from wcache.key.diff import KeyDiff, diff_keys
from wcache.key.provenance import verdicts_of
from wcache.plan.spec import PlanSpec, preload_command
from wcache.schema import Schema

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
    attach: GreedyAttach
    problem: str | None = None  # a difference found before or beside the tokens (a served engine's claim)

    @property
    def all_match(self) -> bool:
        return self.problem is None and all(r.match for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return GreedyOutput(self.all_match, self.attach, self.problem, list(self.results)).to_wire()


class GreedyOutput(Schema, frozen=True, omit_defaults=False):
    """`verify --greedy --json`'s `greedy`: whether every prompt matched (and nothing else went wrong: `problem`),
    how the cached side got its weights, and each prompt's tokens on both sides."""

    all_match: bool
    attach: GreedyAttach
    problem: str | None
    prompts: list[PromptResult]


def built_from_delta(url: str, key_id: str | None, daemon: str | None) -> UnavailableError:
    """Why a served engine on a version built from a delta cannot be verified: no file holds those weights (a delta
    file names only what changed, and a published one is gone once built)."""
    return UnavailableError(f"the engine at {url} serves key {key_id}, a version built from a delta (daemon "
                            f"{daemon}): no checkpoint on disk holds those weights to compare with; write one with "
                            "`wcache delta --apply` and serve that to verify it.")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (the shorter one's length when one extends the other), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


SHOWN_IDS = 8  # token ids of a tokenizer difference its sentence shows


def encoding_difference(model: object, index: int, engine_ids: list[int], disk_ids: list[int]) -> str | None:
    """The sentence naming how a served engine's own tokenizer encodes prompt `index` otherwise than the
    tokenizer files of `model` it claims, or None when they agree."""
    at = first_divergence(engine_ids, disk_ids)
    if at is None:
        return None
    return (f"the engine's own tokenizer encodes prompt {index} otherwise than the tokenizer files of {model} "
            f"(from token {at}: {_ids(engine_ids[at:])} against {_ids(disk_ids[at:])}), so it serves with another "
            "tokenizer than the checkpoint it claims")


def decoding_difference(model: object, index: int, engine_text: str, disk_text: str) -> str | None:
    """The sentence naming how a served engine's own tokenizer decodes the answer to prompt `index` otherwise
    than the tokenizer files of `model`, or None when they agree."""
    if engine_text == disk_text:
        return None
    return (f"the engine's own tokenizer decodes the answer to prompt {index} as {_shown(engine_text)}, the "
            f"tokenizer files of {model} as {_shown(disk_text)}, so it serves with another tokenizer than the "
            "checkpoint it claims")


def _ids(token_ids: list[int]) -> str:
    return "[" + ", ".join(map(str, token_ids[:SHOWN_IDS])) + (", …]" if len(token_ids) > SHOWN_IDS else "]")


def _shown(text: str, limit: int = 120) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "…"


def compare_prompts(prompts: list[str], cached: list[list[int]], disk: list[list[int]]) -> list[PromptResult]:
    results = []
    for index, (prompt, a, b) in enumerate(zip(prompts, cached, disk, strict=True)):
        divergence = first_divergence(a, b)
        results.append(PromptResult(index, prompt, divergence is None, divergence, a, b))
    return results


def verify_greedy(model: Path, plan: PlanSpec, prompts: list[str], max_new_tokens: int, engine: str = "reference",
                  *, options: AttachOptions | None = None, device: str = "cpu") -> GreedyReport:
    """Compare greedy tokens of an attached engine and a disk engine; TP plans run every rank (gloo).

    `engine` is whose engine runs both sides, an entry of `wcache.integrations.registry`: wcache's reference
    engine, vLLM (its `wcache` load format against its default loader), or transformers (`from_pretrained`
    through wcache against its own). The
    attached side never falls back to disk, whatever `options` say: a miss is an error, not a comparison.
    `device` is the reference engine's; vLLM and transformers pick their own.
    """
    options = msgspec.structs.replace(options or AttachOptions(), fallback=False)
    if not prompts:
        raise BadInputError("there are no prompts to verify with.")
    entry = engine_entry(engine)
    refusal = entry.refusal(plan)
    if refusal is not None:
        raise BadInputError(refusal)
    try:
        run = entry.load_runner()(model, plan, prompts, max_new_tokens, options, device)
    except AttachMissError as miss:
        # The attach's own sentence names attach's --no-fallback, an option verify does not have.
        raise AttachMissError(f"{miss.report.reason}; verify compares a daemon's weights with a disk load, so one "
                              f"must hold them: run `{preload_command(model, plan)}` first.", miss.report) from None
    return GreedyReport(compare_prompts(prompts, run.cached, run.disk), run.attach)


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
        source = SourceChanges([c.name for c in diff.changed] if diff else [],
                               [e.name for e in diff.added] if diff else [],
                               [e.name for e in diff.removed] if diff else [])
        return ContentOutput(self.ok, self.daemon, source, ArenaCheck(self.arena_checked, self.arena_changed),
                             provenance_report(self.provenance)).to_wire()


class SourceChanges(Schema, frozen=True):
    """Tensors whose bytes on disk differ from what the daemon loaded, by name."""

    changed: list[str]
    added: list[str]
    removed: list[str]


class ArenaCheck(Schema, frozen=True):
    """The daemon's re-hash of its arena: how many tensors it checked, and the names of those that changed."""

    checked: int
    changed: list[str]


class ContentOutput(Schema, frozen=True, omit_defaults=False):
    """`verify --content --json`'s `content`: whether the daemon serves the checkpoint's bytes, and where not."""

    ok: bool
    daemon: str
    source: SourceChanges
    arena: ArenaCheck
    provenance: ProvenanceReport


class VerifyOutput(Schema, frozen=True):
    """`wcache verify --json`: whether every check asked for passed, and the report of each (absent when not
    asked)."""

    ok: bool
    provenance: ProvenanceReport | None = None
    content: ContentOutput | None = None
    greedy: GreedyOutput | None = None


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
