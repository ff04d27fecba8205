"""The bodies of `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: what the reference engine's server
reads and answers, and what `wcache verify URL` reads back from it or from a vLLM server.

They expose the tokenizer the engine holds in memory, which is what its completions run through: a verify
compares it with the tokenizer files of the checkpoint the engine claims.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from wcache.schema import Schema

MAX_TOKEN_ID = 1 << 31  # no vocabulary is larger; bounds what a client reads before it compares


class TokenizeRequest(Schema, frozen=True):
    """POST /tokenize: a text prompt, encoded as the engine's completions encode it."""

    prompt: str
    model: str | None = None  # vLLM's field: the served model's name, which the reference engine does not check
    add_special_tokens: bool = True


class TokenizeAnswer(Schema, frozen=True, forbid_unknown_fields=False):
    """The prompt's token ids, their count, and how many tokens one request may hold."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]]
    count: Annotated[int, msgspec.Meta(ge=0)]
    max_model_len: Annotated[int, msgspec.Meta(ge=0)]


class DetokenizeRequest(Schema, frozen=True):
    """POST /detokenize: token ids, decoded as the engine's completions decode their answers."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]]
    model: str | None = None


class DetokenizeAnswer(Schema, frozen=True, forbid_unknown_fields=False):
    """The text of the token ids (vLLM calls it `prompt`)."""

    prompt: str
