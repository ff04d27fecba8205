"""The files beside the tensors that a served answer depends on: the tokenizer's, the chat templates and the
generation config. The one list of them; the key covers their bytes and provenance judges each.

Taken from what the loaders read (transformers 5.19's `PreTrainedTokenizerBase` and every tokenizer class's
`vocab_files_names`, its `GenerationConfig`; vLLM 0.32's tokenizer registry, which adds Mistral's tekken and
versioned SentencePiece files): a file of these names in the checkpoint's directory changes what text an engine
reads or writes, or which tokens it picks by default. `tests/test_companions.py` checks the list still holds
every vocabulary file name transformers declares.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from wcache.checkpoint.identity import FileIdentity
from wcache.errors import CheckpointError

GENERATION_CONFIG_NAME = "generation_config.json"
# transformers' tokenizer files (tokenization_utils_base: TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE,
# ADDED_TOKENS_FILE, FULL_TOKENIZER_FILE, CHAT_TEMPLATE_FILE; processing_utils' LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE)
TOKENIZER_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
})
# Every `vocab_files_names` value of transformers' tokenizer classes (vocabularies, merges, SentencePiece models).
VOCABULARY_NAMES = frozenset({
    "bpe.codes", "byte_maps.json", "dict.txt", "emoji.json", "entity_vocab.json", "merges.txt", "normalizer.json",
    "prophetnet.tokenizer", "sentencepiece.bpe.model", "sentencepiece.model", "source.spm", "spiece.model",
    "spm.model", "spm_char.model", "target.spm", "target_vocab.json", "tokenizer.model", "vocab-src.json",
    "vocab-tgt.json", "vocab.json", "vocab.txt", "word_pronunciation.json", "word_shape.json",
    "tekken.json",  # vLLM's Mistral tokenizer
})
# Names a fixed list cannot hold: vLLM's `tokenizer.model.v3`-style SentencePiece files, tiktoken vocabularies.
_PATTERN = re.compile(r"^(tokenizer\.model\.v\d+(\.\w+)?|[\w.-]+\.tiktoken)$")
# transformers' CHAT_TEMPLATE_DIR: every `*.jinja` in it is a named chat template.
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The largest tokenizer file published is some tens of MiB (Gemma 3's tokenizer.json: 33 MiB).
MAX_COMPANION_BYTES = 256 << 20


def is_companion(name: str) -> bool:
    """Whether `name` (relative to the checkpoint's directory, '/'-separated) is a file the answers depend on,
    besides the tensors and config.json."""
    if "/" in name:
        folder, _, leaf = name.partition("/")
        return folder == CHAT_TEMPLATE_DIR and "/" not in leaf and leaf.endswith(".jinja")
    return (name in TOKENIZER_NAMES or name in VOCABULARY_NAMES or name == GENERATION_CONFIG_NAME
            or _PATTERN.match(name) is not None)


@dataclass(frozen=True, slots=True)
class Companion:
    """A companion file found in a checkpoint's directory, by its name there, with the identity stat saw."""

    name: str
    path: Path
    identity: FileIdentity


def find_companions(root: Path) -> tuple[Companion, ...]:
    """The companion files in directory `root`, sorted by name: one listing, and a stat of each one found
    (following a link, as a Hugging Face snapshot's entries are). A companion that is no regular file, or a link
    that leads nowhere, is one error sentence: the key cannot say what it holds."""
    found: list[Companion] = []
    for name, path in _candidates(root):
        try:
            st = os.stat(path)
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be read ({exc.strerror}), so the key cannot cover it.") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file, so the key cannot cover it.")
        found.append(Companion(name, path, FileIdentity.of(st)))
    return tuple(sorted(found, key=lambda c: c.name))


def _candidates(root: Path) -> list[tuple[str, Path]]:
    names: list[tuple[str, Path]] = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if is_companion(entry.name):
                    names.append((entry.name, root / entry.name))
                elif entry.name == CHAT_TEMPLATE_DIR and entry.is_dir():
                    names.extend(_templates(root / CHAT_TEMPLATE_DIR))
    except FileNotFoundError:
        return []
    except PermissionError:
        # Traversable, not listable (mode 0311): the shards are read by name, and so are the companions with a
        # fixed name. Versioned SentencePiece and tiktoken files, and the templates folder, cannot be found so.
        return _by_fixed_name(root)
    except OSError as exc:
        raise CheckpointError(f"{root} cannot be listed ({exc.strerror}).") from None
    return names


def _by_fixed_name(root: Path) -> list[tuple[str, Path]]:
    names = sorted(TOKENIZER_NAMES | VOCABULARY_NAMES | {GENERATION_CONFIG_NAME})
    return [(name, root / name) for name in names if os.path.lexists(root / name)]


def _templates(folder: Path) -> list[tuple[str, Path]]:
    try:
        with os.scandir(folder) as entries:
            return [(f"{CHAT_TEMPLATE_DIR}/{e.name}", folder / e.name) for e in entries
                    if is_companion(f"{CHAT_TEMPLATE_DIR}/{e.name}")]
    except OSError as exc:
        raise CheckpointError(f"{folder} cannot be listed ({exc.strerror}).") from None


@dataclass(frozen=True, slots=True)
class ContentDigests:
    """A small file's SHA-256 (what the Hub names an LFS file by) and git blob SHA-1 (what it names any other
    file by), from one read."""

    sha256: str
    git_sha1: str


def content_digests(data: bytes) -> ContentDigests:
    git = hashlib.sha1(b"blob %d\0" % len(data), usedforsecurity=False)  # git's blob id, the Hub's etag
    git.update(data)
    return ContentDigests(hashlib.sha256(data).hexdigest(), git.hexdigest())
