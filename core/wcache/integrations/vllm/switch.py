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
    refusal = in_place_refusal(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    if refusal is not None:
        raise VllmSwitchError(f"vLLM keeps its previous weights, no switch to {path}: {refusal}.")
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


def in_place_refusal(tp_size: int, quantization: str = "none") -> str | None:
    """Why vLLM's in-place reload cannot take a daemon's tensors for an engine at `tp_size` whose plan quantizes
    with `quantization` at load time, or None.

    The reload takes weights in checkpoint form (the model's `load_weights` shards and quantizes them itself), and a
    daemon holds a TP rank's shards and the tensors it quantized only in vLLM's form: vLLM would keep its old
    weights for every layer it was not given and take the rest, a mix no key names. A start attaches them whole.
    Refused before any worker is asked: at TP > 1, a worker's refusal leaves vLLM's engine core answering the next
    call with that refusal."""
    if tp_size > 1:
        return (f"at TP {tp_size} each rank's daemon holds its shards in vLLM's form, which vLLM's in-place reload "
                "cannot take (it loads checkpoint tensors); restart the engine on the daemon instead")
    if quantization != "none":
        return (f"the daemon holds the tensors it quantized ({quantization}) in vLLM's form, which vLLM's in-place "
                "reload cannot take (it loads checkpoint tensors); restart the engine on the daemon instead")
    return None


def worker_reason(exc: BaseException) -> str:
    """The wcache sentence of a worker's exception as vLLM re-raises it (locally, or in an HTTP error)."""
    text = str(exc).strip() or type(exc).__name__
    # vLLM wraps a worker's exception in its own; the wcache sentence is the last line of it, quoted once more
    # when it crossed processes ("Worker failed with error '…', please check the stack trace above …").
    line = text.splitlines()[-1]
    quoted = _QUOTED_WORKER_ERROR.search(line)
    return (quoted.group(1) if quoted else line).removeprefix("wcache: ").rstrip(".")
