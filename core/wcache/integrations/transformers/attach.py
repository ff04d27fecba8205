"""Hugging Face transformers: `from_pretrained` whose parameters view a daemon's arena, or the disk on a miss.

    from wcache.integrations.transformers import from_pretrained
    model = from_pretrained("Qwen/Qwen3-0.6B", mode="zero_copy", wait_s=30)

A daemon preloaded with the default fused plan serves it too: q, k and v (gate and up) are consecutive row
ranges of the fused tensors, so every Hugging Face parameter is a view, and the model's private memory stays
the size of what transformers itself writes (measured in tests/test_transformers_attach.py). TP 1 only.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from typing import Any

import msgspec
import torch

from wcache.attach import AttachedWeights, AttachMissError, attach_with
from wcache.attach_options import AttachOptions
from wcache.checkpoint.dtypes import PLAN_DTYPES
from wcache.checkpoint.model_path import resolve_model_path
from wcache.errors import BadInputError
from wcache.key.digest_store import DigestStore
from wcache.plan.family import layout_for_architectures
from wcache.plan.spec import PlanSpec

log = logging.getLogger("wcache")

ENGINE = "transformers"

__all__ = ["from_pretrained"]


def _plan_dtype(kwargs: dict[str, Any]) -> str:
    value = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    if name != "auto" and name not in PLAN_DTYPES:
        raise BadInputError(f"dtype must be auto or one of {', '.join(PLAN_DTYPES)} to attach, not {value!r}.")
    return str(name)


def _no_init() -> AbstractContextManager[None]:
    try:  # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef,attr-defined]
    return no_init_weights()


def from_pretrained(model: str | os.PathLike[str], *, revision: str | None = None, **kwargs: Any) -> Any:
    """A ready, eval-mode `AutoModelForCausalLM` on the CPU: a daemon's tensors on a hit, the disk on a miss.

    `kwargs` are transformers' (`dtype`, `attn_implementation`, …) plus the attach options (`fallback`, `mode`,
    `trust_daemon`, `daemon`, `run_dir`, `wait_s`). The attach report is `model.wcache_report`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    options = AttachOptions.from_mapping({k: kwargs.pop(k) for k in AttachOptions.names() if k in kwargs},
                                         "from_pretrained's arguments")
    if kwargs.get("device_map") not in (None, "cpu") or kwargs.get("tp_plan") is not None:
        raise BadInputError("wcache attaches transformers models on the CPU with TP 1; drop device_map and tp_plan.")
    path = resolve_model_path(model, revision)
    config = AutoConfig.from_pretrained(path)
    plan = PlanSpec(dtype=_plan_dtype(kwargs), layout=layout_for_architectures(getattr(config, "architectures", None)))
    try:
        with DigestStore.open() as store:
            no_fallback = msgspec.structs.replace(options, fallback=False)
            weights = attach_with(path, plan, no_fallback, store=store, engine=ENGINE)
    except AttachMissError as exc:
        if not options.fallback:
            raise
        log.warning("wcache: weight cache miss for %s: %s; loading from disk with transformers.", path,
                    exc.report.reason)
        loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        # Module.__setattr__ is typed for tensors and modules, but a plain attribute is set like any other.
        loaded.wcache_report = exc.report  # type: ignore[assignment]
        return loaded.eval()
    return _build(AutoModelForCausalLM, config, weights, kwargs)


def _build(auto_class: Any, config: Any, weights: AttachedWeights, kwargs: dict[str, Any]) -> Any:
    dtype = getattr(torch, weights.key_file.plan.dtype)
    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("dtype", "torch_dtype", "device_map")}
    # No initialization: every parameter is replaced by a daemon tensor, so random init would be wasted work
    # on memory that is freed right after; buffers (rotary frequencies) are still computed by the modules.
    with _no_init():
        model = auto_class.from_config(config, dtype=dtype, **model_kwargs)
    place_into(model, weights)
    model.wcache_report = weights.report
    model._wcache_weights = weights  # the lease and the arena's map live as long as the model
    return model.eval()


def place_into(model: Any, weights: AttachedWeights) -> None:
    """Make the daemon's tensors a built model's parameters, by checkpoint name (the registry's placement); one
    sentence, and the lease closed, for a parameter the daemon holds no tensor for."""
    state = weights.checkpoint_tensors()
    # assign=True: the parameters become the views themselves instead of copies of them.
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Listed once each: a tied lm_head is the embedding and is not missing once tied.
    listed = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    missing = [name for name in result.missing_keys if name in listed]
    if missing:
        weights.close()
        raise BadInputError(f"the daemon holds no tensor for parameter {missing[0]} of this {type(model).__name__}.")
    if result.unexpected_keys:
        log.info("wcache: %d daemon tensor(s) unused by %s (e.g. %s).", len(result.unexpected_keys),
                 type(model).__name__, result.unexpected_keys[0])

