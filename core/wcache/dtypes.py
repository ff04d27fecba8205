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

# safetensors dtype names → torch dtype names. Names missing from the installed torch are rejected when a plan
# is built, not at import, so an older torch still serves every checkpoint that does not use them.
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
assert set(TORCH_NAMES) == set(ITEMSIZE)
# Bytes per element by torch dtype name, known without importing torch (a daemon plans before it has torch).
TORCH_ITEMSIZE: dict[str, int] = {TORCH_NAMES[name]: size for name, size in ITEMSIZE.items()}

# Plan dtype names (what users type) to safetensors names.
PLAN_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SAFETENSORS_TO_PLAN: dict[str, str] = {v: k for k, v in PLAN_DTYPES.items()}
