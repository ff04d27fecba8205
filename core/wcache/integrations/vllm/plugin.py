"""vLLM's entry point (group `vllm.general_plugins`): registers the load format `wcache`.

vLLM loads general plugins in its CLI, engine core and every worker, so this stays cheap and imports
nothing of vLLM's until it runs, and registers once per process. Outside the vLLM versions wcache was tested
on, the load format is a loader that refuses with one sentence when vLLM builds it (`version`).
"""

from __future__ import annotations

LOAD_FORMAT = "wcache"  # not vLLM's own "ipc_cache", which a plugin must never shadow

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from wcache.integrations.vllm.version import register_refusal, version_problem

    problem = version_problem()
    if problem is not None:
        register_refusal(LOAD_FORMAT, problem)
    else:
        from wcache.integrations.vllm.api import register_model_loader
        from wcache.integrations.vllm.loader import WcacheModelLoader

        register_model_loader(LOAD_FORMAT)(WcacheModelLoader)
    _registered = True
