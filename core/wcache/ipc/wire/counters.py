"""The names of a daemon's counters, as its `stats` reply carries them: what `status`, `top` and `/metrics` read.

The reply keeps them a map of name to count (a daemon of a newer version may count more). The names made of
parts, `misses_<reason>` and `attaches_<mode>`, are spelled here only: the daemon counts by them, and
`/metrics` and `top` take them apart again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_MISSES = "misses_"


def attaches(mode: str) -> str:
    """Attaches in one map mode (zero_copy, copy)."""
    return f"attaches_{mode}"


def miss(reason: str | Iterable[str]) -> str:
    """The counter of hellos missed for `reason`: "corrupt", "released", or the key fields that differed."""
    return _MISSES + (reason if isinstance(reason, str) else "_".join(reason))


def misses(counters: Mapping[str, int]) -> dict[str, int]:
    """Each miss reason with its count."""
    return {name.removeprefix(_MISSES): count for name, count in counters.items() if name.startswith(_MISSES)}
