"""Each shard's SHA-256 (what the Hub names an LFS file by, the provenance check's input) from the buffers the
pass reads: one stream per file, fed every chunk in file order on a thread of its own."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from wcache.key.file_digest import FileSha256
from wcache.key.shard_hash import OpenShard
from wcache.load.pass_workers import Hold, Lane, Workers


class ShardSha256:
    """The SHA-256 of every shard the reader goes through, one file after another (`start`, `feed`, `finish`);
    `digests` once the workers are idle."""

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        # Each file's SHA-256 is one stream in file order, as long as the checkpoint: a thread of its own.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wcache-sha256")
        self._file: tuple[Lane, FileSha256, OpenShard] | None = None
        self.digests: dict[Path, str | None] = {}

    def start(self, shard: OpenShard) -> None:
        """The reader moves on to `shard`: a new stream, in a lane of its own."""
        self._file = (Lane(self._workers, self._thread), shard.start_sha256(), shard)

    def feed(self, tensor_start: int, chunk: memoryview, hold: Hold) -> None:
        """`chunk`, read from byte `tensor_start` of the current shard's data section; `hold` is let go once it is
        hashed."""
        assert self._file is not None
        lane, digest, shard = self._file
        lane.submit(functools.partial(self._feed, digest, shard.header.data_start + tensor_start, chunk, hold))

    def finish(self) -> None:
        """The current shard is all read: its digest is recorded once its lane has hashed every chunk."""
        if self._file is not None:
            lane, digest, shard = self._file
            lane.submit(lambda: self._record(shard.path, digest))
            self._file = None

    def close(self) -> None:
        self._thread.shutdown()

    def _feed(self, digest: FileSha256, offset: int, chunk: memoryview, hold: Hold) -> None:
        digest.feed(offset, chunk)
        self._workers.drop(hold)

    def _record(self, path: Path, digest: FileSha256) -> None:
        with self._workers.cond:
            self.digests[path] = digest.hexdigest()
