"""Switch a running vLLM engine to another checkpoint's daemon without a restart.

`switch(llm, model)` runs vLLM's own in-place reload on every worker (`collective_rpc("reload_weights")`,
vLLM ≥ 0.32) with the `wcache` load format: each rank attaches the daemon holding `model`'s key under the
engine's plan and its tensors are loaded under checkpoint names through the model's `load_weights`, with
vLLM's post-processing (the CPU backend's oneDNN repack) re-run as after a disk load. No checkpoint byte is
read. The prefix cache is reset afterwards, so no KV computed under the old weights is reused.

A switch never falls back to disk: when no daemon serves the new checkpoint, every rank refuses before any
layer is touched (the attach is made when vLLM asks the loader for its weights, before the reload starts),
the engine keeps its old weights and `switch` raises with wcache's reason.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.checkpoint.model_path import resolve_model_path
from wcache.errors import UnavailableError

if TYPE_CHECKING:
    pass


LOAD_FORMAT = "wcache"
_QUOTED_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check")


class VllmSwitchError(UnavailableError):
    """vLLM could not move to the new checkpoint's daemon; it keeps serving its previous weights."""


def switch(llm: Any, model: str | Path, **options: Any) -> None:
    """Move the offline `vllm.LLM` engine `llm` to the weights a daemon holds for `model`, in place.

    `options` are wcache's attach options (`mode`, `daemon`, `run_dir`, `trust_daemon`, …) for this and later
    switches; an engine started with another load format is switched to `wcache` first. Raises
    VllmSwitchError, the engine unchanged, when no daemon serves `model`.
    """
    from wcache.attach_options import AttachOptions

    path = resolve_model_path(model).absolute()
    load_config = llm.llm_engine.vllm_config.load_config
    current = dict(load_config.model_loader_extra_config or {}) if load_config.load_format == LOAD_FORMAT else {}
    extra = {**current, **options}
    AttachOptions.from_mapping(extra, "switch options")  # one sentence for a bad option, before any worker runs
    if load_config.load_format != LOAD_FORMAT or options:
        override = {"load_config": {"load_format": LOAD_FORMAT, "model_loader_extra_config": extra}}
        llm.collective_rpc("update_config", args=(override,))
        load_config.load_format, load_config.model_loader_extra_config = LOAD_FORMAT, extra
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
    except Exception as exc:  # a worker's error, re-raised by vLLM in this process with the worker's message
        raise VllmSwitchError(f"vLLM keeps its previous weights, no switch to {path}: {worker_reason(exc)}") from None
    llm.reset_prefix_cache()
    llm.llm_engine.vllm_config.model_config.model = str(path)


def worker_reason(exc: BaseException) -> str:
    """The wcache sentence of a worker's exception as vLLM re-raises it (locally, or in an HTTP error)."""
    text = str(exc).strip() or type(exc).__name__
    # vLLM wraps a worker's exception in its own; the wcache sentence is the last line of it, quoted once more
    # when it crossed processes ("Worker failed with error '…', please check the stack trace above …").
    line = text.splitlines()[-1]
    quoted = _QUOTED_WORKER_ERROR.search(line)
    return (quoted.group(1) if quoted else line).removeprefix("wcache: ").rstrip(".")
