"""Frozen configuration of the reference engine: the model (from config.json) and the engine's own knobs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wcache.errors import BadInputError
from wcache.plan.family import ModelDims, UnsupportedPlanError, prequantized_method

FULL = "full_attention"
SLIDING = "sliding_attention"
SUPPORTED_ROPE = ("default", "linear", "llama3")


class UnsupportedModelError(BadInputError):
    """The checkpoint's architecture or options are outside what the reference engine implements."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture fields the engine reads; derived values are computed here once, never written back."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]
    tie_word_embeddings: bool
    qk_norm: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json of the Llama, Qwen2, Qwen3 or Mistral family."""
        model_type = config.get("model_type")
        try:
            dims = ModelDims.from_config(config)
        except UnsupportedPlanError as exc:
            raise UnsupportedModelError(str(exc)) from None
        if dims.is_moe:
            raise UnsupportedModelError(
                f"the reference engine runs dense models only, and this {model_type} checkpoint is a mixture of "
                f"{dims.experts} experts; serve it with vLLM (load_format wcache)."
            )
        method = prequantized_method(config)
        if method is not None:
            raise UnsupportedModelError(
                f"the reference engine runs unquantized checkpoints only, and config.json quantizes this one "
                f"with {method}; serve it with vLLM (load_format wcache)."
            )
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise UnsupportedModelError(f"model_type {model_type!r} is not one the reference engine runs.")
        layers = dims.layers
        try:
            result = cls(
                hidden_size=dims.hidden,
                intermediate_size=dims.intermediate,
                num_layers=layers,
                num_heads=dims.heads,
                num_kv_heads=dims.kv_heads,
                head_dim=dims.head_dim,
                vocab_size=dims.vocab,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_parameters(config).get("rope_theta", config.get("rope_theta", 10000.0))),
                rope_scaling=tuple(sorted(_rope_scaling(config).items())),
                tie_word_embeddings=dims.tie,
                qk_norm=model_type == "qwen3",
                layer_types=_layer_types(config, layers),
                sliding_window=_sliding_window(config),
                eos_token_ids=_ids(config.get("eos_token_id")),
                bos_token_id=config.get("bos_token_id"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"config.json lacks or garbles a field the engine needs ({exc}).") from None
        if SLIDING in result.layer_types and not result.sliding_window:
            raise UnsupportedModelError("config.json has sliding-window layers but no sliding_window size.")
        return result

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies after the config's scaling (default, linear or llama3)."""
        dim = self.head_dim
        base = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        scaling = dict(self.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return base
        if kind == "linear":
            return [f / float(scaling["factor"]) for f in base]
        # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_context / low, old_context / high
        result = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                result.append(f)
            elif wavelen > low_wavelen:
                result.append(f / factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                result.append((1 - smooth) * f / factor + smooth * f)
        return result


def _rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 moved rope_theta and scaling into `rope_parameters`; like transformers, a legacy
    # `rope_scaling` wins when both are present.
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if isinstance(params, Mapping) and params:
            return dict(params)
    return {}


def _rope_scaling(config: Mapping[str, Any]) -> dict[str, Any]:
    scaling = _rope_parameters(config)
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not implemented; the engine knows {SUPPORTED_ROPE}.")
    return {"rope_type": kind, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    # Qwen2/Qwen3 configs carry a window that only applies when use_sliding_window says so (as in transformers).
    if config.get("model_type") in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    window = _sliding_window(config)
    model_type = config.get("model_type")
    if model_type == "mistral":
        # Mistral windows every layer whenever it has a window; transformers ignores layer_types for it.
        return (SLIDING if window else FULL,) * layers
    explicit = config.get("layer_types")
    if explicit is not None:
        if len(explicit) != layers or any(t not in (FULL, SLIDING) for t in explicit):
            raise UnsupportedModelError(f"layer_types must list {layers} entries of {FULL} or {SLIDING}.")
        return tuple(explicit)
    if model_type in ("qwen2", "qwen3") and window and config.get("use_sliding_window"):
        # The family's older fields: layers from max_window_layers on use the window.
        start = int(config.get("max_window_layers", layers))
        return tuple(SLIDING if i >= start else FULL for i in range(layers))
    return (FULL,) * layers


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's own knobs: KV block size and count, and whether SWA bounded replay is on."""

    block_size: int = 16
    num_blocks: int = 2048
    swa_bounded_replay: bool = True
    enable_prefix_caching: bool = True
