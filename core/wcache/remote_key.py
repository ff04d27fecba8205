"""A running daemon's key as a KeyFile, from its descriptor and the manifest it serves."""

from __future__ import annotations

from typing import Any

from wcache.key import KeyFile, WeightCacheKey
from wcache.manifest import TensorDigest
from wcache.plan import PlanSpec
from wcache.rundir import DaemonDescriptor


def daemon_key_file(descriptor: DaemonDescriptor, tensors: list[dict[str, Any]]) -> KeyFile:
    """The key a daemon holds, comparable with any other KeyFile by diff_keys."""
    manifest = tuple(TensorDigest.from_json(t) for t in tensors)
    return KeyFile(
        key=WeightCacheKey(**descriptor.key),
        plan=PlanSpec.from_json(descriptor.plan),
        config=descriptor.config,
        manifest_source=manifest,
        source=f"daemon {descriptor.name} ({descriptor.source})",
        created=descriptor.started,
        wcache_version="",
    )
