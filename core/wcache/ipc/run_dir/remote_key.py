"""A running daemon's key as a KeyFile, from its descriptor and the manifest it serves."""

from __future__ import annotations

from wcache.checkpoint.manifest import TensorDigest
from wcache.ipc.run_dir.directory import DaemonDescriptor
from wcache.key.cache_key import KeyFile, split_files


def daemon_key_file(descriptor: DaemonDescriptor, tensors: tuple[TensorDigest, ...]) -> KeyFile:
    """The key a daemon holds, comparable with any other KeyFile by diff_keys."""
    shards, companions = split_files(descriptor.files)
    return KeyFile(
        key=descriptor.key,
        plan=descriptor.plan,
        config=descriptor.config,
        manifest_source=tensors,
        source=f"daemon {descriptor.name} ({descriptor.source})",
        created=descriptor.started,
        wcache_version="",
        files_source=shards,
        companions=companions,
    )
