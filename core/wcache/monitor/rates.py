"""Rates from cumulative counters: deltas between two samples, restarted when a counter resets."""

from __future__ import annotations

from collections.abc import Hashable


class CounterDeltas:
    """Remembers the last value of each counter; a value below it means the counter was reset."""

    def __init__(self) -> None:
        self._last: dict[Hashable, float] = {}

    def delta(self, key: Hashable, value: float | None) -> float | None:
        """Increase since the previous sample; None on the first sample or when the series is absent."""
        if value is None:
            self._last.pop(key, None)
            return None
        previous = self._last.get(key)
        self._last[key] = value
        if previous is None:
            return None
        # A restarted server (or a cache reset) starts again from zero: count from there.
        return value - previous if value >= previous else value

    def forget(self, keep: set[Hashable]) -> None:
        for key in list(self._last):
            if key not in keep:
                del self._last[key]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or nothing was queried."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
