"""Turn a command-line operand (a checkpoint path or a saved key file) into a key."""

from __future__ import annotations

from pathlib import Path

from wcache.digest_store import DigestStore
from wcache.key import KeyFile, compute_key, is_key_file, load_key_file
from wcache.plan import PlanSpec

from wcache_cli.progress import hash_bar


def key_of_checkpoint(path: Path, plan: PlanSpec, *, rehash: bool = False) -> KeyFile:
    """Compute a checkpoint's key through the default digest store, with a progress bar."""
    with DigestStore.open() as store, hash_bar(path.name or str(path)) as bar:
        return compute_key(path, plan, store=store, rehash=rehash, progress=bar)


def key_of_operand(operand: Path, plan: PlanSpec) -> KeyFile:
    """A saved key file is read as is; anything else is a checkpoint whose key is computed under `plan`."""
    if is_key_file(operand):
        return load_key_file(operand)
    return key_of_checkpoint(operand, plan)
