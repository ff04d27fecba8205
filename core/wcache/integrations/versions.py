"""An engine's supported versions, checked from package metadata without importing the engine.

Each engine's entry in `integrations/registry.py` names its `SupportedVersions` (owned in the engine's folder),
and `wcache doctor` checks every one the same way: an engine added with a range gets doctor's check for free.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
from dataclasses import dataclass

_CLAUSE = re.compile(r"\s*(>=|<)\s*(\d+(?:\.\d+)*)\s*")
_RELEASE = re.compile(r"\d+(?:\.\d+)*")


def _release(version: str) -> tuple[int, ...] | None:
    """The leading release numbers of a version ("0.34.1rc1" → (0, 34, 1)), or None when it has none."""
    match = _RELEASE.match(version)
    return tuple(int(part) for part in match[0].split(".")) if match else None


@dataclass(frozen=True, slots=True)
class SupportedVersions:
    """The distributions that install an engine (the first one installed is the engine's) and the one range of
    versions wcache supports, as a requirement specifier of ">=" and "<" clauses (">=0.32,<0.35")."""

    distributions: tuple[str, ...]
    range: str

    def __post_init__(self) -> None:
        for clause in self.range.split(","):
            if _CLAUSE.fullmatch(clause) is None:
                raise ValueError(f"{self.range!r}: each clause of a supported range is '>=X.Y' or '<X.Y'")

    def installed(self) -> tuple[str, str] | None:
        """The installed distribution and its version, as its package metadata states it; None when none is."""
        for distribution in self.distributions:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return distribution, importlib.metadata.version(distribution)
        return None

    def holds(self, version: str) -> bool:
        """Whether `version` is in the range (compared by release numbers: a pre-release counts as its release)."""
        release = _release(version)
        if release is None:
            return False
        for clause in self.range.split(","):
            match = _CLAUSE.fullmatch(clause)
            assert match is not None  # __post_init__ refused any other
            bound = tuple(int(part) for part in match[2].split("."))
            if (release < bound) if match[1] == ">=" else (release >= bound):
                return False
        return True
