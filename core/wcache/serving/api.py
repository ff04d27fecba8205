"""The reference engine's HTTP API as schemas: every request its server reads and every reply it writes, read
back by its clients (`wcache switch`, `wcache verify URL`) through the same types.

Requests are read strictly where the engine alone is their client (`SwitchRequest`), and skip fields they do
not know where OpenAI's clients send more (`CompletionRequest`). Replies are written whole (`omit_defaults`
off: a reader sees `logprobs: null`, not a missing key) and read tolerantly: a field the reader does not need
has a default, and fields it does not know are skipped, because the same readers take vLLM's answers, which
carry more and lack wcache's. `POST /tokenize` and `POST /detokenize` are vLLM's shapes (`tokenize_api`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from wcache.ipc.attach_summary import AttachSummary
from wcache.key.cache_key import WeightCacheKey
from wcache.schema import Schema
from wcache.serving.tokenize_api import MAX_TOKEN_ID

# What a verify may allocate from an engine's word: its disk engine holds the same KV cache as the served one.
MAX_BLOCK_SIZE = 4096
MAX_CACHE_TOKENS = 1 << 24


class Reply(Schema, frozen=True, forbid_unknown_fields=False, omit_defaults=False):
    """A reply of the engine: written with every field, read skipping what the reader does not know (a reply
    whose required fields follow optional ones, to keep the order it is written in, is `kw_only`)."""


# -- requests --------------------------------------------------------------------------------------------------


class CompletionRequest(Schema, frozen=True, forbid_unknown_fields=False):
    """POST /v1/completions, as far as the engine reads it: OpenAI's clients send more (model, stream, …)."""

    # A string, a list of one string (what OpenAI's client sends for one), or token ids; None: not sent.
    prompt: str | list[str | int] | None = None
    max_tokens: int = 16  # between 1 and the server's MAX_TOKENS_LIMIT
    temperature: float = 0  # greedy decoding only: 0


class SwitchRequest(Schema, frozen=True):
    """POST /v1/weights: the weights to switch to, a checkpoint (`model`, absolute path or repo id) and/or a
    daemon (`daemon`, a name or key id prefix)."""

    model: str | None = None
    daemon: str | None = None


# -- replies ---------------------------------------------------------------------------------------------------


class ErrorBody(Reply, frozen=True):
    """What went wrong: one sentence, OpenAI's error type, the HTTP status."""

    message: str | None = None
    type: str | None = None
    code: int | None = None


class ErrorAnswer(Reply, frozen=True):
    """Any refusal, in OpenAI's shape; vLLM's own routes may answer a bare string or other keys."""

    error: ErrorBody | str | None = None


class HealthAnswer(Reply, frozen=True):
    """GET /health: 200 with "ok", else 503 with "weights lost" or "weights corrupt" (`corrupt` says why)."""

    status: str
    daemon_lost: bool
    corrupt: str | None


class ModelCard(Reply, frozen=True):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "wcache"


class ModelsAnswer(Reply, frozen=True, kw_only=True):
    """GET /v1/models: the one model the engine serves now."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServedClaim(Reply, frozen=True):
    """Weights an engine claims to serve: their checkpoint (or delta), content key and its short id."""

    model: str | None = None
    key: WeightCacheKey | None = None
    key_id: str | None = None


class ServedCacheConfig(Reply, frozen=True, forbid_unknown_fields=True):
    """An engine's cache settings as `GET /v1/weights` states them, bounded before anything is allocated."""

    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)] = 16
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CACHE_TOKENS)] = 2048
    swa_bounded_replay: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size * self.num_blocks > MAX_CACHE_TOKENS:
            raise ValueError(f"a KV cache of {self.num_blocks} blocks of {self.block_size} tokens is more than "
                             f"the {MAX_CACHE_TOKENS} tokens a verify allocates")


class WeightsAnswer(Reply, frozen=True):
    """GET /v1/weights: the checkpoint and key the engine serves, under which plan (every field of
    `PlanSpec.to_json()`), how it got them (None: from disk), and whether it follows their newest version."""

    object: Literal["weights"] = "weights"
    model: str | None = None
    key: WeightCacheKey | None = None
    key_id: str | None = None
    follows: bool = False
    from_delta: bool = False  # the weights are a version built from a delta: `model` is that delta, no checkpoint
    corrupt: str | None = None
    plan: dict[str, Any] | None = None
    tp_size: int | None = None
    device: str | None = None
    engine_config: ServedCacheConfig = ServedCacheConfig()
    attach: AttachSummary | None = None


class SwitchAttach(Reply, frozen=True):
    """The daemon a switch attached, as every engine's switch answer names it."""

    daemon: str | None = None


class SwitchAnswer(Reply, frozen=True, kw_only=True):
    """What a switch answers (the reference engine's POST /v1/weights, or wcache's switch of a vLLM server), as
    far as `wcache switch` reads it."""

    object: str | None = None  # the reference engine's "weights_switch"
    previous: ServedClaim
    current: ServedClaim
    attach: SwitchAttach
    switch_ms: Annotated[float, msgspec.Meta(ge=0, lt=1e12)]


class WeightsSwitched(SwitchAnswer, frozen=True, kw_only=True):
    """The reference engine's POST /v1/weights: the whole attach report of the switch."""

    attach: AttachSummary  # type: ignore[assignment]  # the whole report of which SwitchAttach reads `daemon`


class CompletionExtension(Reply, frozen=True):
    """The `wcache` part of a completion: what it took from the prefix cache and which weights ran it."""

    hit_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_CACHE_TOKENS)] = 0
    adopted: bool = False
    replayed_tokens: int = 0
    prefill_tokens: int = 0
    weights_key: str | None = None


class CompletionChoice(Reply, frozen=True, kw_only=True):
    index: int = 0
    text: str | None = None  # the engine's own decoding of token_ids
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]]
    logprobs: None = None
    finish_reason: str | None = None


class CompletionUsage(Reply, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionAnswer(Reply, frozen=True, kw_only=True):
    """POST /v1/completions: one choice with its token ids, the usage, and the `wcache` extension (vLLM's
    answer has none; a reader needs only the choices)."""

    id: str | None = None
    object: str | None = None  # "text_completion"
    created: int | None = None
    model: str | None = None
    choices: Annotated[list[CompletionChoice], msgspec.Meta(min_length=1)]
    usage: CompletionUsage | None = None
    wcache: CompletionExtension = CompletionExtension()
