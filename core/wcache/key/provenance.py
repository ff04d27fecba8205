"""A key's files judged against what their publisher released, and the rule `--require-provenance` applies."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from wcache.checkpoint.file_record import FileDigest
from wcache.checkpoint.provenance import FileVerdict, judge, read_expected
from wcache.errors import EXIT_DIFFERENCE, CheckpointError, option

# What a load refuses: nothing (a warning), a file that differs, or also a file whose provenance is unknown.
Requirement = Literal["warn", "differs", "unknown"]
REQUIREMENTS: tuple[Requirement, ...] = ("warn", "differs", "unknown")


def checkpoint_root(source: str | Path) -> Path:
    """The directory a key's file names are relative to: the checkpoint's, or a lone .safetensors file's."""
    path = Path(source)
    return path.parent if path.suffix == ".safetensors" else path


def verdicts_of(source: str | Path, files: tuple[FileDigest, ...], expected: Path | None = None
                ) -> tuple[FileVerdict, ...]:
    """Each file's verdict: against the user's `expected` digests if given, else the Hugging Face cache."""
    return judge(checkpoint_root(source), files, read_expected(expected) if expected is not None else None)


def refusal(verdicts: tuple[FileVerdict, ...], requirement: Requirement, model: str) -> str | None:
    """The sentence a load with `requirement` refuses `verdicts` with, or None when it may go on."""
    if requirement == "warn":
        return None
    differs = [v for v in verdicts if v.verdict == "differs"]
    if differs:
        named = "; ".join(v.sentence() for v in differs)
        return (f"{model} was refused: {named}. Download the file again (hf download --force-download) or drop "
                f"{option('require_provenance')}.")
    unknown = [v for v in verdicts if v.verdict == "unknown"]
    if requirement == "unknown" and unknown:
        return (f"{model} was refused: the provenance of {unknown[0].name} is unknown ({unknown[0].why})"
                f"{f' and of {len(unknown) - 1} more file(s)' if len(unknown) > 1 else ''}; drop "
                f"{option('refuse_unknown')} or give the expected digests with {option('expected')}.")
    return None


def require(verdicts: tuple[FileVerdict, ...], requirement: Requirement, model: str) -> None:
    reason = refusal(verdicts, requirement, model)
    if reason is not None:
        raise ProvenanceError(reason)


class ProvenanceError(CheckpointError):
    """A checkpoint file is not what its publisher released (or cannot be shown to be), and the user required it:
    a check that found a difference."""

    exit_code = EXIT_DIFFERENCE
