"""The digests of the files beside the tensors (config.json, the tokenizer's, the generation config), and the
key field they make: a warm key stats them and reads the digest store, a cold one reads each small file once."""

from __future__ import annotations

import time
from pathlib import Path

from wcache.canonical import digest_of
from wcache.checkpoint.companions import MAX_COMPANION_BYTES, ContentDigests, content_digests, is_companion
from wcache.checkpoint.file_record import FileDigest
from wcache.checkpoint.files import CheckpointLayout, read_small_file
from wcache.checkpoint.identity import FileIdentity
from wcache.errors import CheckpointError
from wcache.key.digest_store import DigestStore

NO_TOKENIZER = "none"  # the key field of a checkpoint with none of these files (a bare .safetensors file)


def companion_files(layout: CheckpointLayout, store: DigestStore | None) -> tuple[FileDigest, ...]:
    """config.json, then each companion file by name, with size, SHA-256 and git blob SHA-1.

    A companion read through a descriptor whose identity is not the one stat saw was replaced meanwhile: one
    error sentence (the key would describe two states of the directory)."""
    files = [layout.config_file] if layout.config_file is not None else []
    wanted = [(c.path, c.identity) for c in layout.companions]
    known = store.lookup_files(wanted) if store is not None and store.enabled else {}
    receipts: list[tuple[Path, FileIdentity, int, ContentDigests]] = []
    for companion in layout.companions:
        digests = known.get(companion.path)
        if digests is None:
            began = time.time_ns()
            read = read_small_file(companion.path, MAX_COMPANION_BYTES, "a tokenizer or generation config file")
            if read is None or read.identity != companion.identity:
                raise CheckpointError(f"{companion.path} changed while {layout.root} was being keyed; try again "
                                      "once it stays put.")
            digests = content_digests(read.data)
            receipts.append((companion.path, companion.identity, began, digests))
        files.append(FileDigest(companion.name, companion.identity.size, digests.sha256, digests.git_sha1))
    if store is not None and receipts:
        store.put_files(receipts)
    return tuple(files)


def tokenizer_digest(files: tuple[FileDigest, ...]) -> str:
    """The key's `tokenizer` field: the names and SHA-256 of the companion files among `files`."""
    listed = [[f.name, f.sha256] for f in files if is_companion(f.name)]
    return digest_of(listed) if listed else NO_TOKENIZER
