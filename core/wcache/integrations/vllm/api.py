"""vLLM's API as wcache uses it, in one place, imported only after a check of the installed vLLM's version.

Much of what a model loader needs (the loader base class, `initialize_model`, the parallel state) is vLLM's
private API, which changes between minor releases. Every import from vLLM in wcache comes from here, and
importing this module first checks the installed vLLM against the range the tests ran
(`wcache.integrations.vllm.version`; pyproject's extras say the same): outside it, one sentence
(`UnsupportedVllmError`) instead of an ImportError or AttributeError halfway through a load.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from wcache.integrations.vllm.version import check_version

check_version()  # before any import below: an untested vLLM is refused here, never halfway through a load

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import ModelConfig, VllmConfig, get_current_vllm_config  # noqa: E402
from vllm.config.load import LoadConfig  # noqa: E402
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader, register_model_loader  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.utils import (  # noqa: E402
    get_model_architecture,
    initialize_model,
    process_weights_after_loading,
)
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402


def guard_each_step(model: Any, check: Callable[[], None]) -> None:
    """Run `check` before every step that samples from `model`; what it raises fails the step.

    The fence is the model's `compute_logits`: vLLM's model runners call it on the model every step that samples,
    outside any CUDA graph (a captured forward replays without running Python), after the forward and before the
    sampler, so no token leaves a step `check` refused. vLLM's V1 engine core does not survive a failed step:
    it dies, every request in flight and after fails, and the OpenAI server's /health answers 503 (the server
    then exits unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set). Guarding twice keeps one guard.
    """
    if getattr(model, "_wcache_guarded", False):
        return
    compute_logits = model.compute_logits

    def guarded(*args: Any, **kwargs: Any) -> Any:
        check()
        return compute_logits(*args, **kwargs)

    # An instance attribute shadows the class's method; a CUDA graph wrapper hands attribute reads to the model.
    model.compute_logits = guarded
    model._wcache_guarded = True


def shutdown_engine(llm: LLM) -> None:
    """Stop `llm`'s engine core and its workers now, removing the shared memory they made (vLLM 0.32's `LLM`
    has no shutdown of its own; its engine core client's is what garbage collection would call, some time)."""
    llm.llm_engine.engine_core.shutdown()


__all__ = [
    "DEFAULT_VOCAB_PADDING_SIZE",
    "LLM",
    "BaseModelLoader",
    "DefaultModelLoader",
    "LoadConfig",
    "ModelConfig",
    "SamplingParams",
    "VllmConfig",
    "get_current_vllm_config",
    "get_model_architecture",
    "get_model_loader",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "guard_each_step",
    "init_logger",
    "initialize_model",
    "process_weights_after_loading",
    "register_model_loader",
    "resolved_model_config",
    "route_mp_context",
    "server_arg_parser",
    "set_default_torch_dtype",
    "shutdown_engine",
]


# --- wcache serve / preload --engine vllm: resolving the plan vLLM will ask for (kept apart from the loader's API) ---


def resolved_model_config(model: str, dtype: str = "auto", revision: str | None = None) -> ModelConfig:
    """vLLM's own ModelConfig for `model`, built by its EngineArgs, so `auto` dtype is resolved by vLLM's rule
    for the platform this process runs on (bfloat16 for a float32 checkpoint on CPU)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype=dtype, revision=revision).create_model_config()  # type: ignore[arg-type]


def server_arg_parser() -> FlexibleArgumentParser:
    """The argument parser of vLLM's OpenAI server, built as its entry point builds it (`wcache serve` saves a
    table of its options once per installed vLLM)."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # 0.34 moved it to the package the server and `vllm serve` share
        from vllm.entrypoints.common.cli_args import make_arg_parser  # type: ignore[no-redef,import-not-found,unused-ignore]
    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


# --- wcache serve's warm start: the multiprocessing context vLLM starts its engine core and workers with ---

# The modules that imported vLLM's `get_mp_context` by name (each holds its own reference to it).
_MP_CONTEXT_USERS = ("vllm.utils.system_utils", "vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor",
                     "vllm.v1.engine.coordinator")


def route_mp_context(context: BaseContext) -> None:
    """Make vLLM start its engine core, workers and their queues and locks with `context` in this process (and
    in processes forked from it). vLLM's own `get_mp_context` still runs first, for what it does besides
    choosing (forcing `spawn` where CUDA is initialised is then refused by the warm starter, never ignored)."""
    import importlib

    from vllm.utils import system_utils

    original = getattr(system_utils.get_mp_context, "__wrapped__", system_utils.get_mp_context)

    def get_mp_context() -> BaseContext:
        original()
        return context

    get_mp_context.__wrapped__ = original  # type: ignore[attr-defined]
    for name in _MP_CONTEXT_USERS:
        module: Any = importlib.import_module(name)
        module.get_mp_context = get_mp_context
