"""Prometheus text exposition, parsed with prometheus-client's own parser into plain sample maps."""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]


def parse_metrics(text: str) -> Samples:
    """Sample name (with `_total` for counters) → label set → value; `_created` timestamps and non-finite
    values are dropped."""
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
