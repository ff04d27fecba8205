"""Load-time quantization: wcache quantizes floating weights per output channel (int8 and fp8 e4m3, float32
scales, bit-reproducible) while the plan makes its outputs, when the plan's `quantization` field asks for it.

Not a pre-quantized checkpoint (config.json's quantization_config, `family.prequantized_method`), whose codes the
plan keeps as stored; the two never combine. Its names and rules import no torch (a plan is built before torch
is loaded); the arithmetic imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache.plan import family

if TYPE_CHECKING:
    import torch

# Load-time quantization method (the plan's `quantization`) → the torch dtype name of the weight's codes.
CODE_DTYPES: dict[str, str] = {"int8": "int8", "fp8": "float8_e4m3fn"}

# The largest magnitude each format represents: int8 is kept symmetric (±127, -128 unused) so that
# negating a weight negates its code; 448 is the largest finite float8_e4m3fn value.
_QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}


def quantized_at_load(name: str, shape: tuple[int, ...]) -> bool:
    """Whether load-time quantization takes this tensor: a decoder layer's 2-D dense projection weight (the
    family's names, checkpoint or fused), the only tensors it quantizes.

    Embeddings, lm_head, norms and biases are deliberately absent: weight-only schemes leave them in floating
    point. So are experts' projections, in both layouts: the fused layout holds them as 3-D stacks, which
    quantization per row does not take, and the identity layout quantizes the same modules as the fused one.
    """
    return len(shape) == 2 and family.is_dense_projection(name)


def scale_name(weight_name: str) -> str:
    """`x.weight` → `x.weight_scale`: the name of a quantized weight's per-channel scales, the name a
    pre-quantized checkpoint gives them too."""
    return family.companion(weight_name, "weight_scale")


def channel_scales(weight: torch.Tensor, method: str) -> torch.Tensor:
    """float32 scales, one per output row: amax(|row|)/qmax, and 1 for an all-zero row (no division by 0).

    The weight must already be float32 on the CPU: the max of absolute values is exact in any reduction
    order and the division is correctly rounded, so the scales are identical on every machine and call.
    """
    import torch

    _check_float32(weight)
    amax = weight.abs().amax(dim=1)
    return torch.where(amax == 0, torch.ones_like(amax), amax / _QMAX[method])


def quantize_rows(weight: torch.Tensor, scales: torch.Tensor, method: str) -> torch.Tensor:
    """Quantize a float32 weight row by row with `scales`: round-half-even to int8, or cast to float8_e4m3fn."""
    import torch

    _check_float32(weight)
    qmax = _QMAX[method]
    scaled = weight / scales.unsqueeze(1)
    if method == "int8":
        return torch.round(scaled).clamp_(-qmax, qmax).to(torch.int8)
    # amax / (amax / 448) can round to a hair above 448, and float8_e4m3fn has no infinity: clamp first so
    # the largest element lands on 448 instead of becoming NaN.
    return scaled.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)


def dequantize_rows(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 approximation of the original weight (for engines without quantized kernels, and for tests)."""
    import torch

    return quantized.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)


def _check_float32(weight: torch.Tensor) -> None:
    import torch

    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"quantization expects a 2-D float32 weight, not {weight.dim()}-D {weight.dtype}")
