"""Each shard's SHA-256 after a cold pass sealed the arena: the provenance verdict follows READY, it does not hold it.

SHA-256 is one stream per file at 1–2 GB/s on one core, as much CPU as the rest of a cold pass; computed inside
the pass it holds READY back by 1.6–1.9× on two cores. When nothing waits for the verdict (no
`--require-provenance`), the pass skips it and this reads each file once more, after READY, through the
descriptor the pass read (never by path: the path may name another file by now), in order, one reused buffer,
the page cache dropped behind the read. A file whose identity moved since it was opened gets no SHA-256 (its
verdict is unknown); the others' are added to the receipts the pass stored, so the next preload needs neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from wcache.checkpoint.file_record import FileDigest
from wcache.checkpoint.files import CheckpointLayout
from wcache.errors import CheckpointError
from wcache.key.digest_store import DigestStore
from wcache.key.fingerprint import files_of
from wcache.key.shard_hash import CHUNK_BYTES, OpenShard, ShardRecord

log = logging.getLogger("wcache")


@dataclass
class Sha256After:
    """The shards a cold pass read (their descriptors, now owned here) and the records it made of them."""

    layout: CheckpointLayout
    shards: list[OpenShard]
    records: dict[Path, ShardRecord]

    def run(self, store: DigestStore | None) -> tuple[FileDigest, ...]:
        """Every file's name, size and SHA-256 (None where the file changed or could not be read); the receipts
        of `store` gain the SHA-256s. Closes the descriptors."""
        try:
            found: dict[Path, str] = {}
            for shard in self.shards:
                digest = _file_sha256(shard)
                if digest is not None:
                    found[shard.path] = digest
        finally:
            self.close()
        records = {path: dataclasses.replace(r, sha256=found.get(path)) for path, r in self.records.items()}
        if store is not None:
            store.put_many([r for r in records.values() if r.sha256 is not None])
        return files_of(self.layout, records)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def _file_sha256(shard: OpenShard) -> str | None:
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(shard.identity.size, 1))))
    sha = hashlib.sha256()
    shard.advise_sequential()
    try:
        for position in range(0, shard.identity.size, len(buffer)):
            chunk = buffer[: min(len(buffer), shard.identity.size - position)]
            shard.read_at(position, chunk)
            sha.update(chunk)  # hashlib releases the GIL: the daemon's serve threads answer meanwhile
            shard.forget_until(position + len(chunk))
    except CheckpointError as exc:
        log.warning("provenance: %s", exc)
        return None
    finally:
        shard.forget_all()
    if not shard.unchanged():
        log.warning("provenance: %s changed after it was loaded; its SHA-256 is not known.", shard.path)
        return None
    return sha.hexdigest()
