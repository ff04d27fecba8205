"""A Hugging Face cache written by the tests: refs, snapshots of links and blobs, as huggingface_hub lays it out.

`shared_store` makes each LFS blob what huggingface_hub 2.4 writes when its shared store is on: `blobs/<etag>` a
relative link into `<cache>/blobs/<2 hex>/<xet hash>`, named by a different function of the bytes than the etag.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_sha1(data: bytes) -> str:
    """What the Hub names a non-LFS file by: git's blob id."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def write_hub_cache(hub: Path, repo_id: str, checkpoint: Path, *, shared_store: bool = False,
                    non_lfs: frozenset[str] = frozenset()) -> Path:
    """Put every file of `checkpoint` into cache `hub` as repo `repo_id` at COMMIT (refs/main); the snapshot."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for source in sorted(checkpoint.iterdir()):
        data = source.read_bytes()
        lfs = source.suffix == ".safetensors" and source.name not in non_lfs
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        blob = blobs / etag
        if shared_store and lfs:
            xet = hashlib.blake2b(data, digest_size=32).hexdigest()  # stands for the Xet hash: not the SHA-256
            stored = hub / "blobs" / xet[:2] / xet
            stored.parent.mkdir(parents=True, exist_ok=True)
            (hub / "blobs" / ".huggingface-shared-blobs").write_text("1")
            stored.write_bytes(data)
            blob.symlink_to(os.path.relpath(stored, blobs))
        else:
            blob.write_bytes(data)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def blob_of(snapshot: Path, name: str) -> Path:
    """The blob a snapshot entry links to (one link, as the cache made it)."""
    return Path(os.path.normpath(snapshot / os.readlink(snapshot / name)))
