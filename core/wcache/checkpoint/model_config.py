"""The part of config.json that shapes processed weights, and its digest."""

from __future__ import annotations

from typing import Any

from wcache.canonical import digest_of
from wcache.checkpoint.dtypes import PLAN_DTYPES

# Fields that name or describe where a config came from, or steer generation, and never change the bytes
# a rank holds. The stored dtype is not here because the plan carries the resolved dtype instead.
IGNORED_FIELDS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict",
})

NO_CONFIG = "none"


def canonical_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {k: v for k, v in sorted(config.items()) if k not in IGNORED_FIELDS}


def config_digest(config: dict[str, Any] | None) -> str:
    """Digest of the canonical config; "none" for a bare .safetensors file without one."""
    canonical = canonical_config(config)
    return NO_CONFIG if canonical is None else digest_of(canonical)


def config_dtype(config: dict[str, Any] | None) -> str | None:
    """The plan dtype name config.json declares, if it declares a known one."""
    if config is None:
        return None
    value = config.get("torch_dtype", config.get("dtype"))
    return value if isinstance(value, str) and value in PLAN_DTYPES else None
