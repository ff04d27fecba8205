"""vLLM's entry point (group `vllm.general_plugins`): registers the load format `wcache`.

vLLM loads general plugins in its CLI, engine core and every worker, so this stays cheap and imports
nothing of vLLM's until it runs, and registers once per process.
"""

from __future__ import annotations

LOAD_FORMAT = "wcache"  # not vLLM's own "ipc_cache", which a plugin must never shadow

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from wcache.integrations.vllm_loader import WcacheModelLoader

    register_model_loader(LOAD_FORMAT)(WcacheModelLoader)
    _registered = True
