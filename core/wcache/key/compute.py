"""Computing a key: fingerprint the checkpoint, resolve the plan's "auto" dtype (the one rule), assemble the
key file; and the trusted fields alone, for engines that skip the fingerprint."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from wcache._version import __version__
from wcache.checkpoint.dtypes import SAFETENSORS_TO_PLAN
from wcache.checkpoint.file_record import FilesSource
from wcache.checkpoint.files import CheckpointLayout, locate
from wcache.checkpoint.manifest import ManifestSource, TensorDigest, build_manifest, merkle_root
from wcache.checkpoint.model_config import canonical_config, config_digest, config_dtype
from wcache.checkpoint.safetensors_header import TensorInfo
from wcache.errors import CheckpointError
from wcache.key.cache_key import FORMAT_VERSION, KeyFile, WeightCacheKey
from wcache.key.companion_digest import companion_files, tokenizer_digest
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import CheckpointChangedError, FingerprintStats, HashProgress, fingerprint_checkpoint
from wcache.key.shard_hash import MAX_ATTEMPTS, OpenShard
from wcache.plan.spec import PlanSpec


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
    """The key of checkpoint `path` under `plan`; warm shards cost one stat each and no reads.

    A checkpoint whose files are replaced while they are read (fingerprint.hashed_state) is keyed again, from
    its config on, so that the key is of one state of it.
    """
    for _ in range(MAX_ATTEMPTS):
        layout = locate(path)
        try:
            fingerprint = fingerprint_checkpoint(layout, store, rehash=rehash, progress=progress)
        except CheckpointChangedError:
            continue
        return make_key_file(path, layout, fingerprint.manifest_source, plan or PlanSpec(), fingerprint.stats,
                             root=fingerprint.root, files=fingerprint.files_source, store=store)
    raise CheckpointError(f"{path} had files replaced every time its key was computed ({MAX_ATTEMPTS} tries); "
                          "try again once it stays put.")


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
    tensors: list[TensorInfo] = []
    for path in layout.shards:
        with OpenShard(path) as shard:
            tensors.extend(shard.header.tensors)
    return plan.resolve(_dominant_dtype(tensors))


def trusted_key(path: Path, plan: PlanSpec, store: DigestStore | None = None) -> dict[str, Any]:
    """What an engine that trusts the daemon compares of `path`'s key under `plan` (every field but the
    checkpoint's digest), without hashing a shard ("auto" as the key resolves it)."""
    layout = locate(path)
    resolved = resolve_plan_from_headers(layout, plan)
    return {"config": config_digest(layout.config), "tokenizer": tokenizer_digest(companion_files(layout, store)),
            "plan": resolved.digest(), "format": FORMAT_VERSION}


def make_key_file(
    path: Path,
    layout: CheckpointLayout,
    manifest: ManifestSource,
    plan: PlanSpec,
    stats: FingerprintStats | None,
    *,
    root: str | None = None,
    files: FilesSource = (),
    store: DigestStore | None = None,
) -> KeyFile:
    """Assemble the key of a fingerprinted checkpoint; "auto" dtype resolves to the checkpoint's own.

    `root` is the manifest's Merkle root where the caller already has it (a Fingerprint's): one root per key.
    """
    resolved = resolve_plan(layout, manifest, plan)
    companions = companion_files(layout, store)
    key = WeightCacheKey(
        checkpoint=root if root is not None else merkle_root(build_manifest(manifest)),
        config=config_digest(layout.config),
        tokenizer=tokenizer_digest(companions),
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
        wcache_version=__version__,
        stats=stats,
        files_source=files,
        companions=companions,
    )
