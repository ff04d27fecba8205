"""WeightCacheKey: the fields that determine one rank's processed bytes, and the key file that carries it.

Value types and key-file I/O only; computing a key is `wcache.key.compute`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.canonical import digest_of
from wcache.checkpoint.manifest import ManifestSource, TensorDigest, build_manifest, merkle_root
from wcache.checkpoint.model_config import config_digest
from wcache.checkpoint.provenance import FileDigest, FilesSource, build_files
from wcache.errors import BadInputError, KeyFileError
from wcache.plan.spec import PlanSpec

if TYPE_CHECKING:
    from wcache.key.fingerprint import FingerprintStats  # a computed key's stats; key files never carry them

# Bumped whenever processing code changes the bytes it produces for the same inputs.
FORMAT_VERSION = 2  # 2: the vocabulary padded to 64 rows before a TP split; stacked experts; pre-quantized codes
KEY_SCHEMA = "wcache.key/1"  # in every saved key file: never changes with the module layout
SHORT_ID_HEX = 12


@dataclass(frozen=True, slots=True)
class WeightCacheKey:
    """The compared fields; anything informational travels beside the key, never inside it."""

    checkpoint: str
    config: str
    plan: str
    format: int

    @property
    def digest(self) -> str:
        return digest_of(asdict(self))

    @property
    def short_id(self) -> str:
        return self.digest[:SHORT_ID_HEX]

    def mismatched_fields(self, other: WeightCacheKey) -> list[str]:
        return [name for name in KEY_FIELDS if getattr(self, name) != getattr(other, name)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The compared fields by name, in order: what a hello carries and a descriptor records.
KEY_FIELDS = tuple(f.name for f in fields(WeightCacheKey))


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

    @cached_property
    def manifest(self) -> tuple[TensorDigest, ...]:
        return build_manifest(self.manifest_source)

    @cached_property
    def files(self) -> tuple[FileDigest, ...]:
        return build_files(self.files_source)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.manifest)

    def to_json(self) -> dict[str, Any]:
        """The key file document; `stats` describe one computation and are not part of it."""
        return {
            "schema": KEY_SCHEMA,
            "id": self.key.short_id,
            "key": self.key.to_json(),
            "plan": self.plan.to_json(),
            "config": self.config,
            "info": {
                "source": self.source,
                "created": self.created,
                "wcache_version": self.wcache_version,
                "num_tensors": len(self.manifest),
                "total_bytes": self.total_bytes,
            },
            "tensors": [e.to_json() for e in self.manifest],
            "files": [f.to_json() for f in self.files],
        }

    @classmethod
    def from_json(cls, data: Any, origin: str) -> KeyFile:
        """Rebuild a key file, checking that its manifest still adds up to its checkpoint digest."""
        try:
            if data.get("schema") != KEY_SCHEMA:
                raise ValueError(f"schema is {data.get('schema')!r}, expected {KEY_SCHEMA!r}")
            key = WeightCacheKey(**data["key"])
            manifest = tuple(TensorDigest.from_json(t) for t in data["tensors"])
            plan = PlanSpec.from_json(data["plan"])
            info = data["info"]
            files = tuple(FileDigest.from_json(f) for f in data.get("files", ()))  # older key files have none
            result = cls(key=key, plan=plan, config=data["config"], manifest_source=manifest,
                         source=str(info["source"]), created=str(info["created"]),
                         wcache_version=str(info["wcache_version"]), files_source=files)
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError, BadInputError) as exc:
            raise KeyFileError(f"{origin} is not a wcache key file ({exc}).") from None
        # A hand-edited key file must not pass for the checkpoint it claims to describe.
        if not manifest or merkle_root(manifest) != key.checkpoint:
            raise KeyFileError(f"{origin} has a tensor list that does not match its checkpoint digest.")
        if plan.dtype == "auto" or plan.digest() != key.plan:
            raise KeyFileError(f"{origin} has a plan that does not match its plan digest.")
        if config_digest(result.config) != key.config:
            raise KeyFileError(f"{origin} has a config that does not match its config digest.")
        return result


def load_key_file(path: Path) -> KeyFile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path} cannot be read as a key file ({exc}).") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise KeyFileError(f"{path} is not a wcache key file (not JSON).") from None
    return KeyFile.from_json(data, str(path))


def is_key_file(path: Path) -> bool:
    """A regular file that is not a .safetensors file is read as a saved key."""
    return path.is_file() and path.suffix != ".safetensors"

