"""A checkpoint file's record (`FileDigest`) and the verdicts on it: the types a key and a daemon's descriptor
hold, apart from the provenance checks (`provenance`) so that reading a descriptor imports none of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

from wcache.schema import Schema

Verdict = Literal["matches", "differs", "unknown"]
VERDICTS: tuple[Verdict, ...] = ("matches", "differs", "unknown")
SHA256_PATTERN = "^[0-9a-f]{64}$"
GIT_SHA1_PATTERN = "^[0-9a-f]{40}$"


class FileDigest(Schema, frozen=True):
    """One checkpoint file: its name under the checkpoint's directory, its size and its SHA-256 (None: not
    computed, e.g. a receipt from before wcache recorded it); for a file beside the tensors (config.json, the
    tokenizer's) also its git blob SHA-1, which the Hub names a file stored outside LFS by."""

    name: str
    size: int
    sha256: Annotated[str, msgspec.Meta(pattern=SHA256_PATTERN)] | None
    git_sha1: Annotated[str, msgspec.Meta(pattern=GIT_SHA1_PATTERN)] | None = None


# The files' digests, or what reads them (a key whose root came from the digest store reads receipts only if asked).
FilesSource = tuple[FileDigest, ...] | Callable[[], tuple[FileDigest, ...]]


def build_files(source: FilesSource) -> tuple[FileDigest, ...]:
    return source if isinstance(source, tuple) else source()
