"""vLLM's start-up caches keyed by the weights: the launcher points `VLLM_CACHE_ROOT` under the content key.

vLLM keeps start-up state under `VLLM_CACHE_ROOT` (default `$XDG_CACHE_HOME/vllm`, else `~/.cache/vllm`): its
torch.compile cache (`torch_compile_cache/`, keyed by vLLM's hash of the config and code, not of the weights),
the model-class inspection cache (`modelinfos/`), the KV-cache budget `VLLM_ENABLE_STARTUP_PLAN` saves on GPUs
(`startup_plan/`) and its warm-up caches. Under `<root>/by-weights/<key id>` a restart of the same weights and
plan reuses all of it, and another checkpoint (a fine-tune with the same config) never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "VLLM_CACHE_ROOT"
KEYED_DIR = "by-weights"


def vllm_cache_root(env: Mapping[str, str]) -> Path:
    """Where vLLM puts its caches under `env`, by its own rule."""
    given = env.get(ENV_VAR)
    if given:
        return Path(given).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path("~/.cache").expanduser()) / "vllm"


def keyed_cache_root(env: Mapping[str, str], key_id: str) -> Path:
    """The cache root of one daemon key (the weights, config, tokenizer and plan) under vLLM's own root."""
    return vllm_cache_root(env) / KEYED_DIR / key_id


def with_keyed_cache(env: Mapping[str, str], key_id: str) -> dict[str, str]:
    """`env` with `VLLM_CACHE_ROOT` under the key, the directory made (owner-only, like vLLM's own)."""
    root = keyed_cache_root(env, key_id)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {**env, ENV_VAR: str(root)}
