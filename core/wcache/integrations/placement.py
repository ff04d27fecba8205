"""Placing a daemon's tensors as a model's parameters, torch only: any engine's loader borrows it (vLLM's does).

A model is built with its parameters on the meta device (`parameters_on_meta`), then each parameter that takes
a daemon tensor is replaced, in every module that shares it, by a parameter of its own class over that tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

KEEP_REAL_NUMEL = 64


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a model registers meanwhile goes to the meta device; its buffers stay where they are made.

    Buffers stay real because the daemon holds only parameters, and vLLM computes buffers such as the rotary
    cos/sin cache at build time (and caches rotary modules across builds: one built on meta would poison a
    later disk load in the same process). vLLM makes each parameter's data with `torch.empty` on the build
    device before it registers it: that memory is freed at once, never touched, one parameter at a time.

    Parameters of at most KEEP_REAL_NUMEL elements stay real too: vLLM gives some of them initial values that
    its post-processing reads when a checkpoint leaves them out (a pre-quantized attention's k_scale and v_scale,
    -1.0 for "not loaded"), and they cost a few bytes each.
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and param.numel() > KEEP_REAL_NUMEL:
            meta = nn.Parameter(param.data.to("meta"), requires_grad=False)
            meta.__class__ = param.__class__
            # One attribute dict for both: vLLM often sets attributes (weight_loader, output_dim, ...) on the
            # object it made after registering it, and they must reach the registered one (and vLLM's record of
            # it for in-place reloads).
            meta.__dict__ = param.__dict__
            param.data = param.data.new_empty(0)
            param = meta
        register(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def same_kind(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter over `data` of `param`'s class, with its attributes (vLLM's weight loaders read them)."""
    result = nn.Parameter(data, requires_grad=False)
    result.__class__ = param.__class__
    result.__dict__ = param.__dict__.copy()
    return result


def parameter_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) that holds each parameter, by the parameter's id: a tied one is in several."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, leaf))
    return slots


def replace_parameter(slots: list[tuple[nn.Module, str]], param: nn.Parameter) -> None:
    # Straight into _parameters: register_parameter would refuse to replace an attribute, and .data cannot
    # move a meta parameter onto a device.
    for module, leaf in slots:
        module._parameters[leaf] = param
