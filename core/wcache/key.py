"""WeightCacheKey: the fields that determine one rank's processed bytes, and the key file that carries it."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import wcache
from wcache.canonical import digest_of
from wcache.checkpoint import CheckpointLayout, locate
from wcache.digest_store import DigestStore
from wcache.dtypes import SAFETENSORS_TO_PLAN
from wcache.errors import BadInputError, KeyFileError
from wcache.fingerprint import FingerprintStats, HashProgress, fingerprint_checkpoint
from wcache.manifest import ManifestSource, TensorDigest, build_manifest, merkle_root
from wcache.model_config import canonical_config, config_digest, config_dtype
from wcache.plan import PlanSpec
from wcache.safetensors_header import TensorInfo
from wcache.shard_hash import OpenShard

# Bumped whenever processing code changes the bytes it produces for the same inputs.
FORMAT_VERSION = 1
KEY_SCHEMA = "wcache.key/1"
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
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


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

    @cached_property
    def manifest(self) -> tuple[TensorDigest, ...]:
        return build_manifest(self.manifest_source)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.manifest)

    def to_json(self) -> dict[str, Any]:
        """The key file document; `stats` describe one computation and are not part of it."""
        return {
            "schema": KEY_SCHEMA,
            "id": self.key.short_id,
            "key": asdict(self.key),
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
            result = cls(key=key, plan=plan, config=data["config"], manifest_source=manifest,
                         source=str(info["source"]), created=str(info["created"]),
                         wcache_version=str(info["wcache_version"]))
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


def _dominant_dtype(tensors: Iterable[TensorDigest | TensorInfo]) -> str:
    by_bytes: Counter[str] = Counter()
    for entry in tensors:
        by_bytes[entry.dtype] += entry.nbytes
    for dtype, _ in by_bytes.most_common():
        if dtype in SAFETENSORS_TO_PLAN:
            return SAFETENSORS_TO_PLAN[dtype]
    return "float32"


def compute_key(
    path: Path,
    plan: PlanSpec | None = None,
    *,
    store: DigestStore | None = None,
    rehash: bool = False,
    progress: HashProgress | None = None,
) -> KeyFile:
    """The key of checkpoint `path` under `plan`; warm shards cost one stat each and no reads."""
    layout = locate(path)
    fingerprint = fingerprint_checkpoint(layout, store, rehash=rehash, progress=progress)
    return make_key_file(path, layout, fingerprint.manifest_source, plan or PlanSpec(), fingerprint.stats,
                         root=fingerprint.root)


def resolve_plan(layout: CheckpointLayout, manifest: ManifestSource, plan: PlanSpec) -> PlanSpec:
    """`plan` with an "auto" dtype made the checkpoint's own: config.json's dtype, else the dtype that holds
    most bytes. The one rule for "auto"; needs the tensors' dtypes, not their digests, and builds a lazy
    manifest only where config.json names no dtype."""
    dtype = config_dtype(layout.config)
    if dtype is None and plan.dtype == "auto":
        dtype = _dominant_dtype(build_manifest(manifest))
    return plan.resolve(dtype or plan.dtype)


def resolve_plan_from_headers(layout: CheckpointLayout, plan: PlanSpec) -> PlanSpec:
    """`resolve_plan` for a caller without a manifest: reads the shard headers only when config.json does not
    name a dtype (and the plan asks for "auto")."""
    if plan.dtype != "auto" or config_dtype(layout.config) is not None:
        return plan.resolve(config_dtype(layout.config) or plan.dtype)
    tensors = []
    for path in layout.shards:
        with OpenShard(path) as shard:
            tensors.extend(shard.header.tensors)
    return plan.resolve(_dominant_dtype(tensors))


def make_key_file(
    path: Path,
    layout: CheckpointLayout,
    manifest: ManifestSource,
    plan: PlanSpec,
    stats: FingerprintStats | None,
    *,
    root: str | None = None,
) -> KeyFile:
    """Assemble the key of a fingerprinted checkpoint; "auto" dtype resolves to the checkpoint's own.

    `root` is the manifest's Merkle root where the caller already has it (a Fingerprint's): one root per key.
    """
    resolved = resolve_plan(layout, manifest, plan)
    key = WeightCacheKey(
        checkpoint=root if root is not None else merkle_root(build_manifest(manifest)),
        config=config_digest(layout.config),
        plan=resolved.digest(),
        format=FORMAT_VERSION,
    )
    return KeyFile(
        key=key,
        plan=resolved,
        config=canonical_config(layout.config),
        manifest_source=manifest,
        source=os.path.abspath(path),  # noqa: PTH100  (no syscalls: resolve() costs round trips on remote storage)
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        wcache_version=wcache.__version__,
        stats=stats,
    )


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

