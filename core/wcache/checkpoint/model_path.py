"""The MODEL argument users already type for vLLM: a directory, a .safetensors file, or a Hugging Face repo id.

A repo id (`Org/Name`, optionally `Org/Name@revision`) is looked up in the local Hugging Face cache only
(`HF_HOME`, `HF_HUB_CACHE`): wcache never downloads, so a key always describes bytes already on this machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from wcache.errors import CheckpointError

# What the Hub accepts as an owner and a name; anything else cannot be a repo id.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text.split("@", 1)[0]))


def resolve_model_path(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local checkpoint path for what the user typed; one sentence saying what to do when there is none."""
    text = os.fspath(model)
    path = Path(text)
    if path.exists() or path.is_symlink() or not looks_like_repo_id(text):
        return path
    repo_id, _, pinned = text.partition("@")
    return _cached_snapshot(repo_id, pinned or revision)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface-hub is a dependency
        raise CheckpointError(f"{repo_id} is neither a path nor resolvable without huggingface-hub.") from None
    wanted = f"{repo_id}@{revision}" if revision else repo_id
    try:
        # local_files_only: the cache's refs and snapshots are read, nothing goes over the network.
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{wanted} is not a path and is not in the local Hugging Face cache ({HF_HUB_CACHE}); download it "
            f"first (hf download {repo_id}{' --revision ' + revision if revision else ''}) or pass its directory."
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{wanted} cannot be found in the local Hugging Face cache ({exc}).") from None
