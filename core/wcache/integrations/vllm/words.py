"""wcache's options as a vLLM user can give them: the keys of `model_loader_extra_config`, vLLM's own arguments
for what vLLM decides itself, and a plain statement for what vLLM chooses from the model (no argument sets it).

Core messages name options by their API name (`wcache.errors.option`); the vLLM loader words them here before
they reach vLLM's log, so a fallback warning never tells a vLLM user to pass a `wcache` flag.
"""

from __future__ import annotations

import json

from wcache.attach_options import AttachOptions

EXTRA_CONFIG = "model_loader_extra_config"
# Plan fields vLLM takes as arguments of its own (`LLM(...)`, `vllm serve --tensor-parallel-size`).
_VLLM_ARGUMENTS = {"tp_size": "tensor_parallel_size", "tp": "tensor_parallel_size", "dtype": "dtype"}


def _json(value: str) -> str:
    """The JSON value of a marked option's text: true/false and digits as themselves, anything else a string."""
    return value if value in ("true", "false") or value.isdigit() else json.dumps(value)


def vllm_words(name: str, value: str | None) -> str:
    """Option `name` (its API name, with the suggested `value` or None) as a vLLM user would set it."""
    if name in AttachOptions.names():
        if value is None:
            return f"{EXTRA_CONFIG} key {json.dumps(name)}"
        return f"{EXTRA_CONFIG}={{{json.dumps(name)}: {_json(value)}}}"
    if name in _VLLM_ARGUMENTS:
        argument = _VLLM_ARGUMENTS[name]
        return argument if value is None else f"{argument}={_json(value)}"
    # The layout, TP rank, wcache's own quantization: vLLM picks them from the model and its config.
    what = f"wcache's {name}" if value is None else f"wcache's {name} {value}"
    return f"{what} (which vLLM chooses from the model; no vLLM argument sets it)"
