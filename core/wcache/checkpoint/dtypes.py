"""The safetensors dtypes wcache accepts: their sizes in bytes, their torch names, and the plan's names for them."""

from __future__ import annotations

from typing import NamedTuple


class Dtype(NamedTuple):
    itemsize: int
    torch_name: str  # the torch dtype's attribute name; an older torch may lack it (checked where tensors are made)
    castable: bool = False  # cast to the plan's dtype (see below)


# The one table. Sub-byte formats (F4, F6_*) are left out on purpose: their byte size is not numel × itemsize,
# and no checkpoint family wcache serves uses them yet. A header naming them is rejected as an unknown dtype.
# Only floats stored as floats are castable: float8 tensors in a checkpoint are already-quantized codes whose
# meaning depends on separate scales, and casting them would silently change it.
SAFETENSORS_DTYPES: dict[str, Dtype] = {
    "BOOL": Dtype(1, "bool"),
    "U8": Dtype(1, "uint8"),
    "I8": Dtype(1, "int8"),
    "F8_E5M2": Dtype(1, "float8_e5m2"),
    "F8_E4M3": Dtype(1, "float8_e4m3fn"),
    "F8_E8M0": Dtype(1, "float8_e8m0fnu"),
    "I16": Dtype(2, "int16"),
    "U16": Dtype(2, "uint16"),
    "F16": Dtype(2, "float16", castable=True),
    "BF16": Dtype(2, "bfloat16", castable=True),
    "I32": Dtype(4, "int32"),
    "U32": Dtype(4, "uint32"),
    "F32": Dtype(4, "float32", castable=True),
    "I64": Dtype(8, "int64"),
    "U64": Dtype(8, "uint64"),
    "F64": Dtype(8, "float64", castable=True),
}
ITEMSIZE: dict[str, int] = {name: d.itemsize for name, d in SAFETENSORS_DTYPES.items()}
TORCH_NAMES: dict[str, str] = {name: d.torch_name for name, d in SAFETENSORS_DTYPES.items()}
# Bytes per element by torch dtype name, known without importing torch (a daemon plans before it has torch).
TORCH_ITEMSIZE: dict[str, int] = {d.torch_name: d.itemsize for d in SAFETENSORS_DTYPES.values()}
CASTABLE = frozenset(name for name, d in SAFETENSORS_DTYPES.items() if d.castable)

# Plan dtype names (what users type) to safetensors names.
PLAN_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SAFETENSORS_TO_PLAN: dict[str, str] = {v: k for k, v in PLAN_DTYPES.items()}
