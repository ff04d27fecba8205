"""Tokenizers: bytes for the test checkpoints, a checkpoint's tokenizer.json when it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from wcache.errors import BadInputError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i; higher ids (BOS, EOS and padding) decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` package."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise BadInputError(
                f"{path} needs the `tokenizers` package (pip install tokenizers) to be read."
            ) from None
        self._tokenizer = RustTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else ByteTokenizer()
