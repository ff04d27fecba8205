"""Writing a safetensors file from arrays of bit patterns, with no torch: the header, then each entry's bytes.

Entries are laid out as the safetensors library lays them out (largest element first, then by name), so every
entry's data starts at a multiple of its element size, and the header is padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from wcache.checkpoint.dtypes import ITEMSIZE

HEADER_ALIGN = 8


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor to write: its safetensors dtype and shape, and its elements' bytes (any contiguous array)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def write_safetensors(path: Path, entries: Iterable[Entry], metadata: Mapping[str, str]) -> None:
    """Write `entries` and `metadata` to `path` as one safetensors file (created or truncated)."""
    with path.open("wb") as f:
        write_safetensors_to(f, entries, metadata)


def write_safetensors_to(f: BinaryIO, entries: Iterable[Entry], metadata: Mapping[str, str]) -> None:
    """Write `entries` and `metadata` as one safetensors file to `f`, open for writing at its start."""
    ordered = sorted(entries, key=lambda e: (-ITEMSIZE[e.dtype], e.name))
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for entry in ordered:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.data.nbytes]}
        offset += entry.data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    f.write(struct.pack("<Q", len(text)))  # the little-endian length prefix
    f.write(text)
    for entry in ordered:
        f.write(np.ascontiguousarray(entry.data).reshape(-1).view(np.uint8).data)
