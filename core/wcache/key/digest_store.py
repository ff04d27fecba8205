"""The digest store: SQLite receipts that let a file's digests be reused while its stat identity holds."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import platformdirs

from wcache.checkpoint.companions import ContentDigests
from wcache.checkpoint.file_record import SHA256_PATTERN
from wcache.checkpoint.safetensors_header import PREFIX_BYTES, ShardHeader, TensorInfo
from wcache.key.shard_hash import FileIdentity, ShardRecord

log = logging.getLogger("wcache")

# The tables' layout. A record's payload grew an optional "s" (the file's SHA-256) without a new version:
# a store written before reads on, its records lacking "s" stand for files whose SHA-256 is not known yet, and
# the next pass that reads such a file adds it.
SCHEMA_VERSION = "1"
DB_NAME = "digests.sqlite3"
# Racy-git rule: a file written within this window of the moment its hashing began may be written again
# without its identity moving (a filesystem's timestamps are truncated to its granularity: 1 s on NFSv3,
# ext3 and HFS+, 2 s on FAT, the coarsest in use), so such a receipt is never trusted. Measured from the
# start of hashing, a write stamped before `hashed_at - window` happened before the read began.
RACY_WINDOW_NS = 2_000_000_000
BUSY_TIMEOUT_S = 30.0
# Ids per SELECT ... IN (...): below SQLite's historical limit of 999 bound parameters.
LOOKUP_BATCH = 500
# Stored Merkle roots kept, newest first: each change to a checkpoint's files adds a row whose state no file
# will have again, so old ones are dropped (a dropped root is rebuilt from the shard receipts).
MAX_ROOTS = 4096
_HEX = frozenset("0123456789abcdef")

# What every receipt row starts with: the file, its stat identity when read, and when hashing began
# (`_rows_by_id` reads them back in this order).
_RECEIPT_COLUMNS = """file_id TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    hashed_at_ns INTEGER NOT NULL,
    path TEXT NOT NULL"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    {_RECEIPT_COLUMNS},
    record BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    {_RECEIPT_COLUMNS},
    sha256 TEXT NOT NULL,
    git_sha1 TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS roots (
    state TEXT PRIMARY KEY,
    root TEXT NOT NULL,
    stored_at_ns INTEGER NOT NULL
);
"""


def default_store_dir() -> Path:
    """`WCACHE_CACHE_DIR`, else the platform's user cache directory for wcache."""
    override = os.environ.get("WCACHE_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("wcache"))


def _file_id(identity: FileIdentity) -> str:
    # Inode numbers can exceed SQLite's signed 64-bit integers on some filesystems; text never overflows.
    return f"{identity.dev}:{identity.ino}"


def is_trusted(identity: FileIdentity, hashed_at_ns: int) -> bool:
    """A receipt is trusted only if the file's last change lies safely before the moment hashing began."""
    return max(identity.mtime_ns, identity.ctime_ns) < hashed_at_ns - RACY_WINDOW_NS


class _StoredTensor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One tensor of a receipt, as a row: name, dtype, shape, start, end, digest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    digest: str


class _StoredShard(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A receipt's record blob: a msgpack map with one-letter keys (h: the header's length, m: its metadata,
    t: the tensor rows, s: the file's SHA-256 when known). The same bytes msgpack's own packer wrote for the
    same map, so a store written before reads on."""

    h: int
    m: dict[str, str]
    t: tuple[_StoredTensor, ...]
    s: Annotated[str, msgspec.Meta(pattern=SHA256_PATTERN)] | None = None


_RECORD_ENCODER = msgspec.msgpack.Encoder()
_RECORD_DECODER = msgspec.msgpack.Decoder(_StoredShard)


def encode_record(record: ShardRecord) -> bytes:
    tensors = tuple(_StoredTensor(t.name, t.dtype, t.shape, t.start, t.end, digest)
                    for t, digest in zip(record.header.tensors, record.digests, strict=True))
    return _RECORD_ENCODER.encode(_StoredShard(record.header.header_bytes, record.header.metadata, tensors,
                                               record.sha256))


def decode_record(blob: bytes, path: Path, identity: FileIdentity, hashed_at_ns: int) -> ShardRecord | None:
    """Decode a stored record; anything malformed is treated as absent rather than trusted."""
    try:
        stored = _RECORD_DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError):  # a blob that fails to decode is no receipt
        return None
    tensors = tuple(TensorInfo(t.name, t.dtype, t.shape, t.start, t.end) for t in stored.t)
    header = ShardHeader(header_bytes=stored.h, metadata=stored.m, tensors=tensors)
    if PREFIX_BYTES + header.header_bytes + header.data_bytes != identity.size:
        return None
    return ShardRecord(path=path, identity=identity, header=header, digests=tuple(t.digest for t in stored.t),
                       hashed_at_ns=hashed_at_ns, sha256=stored.s)


def untrusted_reason(directory: Path, path: Path) -> str | None:
    """Why receipts here could have been written by someone else (then none is used), or None.

    Whoever can write the store can make any checkpoint's key look like another's, so the directory and
    the database must be ours, not symlinks, and writable by nobody else (as the run dir is checked).
    """
    for checked, what in ((directory, "its directory"), (path, "its database")):
        try:
            st = os.lstat(checked)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{what} {checked} cannot be checked ({exc.strerror})"
        if stat.S_ISLNK(st.st_mode):
            return f"{what} {checked} is a symlink"
        if st.st_uid != os.getuid():
            return f"{what} {checked} belongs to uid {st.st_uid}, not to you"
        if st.st_mode & 0o022:
            return (f"{what} {checked} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}), so "
                    "its receipts could be forged; chmod go-w it")
    return None



def quick_check_read_only(directory: Path) -> str | None:
    """What SQLite's quick check finds wrong with the store in `directory`, opened read-only (nothing is created,
    moved aside or rebuilt: `wcache doctor` only reads), or None; None where there is no database yet."""
    path = directory / DB_NAME
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    return None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:3])


class DigestStore:
    """Receipts keyed by (device, inode); a corrupt database is moved aside and rebuilt with a warning."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / DB_NAME
        self._conn: sqlite3.Connection | None = None
        self._disabled_reason: str | None = None
        self._lock = threading.RLock()
        self._connect()

    @classmethod
    def open(cls, path: Path | None = None) -> DigestStore:
        """Open (creating if needed) the store in directory `path`, or the default directory."""
        return cls(path if path is not None else default_store_dir())

    @property
    def enabled(self) -> bool:
        return self._conn is not None

    @property
    def disabled_reason(self) -> str | None:
        """Why the store is not used (one clause), or None while it is."""
        return self._disabled_reason

    def integrity_problem(self) -> str | None:
        """What SQLite's quick check finds wrong with the database, or None (`wcache doctor`)."""
        with self._lock:
            if self._conn is None:
                return self._disabled_reason
            try:
                rows = self._conn.execute("PRAGMA quick_check").fetchall()
            except sqlite3.DatabaseError as exc:
                return str(exc)
            return None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:3])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> DigestStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- opening, checking and rebuilding -------------------------------------------------------------

    def _connect(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            self._disable(f"its directory {self.directory} cannot be created ({exc.strerror})")
            return
        untrusted = self._untrusted_reason()
        if untrusted is not None:
            self._disable(untrusted)
            return
        try:
            self._conn = self._open_checked()
        except sqlite3.DatabaseError as exc:
            if not self._accessible():
                # A store we may not read or write is someone else's, not a corrupt one: leave it alone.
                self._disable(f"you lack permission to use it ({exc})")
                return
            self._rebuild(str(exc))

    def _untrusted_reason(self) -> str | None:
        return untrusted_reason(self.directory, self.path)

    def _accessible(self) -> bool:
        directory_ok = os.access(self.directory, os.R_OK | os.W_OK | os.X_OK)
        file_ok = not self.path.exists() or os.access(self.path, os.R_OK | os.W_OK)
        return directory_ok and file_ok

    def _open_checked(self) -> sqlite3.Connection:
        # One store may be used from a worker thread (an engine computes its key while it connects); the
        # store's own lock serialises every use, so SQLite's same-thread check is not needed.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # A lost receipt after a power cut costs one rehash; an fsync per write costs every run.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {row[0]!r}, expected {SCHEMA_VERSION!r}")
            # Name every column: a table of the same name from another layout must fail here and be rebuilt.
            conn.execute(
                "SELECT file_id, size, mtime_ns, ctime_ns, hashed_at_ns, path, record FROM shards LIMIT 0"
            ).fetchall()
            conn.execute("SELECT key, value FROM meta LIMIT 0").fetchall()
            conn.execute("SELECT state, root, stored_at_ns FROM roots LIMIT 0").fetchall()
            conn.execute("SELECT file_id, size, mtime_ns, ctime_ns, hashed_at_ns, path, sha256, git_sha1 FROM files "
                         "LIMIT 0").fetchall()
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def _rebuild_lock(self) -> Iterator[None]:
        with open(self.directory / "digests.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _rebuild(self, reason: str) -> None:
        self.close()
        try:
            with self._rebuild_lock():
                # Another process may have rebuilt it while we waited for the lock.
                with contextlib.suppress(sqlite3.DatabaseError):
                    self._conn = self._open_checked()
                    return
                aside = self.path.with_name(f"{DB_NAME}.corrupt-{time.time_ns()}")
                for suffix in ("", "-wal", "-shm"):
                    source = Path(f"{self.path}{suffix}")
                    if source.exists():
                        source.rename(Path(f"{aside}{suffix}"))
                log.warning("The digest store %s was unreadable (%s); moved it to %s and started a new one.",
                            self.path, reason, aside)
                self._conn = self._open_checked()
        except (OSError, sqlite3.DatabaseError) as exc:
            self._disable(f"it could not be rebuilt ({exc})")

    def _disable(self, reason: str) -> None:
        self.close()
        if self._disabled_reason is None:
            log.warning("The digest store %s is not used: %s; every file will be hashed.", self.path, reason)
        self._disabled_reason = reason

    # -- receipts ------------------------------------------------------------------------------------

    def lookup(self, path: Path, identity: FileIdentity) -> ShardRecord | None:
        """The stored record for this exact file identity, if one is trusted."""
        return self.lookup_many([(path, identity)]).get(path)

    def _rows_by_id(self, table: str, columns: str, ids: list[str]) -> dict[str, list[Any]]:
        """`table`'s rows for `ids` (size, mtime_ns, ctime_ns, hashed_at_ns, then `columns`), by file id; none
        where the store cannot be read (it is then disabled, or rebuilt when corrupt). Call under the lock."""
        assert self._conn is not None
        try:
            return {file_id: rest for file_id, *rest in self._conn.execute(
                f"SELECT file_id, size, mtime_ns, ctime_ns, hashed_at_ns, {columns} FROM {table} "
                f"WHERE file_id IN ({','.join('?' * len(ids))})", ids)}
        except sqlite3.OperationalError as exc:
            self._disable(f"reading failed ({exc})")
        except sqlite3.DatabaseError as exc:
            self._rebuild(str(exc))
        return {}

    def lookup_many(self, files: Sequence[tuple[Path, FileIdentity]]) -> dict[Path, ShardRecord]:
        """The trusted records among `files`, by path, in one query per LOOKUP_BATCH files."""
        with self._lock:
            records: dict[Path, ShardRecord] = {}
            for start in range(0, len(files), LOOKUP_BATCH):
                records.update(self._lookup_batch(files[start:start + LOOKUP_BATCH]))
            return records

    def _lookup_batch(self, files: Sequence[tuple[Path, FileIdentity]]) -> dict[Path, ShardRecord]:
        if self._conn is None or not files:
            return {}
        ids = [_file_id(identity) for _, identity in files]
        rows = self._rows_by_id("shards", "record", ids)
        records: dict[Path, ShardRecord] = {}
        for (path, identity), file_id in zip(files, ids, strict=True):
            if file_id not in rows:
                continue
            size, mtime_ns, ctime_ns, hashed_at_ns, blob = rows[file_id]
            if (size, mtime_ns, ctime_ns) != (identity.size, identity.mtime_ns, identity.ctime_ns):
                continue
            if not is_trusted(identity, hashed_at_ns):
                continue
            record = decode_record(blob, path, identity, hashed_at_ns)
            if record is not None:
                records[path] = record
        return records

    def put_many(self, records: list[ShardRecord]) -> None:
        """Store receipts in one transaction; failures (full disk, read-only store) are warnings, never errors."""
        with self._lock:
            self._put_many(records)

    def _put_many(self, records: list[ShardRecord]) -> None:
        if self._conn is None or not records:
            return
        rows = [
            (
                _file_id(r.identity), r.identity.size, r.identity.mtime_ns, r.identity.ctime_ns,
                r.hashed_at_ns, str(r.path), encode_record(r),
            )
            for r in records
        ]
        with self._writing() as conn:
            conn.executemany("INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (the caller holds the lock and has checked the connection); a failure
        disables or rebuilds the store and is swallowed, so a write is never an error."""
        assert self._conn is not None
        try:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                yield self._conn
        except sqlite3.OperationalError as exc:
            # "database or disk is full", "readonly database", a writer holding the lock past the timeout:
            # the key is still right, only the next run pays for hashing again.
            self._disable(f"writing failed ({exc})")
        except sqlite3.DatabaseError as exc:
            self._rebuild(str(exc))

    # -- Merkle roots by checkpoint state -------------------------------------------------------------

    def lookup_root(self, state: str) -> str | None:
        """The Merkle root stored for `state` (fingerprint.checkpoint_state: every shard's name and stat
        identity, and the index's digest), if one is."""
        with self._lock:
            if self._conn is None:
                return None
            try:
                row = self._conn.execute("SELECT root FROM roots WHERE state = ?", (state,)).fetchone()
            except sqlite3.OperationalError as exc:
                self._disable(f"reading failed ({exc})")
                return None
            except sqlite3.DatabaseError as exc:
                self._rebuild(str(exc))
                return None
            if row is None or not _is_hex(row[0], 64):
                return None
            root: str = row[0]
            return root

    def put_root(self, state: str, root: str) -> None:
        """Store the root of a checkpoint state whose every receipt is trusted; failures are warnings."""
        with self._lock:
            if self._conn is None:
                return
            with self._writing() as conn:
                conn.execute("INSERT OR REPLACE INTO roots VALUES (?, ?, ?)", (state, root, time.time_ns()))
                conn.execute(
                    "DELETE FROM roots WHERE state NOT IN "
                    "(SELECT state FROM roots ORDER BY stored_at_ns DESC LIMIT ?)",
                    (MAX_ROOTS,),
                )

    # -- small files' receipts (the tokenizer's files and the generation config) ----------------------

    def lookup_files(self, files: Sequence[tuple[Path, FileIdentity]]) -> dict[Path, ContentDigests]:
        """The trusted digests stored for these exact file identities, by path (one query: a checkpoint has a
        handful of such files)."""
        with self._lock:
            if self._conn is None or not files:
                return {}
            ids = [_file_id(identity) for _, identity in files[:LOOKUP_BATCH]]
            rows = self._rows_by_id("files", "sha256, git_sha1", ids)
        found: dict[Path, ContentDigests] = {}
        for (path, identity), file_id in zip(files, ids, strict=False):
            row = rows.get(file_id)
            if row is None:
                continue
            size, mtime_ns, ctime_ns, hashed_at_ns, sha256, git_sha1 = row
            if ((size, mtime_ns, ctime_ns) == (identity.size, identity.mtime_ns, identity.ctime_ns)
                    and is_trusted(identity, hashed_at_ns) and _is_hex(sha256, 64) and _is_hex(git_sha1, 40)):
                found[path] = ContentDigests(sha256, git_sha1)
        return found

    def put_files(self, receipts: Sequence[tuple[Path, FileIdentity, int, ContentDigests]]) -> None:
        """Store small files' digests (path, identity read through, when hashing began, digests); failures are
        warnings, as for shards."""
        with self._lock:
            if self._conn is None or not receipts:
                return
            rows = [(_file_id(i), i.size, i.mtime_ns, i.ctime_ns, at, str(path), d.sha256, d.git_sha1)
                    for path, i, at, d in receipts]
            with self._writing() as conn:
                conn.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)


def _is_hex(value: object, length: int) -> bool:
    """Anything but `length` lowercase hex digits is treated as absent, like a malformed record."""
    return isinstance(value, str) and len(value) == length and _HEX.issuperset(value)
