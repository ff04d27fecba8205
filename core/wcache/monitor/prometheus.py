"""Prometheus text exposition, parsed with prometheus-client's own parser into plain sample maps."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]


def select_families(text: str, prefixes: Iterable[str]) -> str:
    """Only the sample, HELP and TYPE lines of metrics whose names start with one of `prefixes`.

    A vLLM /metrics page is tens of KiB, mostly histogram buckets `top` never shows, and prometheus-client's
    parser is pure Python: parsing only the wanted families is what keeps polling many engines cheap.
    """
    starts = tuple(p for prefix in prefixes for p in (prefix, f"# HELP {prefix}", f"# TYPE {prefix}"))
    return "\n".join(
        line for line in text.splitlines()
        # `_created` samples (and their HELP/TYPE) are start timestamps, dropped after parsing anyway.
        if line.startswith(starts) and "_created{" not in line and "_created " not in line
    )


def parse_metrics(text: str, prefixes: Iterable[str] | None = None) -> Samples:
    """Sample name (with `_total` for counters) → label set → value; `_created` timestamps and non-finite
    values are dropped. With `prefixes`, only metrics whose names start with one of them are parsed."""
    if prefixes is not None:
        text = select_families(text, prefixes)
    samples: defaultdict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created") or not math.isfinite(sample.value):
                continue  # a NaN or infinite sample says nothing, and JSON cannot carry it
            samples[sample.name][tuple(sorted(sample.labels.items()))] = float(sample.value)
    return dict(samples)


def total(samples: Samples, name: str) -> float | None:
    """Sum of a series over all label sets (vLLM exports one per DP engine); None when it is absent."""
    series = samples.get(name)
    if series is None:
        return None
    return sum(series.values())


def label_value(samples: Samples, name: str, label: str) -> str | None:
    for labels in samples.get(name, {}):
        for key, value in labels:
            if key == label:
                return value
    return None


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """A series summed by the value of one of its labels (series without that label are left out)."""
    sums: defaultdict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, {}).items():
        for key, found in labels:
            if key == label:
                sums[found] += value
    return dict(sums)
