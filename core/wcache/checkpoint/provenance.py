"""Whether each checkpoint file holds what its publisher released: its SHA-256 against an expected value.

The expected value comes, offline, from the local Hugging Face cache, which names an LFS file's blob by its
etag, the file's SHA-256: a snapshot entry is a link to `blobs/<etag>`. Exactly one link is read. huggingface_hub
2.4 may make `blobs/<etag>` itself a link into a shared store named by the Xet hash, a different function of
the bytes, so nothing past the first link is ever taken for a digest. A plain directory has no expected value
unless the user gives one: a `SHA256SUMS`-style file or a saved key file (its `files`).
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcache.bounded_read import read_named_text, unreadable_why
from wcache.checkpoint.file_record import (  # the record's owner
    GIT_SHA1_PATTERN,
    SHA256_PATTERN,
    VERDICTS,
    FileDigest,
    Verdict,
)
from wcache.errors import BadInputError
from wcache.schema import Schema

REPO_DIR_PREFIXES = ("models--", "datasets--", "spaces--")
_SHA256 = re.compile(SHA256_PATTERN)
_GIT_SHA1 = re.compile(GIT_SHA1_PATTERN)
# One line of `sha256sum` output: digest, a space, a space or "*" (binary mode), the name.
_SUMS_LINE = re.compile(r"^\\?([0-9a-fA-F]{64}) [ *](.+)$")


@dataclass(frozen=True, slots=True)
class Expected:
    """What a file should hash to and who says so; `sha256` None with `why` when nothing says. A Hub file stored
    outside LFS is named by its git blob SHA-1: `git_sha1` holds it (and `sha256` is None)."""

    sha256: str | None
    origin: str  # "hub" (the cache's etag), "given" (the user's file), or "none"
    why: str = ""
    git_sha1: str | None = None


@dataclass(frozen=True, slots=True)
class FileVerdict:
    name: str
    verdict: Verdict
    sha256: str | None  # the file's digest of `algorithm`
    expected: str | None
    origin: str
    why: str
    algorithm: str = "sha256"  # "sha256", or "git-sha1": what the Hub names a file stored outside LFS by

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "sha256": self.sha256, "expected": self.expected,
                "origin": self.origin, "why": self.why, "algorithm": self.algorithm}

    def sentence(self) -> str:
        if self.verdict == "matches":
            return f"{self.name} matches {'the Hub' if self.origin == 'hub' else 'the given digest'}"
        if self.verdict == "differs":
            source = "the Hub published" if self.origin == "hub" else "the given digest says"
            algorithm = "SHA-256" if self.algorithm == "sha256" else "git SHA-1"
            return (f"{self.name} differs from what {source} ({algorithm} {(self.sha256 or '')[:12]}…, expected "
                    f"{(self.expected or '')[:12]}…)")
        return f"{self.name}: unknown ({self.why})"


def hub_repo_of(path: Path) -> Path | None:
    """The Hugging Face cache repo directory (`models--Org--Name`) that `path` is a snapshot entry of, or None."""
    absolute = Path(os.path.abspath(path))  # noqa: PTH100  (lexical: never follow the links being judged)
    for parent in absolute.parents:
        if parent.name == "snapshots" and parent.parent.name.startswith(REPO_DIR_PREFIXES):
            return parent.parent
    return None


def hub_expected(path: Path) -> Expected:
    """The SHA-256 that the local Hugging Face cache records for snapshot file `path`, reading one link."""
    repo = hub_repo_of(path)
    if repo is None:
        return Expected(None, "none", "not from the Hugging Face cache; give the expected digests with --expected")
    absolute = Path(os.path.abspath(path))  # noqa: PTH100
    try:
        target = str(absolute.readlink())
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return Expected(None, "none", "a copy, not a link to a cache blob: the cache names no digest for it")
        raise BadInputError(f"{path} cannot be read as a link ({exc.strerror}).") from None
    blob = Path(os.path.normpath(absolute.parent / target))
    if blob.parent != repo / "blobs":
        return Expected(None, "none", f"its link points to {target}, not into {repo.name}/blobs")
    etag = blob.name
    if _SHA256.match(etag):
        return Expected(etag, "hub")
    if _GIT_SHA1.match(etag):
        return Expected(None, "hub", git_sha1=etag)
    return Expected(None, "none", f"its blob name {etag!r} is not a digest")


def read_expected(path: Path) -> dict[str, str]:
    """Expected SHA-256 by file name from a `SHA256SUMS`-style file (`sha256sum` output) or a saved key file."""
    try:
        text = read_named_text(path)  # bounded, and never blocking on a FIFO: /dev/zero must not fill memory
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path} cannot be read as a list of expected digests "
                            f"({unreadable_why(exc)}).") from None
    if text.lstrip().startswith("{"):
        try:
            files = [FileDigest.from_wire(entry) for entry in json.loads(text)["files"]]
        except (ValueError, KeyError, TypeError, RecursionError):  # SchemaError is a ValueError
            raise BadInputError(f"{path} is a JSON file but not a wcache key file with files' SHA-256 "
                                "(save one with: wcache key MODEL --json > model.key).") from None
        return {f.name: f.sha256 for f in files if f.sha256 is not None}
    expected: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _SUMS_LINE.match(line)
        if match is None:
            raise BadInputError(f"{path} line {number} is not a `sha256sum` line (64 hex digits, two spaces, a name).")
        name = match.group(2).removeprefix("./")
        expected[name] = match.group(1).lower()
    if not expected:
        raise BadInputError(f"{path} lists no digests.")
    return expected


def judge(root: Path, files: Iterable[FileDigest], given: Mapping[str, str] | None = None) -> tuple[FileVerdict, ...]:
    """A verdict per file: against `given` (by name) when the user gave digests, else against the cache."""
    verdicts = []
    for entry in files:
        if given is not None:
            sha = given.get(entry.name) or given.get(Path(entry.name).name)
            expected = (Expected(sha, "given") if sha
                        else Expected(None, "none", "the given file lists no digest for it"))
        else:
            expected = hub_expected(root / entry.name)
        if expected.git_sha1 is not None:
            verdicts.append(_judged_by_git_sha1(entry, expected.git_sha1))
        elif expected.sha256 is None:
            verdicts.append(FileVerdict(entry.name, "unknown", entry.sha256, None, expected.origin, expected.why))
        elif entry.sha256 is None:
            verdicts.append(FileVerdict(entry.name, "unknown", None, expected.sha256, expected.origin,
                                        "its SHA-256 has not been computed yet; run wcache verify --provenance"))
        else:
            verdict: Verdict = "matches" if entry.sha256 == expected.sha256 else "differs"
            verdicts.append(FileVerdict(entry.name, verdict, entry.sha256, expected.sha256, expected.origin, ""))
    return tuple(verdicts)


def _judged_by_git_sha1(entry: FileDigest, expected: str) -> FileVerdict:
    """A file the Hub stores outside LFS, against the git blob SHA-1 its blob is named by."""
    if entry.git_sha1 is None:
        return FileVerdict(entry.name, "unknown", None, expected, "hub",
                           "the Hub names it by its git SHA-1, which wcache computes only for the files beside "
                           "the tensors", "git-sha1")
    verdict: Verdict = "matches" if entry.git_sha1 == expected else "differs"
    return FileVerdict(entry.name, verdict, entry.git_sha1, expected, "hub", "", "git-sha1")


def overall(verdicts: Iterable[FileVerdict]) -> Verdict:
    """The checkpoint's verdict: differs if any file does, matches if every file does, else unknown."""
    seen = {v.verdict for v in verdicts}
    if "differs" in seen:
        return "differs"
    return "matches" if seen == {"matches"} else "unknown"


def counts(verdicts: Iterable[FileVerdict]) -> dict[str, int]:
    found: dict[str, int] = dict.fromkeys(VERDICTS, 0)
    for v in verdicts:
        found[v.verdict] += 1
    return found


class ProvenanceReport(Schema, frozen=True):
    """What every command prints of a checkpoint's provenance: the overall verdict, the count of each verdict,
    and each file's."""

    verdict: str
    counts: dict[str, int]
    files: list[FileVerdict]


def provenance_report(verdicts: Iterable[FileVerdict]) -> ProvenanceReport:
    listed = tuple(verdicts)
    return ProvenanceReport(overall(listed), counts(listed), list(listed))


def report(verdicts: Iterable[FileVerdict]) -> dict[str, Any]:
    """The JSON form every command prints (`ProvenanceReport`)."""
    return provenance_report(verdicts).to_wire()
