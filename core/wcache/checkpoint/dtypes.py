"""The safetensors dtype names wcache accepts and their sizes in bytes."""

from __future__ import annotations

# Sub-byte formats (F4, F6_*) are left out on purpose: their byte size is not numel × itemsize, and no
# checkpoint family wcache serves uses them yet. A header naming them is rejected as an unknown dtype.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# Plan dtype names (what users type) to safetensors names.
PLAN_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SAFETENSORS_TO_PLAN: dict[str, str] = {v: k for k, v in PLAN_DTYPES.items()}
