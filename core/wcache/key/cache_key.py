"""WeightCacheKey: the fields that determine one rank's processed bytes, and the key file that carries it.

Value types and key-file I/O only; computing a key is `wcache.key.compute`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from wcache.bounded_read import read_named_text, unreadable_why
from wcache.canonical import digest_of
from wcache.checkpoint.file_record import FileDigest, FilesSource, build_files
from wcache.checkpoint.manifest import ManifestSource, TensorDigest, build_manifest, merkle_root
from wcache.checkpoint.model_config import config_digest
from wcache.errors import BadInputError, KeyFileError
from wcache.plan.spec import PlanSpec
from wcache.schema import Schema

if TYPE_CHECKING:
    from wcache.key.fingerprint import FingerprintStats  # a computed key's stats; key files never carry them

# Bumped whenever processing code changes the bytes it produces for the same inputs.
FORMAT_VERSION = 2  # 2: the vocabulary padded to 64 rows before a TP split; stacked experts; pre-quantized codes
# In every saved key file: never changes with the module layout. 2: the key has a `tokenizer` field, and `files`
# lists config.json and the tokenizer's files after the shards (a /1 file is refused: docs/key.md, migration).
KEY_SCHEMA = "wcache.key/2"
SHORT_ID_HEX = 12


class WeightCacheKey(Schema, frozen=True):
    """The compared fields; anything informational travels beside the key, never inside it."""

    checkpoint: str
    config: str
    tokenizer: str  # the tokenizer's files and generation_config.json (wcache.key.companion_digest)
    plan: str
    format: int

    @property
    def digest(self) -> str:
        return digest_of(msgspec.structs.asdict(self))

    @property
    def short_id(self) -> str:
        return self.digest[:SHORT_ID_HEX]

    def mismatched_fields(self, other: WeightCacheKey) -> list[str]:
        return [name for name in KEY_FIELDS if getattr(self, name) != getattr(other, name)]

    def to_json(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


# The compared fields by name, in order: what a hello carries and a descriptor records.
KEY_FIELDS: tuple[str, ...] = WeightCacheKey.__struct_fields__


class KeyInfo(Schema, frozen=True):
    """Where a key file came from and what it describes; informational, outside the key."""

    source: str
    created: str
    wcache_version: str
    num_tensors: int
    total_bytes: int


class KeyDocument(Schema, frozen=True):
    """A key file as saved: `wcache key --json` prints one (with `provenance`, its verdicts, beside the key;
    such output saved reads as a key file too)."""

    schema: str
    id: str
    key: WeightCacheKey
    plan: dict[str, Any]  # PlanSpec's every field: its digest is over all of them, its defaults included
    config: dict[str, Any] | None
    info: KeyInfo
    tensors: tuple[TensorDigest, ...]
    # each shard's size and SHA-256, then config.json's and each tokenizer file's (with its git SHA-1)
    files: tuple[FileDigest, ...] | None = None
    provenance: dict[str, Any] | None = None


@dataclass(frozen=True)
class KeyFile:
    """A key with what explains it: the plan, the canonical config, the manifest, and where it came from.

    `manifest_source` is the manifest, or what builds it: a key whose root came from the digest store builds
    its per-tensor list only when `manifest` is first read (an attach that hits never reads it).
    """

    key: WeightCacheKey
    plan: PlanSpec
    config: dict[str, Any] | None
    manifest_source: ManifestSource = field(repr=False, compare=False)
    source: str
    created: str
    wcache_version: str
    stats: FingerprintStats | None = None
    # Each shard's size and SHA-256, for provenance; informational, outside the key (a key file may lack them).
    files_source: FilesSource = field(default=(), repr=False, compare=False)
    # config.json and the tokenizer's files (the `tokenizer` field is made of the latter), always at hand.
    companions: tuple[FileDigest, ...] = field(default=(), repr=False, compare=False)

    @cached_property
    def manifest(self) -> tuple[TensorDigest, ...]:
        return build_manifest(self.manifest_source)

    @cached_property
    def files(self) -> tuple[FileDigest, ...]:
        """Every file the key depends on: the shards, then config.json and the tokenizer's files."""
        return build_files(self.files_source) + self.companions

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.manifest)

    def to_json(self) -> dict[str, Any]:
        """The key file document; `stats` describe one computation and are not part of it."""
        info = KeyInfo(self.source, self.created, self.wcache_version, len(self.manifest), self.total_bytes)
        return KeyDocument(KEY_SCHEMA, self.key.short_id, self.key, self.plan.to_json(), self.config, info,
                           self.manifest, self.files).to_wire()

    @classmethod
    def from_json(cls, data: Any, origin: str) -> KeyFile:
        """Rebuild a key file, checking that its manifest still adds up to its checkpoint digest."""
        try:
            if isinstance(data, dict) and data.get("schema") == "wcache.key/1":
                raise ValueError("it was saved by a wcache whose key did not cover the tokenizer; save it again "
                                 "with: wcache key MODEL --json")
            if not isinstance(data, dict) or data.get("schema") != KEY_SCHEMA:
                found = data.get("schema") if isinstance(data, dict) else type(data).__name__
                raise ValueError(f"schema is {found!r}, expected {KEY_SCHEMA!r}")
            document = KeyDocument.from_wire(data)
            plan = PlanSpec.from_wire(document.plan)
        except (ValueError, BadInputError) as exc:  # SchemaError is a ValueError
            raise KeyFileError(f"{origin} is not a wcache key file ({exc}).") from None
        key, manifest = document.key, document.tensors
        shards, companions = split_files(document.files or ())
        result = cls(key=key, plan=plan, config=document.config, manifest_source=manifest,
                     source=document.info.source, created=document.info.created,
                     wcache_version=document.info.wcache_version, files_source=shards, companions=companions)
        # A hand-edited key file must not pass for the checkpoint it claims to describe.
        if not manifest or merkle_root(manifest) != key.checkpoint:
            raise KeyFileError(f"{origin} has a tensor list that does not match its checkpoint digest.")
        if plan.dtype == "auto" or plan.digest() != key.plan:
            raise KeyFileError(f"{origin} has a plan that does not match its plan digest.")
        if config_digest(result.config) != key.config:
            raise KeyFileError(f"{origin} has a config that does not match its config digest.")
        # Imported here: it brings the digest store (sqlite3, platformdirs), which every reader of a daemon
        # descriptor (`wcache status`) would otherwise load for nothing.
        from wcache.key.companion_digest import tokenizer_digest

        if tokenizer_digest(companions) != key.tokenizer:
            raise KeyFileError(f"{origin} has tokenizer files that do not match its tokenizer digest.")
        return result


def split_files(files: tuple[FileDigest, ...]) -> tuple[tuple[FileDigest, ...], tuple[FileDigest, ...]]:
    """A key's files as (shards, then config.json and the tokenizer's files), by name."""
    # Imported here: every reader of a daemon descriptor (`wcache status`) decodes a key, and would otherwise
    # load the checkpoint's file and companion rules (hashlib, safetensors headers) for nothing.
    from wcache.checkpoint.companions import is_companion
    from wcache.checkpoint.files import CONFIG_NAME

    beside = tuple(f for f in files if f.name == CONFIG_NAME or is_companion(f.name))
    return tuple(f for f in files if f not in beside), beside


def load_key_file(path: Path) -> KeyFile:
    try:
        text = read_named_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path} cannot be read as a key file ({unreadable_why(exc)}).") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise KeyFileError(f"{path} is not a wcache key file (not JSON).") from None
    return KeyFile.from_json(data, str(path))


def is_key_file(path: Path) -> bool:
    """A regular file that is not a .safetensors file is read as a saved key."""
    return path.is_file() and path.suffix != ".safetensors"

