"""`wcache verify URL --greedy`: a running reference engine's tokens, through its own HTTP API, against a disk
engine of the checkpoint it claims to serve (GET /v1/weights).

The claim is checked first: the checkpoint's key on disk now must be the key the engine states, else the disk
engine would load other weights and the comparison would prove nothing. The key covers the tokenizer files, not
the tokenizer the engine holds in memory: each prompt is encoded by the engine itself (POST /tokenize) and by
the checkpoint's files, and each answer decoded by both (POST /detokenize); any difference is named. Each
prompt goes through the engine's completions API as token ids; its answer names the weights that ran it (a
switch in between is a difference). The served engine may answer from its prefix cache: the disk engine, with
the same cache settings, first computes the prefix the served engine reported as its hit, so both run the
same steps. With bounded replay an adopted hit recomputes one window only, as on the served side.

An engine without /v1/weights is not a reference engine: `verify_served` asks the registry's next served
engine (a vLLM server: `wcache.vllm_served` verifies it through vLLM's own API).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wcache.errors import BadInputError, UnavailableError
from wcache.integrations.registry import GreedyAttach, not_served, served_verifiers
from wcache.ipc.attach_summary import AttachSummary
from wcache.key.cache_key import WeightCacheKey
from wcache.plan.spec import PlanSpec
from wcache.serving.api import CompletionAnswer, WeightsAnswer
from wcache.serving.client import (
    EngineRequestError,
    call_engine,
    engine_base_url,
    engine_text,
    engine_tokens,
    read_answer,
)
from wcache.verify import (
    GreedyReport,
    PromptResult,
    built_from_delta,
    compare_prompts,
    decoding_difference,
    encoding_difference,
)

if TYPE_CHECKING:
    from wcache.engine import EngineConfig
    from wcache.engine.tokenizer import Tokenizer

SERVED = "reference (served)"  # the engine a served reference engine's report names


def _claim(url: str) -> tuple[Path, WeightCacheKey, PlanSpec, EngineConfig, AttachSummary | None]:
    """What the engine at `url` says it serves: checkpoint, key, plan, its cache settings, and how it attached
    them (None: it loaded them from disk)."""
    from wcache.engine import EngineConfig

    document = call_engine(url, "GET", "/v1/weights")
    try:
        claim = WeightsAnswer.from_wire(document)
        if claim.tp_size != 1:
            raise BadInputError(f"the engine at {url} runs TP {claim.tp_size}; verifying a served "
                                "tensor-parallel engine is not implemented.")
        if claim.model is None or claim.key is None or claim.plan is None:
            raise BadInputError(f"the engine at {url} does not say which keyed checkpoint it serves.")
        if claim.from_delta:
            raise built_from_delta(url, claim.key_id, claim.attach.daemon if claim.attach else None)
        return (Path(claim.model), claim.key, PlanSpec.from_json(claim.plan),
                EngineConfig(**claim.engine_config.to_wire()), claim.attach)
    except (TypeError, ValueError) as exc:
        raise UnavailableError(f"the engine at {url} describes its weights in a form wcache does not read "
                               f"({exc}).") from None


def verify_served(url: str, prompts: list[str], max_new_tokens: int) -> GreedyReport:
    """Greedy tokens of the engine at `url` against a disk load of the checkpoint it claims, per prompt, by the
    first engine of the registry that recognizes the engine at `url` as its own."""
    if not prompts:
        raise BadInputError("there are no prompts to verify with.")
    for verifier in served_verifiers():
        report: GreedyReport | None = verifier(url, prompts, max_new_tokens)
        if report is not None:
            return report
    raise not_served(engine_base_url(url))


def verify_served_reference(url: str, prompts: list[str], max_new_tokens: int) -> GreedyReport | None:
    """`verify_served` for a reference engine; None when the engine at `url` has no /v1/weights."""
    from wcache.engine import Engine
    from wcache.engine.engine import checkpoint_model
    from wcache.key.compute import compute_key
    from wcache.key.digest_store import DigestStore
    from wcache.load.loader import load_from_disk

    try:
        model, claimed, plan, config, report = _claim(url)
    except EngineRequestError as exc:
        if exc.status != 404:
            raise
        return None
    attach = (GreedyAttach.of_report(SERVED, report, url=url, model=str(model)) if report is not None
              else GreedyAttach(SERVED, "disk", key_id=claimed.short_id, url=url, model=str(model)))
    with DigestStore.open() as store:
        key_file = compute_key(model, plan, store=store)
    if key_file.key != claimed:
        return GreedyReport([], attach, f"the engine claims key {claimed.short_id} for {model}, but that "
                            f"checkpoint's key is now {key_file.key.short_id}: its files changed since the engine "
                            "attached them")
    weights = load_from_disk(key_file, model)
    model_config, tokenizer = checkpoint_model(model)
    if tokenizer is None:
        raise BadInputError(f"{model} has no tokenizer to encode the prompts.")
    served: list[list[int]] = []
    disk: list[list[int]] = []
    problems = [_encoding_difference(url, model, tokenizer, prompts)]
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        answer = read_answer(CompletionAnswer, call_engine(url, "POST", "/v1/completions", {
            "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0}), url)
        extension = answer.wcache
        if extension.weights_key != claimed.short_id:
            problems.append(f"the engine answered with weights {extension.weights_key}, not the "
                            f"{claimed.short_id} it claimed: it switched during the verification")
        served.append(list(answer.choices[0].token_ids))
        # A fresh disk engine per prompt over the same tensors: its cache holds exactly the served hit.
        engine = Engine(model_config, weights, config, tokenizer=tokenizer)
        hit = min(extension.hit_tokens, len(ids))
        if hit:
            engine.generate(ids[:hit], 1)
        disk.append(engine.generate(ids, max_new_tokens).token_ids)
    problems.append(_decoding_difference(url, model, tokenizer, served))
    results: list[PromptResult] = compare_prompts(prompts, served, disk)
    return GreedyReport(results, attach, next((p for p in problems if p is not None), None))


def _encoding_difference(url: str, model: Path, tokenizer: Tokenizer, prompts: list[str]) -> str | None:
    """The first prompt the engine's own tokenizer encodes otherwise than the checkpoint's files, in one sentence."""
    differences = (encoding_difference(model, index, engine_tokens(url, prompt), tokenizer.encode(prompt))
                   for index, prompt in enumerate(prompts))
    return next((d for d in differences if d is not None), None)


def _decoding_difference(url: str, model: Path, tokenizer: Tokenizer, answers: list[list[int]]) -> str | None:
    """The first answer the engine's own tokenizer decodes otherwise than the checkpoint's files, in one sentence."""
    differences = (decoding_difference(model, index, engine_text(url, token_ids), tokenizer.decode(token_ids))
                   for index, token_ids in enumerate(answers))
    return next((d for d in differences if d is not None), None)

