"""The MODEL argument users already type for vLLM: a directory, a .safetensors file, or a Hugging Face repo id.

A repo id (`Org/Name`, optionally `Org/Name@revision`) is looked up in the local Hugging Face cache only
(`HF_HOME`, `HF_HUB_CACHE`): wcache never downloads, so a key always describes bytes already on this machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from wcache.canonical import loads_finite
from wcache.checkpoint.files import MAX_JSON_BYTES, read_small_file
from wcache.errors import CheckpointError

# What the Hub accepts as an owner and a name; anything else cannot be a repo id.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# A branch or tag (`refs/pr/1` has slashes) or a commit; never a path out of the cache (`..`) or a newline.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
MAX_REF_BYTES = 256  # a ref holds one 40-digit commit hash
TREE_FORMAT = 1  # the tree listing format huggingface_hub 2 writes (trees/<commit>.json)


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
        from huggingface_hub.constants import DEFAULT_REVISION, HF_HUB_CACHE
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # pragma: no cover - huggingface-hub is a dependency
        raise CheckpointError(f"{repo_id} is neither a path nor resolvable without huggingface-hub.") from None
    if revision is not None and not _is_revision(revision):
        raise CheckpointError(f"{_shown(revision)} is not a branch, tag or commit name, so {repo_id} cannot be "
                              "looked up in the local Hugging Face cache.")
    try:
        validate_repo_id(repo_id)  # what the Hub refuses (`org/m.`, `--`, `..`, over 96 characters) is no repo id
    except HFValidationError:
        raise CheckpointError(f"{_shown(repo_id)} is neither a path nor a Hugging Face repo id (an owner and a name "
                              "of letters, digits, '-', '_' and '.', neither starting nor ending with '-' or '.', "
                              "with no '--' or '..', at most 96 characters).") from None
    wanted = f"{repo_id}@{revision}" if revision else repo_id
    storage = Path(HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    # The refs and the tree listing are read here, bounded and refusing FIFOs and devices, before
    # huggingface_hub is asked: it opens and reads both whole, so a FIFO would hang it and /dev/zero fill memory.
    commit = _commit_of(storage, revision or DEFAULT_REVISION)
    not_cached = CheckpointError(
        f"{wanted} is not a path and is not in the local Hugging Face cache ({HF_HUB_CACHE}); download it "
        f"first (hf download {repo_id}{' --revision ' + revision if revision else ''}) or pass its directory."
    )
    if commit is None:
        raise not_cached
    _check_tree_listing(storage / "trees" / f"{commit}.json")
    try:
        # local_files_only: the cache's snapshots are read, nothing goes over the network.
        return Path(snapshot_download(repo_id, revision=commit, local_files_only=True))
    except LocalEntryNotFoundError:
        raise not_cached from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{wanted} cannot be found in the local Hugging Face cache ({exc}).") from None


def _is_revision(text: str) -> bool:
    return bool(_REVISION.match(text)) and ".." not in text.split("/")


def _shown(text: str) -> str:
    return repr(text if len(text) <= 60 else f"{text[:60]}…")


def _commit_of(storage: Path, revision: str) -> str | None:
    """The commit a revision names: itself when it is a commit hash, else what the cache's refs say (None
    where they say nothing)."""
    if _COMMIT.match(revision):
        return revision
    ref = storage / "refs" / revision
    text = _read_cache_file(ref, MAX_REF_BYTES, "a ref")
    if text is None:
        return None
    commit = text.decode(errors="replace").strip()
    if not _COMMIT.match(commit):
        raise CheckpointError(f"{ref} does not hold a commit hash; remove it, or download the model again.")
    return commit


def _check_tree_listing(path: Path) -> None:
    """The cached tree listing huggingface_hub checks a snapshot's completeness against, if there is one, must
    be one it can read: it parses the file without catching everything a damaged one raises."""
    text = _read_cache_file(path, MAX_JSON_BYTES, "a tree listing")
    if text is None:
        return
    try:
        listing = loads_finite(text)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); remove it, or download the model again.") from None
    foreign = CheckpointError(f"{path} is not a tree listing huggingface_hub wrote; remove it, or download the "
                              "model again.")
    if not isinstance(listing, dict):
        raise foreign
    if listing.get("format_version") != TREE_FORMAT:
        return  # another version's format: huggingface_hub ignores it
    files = listing.get("files")
    if not isinstance(files, dict) or not all(_is_tree_entry(entry) for entry in files.values()):
        raise foreign


def _is_tree_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("blob_id"), str)
            and all(isinstance(entry.get(name), str | None) for name in ("lfs_sha256", "xet_hash"))
            and type(entry.get("lfs_size", 0)) in (int, type(None)))


def _read_cache_file(path: Path, limit: int, what: str) -> bytes | None:
    try:
        read = read_small_file(path, limit, what)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None
    return None if read is None else read.data
